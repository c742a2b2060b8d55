// GPU twins of the element-wise and row-wise ops of kernels/cpu/ops.h (and of
// the embedding lookup and SwiGLU the CPU forward does with
// cpu::dequantize_row and KernelTable::silu_mul). Device pointers; each
// queues one kernel on the backend's stream.
#pragma once

#include <cstdint>

#include "kernels/cuda/backend.h"
#include "kernels/cuda/weights.h"
#include "kernels/op_params.h"

namespace duet::cuda {

// out (n, table.k) = rows tokens[0..n) of the table, dequantized, where the
// table holds the vocabulary's rows [first_row, first_row + table.n_out) (a
// tensor-parallel rank's slice); the rows of tokens outside it are zeros.
void embed_rows(const DeviceWeight& table, const int32_t* tokens, int64_t n, float* out,
                CudaBackend& backend, int64_t first_row = 0);

// Vocabulary-parallel logits laid out row by row: `slices` holds n_slices
// blocks of (n_rows, stride), slice s the columns [s * stride, s * stride +
// stride) of every row (an all-gather's result, the last slice padded); out
// (n_rows, n_cols) takes each row's n_cols columns from them. The twin of
// the CPU forward's assemble_logits op.
void assemble_slices(const float* slices, int64_t n_slices, int64_t n_rows, int64_t stride,
                     int64_t n_cols, float* out, CudaBackend& backend);

// Column parts of unequal widths, as a tensor-parallel all-gather leaves
// them: part p, (n_rows, width_p) row-major, starts at slices + p * slot;
// `begin` holds each part's first column and, last, the total (n_parts + 1
// entries, at most kMaxParts parts). out (n_rows, total). The twin of
// duet::assemble_slices (worker/model/tp_shard.h).
inline constexpr int kMaxParts = 8;
struct ColumnParts {
  int n_parts = 0;
  int64_t begin[kMaxParts + 1] = {};
};
void assemble_parts(const float* slices, int64_t slot, const ColumnParts& parts, int64_t n_rows,
                    float* out, CudaBackend& backend);

// Twin of cpu::rms_norm (the sum of squares in F64, in another order); out may alias x.
void rms_norm(const float* x, const float* weight, float* out, int64_t n_rows, int64_t dim,
              float eps, CudaBackend& backend);

// Twin of cpu::rope; params.freq_factors, when set, is a device pointer.
void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
          const RopeParams& params, CudaBackend& backend);

// out[i] = silu(gate[i]) * up[i] (twin of KernelTable::silu_mul); out may alias gate.
void silu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend);

// out[i] = gelu(gate[i]) * up[i] (twin of cpu::gelu_mul); out may alias gate.
void gelu_mul(const float* gate, const float* up, float* out, int64_t n, CudaBackend& backend);

// x[i] += y[i]
void add_in_place(float* x, const float* y, int64_t n, CudaBackend& backend);

// x[i] *= factor (twin of cpu::scale).
void scale(float* x, int64_t n, float factor, CudaBackend& backend);

// x (n_rows, dim) += bias (dim) on every row.
void add_bias(float* x, const float* bias, int64_t n_rows, int64_t dim, CudaBackend& backend);

// A mixture of experts' ops (twins of kernels/cpu/experts.h, device pointers; the router's
// softmax takes expf throughout, in one order).
void route_experts(const float* logits, int64_t n_rows, const RouterShape& shape, int32_t* picked,
                   float* weights, CudaBackend& backend);
// out[i] = x[rows[i]] for the n rows of width.
void gather_rows(const float* x, int64_t width, const int32_t* rows, int64_t n, float* out,
                 CudaBackend& backend);
// out[slots[i]] = y[i] * weights[slots[i]] for the n rows of width.
void scatter_weighted(const float* y, int64_t width, const int32_t* slots, int64_t n,
                      const float* weights, float* out, CudaBackend& backend);
// out[r] = the sum of picks[r][0..n_used), left to right.
void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out,
               CudaBackend& backend);
// x[0..n) = 0
void zero(float* x, int64_t n, CudaBackend& backend);

}  // namespace duet::cuda
