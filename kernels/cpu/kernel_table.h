// The per-ISA CPU kernels, as one table of function pointers per path.
//
// Batch invariance is a contract of every DotTileFn: the value written for a
// pair (weight row j, activation row i) is computed by the same sequence of
// operations whatever n_w, n_x, the pair's position in the tile, or the way a
// caller splits rows into tiles and threads. Only `k` shapes the reduction.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/isa.h"

namespace duet::cpu {

// y[i * ldy + j] = dot(weight row j, activation row i) for j < n_w, i < n_x.
// w: n_w rows of k elements in the weight type, w_stride bytes apart.
// x: n_x rows of k elements in the weight's activation type, x_stride bytes apart.
using DotTileFn = void (*)(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                           size_t x_stride, int64_t n_x, int64_t k, float* y, int64_t ldy);

// x: (n) floats -> one row of the target type.
using ConvertRowFn = void (*)(const float* x, void* out, int64_t n);

// Reduction orders of the dot products. Every path computes exactly these, so
// all paths agree bit for bit (the scalar path spells them out):
//  - Q8_0, Q4_1, Q5_0: see x86_kernels_inl.h (llama.cpp's AVX2 order).
//  - Q4_0 x Q8_0: one exact integer per 32-element block and pair, then one
//    float step (the order of llama.cpp's repacked Q4_0 kernels, which it
//    runs by default on AVX2 and AVX-512). For block b in order, y from 0:
//      S = sum over e of (q[e] - 8) * x[e];  y = fma(float(S), d_w * d_x, y)
//    d_w * d_x multiplies two halves, so it is exact in float.
//  - BF16 x BF16: 16 float lanes over whole 32-element chunks; for chunk c,
//    lane l adds the product of elements 32c + 2l + 1, then of 32c + 2l
//    (what AVX512-BF16's vdpbf16ps computes, used by llama.cpp's tinyBLAS on
//    CPUs that have it; a BF16 product is exact in float, so each step is one
//    rounding: an FMA). The lanes are summed by lane_tree_sum16, then the
//    elements past the last whole chunk are added in order by FMA. Unlike
//    vdpbf16ps, subnormal inputs and results are not flushed to zero.
//  - Q4_K, Q5_K and Q6_K x Q8_K: one exact integer per 256-element super-block
//    and pair, then three float steps (llama.cpp's tiled prefill order, in
//    ggml-cpu/tiled, with its last multiply-add fused). For super-block b in
//    order, y starting at 0:
//      S = sum over sub-blocks s of sc[s] * (the dot of the sub-block's q with x)
//      M = sum over sub-blocks s of m[s] * ys[s]           (Q4_K, Q5_K)
//      r = float(S) * d_w;  r = fma(-dmin_w, float(M), r)  (the fma: Q4_K, Q5_K)
//      y = fma(r, d_x, y)
//    Sub-blocks: 8 of 32 elements with 6-bit sc and m (Q4_K; Q5_K's q has a
//    fifth bit), 16 of 16 with signed 8-bit sc (Q6_K, whose q is the stored
//    6-bit value minus 32). ys[s] is the Q8_K sum of x over sub-block s (its
//    bsums). S and M are exact in int32, so a path may compute them any way
//    it likes: the SIMD paths take Q6_K's unsigned q and subtract
//    32 * sum sc[s] * ys[s].
//  Integer lanes and sums are exact, so a path may compute them any way it likes.

// Attention primitives. Their reduction orders are fixed by contract, so all
// paths give bit-identical results, and they follow llama.cpp's CPU build for
// AVX-512 machines (see attention.h for where each order is used). K and V
// rows come as 16-row segments of one KV head (segment m holds rows 16m ..
// 16m + 15, dim halves each, one after the other: a piece of one cache
// block), and several query heads that share the KV head go together.
//  - kq_scores: out[h * ld_out + t] = dot(q head h, k row t) for h < n_q
//    (q: n_q rows of dim halves) and t < n_keys, over `dim` F16 elements,
//    products accumulated in 16 lanes (element e in lane e % 16). groups == 1:
//    every 16-chunk goes into one accumulator in order (llamafile's tinyBLAS,
//    used by llama.cpp for multi-token batches; needs dim % 16 == 0). groups
//    == 4: chunk c into accumulator c % 4 over whole 64-chunks, then
//    (a0+a2)+(a1+a3), and any elements past the last whole 64-chunk added in
//    double (ggml_vec_dot_f16, used for single tokens). Lanes are summed as a
//    binary tree: (l, l+8), then (l, l+4), then (0+2)+(1+3).
//  - kqv_sum: out[h * dim + d] = query head h's probabilities p[h * ld_p + t]
//    times V, over the n_keys value rows. For every slot s < 16 and group
//    g < groups (1 or 4), the lanes start at 0 and
//    lanes[g][s][d] = fma(v[t][d], p[t], lanes[g][s][d]) for the rows
//    t = 16m + s < n_keys with m % groups == g, in increasing t. Then (groups
//    4) G[s][d] = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]) (groups 1: G =
//    lanes[0]), and out[d] = the 16-lane tree sum of G[.][d] over s.
//  - softmax_exp: y[i] = exp(x[i] - max) by ggml's polynomial, returns the sum
//    of y taken as a double over 16-element chunks, each summed by the tree.
//  - dot_f32_lanes: y[j] = dot(w row j, x) over k floats for the n_w rows of w
//    (k floats each), in kq_scores's lane orders on F32: groups 1 (llamafile's
//    tinyBLAS, llama.cpp's F32 product of several tokens; needs k % 16 == 0)
//    or 4 (ggml_vec_dot_f32, its product of one token), the lanes summed by
//    the tree; then, groups 4, the elements past the last whole 64-chunk added
//    in float, in order, each by an FMA (GCC contracts ggml's multiply-add).
using KqScoresFn = void (*)(const uint16_t* q, int64_t n_q, const uint16_t* const* segments,
                            int64_t n_keys, int64_t dim, int groups, float* out, int64_t ld_out);
using KqvSumFn = void (*)(const float* p, int64_t ld_p, int64_t n_q,
                          const uint16_t* const* segments, int64_t n_keys, int64_t dim, int groups,
                          float* out);
using SoftmaxExpFn = double (*)(const float* x, int64_t n, float max, float* y);
using DotF32LanesFn = void (*)(const float* w, int64_t n_w, const float* x, int64_t k, int groups,
                               float* y);
//  - kqv_sum_tile: kqv_sum of n_rows query rows at once (a tile of a
//    prefill's consecutive rows, which read the same values): row r's n_q
//    heads have their probabilities at p + (r * n_q + h) * ld_p, n_keys0 + r
//    keys, and their output at out + r * ld_out + h * dim. Each row's result
//    is exactly kqv_sum's. Optional (null: row by row with kqv_sum).
using KqvSumTileFn = void (*)(const float* p, int64_t ld_p, int64_t n_q, int64_t n_rows,
                              int64_t n_keys0, const uint16_t* const* segments, int64_t dim,
                              int groups, float* out, int64_t ld_out);

// out[i] = x[i] / (1 + exp(-x[i])) * g[i] with ggml's exp (llama.cpp's SwiGLU).
using SiluMulFn = void (*)(const float* x, const float* g, float* out, int64_t n);
// x[i] = x[i] * factor (in F32) rounded to the nearest F16 value (and back
// to F32).
using ScaleRoundF16Fn = void (*)(float* x, int64_t n, float factor);

struct KernelTable {
  Isa isa;
  ConvertRowFn quantize_q8_0;
  ConvertRowFn quantize_q8_1;
  ConvertRowFn quantize_q8_k;
  ConvertRowFn convert_f16;
  ConvertRowFn convert_bf16;
  DotTileFn dot_f32;   // F32 weights, F32 activations
  DotTileFn dot_f16;   // F16 weights, F16 activations
  DotTileFn dot_q8_0;  // Q8_0 weights, Q8_0 activations
  DotTileFn dot_q4_0;  // Q4_0 weights, Q8_0 activations
  DotTileFn dot_q4_1;  // Q4_1 weights, Q8_1 activations
  DotTileFn dot_q5_0;  // Q5_0 weights, Q8_0 activations
  DotTileFn dot_bf16;  // BF16 weights, BF16 activations
  DotTileFn dot_q4_k;  // Q4_K weights, Q8_K activations
  DotTileFn dot_q5_k;  // Q5_K weights, Q8_K activations
  DotTileFn dot_q6_k;  // Q6_K weights, Q8_K activations
  // Q4_0 weights interleaved by 8 rows (interleave.h), Q8_0 activations.
  DotTileFn dot_q4_0x8;
  // Whether Q4_0 weights run faster interleaved on this path (the model
  // loader lays them out so); every path computes every layout alike.
  bool interleave_q4_0;
  // Q4_0 weights interleaved by 16 rows (BlockQ4_0x16), Q8_0 activations,
  // and whether this path prefers them so (then by 8, where interleave_q4_0
  // says so, only for matrices whose rows fill no group of 16).
  DotTileFn dot_q4_0x16;
  bool interleave_q4_0_by_16;
  // Q4_K weights interleaved by 16 rows (interleave.h), Q8_K activations,
  // and whether this path prefers them so.
  DotTileFn dot_q4_kx16;
  bool interleave_q4_k;
  // Q6_K weights interleaved by 16 rows, Q8_K activations, likewise.
  DotTileFn dot_q6_kx16;
  bool interleave_q6_k;
  // Q8_0 weights interleaved by 16 rows, Q8_0 activations, likewise.
  DotTileFn dot_q8_0x16;
  bool interleave_q8_0;
  // Q4_1 weights interleaved by 16 rows, Q8_1 activations, likewise.
  DotTileFn dot_q4_1x16;
  bool interleave_q4_1;
  KqScoresFn kq_scores;
  KqvSumFn kqv_sum;
  SoftmaxExpFn softmax_exp;
  DotF32LanesFn dot_f32_lanes;
  SiluMulFn silu_mul;
  ScaleRoundF16Fn scale_round_f16;
  KqvSumTileFn kqv_sum_tile = nullptr;
};

// The table of `isa`; the caller must have checked cpu_supports(isa).
const KernelTable& kernel_table(Isa isa);

const KernelTable& scalar_kernel_table();
const KernelTable& avx2_kernel_table();
const KernelTable& avx512_kernel_table();

}  // namespace duet::cpu
