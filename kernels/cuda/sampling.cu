// Choosing tokens on the GPU with the CPU Sampler's semantics
// (common/sampling.cpp, weigh() and sample()), one thread block per row.
//
// The CPU keeps a prefix of the order "higher logit first, then lower id":
// top-k its first k tokens, top-p (over those) the shortest prefix whose
// probability at temperature 1 reaches top_p. It then walks the vocabulary in
// id order adding the kept tokens' weights exp((logit - max) / temperature)
// and draws the first token whose running sum exceeds uniform * total.
//
// Here a prefix of that order is a Cut (the last kept token's key and id),
// found by a radix select over the 32-bit order key (three passes of 11, 11
// and 10 bits, each a histogram of the tokens that match the bits fixed so
// far), which fixes the boundary logit; among the tokens tied at it (equal
// weights) the cut is the m-th in id order. Top-k histograms counts; top-p
// histograms the weights exp(logit - max) in fixed point (fixed_one(n)), so
// that sums are exact and never depend on the order of atomic adds. The
// draw is an ordered scan over the vocabulary in F64: each warp owns a
// contiguous range of ids, and the warp whose range holds the crossing walks
// it again, 32 ids at a time. The CPU sums the same terms in another order,
// so the two pick different tokens only where the draw (or the top-p mass)
// falls within rounding of a boundary between two tokens.
//
// Greedy is the CPU's argmax() exactly, NaN and +inf included. Where the CPU
// refuses to draw (a NaN or +inf logit, or every logit -inf) the GPU still
// picks: NaN counts as -inf and +inf as FLT_MAX (clean()), and a row with no
// logit above -inf gives its argmax, 0.
//
// Cost: passes over the row (from L2 after the first): 1 for the argmax, 5
// per select (3 histograms, 2 to find the tied token), 1 for the draw plus
// one warp's range; top-p evaluates exp in F64 for every token once.
// TODO(perf): a multi-block variant for small batches with large vocabularies.
#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/sampling.h"

namespace duet::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;  // the widest radix digit: 11 bits
constexpr int kBinsPerThread = kBins / kThreads;
// Top-p's weights are fixed point: the top token weighs fixed_one(n), the
// largest power of two with n * fixed_one(n) <= 2^63, so every sum fits in 64
// bits; up to kMaxVocab tokens that keeps at least 43 bits (2^45 at 152k
// tokens, 2^47 at 49k).
constexpr int64_t kMaxVocab = int64_t{1} << 20;

// The first tokens of the order (key ascending, then id ascending): kept iff
// (key, id) <= (cut.key, cut.id).
struct Cut {
  uint32_t key;
  int32_t id;
};

__device__ __forceinline__ bool kept(uint32_t key, int32_t id, Cut cut) {
  return key < cut.key || (key == cut.key && id <= cut.id);
}

// NaN never wins, +inf is the largest float, -0 ties with +0 (as float compares).
__device__ __forceinline__ float clean(float x) {
  if (x != x) return -INFINITY;
  if (x == INFINITY) return FLT_MAX;
  return x == 0.0f ? 0.0f : x;
}

// Ascending key = descending logit.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? bits : ~(bits | 0x80000000u);
}

__device__ __forceinline__ float key_logit(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? key : ~key & 0x7fffffffu);
}

__device__ __forceinline__ double fixed_one(int n) {
  const int bits = n > 1 ? 32 - __clz(n - 1) : 0;  // ceil(log2(n)), <= 20
  return __ull2double_rn(1ull << (63 - bits));
}

// exp(x - max) at temperature 1 (as the CPU's top-p computes it), in fixed
// point: `one` is fixed_one(n).
__device__ __forceinline__ uint64_t fixed_weight(float x, float max, double one) {
  return __double2ull_rn(exp(static_cast<double>(x - max)) * one);
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const T y = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

struct Shared {
  uint64_t bins[kBins];
  uint64_t stage[kWarps][32];
  uint64_t warp_u64[kWarps];
  double warp_f64[kWarps];
  float warp_value[kWarps];
  int32_t warp_index[kWarps];
  uint32_t digit;
  uint64_t need;
  int32_t found_warp;
  int32_t found;
};

// Adds w to bins[digit] for the active lanes, one atomic per distinct digit
// of the warp. Every lane of the warp calls it.
__device__ void histogram_add(Shared& sh, int warp, int lane, bool active, uint32_t digit,
                              uint64_t w) {
  const unsigned act = __ballot_sync(kFullMask, active);
  if (act == 0) return;
  if (active) {
    const unsigned group = __match_any_sync(act, digit);
    sh.stage[warp][lane] = w;
    __syncwarp(act);
    if (lane == __ffs(group) - 1) {
      uint64_t sum = 0;
      for (unsigned g = group; g != 0; g &= g - 1) sum += sh.stage[warp][__ffs(g) - 1];
      atomicAdd(reinterpret_cast<unsigned long long*>(&sh.bins[digit]),
                static_cast<unsigned long long>(sum));
    }
  }
  __syncwarp();  // stage is reused by the next call
}

__device__ uint64_t block_sum(Shared& sh, uint64_t x, int warp, int lane) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  if (lane == 0) sh.warp_u64[warp] = x;
  __syncthreads();
  uint64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += sh.warp_u64[w];
  __syncthreads();
  return total;
}

__device__ uint64_t block_exclusive_scan(Shared& sh, uint64_t x, int warp, int lane) {
  const uint64_t inclusive = warp_inclusive_scan(x, lane);
  if (lane == 31) sh.warp_u64[warp] = inclusive;
  __syncthreads();
  uint64_t before = 0;
  for (int w = 0; w < warp; ++w) before += sh.warp_u64[w];
  __syncthreads();
  return before + inclusive - x;
}

// The CPU's argmax() (common/sampling.cpp) in *id: the lowest id of the
// largest logit, +inf the largest and NaN never larger (as float compares);
// 0 when no logit exceeds -inf, and 0 when the logit of id 0 is NaN (the
// CPU's scan starts there and every comparison with NaN fails). *max: that
// largest non-NaN logit, cleaned (clean(); -inf when none exceeds -inf).
__device__ void block_argmax(Shared& sh, const float* x, int n, int warp, int lane, float* max,
                             int32_t* id) {
  float best = -INFINITY;
  int32_t best_id = INT32_MAX;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float xi = x[i];
    if (xi > best) best = xi, best_id = i;  // ids ascend per thread: ties keep the first
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(kFullMask, best, offset);
    const int32_t other_id = __shfl_xor_sync(kFullMask, best_id, offset);
    if (other > best || (other == best && other_id < best_id)) best = other, best_id = other_id;
  }
  if (lane == 0) sh.warp_value[warp] = best, sh.warp_index[warp] = best_id;
  __syncthreads();
  best = sh.warp_value[0], best_id = sh.warp_index[0];
  for (int w = 1; w < kWarps; ++w) {
    if (sh.warp_value[w] > best || (sh.warp_value[w] == best && sh.warp_index[w] < best_id))
      best = sh.warp_value[w], best_id = sh.warp_index[w];
  }
  __syncthreads();
  *max = clean(best);
  *id = best_id == INT32_MAX || x[0] != x[0] ? 0 : best_id;
}

// The first id i with value(0) + ... + value(i) > target(total), -1 if none;
// value() >= 0 and deterministic. Warp w owns ids [w * span, (w + 1) * span)
// and sums them 32 at a time; the walk of the crossing warp repeats exactly
// those additions, so it finds the crossing its total promised.
template <typename T, typename Value, typename Target>
__device__ int32_t first_crossing(Shared& sh, int n, int warp, int lane, Value value,
                                  Target target_of) {
  __shared__ T totals[kWarps];
  __shared__ T start_shared, target_shared;
  const int span = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int begin = warp * span, end = min(n, begin + span);
  T running = 0;
  for (int base = begin; base < end; base += 32) {
    const T v = base + lane < end ? value(base + lane) : T(0);
    running += __shfl_sync(kFullMask, warp_inclusive_scan(v, lane), 31);
  }
  if (lane == 0) totals[warp] = running;
  __syncthreads();
  if (threadIdx.x == 0) {
    T total = 0;
    for (int w = 0; w < kWarps; ++w) total = total + totals[w];
    const T target = target_of(total);
    T start = 0;
    sh.found_warp = -1;
    for (int w = 0; w < kWarps; ++w) {
      const T inclusive = start + totals[w];
      if (inclusive > target) {
        sh.found_warp = w;
        break;
      }
      start = inclusive;
    }
    start_shared = start;
    target_shared = target;
    sh.found = -1;
  }
  __syncthreads();
  if (warp == sh.found_warp) {
    const T start = start_shared, target = target_shared;
    running = 0;
    for (int base = begin; base < end; base += 32) {
      const T v = base + lane < end ? value(base + lane) : T(0);
      const T inclusive = warp_inclusive_scan(v, lane);
      const T chunk = __shfl_sync(kFullMask, inclusive, 31);
      if (start + (running + chunk) > target) {  // warp-uniform
        const unsigned hit =
            __ballot_sync(kFullMask, v > T(0) && start + (running + inclusive) > target);
        const unsigned nonzero = __ballot_sync(kFullMask, v > T(0));  // not empty: chunk > 0
        if (lane == 0) sh.found = base + (hit != 0 ? __ffs(hit) - 1 : 31 - __clz(nonzero));
        break;
      }
      running += chunk;
    }
  }
  __syncthreads();
  const int32_t found = sh.found;
  __syncthreads();
  return found;
}

// The shortest prefix of the order, among the tokens `domain` keeps, whose
// weight reaches `need`: count (weight 1, need = k) for top-k, fixed-point
// exp(x - max) (need = top_p of the domain's total) for top-p.
__device__ Cut select_prefix(Shared& sh, const float* x, int n, float max, Cut domain, bool by_mass,
                             uint64_t need, float top_p, int warp, int lane) {
  const double one = fixed_one(n);
  uint32_t prefix = 0;  // the key bits fixed so far
  for (int pass = 0; pass < 3; ++pass) {
    const int high = 32 - 11 * pass;              // bits [high, 32) are fixed
    const int shift = high > 11 ? high - 11 : 0;  // this pass's digit: bits [shift, high)
    const uint32_t digit_mask = (1u << (high - shift)) - 1;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.bins[b] = 0;
    __syncthreads();
    for (int base = warp * 32; base < n; base += kThreads) {  // warp-uniform
      const int i = base + lane;
      bool active = false;
      uint32_t digit = 0;
      uint64_t w = 0;
      if (i < n) {
        const float xi = clean(x[i]);
        const uint32_t key = order_key(xi);
        active = kept(key, i, domain) &&
                 (static_cast<uint64_t>(key) >> high) == (static_cast<uint64_t>(prefix) >> high);
        if (active) {
          digit = (key >> shift) & digit_mask;
          w = by_mass ? fixed_weight(xi, max, one) : 1;
          active = w != 0;
        }
      }
      histogram_add(sh, warp, lane, active, digit, w);
    }
    __syncthreads();
    uint64_t local = 0;
#pragma unroll
    for (int b = 0; b < kBinsPerThread; ++b) local += sh.bins[threadIdx.x * kBinsPerThread + b];
    if (pass == 0 && by_mass) {  // the CPU's cut: cumulative / total >= top_p
      const uint64_t total = block_sum(sh, local, warp, lane);  // > 0: the top token is kept
      const double wanted = ceil(static_cast<double>(top_p) * static_cast<double>(total));
      need = wanted < 1.0
                 ? 1
                 : (wanted >= static_cast<double>(total) ? total : __double2ull_rn(wanted));
    }
    const uint64_t before = block_exclusive_scan(sh, local, warp, lane);
    if (before < need && need <= before + local) {  // exactly one thread
      uint64_t cumulative = before;
      for (int b = 0; b < kBinsPerThread; ++b) {
        const uint64_t mass = sh.bins[threadIdx.x * kBinsPerThread + b];
        if (need <= cumulative + mass) {
          sh.digit = threadIdx.x * kBinsPerThread + b;
          sh.need = need - cumulative;
          break;
        }
        cumulative += mass;
      }
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    need = sh.need;
    __syncthreads();
  }
  // prefix is the boundary key; its tokens weigh the same: the cut is the m-th of them.
  const uint64_t w = by_mass ? fixed_weight(key_logit(prefix), max, one) : 1;
  const uint64_t m = w == 0 ? 1 : (need + w - 1) / w;
  const int32_t id = first_crossing<uint64_t>(
      sh, n, warp, lane,
      [&](int i) -> uint64_t {
        const uint32_t key = order_key(clean(x[i]));
        return key == prefix && kept(key, i, domain) ? 1 : 0;
      },
      [&](uint64_t) { return m - 1; });
  return {prefix, id < 0 ? INT32_MAX : id};
}

__global__ void __launch_bounds__(kThreads, 2)  // 2 blocks an SM: at most 64 registers
    sample_kernel(const float* __restrict__ logits, int n, const RowSampling* __restrict__ rows,
                  int32_t* __restrict__ tokens) {
  __shared__ Shared sh;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* x = logits + static_cast<int64_t>(blockIdx.x) * n;
  const RowSampling params = rows[blockIdx.x];
  float max;
  int32_t best;
  block_argmax(sh, x, n, warp, lane, &max, &best);
  if (params.temperature == 0.0f || max == -INFINITY) {  // block-uniform
    if (threadIdx.x == 0) tokens[blockIdx.x] = best;
    return;
  }
  Cut cut{0xffffffffu, INT32_MAX};  // keeps every token
  if (params.top_k > 0 && params.top_k < n) {
    cut = select_prefix(sh, x, n, max, cut, false, static_cast<uint64_t>(params.top_k), 1.0f, warp,
                        lane);
  }
  if (params.top_p < 1.0f)
    cut = select_prefix(sh, x, n, max, cut, true, 0, params.top_p, warp, lane);
  const double temperature = params.temperature;
  const int32_t token = first_crossing<double>(
      sh, n, warp, lane,
      [&](int i) {
        const float xi = clean(x[i]);
        return kept(order_key(xi), i, cut) ? exp(static_cast<double>(xi - max) / temperature) : 0.0;
      },
      [&](double total) { return params.uniform * total; });
  if (threadIdx.x == 0) tokens[blockIdx.x] = token < 0 ? best : token;  // as the CPU's fallback
}

}  // namespace

void sample_rows(const float* logits, int64_t n_rows, int64_t n_vocab, const RowSampling* rows,
                 int32_t* tokens, CudaBackend& backend) {
  DUET_REQUIRE(n_vocab > 0 && n_vocab <= kMaxVocab, "vocabulary of {} tokens: 1 to {} supported",
               n_vocab, kMaxVocab);
  DUET_REQUIRE(n_rows >= 0 && n_rows <= INT32_MAX, "bad number of rows {}", n_rows);
  if (n_rows == 0) return;
  sample_kernel<<<static_cast<unsigned>(n_rows), kThreads, 0,
                  static_cast<cudaStream_t>(backend.stream())>>>(logits, static_cast<int>(n_vocab),
                                                                 rows, tokens);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda
