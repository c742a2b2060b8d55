// Scalar definitions of the fixed-order reductions and the exponential that
// the attention kernels share (see kernel_table.h). The SIMD paths compute
// exactly these; the portable path calls them directly.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/model/fp16.h"

namespace duet::cpu {

// Sum of 16 lanes as the tree (l, l+8), (l, l+4), (0+2)+(1+3).
static inline float lane_tree_sum16(const float* v) {
  float a[8], b[4];
  for (int l = 0; l < 8; ++l) a[l] = v[l + 8] + v[l];
  for (int l = 0; l < 4; ++l) b[l] = a[l + 4] + a[l];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Element d of kqv_sum (kernel_table.h): per (group, slot) one FMA chain over
// the value rows in order, the groups combined, then the 16-lane tree.
static inline float kqv_sum_at(const float* p, const uint16_t* const* segments, int64_t n_keys,
                               int64_t dim, int groups, int64_t d) {
  float lanes[4][16] = {};
  for (int64_t t = 0; t < n_keys; ++t) {
    float& lane = lanes[(t / 16) % groups][t % 16];
    lane = std::fma(fp16_to_fp32(segments[t / 16][t % 16 * dim + d]), p[t], lane);
  }
  float g[16];
  for (int s = 0; s < 16; ++s) {
    g[s] = groups == 1 ? lanes[0][s] : (lanes[0][s] + lanes[2][s]) + (lanes[1][s] + lanes[3][s]);
  }
  return lane_tree_sum16(g);
}

// ggml's vectorized expf: a degree-5 polynomial after range reduction by
// ln 2, scaled by 2^n; |n| > 192 saturates to 0 or infinity.
static inline float ggml_expf(float x) {
  if (std::isnan(x)) return x;
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, std::fma(0x1.ffffecp-1f, b, 1.0f));
  return std::ldexp(j, static_cast<int>(n));
}

}  // namespace duet::cpu
