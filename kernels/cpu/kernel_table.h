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

// Attention primitives. Their reduction orders are fixed by contract, so all
// paths give bit-identical results, and they follow llama.cpp's CPU build for
// AVX-512 machines (see attention.h for where each order is used):
//  - kq_scores: out[t] = dot(q, k row t) over `dim` F16 elements, products
//    accumulated in 16 lanes (element e in lane e % 16). groups == 1: every
//    16-chunk goes into one accumulator in order (llamafile's tinyBLAS, used by
//    llama.cpp for multi-token batches; needs dim % 16 == 0). groups == 4:
//    chunk c into accumulator c % 4 over whole 64-chunks, then (a0+a2)+(a1+a3),
//    and any elements past the last whole 64-chunk added in double
//    (ggml_vec_dot_f16, used for single tokens). Lanes are summed as a binary
//    tree: (l, l+8), then (l, l+4), then (0+2)+(1+3).
//  - kqv_accumulate: lanes[s * dim + d] = fma(v[s * dim + d], p[s], lanes[...])
//    for s < n_rows: one KV block's contribution to per-slot accumulators.
//  - softmax_exp: y[i] = exp(x[i] - max) by ggml's polynomial, returns the sum
//    of y taken as a double over 16-element chunks, each summed by the tree.
using KqScoresFn = void (*)(const uint16_t* q, const uint16_t* k, int64_t n_rows, int64_t dim,
                            int groups, float* out);
using KqvAccumulateFn = void (*)(const float* p, const uint16_t* v, int64_t n_rows, int64_t dim,
                                 float* lanes);
using SoftmaxExpFn = double (*)(const float* x, int64_t n, float max, float* y);

// out[i] = x[i] / (1 + exp(-x[i])) * g[i] with ggml's exp (llama.cpp's SwiGLU).
using SiluMulFn = void (*)(const float* x, const float* g, float* out, int64_t n);
// x[i] = x[i] rounded to the nearest F16 value (and back to F32).
using RoundF16Fn = void (*)(float* x, int64_t n);

struct KernelTable {
  Isa isa;
  ConvertRowFn quantize_q8_0;
  ConvertRowFn quantize_q8_1;
  ConvertRowFn convert_f16;
  DotTileFn dot_f32;   // F32 weights, F32 activations
  DotTileFn dot_f16;   // F16 weights, F16 activations
  DotTileFn dot_q8_0;  // Q8_0 weights, Q8_0 activations
  DotTileFn dot_q4_0;  // Q4_0 weights, Q8_0 activations
  DotTileFn dot_q4_1;  // Q4_1 weights, Q8_1 activations
  KqScoresFn kq_scores;
  KqvAccumulateFn kqv_accumulate;
  SoftmaxExpFn softmax_exp;
  SiluMulFn silu_mul;
  RoundF16Fn round_f16;
};

// The table of `isa`; the caller must have checked cpu_supports(isa).
const KernelTable& kernel_table(Isa isa);

const KernelTable& scalar_kernel_table();
const KernelTable& avx2_kernel_table();
const KernelTable& avx512_kernel_table();

}  // namespace duet::cpu
