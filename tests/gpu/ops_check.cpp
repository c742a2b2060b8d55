// Every element-wise and row-wise CUDA op (kernels/cuda/ops.h) against its
// CPU twin on the same inputs: embedding rows of every weight type, RMSNorm,
// RoPE (both styles, with and without frequency divisors), SwiGLU, Gemma's
// gated GELU, scaling and adds; a mixture of experts' router and row moves;
// and the two tensor-parallel layouts: a vocabulary slice's embedding rows
// (zeros for the other ranks' tokens), the gathered logits reassembled, and
// unequal column parts (O's and down's gathered inputs and outputs) laid side by side.
#include <algorithm>
#include <cmath>
#include <random>

#include "common/model/dtype.h"
#include "kernels/cpu/experts.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/ops.h"
#include "tests/gpu/backend_check.h"
#include "tests/gpu/device_vector.h"
#include "tests/gpu/gpu_check.h"

namespace duet {
namespace {

using gpu_check::expect_close;
using gpu_check::fail;
using gpu_check::to_device;
using gpu_check::to_host;

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void check_embedding(cuda::CudaBackend& backend) {
  const int64_t k = 576, n_vocab = 300;
  const std::vector<float> table = random_floats(static_cast<size_t>(k * n_vocab), 1);
  const std::vector<int32_t> tokens = {0, 7, 299, 7, 150, 42};
  const auto n = static_cast<int64_t>(tokens.size());
  for (DType type : {DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
    const size_t row_bytes = dtype_row_bytes(type, k);
    std::vector<uint8_t> stored(row_bytes * n_vocab);
    for (int64_t r = 0; r < n_vocab; ++r)
      cpu::quantize_row(type, table.data() + r * k, stored.data() + r * row_bytes, k);
    std::vector<float> want(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n; ++i)
      cpu::dequantize_row(type, stored.data() + tokens[i] * row_bytes, want.data() + i * k, k);
    const cuda::DeviceWeight weight =
        cuda::upload_weight(cpu::make_weight_matrix(type, stored.data(), k, n_vocab), backend);
    const cuda::DeviceBuffer d_tokens = to_device(tokens, backend);
    cuda::DeviceBuffer out(want.size() * sizeof(float));
    cuda::embed_rows(weight, d_tokens.as<int32_t>(), n, out.as<float>(), backend);
    // F32 tables are stored as F16 on the GPU: their rows are rounded.
    const double tolerance = type == DType::kF32 ? 1e-3 : 0.0;
    expect_close(dtype_name(type).data(), to_host<float>(out, want.size(), backend), want,
                 tolerance);
  }
}

// A rank's slice of the table: its tokens' rows as in the whole table, the
// others' zeros (the all-reduce over ranks then adds exactly one row).
void check_embedding_slice(cuda::CudaBackend& backend) {
  const int64_t k = 256, n_vocab = 300, first = 150, n_slice = 100;
  const std::vector<float> table = random_floats(static_cast<size_t>(k * n_vocab), 11);
  const DType type = DType::kQ8_0;
  const size_t row_bytes = dtype_row_bytes(type, k);
  std::vector<uint8_t> stored(row_bytes * n_vocab);
  for (int64_t r = 0; r < n_vocab; ++r)
    cpu::quantize_row(type, table.data() + r * k, stored.data() + r * row_bytes, k);
  const std::vector<int32_t> tokens = {0, 149, 150, 249, 250, 299, 200};
  const auto n = static_cast<int64_t>(tokens.size());
  std::vector<float> want(static_cast<size_t>(n * k), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] >= first && tokens[i] < first + n_slice)
      cpu::dequantize_row(type, stored.data() + tokens[i] * row_bytes, want.data() + i * k, k);
  }
  const cuda::DeviceWeight weight = cuda::upload_weight(
      cpu::make_weight_matrix(type, stored.data() + first * row_bytes, k, n_slice), backend);
  const cuda::DeviceBuffer d_tokens = to_device(tokens, backend);
  cuda::DeviceBuffer out(want.size() * sizeof(float));
  cuda::embed_rows(weight, d_tokens.as<int32_t>(), n, out.as<float>(), backend, first);
  expect_close("slice [150, 250) of 300 rows", to_host<float>(out, want.size(), backend), want,
               0.0);
}

// Three ranks' logit slices of 4 rows, stride 34 over a vocabulary of 100
// (the last slice 32 wide, padded): every element lands where the CPU's
// head puts it.
void check_assemble_slices(cuda::CudaBackend& backend) {
  const int64_t n_slices = 3, n_rows = 4, stride = 34, n_cols = 100;
  const std::vector<float> slices =
      random_floats(static_cast<size_t>(n_slices * n_rows * stride), 12);
  std::vector<float> want(static_cast<size_t>(n_rows * n_cols));
  for (int64_t s = 0; s < n_slices; ++s) {
    const int64_t count = std::min(stride, n_cols - s * stride);
    for (int64_t i = 0; i < n_rows; ++i) {
      std::copy_n(slices.data() + (s * n_rows + i) * stride, count,
                  want.data() + i * n_cols + s * stride);
    }
  }
  const cuda::DeviceBuffer d_slices = to_device(slices, backend);
  cuda::DeviceBuffer out(want.size() * sizeof(float));
  cuda::assemble_slices(d_slices.as<float>(), n_slices, n_rows, stride, n_cols, out.as<float>(),
                        backend);
  expect_close("3 slices of (4, 34) into (4, 100)", to_host<float>(out, want.size(), backend), want,
               0.0);
}

// A tensor-parallel all-gather of unequal column parts (the default model's
// query dims on 2 ranks: 384 + 192; here 3 parts of 5, 3 and 1 columns of 4
// rows, each in a slot of the widest's size): laid side by side, row by row.
void check_assemble_parts(cuda::CudaBackend& backend) {
  const int64_t n_rows = 4, widths[] = {5, 3, 1}, slot = 5 * n_rows, n_cols = 9;
  const std::vector<float> slices = random_floats(static_cast<size_t>(3 * slot), 13);
  std::vector<float> want(static_cast<size_t>(n_rows * n_cols));
  cuda::ColumnParts parts;
  parts.n_parts = 3;
  for (int p = 0; p < 3; ++p) {
    parts.begin[p + 1] = parts.begin[p] + widths[p];
    for (int64_t i = 0; i < n_rows; ++i) {
      std::copy_n(slices.data() + p * slot + i * widths[p], widths[p],
                  want.data() + i * n_cols + parts.begin[p]);
    }
  }
  const cuda::DeviceBuffer d_slices = to_device(slices, backend);
  cuda::DeviceBuffer out(want.size() * sizeof(float));
  cuda::assemble_parts(d_slices.as<float>(), slot, parts, n_rows, out.as<float>(), backend);
  expect_close("3 parts of 5, 3 and 1 columns into (4, 9)",
               to_host<float>(out, want.size(), backend), want, 0.0);
}

void check_rms_norm(cuda::CudaBackend& backend) {
  const int64_t n_rows = 37, dim = 4096;
  const std::vector<float> x = random_floats(static_cast<size_t>(n_rows * dim), 2, 3.0f);
  const std::vector<float> w = random_floats(static_cast<size_t>(dim), 3);
  std::vector<float> want(x.size());
  cpu::rms_norm(x.data(), w.data(), want.data(), n_rows, dim, 1e-5f);
  const cuda::DeviceBuffer d_x = to_device(x, backend), d_w = to_device(w, backend);
  cuda::DeviceBuffer out(x.size() * sizeof(float));
  cuda::rms_norm(d_x.as<float>(), d_w.as<float>(), out.as<float>(), n_rows, dim, 1e-5f, backend);
  expect_close("rms_norm 37 x 4096", to_host<float>(out, x.size(), backend), want, 1e-6);
}

void check_rope(cuda::CudaBackend& backend) {
  const int64_t n_rows = 19, n_heads = 8, head_dim = 128;
  const std::vector<float> x = random_floats(static_cast<size_t>(n_rows * n_heads * head_dim), 4);
  std::vector<int32_t> positions(static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r)
    positions[static_cast<size_t>(r)] = static_cast<int32_t>(r * 211 % 8000);
  std::vector<float> factors(static_cast<size_t>(head_dim / 2));
  for (size_t i = 0; i < factors.size(); ++i) factors[i] = 1.0f + static_cast<float>(i % 7);
  const cuda::DeviceBuffer d_positions = to_device(positions, backend);
  const cuda::DeviceBuffer d_factors = to_device(factors, backend);
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    for (bool with_factors : {false, true}) {
      RopeParams params;
      params.style = style;
      params.n_rot = head_dim;
      params.freq_base = 500000.0f;
      params.freq_factors = with_factors ? factors.data() : nullptr;
      std::vector<float> want = x;
      cpu::rope(want.data(), n_rows, n_heads, head_dim, positions.data(), params);
      cuda::DeviceBuffer d_x = to_device(x, backend);
      params.freq_factors = with_factors ? d_factors.as<float>() : nullptr;
      cuda::rope(d_x.as<float>(), n_rows, n_heads, head_dim, d_positions.as<int32_t>(), params,
                 backend);
      const std::string what = std::string("rope ") +
                               (style == RopeStyle::kHalves ? "halves" : "adjacent pairs") +
                               (with_factors ? ", divisors" : "");
      // Angles up to 8000 radians: sin/cos of the same float angle differ
      // in the last bits between libm and CUDA.
      expect_close(what.c_str(), to_host<float>(d_x, x.size(), backend), want, 1e-5);
    }
  }
}

void check_silu_mul_and_add(cuda::CudaBackend& backend) {
  const int64_t n = 3 * 14336;
  const std::vector<float> gate = random_floats(static_cast<size_t>(n), 5, 4.0f);
  const std::vector<float> up = random_floats(static_cast<size_t>(n), 6);
  std::vector<float> want(gate.size());
  cpu::kernel_table(cpu::best_isa()).silu_mul(gate.data(), up.data(), want.data(), n);
  const cuda::DeviceBuffer d_gate = to_device(gate, backend), d_up = to_device(up, backend);
  cuda::silu_mul(d_gate.as<float>(), d_up.as<float>(), d_gate.as<float>(), n, backend);
  expect_close("silu_mul (in place)", to_host<float>(d_gate, gate.size(), backend), want, 1e-5);

  std::vector<float> sum = gate;
  cpu::add_in_place(sum.data(), up.data(), n);
  const cuda::DeviceBuffer d_x = to_device(gate, backend);
  cuda::add_in_place(d_x.as<float>(), d_up.as<float>(), n, backend);
  expect_close("add_in_place", to_host<float>(d_x, sum.size(), backend), sum, 0.0);

  const int64_t dim = 14336, n_rows = 3;
  std::vector<float> biased = gate;
  for (int64_t r = 0; r < n_rows; ++r) cpu::add_in_place(biased.data() + r * dim, up.data(), dim);
  const cuda::DeviceBuffer d_b = to_device(gate, backend);
  cuda::add_bias(d_b.as<float>(), d_up.as<float>(), n_rows, dim, backend);
  expect_close("add_bias", to_host<float>(d_b, biased.size(), backend), biased, 0.0);
}

// Gemma's gated GELU: both round the activation's input and output to F16;
// only the tanh (CUDA's against the C library's) may move an output by one
// F16 step. Inputs reach past the +-10 clamps.
void check_gelu_mul_and_scale(cuda::CudaBackend& backend) {
  const int64_t n_rows = 3, width = 6912;  // Gemma 3 1B's feed-forward
  const int64_t n = n_rows * width;
  const std::vector<float> gate = random_floats(static_cast<size_t>(n), 7, 4.0f);
  const std::vector<float> up = random_floats(static_cast<size_t>(n), 8);
  std::vector<float> want(gate.size());
  cpu::ThreadPool pool(2);
  cpu::gelu_mul(gate.data(), up.data(), want.data(), n_rows, width, pool);
  const cuda::DeviceBuffer d_gate = to_device(gate, backend), d_up = to_device(up, backend);
  cuda::gelu_mul(d_gate.as<float>(), d_up.as<float>(), d_gate.as<float>(), n, backend);
  expect_close("gelu_mul (in place)", to_host<float>(d_gate, gate.size(), backend), want, 1e-4);

  std::vector<float> scaled = gate;
  cpu::scale(scaled.data(), n, 33.941125f);  // sqrt(1152): Gemma's embedding scale
  const cuda::DeviceBuffer d_x = to_device(gate, backend);
  cuda::scale(d_x.as<float>(), n, 33.941125f, backend);
  expect_close("scale", to_host<float>(d_x, scaled.size(), backend), scaled, 0.0);
}

// The router: the same experts in the same order, except where two logits
// are so close that the devices' exp (CUDA's expf, the CPU's ggml polynomial
// on whole 16-expert chunks) may order them differently; the weights of
// rows picked alike within float rounding.
void check_route_experts(cuda::CudaBackend& backend) {
  const int64_t n_rows = 37;
  // Qwen3-30B-A3B's, Mixtral's, and one whose experts leave a partial chunk.
  for (const RouterShape shape : {RouterShape{128, 8}, RouterShape{8, 2}, RouterShape{60, 4}}) {
    const std::vector<float> logits =
        random_floats(static_cast<size_t>(n_rows * shape.n_experts), 9, 2.0f);
    const auto n_picks = static_cast<size_t>(n_rows * shape.n_used);
    std::vector<int32_t> want_picked(n_picks);
    std::vector<float> want_weights(n_picks);
    cpu::route_experts(cpu::kernel_table(cpu::best_isa()), logits.data(), n_rows, shape,
                       want_picked.data(), want_weights.data());
    const cuda::DeviceBuffer d_logits = to_device(logits, backend);
    cuda::DeviceBuffer d_picked(n_picks * sizeof(int32_t)), d_weights(n_picks * sizeof(float));
    cuda::route_experts(d_logits.as<float>(), n_rows, shape, d_picked.as<int32_t>(),
                        d_weights.as<float>(), backend);
    const std::vector<int32_t> picked = to_host<int32_t>(d_picked, n_picks, backend);
    const std::vector<float> weights = to_host<float>(d_weights, n_picks, backend);
    std::vector<float> got_alike, want_alike;
    int64_t near_ties = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* x = logits.data() + r * shape.n_experts;
      const auto row = static_cast<size_t>(r * shape.n_used);
      bool alike = true;
      for (int64_t j = 0; j < shape.n_used; ++j) {
        const int32_t a = picked[row + static_cast<size_t>(j)];
        const int32_t b = want_picked[row + static_cast<size_t>(j)];
        if (a == b) continue;
        alike = false;
        if (a < 0 || a >= shape.n_experts || std::fabs(x[a] - x[b]) > 1e-5f) {
          fail("%lld of %lld experts, row %lld, pick %lld: expert %d, the CPU's %d",
               static_cast<long long>(shape.n_used), static_cast<long long>(shape.n_experts),
               static_cast<long long>(r), static_cast<long long>(j), a, b);
        } else {
          ++near_ties;
        }
        break;
      }
      if (!alike) continue;
      got_alike.insert(got_alike.end(), weights.begin() + static_cast<ptrdiff_t>(row),
                       weights.begin() + static_cast<ptrdiff_t>(row + shape.n_used));
      want_alike.insert(want_alike.end(), want_weights.begin() + static_cast<ptrdiff_t>(row),
                        want_weights.begin() + static_cast<ptrdiff_t>(row + shape.n_used));
    }
    char what[96];
    std::snprintf(what, sizeof(what), "route %lld of %lld experts (%lld near-tie rows)",
                  static_cast<long long>(shape.n_used), static_cast<long long>(shape.n_experts),
                  static_cast<long long>(near_ties));
    expect_close(what, got_alike, want_alike, 1e-5);
  }
}

// Moving rows into an expert's batch and its weighted outputs back, the sum
// of each row's picks in llama.cpp's order, and zeroing: the same bits.
void check_expert_rows(cuda::CudaBackend& backend) {
  const int64_t width = 2048, n_x = 10;
  const std::vector<float> x = random_floats(static_cast<size_t>(n_x * width), 10);
  const std::vector<int32_t> rows = {3, 0, 9, 3, 7};
  const auto n = static_cast<int64_t>(rows.size());
  std::vector<float> gathered(static_cast<size_t>(n * width));
  cpu::gather_rows(x.data(), width, rows, gathered.data());
  const cuda::DeviceBuffer d_x = to_device(x, backend), d_rows = to_device(rows, backend);
  cuda::DeviceBuffer d_gathered(gathered.size() * sizeof(float));
  cuda::gather_rows(d_x.as<float>(), width, d_rows.as<int32_t>(), n, d_gathered.as<float>(),
                    backend);
  expect_close("gather_rows", to_host<float>(d_gathered, gathered.size(), backend), gathered, 0.0);

  // Five expert outputs into slots of a (rows x 8 picks) layout, the others untouched.
  const std::vector<int32_t> slots = {17, 2, 40, 9, 33};
  const std::vector<float> slot_weights = random_floats(48, 14);
  std::vector<float> scattered = random_floats(static_cast<size_t>(48 * width), 15);
  const cuda::DeviceBuffer d_out = to_device(scattered, backend);
  cpu::scatter_weighted(gathered.data(), width, slots, slot_weights.data(), scattered.data());
  const cuda::DeviceBuffer d_slots = to_device(slots, backend);
  const cuda::DeviceBuffer d_weights = to_device(slot_weights, backend);
  cuda::scatter_weighted(d_gathered.as<float>(), width, d_slots.as<int32_t>(), n,
                         d_weights.as<float>(), d_out.as<float>(), backend);
  expect_close("scatter_weighted", to_host<float>(d_out, scattered.size(), backend), scattered,
               0.0);

  const int64_t n_rows = 6, n_used = 8;
  const std::vector<float> picks = random_floats(static_cast<size_t>(n_rows * n_used * width), 16);
  std::vector<float> summed(static_cast<size_t>(n_rows * width));
  cpu::sum_picks(picks.data(), n_rows, n_used, width, summed.data());
  const cuda::DeviceBuffer d_picks = to_device(picks, backend);
  cuda::DeviceBuffer d_summed(summed.size() * sizeof(float));
  cuda::sum_picks(d_picks.as<float>(), n_rows, n_used, width, d_summed.as<float>(), backend);
  expect_close("sum_picks, 8 per row", to_host<float>(d_summed, summed.size(), backend), summed,
               0.0);

  std::vector<float> zeroed = x;
  std::fill_n(zeroed.begin(), 3 * width + 5, 0.0f);
  const cuda::DeviceBuffer d_z = to_device(x, backend);
  cuda::zero(d_z.as<float>(), 3 * width + 5, backend);
  expect_close("zero", to_host<float>(d_z, zeroed.size(), backend), zeroed, 0.0);
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  return gpu_check::run_on_backend([](cuda::CudaBackend& backend) {
    gpu_check::run_case("embedding rows, every weight type", [&] { check_embedding(backend); });
    gpu_check::run_case("embedding rows of a vocabulary slice",
                        [&] { check_embedding_slice(backend); });
    gpu_check::run_case("logit slices assembled", [&] { check_assemble_slices(backend); });
    gpu_check::run_case("column parts assembled", [&] { check_assemble_parts(backend); });
    gpu_check::run_case("rms_norm", [&] { check_rms_norm(backend); });
    gpu_check::run_case("rope", [&] { check_rope(backend); });
    gpu_check::run_case("silu_mul, add_in_place, add_bias",
                        [&] { check_silu_mul_and_add(backend); });
    gpu_check::run_case("gelu_mul, scale", [&] { check_gelu_mul_and_scale(backend); });
    gpu_check::run_case("expert routing", [&] { check_route_experts(backend); });
    gpu_check::run_case("expert rows gathered, scattered and summed",
                        [&] { check_expert_rows(backend); });
  });
}
