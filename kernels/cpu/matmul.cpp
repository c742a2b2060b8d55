#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "common/format.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/quantize.h"

namespace duet::cpu {
namespace {

constexpr int64_t kMinWeightRowsPerTask = 32;
constexpr int64_t kWeightRowsMultiple = kInterleavedRowsQ4_K;  // tasks start on a group (16 or 8)
constexpr int64_t kTasksPerThread = 4;                         // enough to balance a noisy machine
constexpr int64_t kActivationRowsPerTask = 64;
static_assert(kWeightRowsMultiple % kInterleavedRowsQ6_K == 0 &&
              kWeightRowsMultiple % kInterleavedRows == 0 &&
              kWeightRowsMultiple % kInterleavedRowsQ4_0x16 == 0 &&
              kWeightRowsMultiple % kInterleavedRowsQ8_0 == 0 &&
              kWeightRowsMultiple % kInterleavedRowsQ4_1 == 0);

// Weight rows per task: few large tasks when there are few activation rows
// (decode: each task is short, so handing one out must stay rare), never
// fewer than kMinWeightRowsPerTask. Results do not depend on the split.
int64_t weight_rows_per_task(int64_t n_out, int64_t n_x_tasks, int n_threads) {
  const int64_t wanted_tasks = kTasksPerThread * n_threads;
  const int64_t n_w_tasks = std::max<int64_t>(1, (wanted_tasks + n_x_tasks - 1) / n_x_tasks);
  const int64_t rows = (n_out + n_w_tasks - 1) / n_w_tasks;
  return std::max(kMinWeightRowsPerTask,
                  (rows + kWeightRowsMultiple - 1) / kWeightRowsMultiple * kWeightRowsMultiple);
}

ConvertRowFn convert_fn(const KernelTable& kernels, DType activation) {
  switch (activation) {
    case DType::kF16:
      return kernels.convert_f16;
    case DType::kBF16:
      return kernels.convert_bf16;
    case DType::kQ8_0:
      return kernels.quantize_q8_0;
    case DType::kQ8_1:
      return kernels.quantize_q8_1;
    case DType::kQ8_K:
      return kernels.quantize_q8_k;
    default:
      DUET_ASSERT(false, "no converter to {} activations", dtype_name(activation));
  }
  return nullptr;
}

// The kernel of `type` in `layout` (interleave.h).
DotTileFn interleaved_dot_fn(const KernelTable& kernels, DType type, WeightLayout layout) {
  switch (type) {
    case DType::kQ4_0:
      return layout == WeightLayout::kInterleaved16 ? kernels.dot_q4_0x16 : kernels.dot_q4_0x8;
    case DType::kQ4_K:
      return kernels.dot_q4_kx16;
    case DType::kQ6_K:
      return kernels.dot_q6_kx16;
    case DType::kQ8_0:
      return kernels.dot_q8_0x16;
    case DType::kQ4_1:
      return kernels.dot_q4_1x16;
    default:
      DUET_ASSERT(false, "no interleaved layout for {}", dtype_name(type));
  }
  return nullptr;
}

}  // namespace

DotTileFn dot_tile_fn(const KernelTable& kernels, DType weight_type) {
  switch (weight_type) {
    case DType::kF32:
      return kernels.dot_f32;
    case DType::kF16:
      return kernels.dot_f16;
    case DType::kQ8_0:
      return kernels.dot_q8_0;
    case DType::kQ4_0:
      return kernels.dot_q4_0;
    case DType::kQ4_1:
      return kernels.dot_q4_1;
    case DType::kQ5_0:
      return kernels.dot_q5_0;
    case DType::kBF16:
      return kernels.dot_bf16;
    case DType::kQ4_K:
      return kernels.dot_q4_k;
    case DType::kQ5_K:
      return kernels.dot_q5_k;
    case DType::kQ6_K:
      return kernels.dot_q6_k;
    default:
      throw Error(ErrorKind::kUnsupported,
                  duet::format("no matrix kernel for {} weights", dtype_name(weight_type)));
  }
}

WeightMatrix make_weight_matrix(DType type, const void* data, int64_t k, int64_t n_out) {
  WeightMatrix w;
  w.type = type;
  w.data = static_cast<const uint8_t*>(data);
  w.k = k;
  w.n_out = n_out;
  w.row_bytes = dtype_row_bytes(type, k);
  return w;
}

WeightLayout preferred_layout(const KernelTable& kernels, const WeightMatrix& w) {
  if (w.layout != WeightLayout::kRows) return w.layout;
  WeightLayout layout = WeightLayout::kInterleaved;
  bool wanted = false;
  switch (w.type) {
    case DType::kQ4_0:
      // By 16 where the path asks for it and the rows fill its groups, else
      // by 8 where it takes that.
      if (kernels.interleave_q4_0_by_16 &&
          w.n_out % interleaved_group_rows(w.type, WeightLayout::kInterleaved16) == 0) {
        return WeightLayout::kInterleaved16;
      }
      wanted = kernels.interleave_q4_0;
      break;
    case DType::kQ4_K:
      wanted = kernels.interleave_q4_k;
      break;
    case DType::kQ6_K:
      wanted = kernels.interleave_q6_k;
      break;
    case DType::kQ8_0:
      wanted = kernels.interleave_q8_0;
      break;
    case DType::kQ4_1:
      wanted = kernels.interleave_q4_1;
      break;
    default:
      return WeightLayout::kRows;  // no interleaved layout
  }
  const bool fits = w.n_out % interleaved_group_rows(w.type, layout) == 0;
  return wanted && fits ? layout : WeightLayout::kRows;
}

WeightMatrix interleave(const WeightMatrix& w, WeightLayout layout, uint8_t* out,
                        const std::function<void(const uint8_t*, size_t)>& read) {
  DUET_ASSERT(w.layout == WeightLayout::kRows, "{} weights are laid out already",
              dtype_name(w.type));
  constexpr int64_t kRowsPerPiece = 1024;  // whole groups of every type
  for (int64_t row0 = 0; row0 < w.n_out; row0 += kRowsPerPiece) {
    const int64_t n_rows = std::min(kRowsPerPiece, w.n_out - row0);
    const size_t offset = static_cast<size_t>(row0) * w.row_bytes;
    cpu::interleave(w.type, layout, w.data + offset, n_rows, w.k, out + offset);
    if (read) read(w.data + offset, static_cast<size_t>(n_rows) * w.row_bytes);
  }
  WeightMatrix result = w;
  result.data = out;
  result.layout = layout;
  return result;
}

void dequantize_weight_row(const WeightMatrix& w, int64_t row, float* out) {
  if (w.layout == WeightLayout::kRows) {
    dequantize_row(w.type, w.data + static_cast<size_t>(row) * w.row_bytes, out, w.k);
    return;
  }
  thread_local std::vector<uint8_t> bytes;
  bytes.resize(w.row_bytes);
  deinterleave(w.type, w.layout, w.data, w.k, row, 1, bytes.data());
  dequantize_row(w.type, bytes.data(), out, w.k);
}

DType activation_type(DType weight_type) {
  switch (weight_type) {
    case DType::kF32:
      return DType::kF32;
    case DType::kF16:
      return DType::kF16;
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ5_0:
      return DType::kQ8_0;
    case DType::kQ4_1:
      return DType::kQ8_1;
    case DType::kBF16:
      return DType::kBF16;
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
      return DType::kQ8_K;
    default:
      throw Error(ErrorKind::kUnsupported,
                  duet::format("{} weights are not supported", dtype_name(weight_type)));
  }
}

int PackedActivations::slot(DType activation) {
  switch (activation) {
    case DType::kF32:
      return 0;
    case DType::kF16:
      return 1;
    case DType::kQ8_0:
      return 2;
    case DType::kQ8_1:
      return 3;
    case DType::kQ8_K:
      return 4;
    case DType::kBF16:
      return 5;
    default:
      DUET_ASSERT(false, "no activation slot for {}", dtype_name(activation));
  }
  return 0;
}

void PackedActivations::pack(const KernelTable& kernels, const float* x, int64_t n_x, int64_t k,
                             std::initializer_list<DType> weight_types, ThreadPool& pool) {
  source_ = x;
  n_x_ = n_x;
  k_ = k;
  for (auto& packed : packed_) packed.valid = false;
  for (DType weight_type : weight_types) {
    const DType act = activation_type(weight_type);
    Packed& packed = packed_[slot(act)];
    if (packed.valid) continue;
    packed.type = act;
    packed.row_bytes = dtype_row_bytes(act, k);
    packed.valid = true;
    if (act == DType::kF32) continue;  // read straight from the source rows
    packed.bytes.resize(packed.row_bytes * static_cast<size_t>(n_x));
    const ConvertRowFn convert = convert_fn(kernels, act);
    uint8_t* out = packed.bytes.data();
    const size_t row_bytes = packed.row_bytes;
    pool.parallel_for(n_x, [&](int64_t row, int) {
      convert(x + row * k, out + static_cast<size_t>(row) * row_bytes, k);
    });
  }
}

const uint8_t* PackedActivations::rows(DType weight_type, size_t* row_bytes) const {
  const Packed& packed = packed_[slot(activation_type(weight_type))];
  DUET_ASSERT(packed.valid, "activations were not packed for {} weights", dtype_name(weight_type));
  *row_bytes = packed.row_bytes;
  if (packed.type == DType::kF32) return reinterpret_cast<const uint8_t*>(source_);
  return packed.bytes.data();
}

void matmul(const KernelTable& kernels, const WeightMatrix& w, const PackedActivations& x, float* y,
            int64_t ldy, ThreadPool& pool) {
  DUET_ASSERT(w.k == x.k(), "matmul: weight rows have {} elements, activations {}", w.k, x.k());
  DUET_ASSERT(ldy >= w.n_out);
  const DotTileFn dot = w.layout == WeightLayout::kRows
                            ? dot_tile_fn(kernels, w.type)
                            : interleaved_dot_fn(kernels, w.type, w.layout);
  size_t x_row_bytes = 0;
  const uint8_t* x_rows = x.rows(w.type, &x_row_bytes);
  const int64_t n_x = x.n_rows();
  const int64_t n_x_tasks = (n_x + kActivationRowsPerTask - 1) / kActivationRowsPerTask;
  const int64_t rows_per_task = weight_rows_per_task(w.n_out, n_x_tasks, pool.size());
  const int64_t n_w_tasks = (w.n_out + rows_per_task - 1) / rows_per_task;
  pool.parallel_for(n_w_tasks * n_x_tasks, [&](int64_t task, int) {
    const int64_t j0 = (task % n_w_tasks) * rows_per_task;
    const int64_t i0 = (task / n_w_tasks) * kActivationRowsPerTask;
    const int64_t n_j = std::min(rows_per_task, w.n_out - j0);
    const int64_t n_i = std::min(kActivationRowsPerTask, n_x - i0);
    dot(w.data + static_cast<size_t>(j0) * w.row_bytes, w.row_bytes, n_j,
        x_rows + static_cast<size_t>(i0) * x_row_bytes, x_row_bytes, n_i, w.k, y + i0 * ldy + j0,
        ldy);
  });
}

}  // namespace duet::cpu
