// Matrix products of activations with stored (possibly quantized) weights.
//
// y (n_x, n_out) = x (n_x, k) . W^T, W stored as n_out rows of k elements
// (GGUF's ne = {k, n_out}). Activations are first converted into the type
// the weight's dot product takes (llama.cpp's "vec_dot_type": Q8_0 for Q8_0
// and Q4_0, Q8_1 for Q4_1, Q8_K for Q4_K and Q6_K, F16 for F16, BF16 for
// BF16, F32 for F32), once per input and reused by every weight that shares
// it (Q, K and V; gate and up).
//
// Batch invariance: every output element is one DotTileFn pair, so results do
// not depend on n_x, on a row's place in the batch, or on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/model/dtype.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {

// A non-owning view of a weight matrix: n_out rows of k elements.
struct WeightMatrix {
  DType type = DType::kF32;
  const uint8_t* data = nullptr;
  int64_t k = 0;
  int64_t n_out = 0;
  size_t row_bytes = 0;  // a row's bytes in the file (the layout's total is the same)
  WeightLayout layout = WeightLayout::kRows;
};

WeightMatrix make_weight_matrix(DType type, const void* data, int64_t k, int64_t n_out);

// The layout `kernels` run `w` (in rows) fastest in: kRows, or the one to
// lay it out in.
WeightLayout preferred_layout(const KernelTable& kernels, const WeightMatrix& w);
// `w` (in rows) laid out in `layout` into `out` (w's bytes), a piece of rows
// at a time, `read(bytes, n)` told of each piece of w.data once it is read
// for the last time. The result views `out`.
WeightMatrix interleave(const WeightMatrix& w, WeightLayout layout, uint8_t* out,
                        const std::function<void(const uint8_t*, size_t)>& read = {});

// Row `row` of `w` (any layout) as n = w.k floats.
void dequantize_weight_row(const WeightMatrix& w, int64_t row, float* out);

// The kernel path's dot-product tile for a weight type; throws kUnsupported.
DotTileFn dot_tile_fn(const KernelTable& kernels, DType weight_type);

// The activation type a weight type's dot product takes; throws kUnsupported.
DType activation_type(DType weight_type);

// Activation rows converted for one or more weight types. Owns its buffers;
// reuse one object across steps to avoid allocations.
class PackedActivations {
 public:
  // Converts x (n_x, k) for every type in `types` (no duplicates needed).
  void pack(const KernelTable& kernels, const float* x, int64_t n_x, int64_t k,
            std::initializer_list<DType> weight_types, ThreadPool& pool);

  int64_t n_rows() const { return n_x_; }
  int64_t k() const { return k_; }
  // Rows for `weight_type`; it must have been packed.
  const uint8_t* rows(DType weight_type, size_t* row_bytes) const;

 private:
  struct Packed {
    DType type = DType::kF32;  // activation type
    size_t row_bytes = 0;
    std::vector<uint8_t> bytes;
    bool valid = false;
  };
  static constexpr int kSlots = 6;  // F32, F16, Q8_0, Q8_1, Q8_K, BF16
  static int slot(DType activation);
  Packed packed_[kSlots];
  const float* source_ = nullptr;
  int64_t n_x_ = 0;
  int64_t k_ = 0;
};

// y[i * ldy + j] for i < x.n_rows(), j < w.n_out.
void matmul(const KernelTable& kernels, const WeightMatrix& w, const PackedActivations& x, float* y,
            int64_t ldy, ThreadPool& pool);

}  // namespace duet::cpu
