// Element-wise and row-wise operations of the Llama forward pass (scalar C++;
// their cost is small beside the matrix products, but not beside a batched
// step's, hence the row-parallel forms). Shapes are row-major.
#pragma once

#include <cstdint>

#include "kernels/cpu/thread_pool.h"
#include "kernels/op_params.h"

namespace duet::cpu {

// out (n_rows, dim) = x / rms(x) * weight; the sum of squares is taken in
// double, as llama.cpp does. out may alias x.
void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps);

// Rotates x (n_rows, n_heads * head_dim) in place; row r sits at positions[r].
void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params);

// rms_norm and rope with the rows split across the pool's threads (rows are
// independent, so the results are the same bits; one row runs inline).
void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps, ThreadPool& pool);
void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params, ThreadPool& pool);

// x[i] += y[i]
void add_in_place(float* x, const float* y, int64_t n);

// x[i] *= factor (as ggml_scale).
void scale(float* x, int64_t n, float factor);

// GELU by its tanh approximation, as llama.cpp's CPU build computes it
// (ggml_gelu_f32 through its F16 table): x <= -10 gives 0, x >= 10 gives x,
// else the F16 rounding of gelu(the F16 rounding of x). The same bits on
// every ISA (a table built once with the C library's tanhf).
float gelu(float x);

// out (n_rows, width) = gelu(gate) * up, element by element (llama.cpp's
// GEGLU, ggml_vec_geglu_f32); out may alias gate. Rows split across the pool.
void gelu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width,
              ThreadPool& pool);

// Numerically safe softmax of x (n) in place; returns nothing, sums in double.
void softmax_in_place(float* x, int64_t n);

}  // namespace duet::cpu
