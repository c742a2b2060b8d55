// Packing KV rows out of (and into) the paged cache on the GPU (twins of
// worker/kv/kv_rows.cpp).
//
// kv_rows_kernel: a copy of W-element vectors (W = 8, 4, 2 or 1 F16 values,
// the widest that divides head_dim and keeps both pointers aligned; every row
// starts at a multiple of head_dim elements on both sides, so then every
// vector is aligned). blockIdx.y is one (K/V, head): its n rows of head_dim,
// which the packed rows hold a chunk at a time; in it one thread per vector,
// consecutive threads on consecutive vectors of a row and then on the next
// position, so both sides are read and written in runs (the cache side in
// runs of a block's slots, the packed side in runs of a chunk's). A thread
// finds its cache row through the block table and its packed row from its
// chunk: the launch depends on n and the head range only and nothing is read
// back to the host.
//
// Indices within a run (position, vector in a row, block-table index, slot)
// are 32-bit, bounded on the host (pos0 + n and n * head_dim at most
// INT32_MAX): the divisions are the kernel's only arithmetic. Offsets into
// the cache and the packed rows are 64-bit.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/kv_rows.h"

namespace duet::cuda {
namespace {

constexpr int kThreads = 256;

// One layer's rows, in vectors of the launch's width.
struct RowsGeometry {
  int64_t base = 0;        // first vector of the layer's first selected head in block 0
  int64_t block_vecs = 0;  // K and V of one block of one layer
  int64_t kv_vecs = 0;     // from a K row to its V row
  int64_t head_vecs = 0;   // one KV head's rows in one block
  uint32_t row_vecs = 0;   // one row: head_dim elements
  uint32_t run_vecs = 0;   // one (K/V, head)'s rows: n rows
  uint32_t block_size = 0;
  uint32_t pos0 = 0;
  uint32_t n = 0;
  uint32_t head_count = 0;
};

// Block (run, y = K/V * head_count + head): vector i of that run, which is
// vector i % row_vecs of position pos0 + i / row_vecs. kPack copies cache ->
// packed (from = cache), else packed -> cache (from = packed).
template <typename Vector, bool kPack>
__global__ void __launch_bounds__(kThreads)
    kv_rows_kernel(RowsGeometry g, const int32_t* __restrict__ block_table,
                   const Vector* __restrict__ from, Vector* __restrict__ to) {
  const uint32_t i = blockIdx.x * static_cast<uint32_t>(kThreads) + threadIdx.x;
  if (i >= g.run_vecs) return;
  const uint32_t y = blockIdx.y;
  const uint32_t kv = y / g.head_count, head = y - kv * g.head_count;
  const uint32_t p = i / g.row_vecs, c = i - p * g.row_vecs;
  const uint32_t pos = g.pos0 + p;
  const uint32_t table_index = pos / g.block_size, slot = pos - table_index * g.block_size;
  const int64_t block = block_table[table_index];
  const int64_t cache_at = g.base + block * g.block_vecs + kv * g.kv_vecs + head * g.head_vecs +
                           static_cast<int64_t>(slot) * g.row_vecs + c;
  // Its chunk of the packed rows: [chunk_first, chunk_end) of the positions.
  const uint32_t chunk =
      pos / static_cast<uint32_t>(kKvPackChunk) * static_cast<uint32_t>(kKvPackChunk);
  const uint32_t chunk_first = chunk > g.pos0 ? chunk : g.pos0;
  const uint32_t chunk_end = min(chunk + static_cast<uint32_t>(kKvPackChunk), g.pos0 + g.n);
  const int64_t chunk_rows = static_cast<int64_t>(chunk_first - g.pos0) * 2 * g.head_count +
                             static_cast<int64_t>(y) * (chunk_end - chunk_first) +
                             (pos - chunk_first);
  const int64_t packed_at = chunk_rows * g.row_vecs + c;
  if constexpr (kPack) {
    to[packed_at] = from[cache_at];
  } else {
    to[cache_at] = from[packed_at];
  }
}

// The widest vector (in F16 elements) that divides head_dim and to which both
// pointers are aligned.
int64_t vector_elems(const KvLayout& layout, const void* a, const void* b) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  for (const int64_t elems : {8, 4, 2}) {
    if (layout.head_dim % elems == 0 &&
        addresses % static_cast<uintptr_t>(elems * sizeof(KvElement)) == 0) {
      return elems;
    }
  }
  return 1;
}

// Checks the caller's arguments; false when there is nothing to copy.
bool check_rows(const KvLayout& layout, const void* cache, int64_t layer,
                const int32_t* block_table, int64_t pos0, int64_t n, int64_t head_first,
                int64_t head_count, const void* packed) {
  DUET_REQUIRE(layout.head_dim > 0 && layout.head_dim <= INT32_MAX && layout.block_size > 0 &&
                   layout.block_size <= INT32_MAX && layout.n_kv_heads > 0,
               "bad KV layout: head_dim {}, block size {}, {} KV heads", layout.head_dim,
               layout.block_size, layout.n_kv_heads);
  DUET_REQUIRE(layer >= 0 && layer < layout.n_layers, "layer {} outside the cache's {} layers",
               layer, layout.n_layers);
  DUET_REQUIRE(head_first >= 0 && head_count >= 0 && head_first + head_count <= layout.n_kv_heads,
               "KV heads [{}, +{}) of {}", head_first, head_count, layout.n_kv_heads);
  DUET_REQUIRE(pos0 >= 0 && n >= 0, "bad KV row range [{}, +{})", pos0, n);
  DUET_REQUIRE(pos0 <= INT32_MAX && n <= INT32_MAX - pos0 && n * layout.head_dim <= INT32_MAX,
               "KV rows [{}, +{}) of head_dim {} are too many for one copy", pos0, n,
               layout.head_dim);
  DUET_REQUIRE(2 * head_count <= 65535, "{} KV heads are too many for one copy", head_count);
  if (n == 0 || head_count == 0) return false;
  DUET_REQUIRE(cache != nullptr && block_table != nullptr && packed != nullptr,
               "null cache, block table or packed rows");
  return true;
}

template <bool kPack, typename Vector>
void launch(const KvLayout& layout, int64_t layer, const int32_t* block_table, int64_t pos0,
            int64_t n, int64_t head_first, int64_t head_count, const KvElement* from, KvElement* to,
            cudaStream_t stream) {
  constexpr int64_t kElems = sizeof(Vector) / sizeof(KvElement);
  RowsGeometry g;
  g.base = (layer * layout.layer_elems() + head_first * layout.head_elems()) / kElems;
  g.block_vecs = layout.block_elems() / kElems;
  g.kv_vecs = layout.kv_elems() / kElems;
  g.head_vecs = layout.head_elems() / kElems;
  g.row_vecs = static_cast<uint32_t>(layout.head_dim / kElems);
  g.run_vecs = static_cast<uint32_t>(n * (layout.head_dim / kElems));
  g.block_size = static_cast<uint32_t>(layout.block_size);
  g.pos0 = static_cast<uint32_t>(pos0);
  g.n = static_cast<uint32_t>(n);
  g.head_count = static_cast<uint32_t>(head_count);
  const dim3 grid(static_cast<unsigned>((g.run_vecs + kThreads - 1) / kThreads),
                  static_cast<unsigned>(2 * head_count));
  kv_rows_kernel<Vector, kPack><<<grid, kThreads, 0, stream>>>(
      g, block_table, reinterpret_cast<const Vector*>(from), reinterpret_cast<Vector*>(to));
  DUET_CUDA_CHECK(cudaGetLastError());
}

// Copies cache -> packed rows (from = cache, to = packed) when kPack, else
// packed rows -> cache (from = packed, to = cache).
template <bool kPack>
void copy_rows(const KvLayout& layout, int64_t layer, const int32_t* block_table, int64_t pos0,
               int64_t n, int64_t head_first, int64_t head_count, const KvElement* from,
               KvElement* to, void* stream) {
  const void* cache = kPack ? static_cast<const void*>(from) : to;
  const void* packed = kPack ? static_cast<const void*>(to) : from;
  if (!check_rows(layout, cache, layer, block_table, pos0, n, head_first, head_count, packed)) {
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (vector_elems(layout, from, to)) {
    case 8:
      launch<kPack, uint4>(layout, layer, block_table, pos0, n, head_first, head_count, from, to,
                           s);
      break;
    case 4:
      launch<kPack, uint2>(layout, layer, block_table, pos0, n, head_first, head_count, from, to,
                           s);
      break;
    case 2:
      launch<kPack, uint32_t>(layout, layer, block_table, pos0, n, head_first, head_count, from, to,
                              s);
      break;
    default:
      launch<kPack, uint16_t>(layout, layer, block_table, pos0, n, head_first, head_count, from, to,
                              s);
      break;
  }
}

}  // namespace

void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  const int32_t* block_table, int64_t pos0, int64_t n, int64_t head_first,
                  int64_t head_count, KvElement* out, void* stream) {
  copy_rows<true>(layout, layer, block_table, pos0, n, head_first, head_count, cache, out, stream);
}

void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    const int32_t* block_table, int64_t pos0, int64_t n, int64_t head_first,
                    int64_t head_count, const KvElement* in, void* stream) {
  copy_rows<false>(layout, layer, block_table, pos0, n, head_first, head_count, in, cache, stream);
}

}  // namespace duet::cuda
