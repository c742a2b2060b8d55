// Paged KV cache stores and causal attention on the GPU (twins of
// kernels/cpu/attention.cpp).
//
// attention_kernel: one thread block per (row, KV head, chunk of the query
// heads that read it, split), kWarps warps. The row's keys [0, position]
// (the last `window` of them, with a sliding window) are
// cut into n_splits runs of whole kStep keys (n_splits is 1 unless the grid
// would not fill the GPU: then the runs go to separate blocks and
// combine_kernel merges their partial softmaxes). A block's keys go in tiles
// of 32, warp w taking tiles w, w + kWarps, ...; in a tile lane l scores key
// t0 + l against every head of the chunk (Q from shared memory, K read as
// 16-byte F16 vectors), then the lanes split head_dim to add the tile's
// values. Each warp keeps an online softmax (running max, running sum, F32
// accumulators); the warps are combined through shared memory at the end. The
// launch depends on n_rows and the shape only (and on the batch's fixed
// split-KV scratch): a row's work is bounded by its position, read on the
// device, so a decode step can be captured in a graph.
//
// Numerics: Q is rounded to F16 as the CPU does; scores, exponentials (expf)
// and sums are F32. The CPU rounds the normalized probabilities to F16 before
// weighting V and sums in its fixed lane orders; the GPU does neither, so the
// two agree to about 1e-4 normalized error, not bit for bit.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/check.h"

namespace duet::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 4;  // per attention block
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 32;              // keys per warp step, one per lane
constexpr int kStep = kWarps * kTile;  // keys per block step
constexpr int kStoreThreads = 256;
// Split-KV: rows are split while the grid has fewer than kBlocksPerSm blocks
// per SM, into at most kMaxSplits runs of keys.
constexpr int kBlocksPerSm = 4;
constexpr int kMaxSplits = 64;
constexpr int kMaxChunk = 8;  // query heads per block (launch_for_group)
constexpr int kMaxHeadDim = 256;

// Where one layer's rows live (KvLayout's arithmetic, for device code).
struct CacheGeometry {
  int64_t layer_offset = 0;  // elements before the layer
  int64_t block_elems = 0;   // K and V of one block of one layer
  int64_t kv_elems = 0;      // from a K row to its V row
  int64_t head_elems = 0;    // one KV head's rows in one block
  int64_t head_dim = 0;
  int32_t block_size = 0;
};

CacheGeometry geometry(const KvLayout& layout, int64_t layer) {
  DUET_REQUIRE(layer >= 0 && layer < layout.n_layers, "layer {} outside the cache's {} layers",
               layer, layout.n_layers);
  DUET_REQUIRE(layout.block_size > 0 && layout.block_size <= INT32_MAX, "bad block size {}",
               layout.block_size);
  return {
      layer * layout.layer_elems(), layout.block_elems(), layout.kv_elems(),
      layout.head_elems(),          layout.head_dim,      static_cast<int32_t>(layout.block_size)};
}

// Offset of the K row of (kv head, position) of the sequence whose block table is `table`.
__device__ __forceinline__ int64_t k_row_offset(const CacheGeometry& g, const int32_t* table,
                                                int64_t head, int32_t pos) {
  const int64_t block = table[pos / g.block_size];
  return g.layer_offset + block * g.block_elems + head * g.head_elems +
         static_cast<int64_t>(pos % g.block_size) * g.head_dim;
}

// The first key a row at `position` attends to: window keys at most (0: no window).
__device__ __forceinline__ int32_t first_key(int32_t position, int32_t window) {
  return window > 0 && position >= window ? position - window + 1 : 0;
}

// Keys per split of a row with n_keys keys cut into n_splits: whole block
// steps, so the splits used are the first ceil(n_keys / this), and warp 0 of
// each has at least one key.
__host__ __device__ __forceinline__ int64_t split_keys(int64_t n_keys, int n_splits) {
  const int64_t per = (n_keys + n_splits - 1) / n_splits;
  return (per + kStep - 1) / kStep * kStep;
}

// One element of K and V per thread: (row, kv head * head_dim + d).
__global__ void store_kernel(AttentionBatch::View batch, CacheGeometry g, int64_t row_elems,
                             const float* __restrict__ k, const float* __restrict__ v,
                             uint16_t* __restrict__ cache) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kStoreThreads) + threadIdx.x;
  if (i >= batch.n_rows * row_elems) return;
  const int64_t row = i / row_elems, e = i % row_elems;
  const int32_t* table = batch.tables + batch.table_offset[batch.row_sequence[row]];
  const int64_t offset =
      k_row_offset(g, table, e / g.head_dim, batch.row_position[row]) + e % g.head_dim;
  cache[offset] = __half_as_ushort(__float2half_rn(k[i]));
  cache[offset + g.kv_elems] = __half_as_ushort(__float2half_rn(v[i]));
}

template <int kHalves>
struct HalfVector;  // kHalves F16 values as one aligned load
template <>
struct HalfVector<2> {
  using Type = unsigned int;
};
template <>
struct HalfVector<4> {
  using Type = uint2;
};
template <>
struct HalfVector<8> {
  using Type = uint4;
};

// out[0..kHalves) = the F16 values at p (aligned to their total size).
template <int kHalves>
__device__ __forceinline__ void load_halves(const uint16_t* p, float* out) {
  using Vector = typename HalfVector<kHalves>::Type;
  const Vector raw = *reinterpret_cast<const Vector*>(p);
  const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < kHalves / 2; ++i) {
    const float2 f = __half22float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// Block (row, blockIdx.y = kv head * n_chunks + chunk, blockIdx.z = split):
// query heads kv_head * group + chunk * kChunk + [0, n_h), n_h <= kChunk. With
// one split it writes out; with several, for each (row, head, split) entry
// (row * n_heads + head) * n_splits + split, the unnormalized sum of the
// values in partial_acc (head_dim each) and (max, sum of exponentials) in
// partial_stats.
template <int kHeadDim, int kChunk>
__global__ void __launch_bounds__(kThreads)
    attention_kernel(AttentionBatch::View batch, CacheGeometry g,
                     const uint16_t* __restrict__ cache, const float* __restrict__ q,
                     float* __restrict__ out, float* __restrict__ partial_acc,
                     float2* __restrict__ partial_stats, int n_heads, int group, int n_chunks,
                     int n_splits, float scale, int32_t window) {
  static_assert(kChunk <= kMaxChunk && kHeadDim <= kMaxHeadDim);
  constexpr int kDims = kHeadDim / 32;  // value dims per lane
  __shared__ float4 q_shared[kChunk][kHeadDim / 4];
  __shared__ float acc_shared[kWarps][kChunk][kHeadDim];
  __shared__ float max_shared[kWarps][kChunk], sum_shared[kWarps][kChunk];

  const int64_t row = blockIdx.x;
  // Causal: positions [key0, position], key0 > 0 past a sliding window.
  const int32_t key0 = first_key(batch.row_position[row], window);
  const int32_t n_keys = batch.row_position[row] + 1 - key0;
  const int64_t per_split = split_keys(n_keys, n_splits);
  const int64_t split_begin = blockIdx.z * per_split;
  if (split_begin >= n_keys) return;  // an unused split (the whole block, before any barrier)
  // Keys counted from key0.
  const auto begin = static_cast<int32_t>(split_begin);
  const auto end = static_cast<int32_t>(min(static_cast<int64_t>(n_keys), split_begin + per_split));
  const int kv_head = static_cast<int>(blockIdx.y) / n_chunks;
  const int first = (static_cast<int>(blockIdx.y) % n_chunks) * kChunk;  // within the group
  const int n_h = min(kChunk, group - first);
  const int h0 = kv_head * group + first;  // first query head of the block
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Q rounded to F16 as the CPU rounds it; heads past n_h are zeros.
  float* q_flat = reinterpret_cast<float*>(q_shared);
  for (int i = threadIdx.x; i < kChunk * kHeadDim; i += kThreads) {
    const int h = i / kHeadDim;
    q_flat[i] =
        h < n_h ? __half2float(__float2half_rn(q[(row * n_heads + h0) * kHeadDim + i])) : 0.0f;
  }
  __syncthreads();

  const int32_t* table = batch.tables + batch.table_offset[batch.row_sequence[row]];
  float running_max[kChunk], running_sum[kChunk], acc[kChunk][kDims];
#pragma unroll
  for (int h = 0; h < kChunk; ++h) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;  // this lane's share
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[h][d] = 0.0f;
  }

  for (int32_t t0 = begin + warp * kTile; t0 < end; t0 += kStep) {  // warp-uniform
    const int32_t t = t0 + lane;
    const bool valid = t < end;
    int64_t k_offset = 0;
    float score[kChunk];
#pragma unroll
    for (int h = 0; h < kChunk; ++h) score[h] = 0.0f;
    if (valid) {
      k_offset = k_row_offset(g, table, kv_head, key0 + t);
#pragma unroll 4
      for (int c = 0; c < kHeadDim / 8; ++c) {
        float kf[8];
        load_halves<8>(cache + k_offset + 8 * c, kf);
#pragma unroll
        for (int h = 0; h < kChunk; ++h) {
          const float4 a = q_shared[h][2 * c], b = q_shared[h][2 * c + 1];
          score[h] = fmaf(a.x, kf[0], score[h]);
          score[h] = fmaf(a.y, kf[1], score[h]);
          score[h] = fmaf(a.z, kf[2], score[h]);
          score[h] = fmaf(a.w, kf[3], score[h]);
          score[h] = fmaf(b.x, kf[4], score[h]);
          score[h] = fmaf(b.y, kf[5], score[h]);
          score[h] = fmaf(b.z, kf[6], score[h]);
          score[h] = fmaf(b.w, kf[7], score[h]);
        }
      }
    }
    // Online softmax: rescale what came before to the new maximum.
    float p[kChunk];
#pragma unroll
    for (int h = 0; h < kChunk; ++h) {
      const float s = valid ? score[h] * scale : -INFINITY;
      const float new_max = fmaxf(running_max[h], warp_max(s));  // finite: lane 0 is valid
      const float alpha = expf(running_max[h] - new_max);        // 0 on the first tile
      p[h] = valid ? expf(s - new_max) : 0.0f;
      running_sum[h] = running_sum[h] * alpha + p[h];
#pragma unroll
      for (int d = 0; d < kDims; ++d) acc[h][d] *= alpha;
      running_max[h] = new_max;
    }
    // Values: lane l owns dims [l * kDims, (l + 1) * kDims).
    const int n_valid = min(kTile, end - t0);
    for (int j = 0; j < n_valid; ++j) {
      const int64_t v_offset = __shfl_sync(kFullMask, k_offset, j) + g.kv_elems;
      float vf[kDims];
      load_halves<kDims>(cache + v_offset + lane * kDims, vf);
#pragma unroll
      for (int h = 0; h < kChunk; ++h) {
        const float pj = __shfl_sync(kFullMask, p[h], j);
#pragma unroll
        for (int d = 0; d < kDims; ++d) acc[h][d] = fmaf(pj, vf[d], acc[h][d]);
      }
    }
  }

  // Combine the warps: out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M).
#pragma unroll
  for (int h = 0; h < kChunk; ++h) {
    const float sum = warp_sum(running_sum[h]);
    if (lane == 0) {
      max_shared[warp][h] = running_max[h];
      sum_shared[warp][h] = sum;
    }
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc_shared[warp][h][lane * kDims + d] = acc[h][d];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_h * kHeadDim; i += kThreads) {
    const int h = i / kHeadDim, d = i % kHeadDim;
    float max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) max = fmaxf(max, max_shared[w][h]);  // warp 0's is finite
    float numerator = 0.0f, denominator = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = expf(max_shared[w][h] - max);  // 0 for a warp that had no tile
      numerator = fmaf(acc_shared[w][h][d], f, numerator);
      denominator = fmaf(sum_shared[w][h], f, denominator);
    }
    const int64_t entry = row * n_heads + h0 + h;
    if (n_splits == 1) {
      out[entry * kHeadDim + d] = numerator / denominator;
    } else {
      const int64_t slot = entry * n_splits + blockIdx.z;
      partial_acc[slot * kHeadDim + d] = numerator;
      if (d == 0) partial_stats[slot] = make_float2(max, denominator);
    }
  }
}

// Merges the used splits of attention_kernel: block (row * n_heads + head),
// thread d: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim)
    combine_kernel(AttentionBatch::View batch, const float* __restrict__ partial_acc,
                   const float2* __restrict__ partial_stats, float* __restrict__ out, int n_heads,
                   int n_splits, int32_t window) {
  const int64_t entry = blockIdx.x;  // row * n_heads + head
  const int d = threadIdx.x;
  const int32_t position = batch.row_position[entry / n_heads];
  const int64_t n_keys = position + 1 - first_key(position, window);
  const int64_t per_split = split_keys(n_keys, n_splits);
  const auto n_used = static_cast<int>((n_keys + per_split - 1) / per_split);  // >= 1
  const int64_t slot0 = entry * n_splits;
  float max = -INFINITY;
  for (int s = 0; s < n_used; ++s) max = fmaxf(max, partial_stats[slot0 + s].x);
  float numerator = 0.0f, denominator = 0.0f;
  for (int s = 0; s < n_used; ++s) {
    const float2 stats = partial_stats[slot0 + s];
    const float f = expf(stats.x - max);
    numerator = fmaf(partial_acc[(slot0 + s) * kHeadDim + d], f, numerator);
    denominator = fmaf(stats.y, f, denominator);
  }
  out[entry * kHeadDim + d] = numerator / denominator;
}

// Splits per row for a grid of `blocks` blocks: enough to reach
// batch.split_below_blocks, within kMaxSplits and the scratch; 1 (no split,
// no scratch) when the grid is big enough or no scratch was allocated.
int split_count(const AttentionBatch::View& batch, int64_t blocks, int n_heads, int head_dim) {
  if (batch.partials == nullptr || blocks >= batch.split_below_blocks) return 1;
  int64_t n = std::min<int64_t>(kMaxSplits, (batch.split_below_blocks + blocks - 1) / blocks);
  n = std::min(n, batch.partial_floats / (batch.n_rows * n_heads * (head_dim + 2)));
  return n >= 2 ? static_cast<int>(n) : 1;
}

template <int kHeadDim, int kChunk>
void launch_attention(const AttentionBatch::View& batch, const CacheGeometry& g,
                      const uint16_t* cache, const float* q, float* out, int n_heads,
                      int n_kv_heads, int group, float scale, int32_t window, cudaStream_t stream) {
  const int n_chunks = (group + kChunk - 1) / kChunk;
  const int64_t blocks = batch.n_rows * n_kv_heads * n_chunks;
  const int n_splits = split_count(batch, blocks, n_heads, kHeadDim);
  float* partial_acc = nullptr;
  float2* partial_stats = nullptr;
  const int64_t n_entries = batch.n_rows * n_heads * n_splits;
  if (n_splits > 1) {  // the accumulators, then the (max, sum) pairs (8-byte aligned: even offset)
    partial_acc = batch.partials;
    partial_stats = reinterpret_cast<float2*>(batch.partials + n_entries * kHeadDim);
  }
  const dim3 grid(static_cast<unsigned>(batch.n_rows), static_cast<unsigned>(n_kv_heads * n_chunks),
                  static_cast<unsigned>(n_splits));
  attention_kernel<kHeadDim, kChunk>
      <<<grid, kThreads, 0, stream>>>(batch, g, cache, q, out, partial_acc, partial_stats, n_heads,
                                      group, n_chunks, n_splits, scale, window);
  if (n_splits > 1) {
    DUET_CUDA_CHECK(cudaGetLastError());
    combine_kernel<kHeadDim>
        <<<static_cast<unsigned>(batch.n_rows * n_heads), kHeadDim, 0, stream>>>(
            batch, partial_acc, partial_stats, out, n_heads, n_splits, window);
  }
}

// Query heads per block: the GQA group, rounded up to 1, 2, 4 or 8 (at most 8,
// larger groups taking several blocks per KV head).
template <int kHeadDim>
void launch_for_group(const AttentionBatch::View& batch, const CacheGeometry& g,
                      const uint16_t* cache, const float* q, float* out, int n_heads,
                      int n_kv_heads, float scale, int32_t window, cudaStream_t stream) {
  const int group = n_heads / n_kv_heads;
  auto launch = [&](auto chunk) {
    launch_attention<kHeadDim, decltype(chunk)::value>(batch, g, cache, q, out, n_heads, n_kv_heads,
                                                       group, scale, window, stream);
  };
  if (group == 1) {
    launch(std::integral_constant<int, 1>{});
  } else if (group == 2) {
    launch(std::integral_constant<int, 2>{});
  } else if (group <= 4) {
    launch(std::integral_constant<int, 4>{});
  } else {
    launch(std::integral_constant<int, 8>{});
  }
}

}  // namespace

void AttentionBatch::set(std::span<const AttentionSequence> sequences, CudaBackend& backend) {
  int64_t n_rows = 0, n_table = 0, max_position = 0;
  for (const AttentionSequence& s : sequences) {
    DUET_REQUIRE(s.n_q >= 0 && s.pos0 >= 0 && s.pos0 + s.n_q <= INT32_MAX,
                 "bad rows: pos0 {}, n_q {}", s.pos0, s.n_q);
    n_rows += s.n_q;
    n_table += static_cast<int64_t>(s.block_table.size());
    if (s.n_q > 0) max_position = std::max(max_position, s.pos0 + s.n_q - 1);
  }
  const int64_t n_sequences = static_cast<int64_t>(sequences.size());
  DUET_REQUIRE(n_rows <= INT32_MAX && n_sequences + n_table <= INT32_MAX, "batch too large");
  const size_t bytes = static_cast<size_t>(2 * n_rows + n_sequences + n_table) * sizeof(int32_t);
  const size_t room = std::max<size_t>(bytes, sizeof(int32_t));
  // The previous set()'s upload may still be reading host_ (not while
  // capturing: then that upload was recorded, not queued, and the arrays
  // must not move under the recorded launches).
  if (backend.capturing()) {
    DUET_REQUIRE(room <= device_.bytes() && room <= host_.bytes(),
                 "AttentionBatch::set must not grow its arrays during a graph capture");
  } else if (host_.bytes() > 0) {
    backend.synchronize();
  }
  host_.reserve(room);
  device_.reserve(room);
  if (partials_.bytes() == 0 && !backend.capturing()) {
    // A split launch has n_rows * n_heads <= blocks * kMaxChunk and n_splits
    // <= ceil(split_below_blocks / blocks), so fewer than 2 * kMaxChunk *
    // split_below_blocks (row, head, split) entries of up to kMaxHeadDim + 2
    // floats; a fixed size, so that the scratch never moves under a graph.
    int n_sms = 0;
    DUET_CUDA_CHECK(
        cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, backend.device()));
    split_below_blocks_ = int64_t{kBlocksPerSm} * n_sms;
    partials_.reserve(static_cast<size_t>(2 * kMaxChunk * split_below_blocks_ * (kMaxHeadDim + 2)) *
                      sizeof(float));
  }

  int32_t* row_sequence = host_.as<int32_t>();
  int32_t* row_position = row_sequence + n_rows;
  int32_t* table_offset = row_position + n_rows;
  int32_t* tables = table_offset + n_sequences;
  std::fill(row_sequence, row_sequence + n_rows, -1);
  int64_t offset = 0;
  for (int64_t i = 0; i < n_sequences; ++i) {
    const AttentionSequence& s = sequences[static_cast<size_t>(i)];
    DUET_REQUIRE(s.row >= 0 && s.row + s.n_q <= n_rows,
                 "sequence {}'s rows [{}, {}) are outside the batch's {} rows", i, s.row,
                 s.row + s.n_q, n_rows);
    for (int64_t t = 0; t < s.n_q; ++t) {
      DUET_REQUIRE(row_sequence[s.row + t] < 0, "row {} belongs to two sequences", s.row + t);
      row_sequence[s.row + t] = static_cast<int32_t>(i);
      row_position[s.row + t] = static_cast<int32_t>(s.pos0 + t);
    }
    table_offset[i] = static_cast<int32_t>(offset);
    if (!s.block_table.empty()) {
      std::memcpy(tables + offset, s.block_table.data(), s.block_table.size() * sizeof(int32_t));
    }
    offset += static_cast<int64_t>(s.block_table.size());
  }
  if (bytes > 0) backend.upload(device_.data(), host_.data(), bytes);

  const int32_t* base = device_.as<int32_t>();
  view_.row_sequence = base;
  view_.row_position = base + n_rows;
  view_.table_offset = base + 2 * n_rows;
  view_.tables = base + 2 * n_rows + n_sequences;
  view_.n_rows = n_rows;
  view_.n_sequences = n_sequences;
  view_.max_position = max_position;
  view_.partials = partials_.as<float>();
  view_.partial_floats = static_cast<int64_t>(partials_.bytes() / sizeof(float));
  view_.split_below_blocks = split_below_blocks_;
}

void kv_cache_store_batch(const KvLayout& layout, KvElement* cache, int64_t layer,
                          const AttentionBatch& batch, const float* k, const float* v,
                          CudaBackend& backend) {
  const AttentionBatch::View& view = batch.view();
  const CacheGeometry g = geometry(layout, layer);
  const int64_t row_elems = layout.n_kv_heads * layout.head_dim;
  const int64_t n = view.n_rows * row_elems;
  if (n == 0) return;
  const int64_t n_blocks = (n + kStoreThreads - 1) / kStoreThreads;
  DUET_REQUIRE(n_blocks <= INT32_MAX, "{} rows of K and V are too many for one store", view.n_rows);
  store_kernel<<<static_cast<unsigned>(n_blocks), kStoreThreads, 0,
                 static_cast<cudaStream_t>(backend.stream())>>>(view, g, row_elems, k, v, cache);
  DUET_CUDA_CHECK(cudaGetLastError());
}

void attention_batch(const KvLayout& layout, const KvElement* cache, int64_t layer,
                     const AttentionBatch& batch, const AttentionShape& shape, const float* q,
                     float* out, CudaBackend& backend) {
  DUET_REQUIRE(shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
               "{} query heads do not divide into {} KV heads", shape.n_heads, shape.n_kv_heads);
  DUET_REQUIRE(shape.head_dim == layout.head_dim && shape.n_kv_heads == layout.n_kv_heads,
               "the attention shape (head_dim {}, {} KV heads) is not the cache's ({}, {})",
               shape.head_dim, shape.n_kv_heads, layout.head_dim, layout.n_kv_heads);
  DUET_REQUIRE(reinterpret_cast<uintptr_t>(cache) % 16 == 0, "the cache must be 16-byte aligned");
  DUET_REQUIRE(shape.n_heads <= 65535 && batch.view().n_rows <= INT32_MAX, "batch too large");
  const AttentionBatch::View& view = batch.view();
  if (view.n_rows == 0) return;
  const CacheGeometry g = geometry(layout, layer);
  const auto* c = reinterpret_cast<const uint16_t*>(cache);
  const int n_heads = static_cast<int>(shape.n_heads);
  const int n_kv_heads = static_cast<int>(shape.n_kv_heads);
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  DUET_REQUIRE(shape.window >= 0 && shape.window <= INT32_MAX, "window {}", shape.window);
  const auto window = static_cast<int32_t>(shape.window);
  switch (shape.head_dim) {
    case 64:
      launch_for_group<64>(view, g, c, q, out, n_heads, n_kv_heads, shape.scale, window, stream);
      break;
    case 128:
      launch_for_group<128>(view, g, c, q, out, n_heads, n_kv_heads, shape.scale, window, stream);
      break;
    case 256:
      launch_for_group<256>(view, g, c, q, out, n_heads, n_kv_heads, shape.scale, window, stream);
      break;
    default:
      DUET_REQUIRE(false, "the CUDA attention supports head_dim 64, 128 and 256, not {}",
                   shape.head_dim);
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
