// The GPU benchmark: what the CUDA backend achieves against what the GPU can
// do, measured on the GPU itself.
//
//   1. Rooflines: device-to-device copy bandwidth (1 GiB, counted as read +
//      write bytes) and the cuBLAS F16 GEMM rate through cuda::matmul_gemm.
//   2. One synthetic Llama-3-8B layer (its 7 weight matrices, random weights;
//      no attention, no norms): decode GEMV weight-read GB/s per weight type
//      at 1 and 8 rows, and prefill TFLOP/s on the GEMM path.
//   3. The real model (--model): decode tokens/s at batch 1 and 64 with and
//      without CUDA graphs, weight bytes per token and the weight-read GB/s it
//      implies, and the prefill rate of one 512-token prompt.
//
// Every GPU section is timed on the host with std::chrono around
// CudaBackend::synchronize(), after warm-up runs; figures are medians of
// repetitions (decode: the total of 64 steps, and the median step). Prints a
// table and writes the figures as JSON (--json).
//
//   duet-cuda-bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --json out.json [--quick]
//
// Exits 77 (skipped) on a machine without a CUDA device, 2 on a bad command line.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/model/dtype.h"
#include "common/stats.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/weights.h"
#include "worker/kv/kv_cache.h"
#include "worker/model/cuda_forward.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"

namespace duet {
namespace {

constexpr int kSkipped = 77;
constexpr int kUsageError = 2;
constexpr double kGiga = 1e9;
constexpr double kTera = 1e12;

// ---------------------------------------------------------------------------
// Command line

struct Options {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string json;  // empty: no JSON file
  bool quick = false;
};

void print_usage(std::FILE* to) {
  std::fputs(
      "usage: duet-cuda-bench [--model PATH] [--json OUT.json] [--quick]\n"
      "  --model PATH   GGUF model for the decode/prefill figures\n"
      "                 (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
      "  --json PATH    also write the figures as JSON to PATH\n"
      "  --quick        fewer repetitions and a smaller synthetic prefill\n",
      to);
}

// Returns the exit status to stop with (0 for --help), or -1 to go on.
int parse_options(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "duet-cuda-bench: option %s needs a value\n", argv[i]);
        return false;
      }
      out = argv[++i];
      return true;
    };
    if (arg == "--model") {
      if (!value(options.model)) return kUsageError;
    } else if (arg == "--json") {
      if (!value(options.json)) return kUsageError;
    } else if (arg == "--quick") {
      options.quick = true;
    } else if (arg == "--help" || arg == "-h") {
      print_usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "duet-cuda-bench: unknown option '%s'\n", argv[i]);
      print_usage(stderr);
      return kUsageError;
    }
  }
  return -1;
}

// Warm-up runs and timed repetitions of one measurement.
struct Reps {
  int warmup = 0;
  int timed = 0;
};

struct Plan {
  Reps copy, gemm, gemv, prefill, model_prefill;
  int64_t prefill_rows = 0;  // synthetic prefill batch
};

Plan make_plan(bool quick) {
  if (quick) return {{2, 5}, {2, 5}, {2, 10}, {1, 3}, {1, 3}, 1024};
  return {{3, 20}, {3, 20}, {3, 30}, {2, 10}, {2, 10}, 2048};
}

// ---------------------------------------------------------------------------
// JSON, written by hand: nested objects and arrays of numbers and strings.

class JsonWriter {
 public:
  // An object or array (bracket '{' or '['); key empty inside arrays.
  void open(std::string_view key, char bracket) {
    raw(key, std::string(1, bracket));
    first_.push_back(true);
  }
  void close(char bracket) {
    first_.pop_back();
    out_ += '\n' + std::string(2 * first_.size(), ' ') + bracket;
    if (first_.empty()) out_ += '\n';
  }
  void number(std::string_view key, double v) {
    char text[64];
    std::snprintf(text, sizeof text, "%.9g", v);
    raw(key, std::isfinite(v) ? text : "null");
  }
  void integer(std::string_view key, int64_t v) { raw(key, std::to_string(v)); }
  void boolean(std::string_view key, bool v) { raw(key, v ? "true" : "false"); }
  void string(std::string_view key, std::string_view v) { raw(key, quoted(v)); }
  const std::string& text() const { return out_; }

 private:
  // The separator, indentation and key, then the value's text.
  void raw(std::string_view key, std::string_view value) {
    if (!first_.empty()) {
      out_ += first_.back() ? "\n" : ",\n";
      first_.back() = false;
      out_.append(2 * first_.size(), ' ');
    }
    if (!key.empty()) out_ += quoted(key) + ": ";
    out_ += value;
  }
  static std::string quoted(std::string_view s) {
    std::string q = "\"";
    for (const char c : s) {
      if (c == '"' || c == '\\') q += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        char escape[8];
        std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(c));
        q += escape;
      } else {
        q += c;
      }
    }
    return q + '"';
  }

  std::string out_;
  std::vector<bool> first_;  // per open level: no value written yet
};

// ---------------------------------------------------------------------------
// Timing

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

// Median seconds of `body` (which queues GPU work) over reps.timed runs after
// reps.warmup ones, each bracketed by synchronize().
template <typename Body>
double time_median(cuda::CudaBackend& backend, Reps reps, Body&& body) {
  for (int i = 0; i < reps.warmup; ++i) body();
  backend.synchronize();
  std::vector<double> seconds;
  for (int i = 0; i < reps.timed; ++i) {
    const Clock::time_point t0 = Clock::now();
    body();
    backend.synchronize();
    seconds.push_back(seconds_between(t0, Clock::now()));
  }
  return median(std::move(seconds));
}

// ---------------------------------------------------------------------------
// Synthetic data

// Llama-3-8B's layer: n_embd 4096, 32 query and 8 KV heads of 128, FFN 14336:
// (n_out, k) of q, k, v, o, gate, up, down.
constexpr int64_t kLayer8b[][2] = {{4096, 4096},  {1024, 4096},  {1024, 4096}, {4096, 4096},
                                   {14336, 4096}, {14336, 4096}, {4096, 14336}};
constexpr int64_t kMaxDim = 14336;     // the widest k and n_out above
constexpr int64_t kDistinctRows = 64;  // random rows quantized; the rest repeat them
constexpr int kLayersPerGraph = 8;     // GEMV: 8 layers (~1 GB of Q4_0) per timed launch
constexpr DType kGemvTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kF16};

// kDistinctRows rows of kMaxDim normal floats (sigma `scale`).
std::vector<float> random_rows(uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> rows(static_cast<size_t>(kDistinctRows * kMaxDim));
  for (float& v : rows) v = normal(rng);
  return rows;
}

// A random (n_out, k) weight of `type` on the device. The values do not
// change the timing, so only kDistinctRows rows are quantized and repeated.
cuda::DeviceWeight random_weight(DType type, int64_t n_out, int64_t k,
                                 const std::vector<float>& source, cuda::CudaBackend& backend) {
  const size_t row_bytes = dtype_row_bytes(type, k);
  std::vector<uint8_t> stored(row_bytes * static_cast<size_t>(n_out));
  const int64_t distinct = std::min(n_out, kDistinctRows);
  for (int64_t r = 0; r < distinct; ++r)
    cpu::quantize_row(type, source.data() + r * kMaxDim, stored.data() + r * row_bytes, k);
  for (int64_t r = distinct; r < n_out; ++r)
    std::memcpy(stored.data() + r * row_bytes, stored.data() + (r % distinct) * row_bytes,
                row_bytes);
  return cuda::upload_weight(cpu::make_weight_matrix(type, stored.data(), k, n_out), backend);
}

// n floats on the device, cycling through `source`.
cuda::DeviceBuffer device_floats(size_t n, const std::vector<float>& source,
                                 cuda::CudaBackend& backend) {
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = source[i % source.size()];
  cuda::DeviceBuffer buffer(n * sizeof(float));
  backend.upload(buffer.data(), host.data(), n * sizeof(float));
  backend.synchronize();  // `host` goes away
  return buffer;
}

// One synthetic layer's 7 weights of one type, in kLayer8b's order.
struct SyntheticLayer {
  DType type = DType::kQ4_0;
  std::vector<cuda::DeviceWeight> weights;
  size_t bytes = 0;          // device bytes of all of them
  double flops_per_row = 0;  // 2 * sum(n_out * k)
};

SyntheticLayer make_layer(DType type, const std::vector<float>& source,
                          cuda::CudaBackend& backend) {
  SyntheticLayer layer;
  layer.type = type;
  for (const auto& [n_out, k] : kLayer8b) {
    layer.weights.push_back(random_weight(type, n_out, k, source, backend));
    layer.bytes += layer.weights.back().bytes();
    layer.flops_per_row += 2.0 * static_cast<double>(n_out) * static_cast<double>(k);
  }
  return layer;
}

// Queues the layer's 7 products of n_x rows. x holds (n_x, kMaxDim) floats
// (each product reads its first n_x * k), y (n_x, kMaxDim).
void run_layer(const SyntheticLayer& layer, const cuda::DeviceBuffer& x, int64_t n_x,
               const cuda::DeviceBuffer& y, cuda::CudaBackend& backend) {
  for (const cuda::DeviceWeight& w : layer.weights)
    cuda::matmul(w, x.as<float>(), n_x, y.as<float>(), w.n_out, backend);
}

// ---------------------------------------------------------------------------
// 1. Rooflines. Each measurement prints its figures and records them in `json`.

// Returns the copy bandwidth counted as read + write bytes: the memory roofline.
double measure_copy(cuda::CudaBackend& backend, Reps reps, JsonWriter& json) {
  const size_t bytes = size_t{1} << 30;
  const cuda::DeviceBuffer from(bytes), to(bytes);
  const double seconds =
      time_median(backend, reps, [&] { backend.copy(to.data(), from.data(), bytes); });
  const double gbps = 2.0 * static_cast<double>(bytes) / seconds / kGiga;
  std::printf("== device-to-device copy of 1 GiB (the memory roofline) ==\n");
  std::printf("  copy GB/s (read+write)       %9.1f   (%.3f ms)\n", gbps, seconds * 1e3);
  std::printf("  copy GB/s (read only, = /2)  %9.1f\n\n", gbps / 2);
  json.integer("copy_bytes", static_cast<int64_t>(bytes));
  json.number("copy_gbps", gbps);
  json.number("copy_read_only_gbps", gbps / 2);
  return gbps;
}

// cuBLAS F16 through matmul_gemm on an F16 weight (its tile "dequantization"
// is a copy, and the activations are converted to F16 first: both counted).
// Returns TFLOP/s: the GEMM roofline.
double measure_gemm(const std::vector<float>& source, cuda::CudaBackend& backend, Reps reps,
                    JsonWriter& json) {
  const int64_t n_x = 4096, k = 4096, n_out = 14336;
  const cuda::DeviceWeight w = random_weight(DType::kF16, n_out, k, source, backend);
  const cuda::DeviceBuffer x = device_floats(static_cast<size_t>(n_x * k), source, backend);
  const cuda::DeviceBuffer y(static_cast<size_t>(n_x * n_out) * sizeof(float));
  const double seconds = time_median(backend, reps, [&] {
    cuda::matmul_gemm(w, x.as<float>(), n_x, y.as<float>(), n_out, backend);
  });
  const double tflops =
      2.0 * static_cast<double>(n_x * k) * static_cast<double>(n_out) / seconds / kTera;
  std::printf("== cuBLAS F16 GEMM via matmul_gemm: x (4096, 4096) . W^T, W (14336, 4096) ==\n");
  std::printf("  TFLOP/s (the GEMM roofline)  %9.1f   (%.3f ms)\n\n", tflops, seconds * 1e3);
  json.number("gemm_tflops", tflops);
  json.open("gemm_shape", '{');
  json.integer("n_x", n_x);
  json.integer("k", k);
  json.integer("n_out", n_out);
  json.close('}');
  return tflops;
}

// ---------------------------------------------------------------------------
// 2. Synthetic 8B layers (matmuls only: no attention, no norms)

// The layer's 7 GEMVs, kLayersPerGraph times over in one CUDA graph (as a
// decode step replays its layers), so that launch gaps do not count and the
// bytes read between two reads of one weight (> 120 MB) exceed the L2.
// One row of the table, one object of the "gemv" array.
void measure_gemv(const SyntheticLayer& layer, int64_t n_x, double copy_gbps,
                  const cuda::DeviceBuffer& x, const cuda::DeviceBuffer& y,
                  cuda::CudaBackend& backend, Reps reps, JsonWriter& json) {
  run_layer(layer, x, n_x, y, backend);  // first launches outside the capture
  backend.synchronize();
  backend.begin_capture();
  try {
    for (int i = 0; i < kLayersPerGraph; ++i) run_layer(layer, x, n_x, y, backend);
  } catch (...) {
    backend.end_capture();
    throw;
  }
  const cuda::Graph graph = backend.end_capture();
  const double seconds =
      time_median(backend, reps, [&] { backend.launch(graph); }) / kLayersPerGraph;
  const double gbps = static_cast<double>(layer.bytes) / seconds / kGiga;
  const std::string type(dtype_name(layer.type));
  std::printf("  %-5s %4ld %10.1f %10.2f %9.1f %8.3f\n", type.c_str(), static_cast<long>(n_x),
              static_cast<double>(layer.bytes) / 1e6, seconds * 1e6, gbps, gbps / copy_gbps);
  std::fflush(stdout);
  json.open({}, '{');
  json.string("type", type);
  json.integer("n_x", n_x);
  json.integer("layer_bytes", static_cast<int64_t>(layer.bytes));
  json.number("us_per_layer", seconds * 1e6);
  json.number("gbps", gbps);
  json.number("ratio_to_copy", gbps / copy_gbps);
  json.close('}');
}

// n_x rows through the layer's 7 products (the GEMM path).
void measure_prefill(const SyntheticLayer& layer, int64_t n_x, double gemm_tflops,
                     const std::vector<float>& source, cuda::CudaBackend& backend, Reps reps,
                     JsonWriter& json) {
  const cuda::DeviceBuffer x = device_floats(static_cast<size_t>(n_x * kMaxDim), source, backend);
  const cuda::DeviceBuffer y(static_cast<size_t>(n_x * kMaxDim) * sizeof(float));
  const double seconds = time_median(backend, reps, [&] { run_layer(layer, x, n_x, y, backend); });
  const double tokens_per_s = static_cast<double>(n_x) / seconds;
  const double tflops = layer.flops_per_row * static_cast<double>(n_x) / seconds / kTera;
  const std::string type(dtype_name(layer.type));
  std::printf("\n== prefill: a %s 8B layer's 7 matmuls, %ld rows, GEMM path ==\n", type.c_str(),
              static_cast<long>(n_x));
  std::printf("  (attention is not part of this synthetic: matmuls only)\n");
  std::printf("  ms/layer %.3f   tokens/s per layer %.0f   TFLOP/s %.1f   vs GEMM %.3f\n\n",
              seconds * 1e3, tokens_per_s, tflops, tflops / gemm_tflops);
  json.open("prefill_synthetic", '{');
  json.string("type", type);
  json.integer("n_x", n_x);
  json.boolean("attention_included", false);
  json.number("ms_per_layer", seconds * 1e3);
  json.number("tokens_per_s_per_layer", tokens_per_s);
  json.number("tflops", tflops);
  json.number("ratio_to_gemm", tflops / gemm_tflops);
  json.close('}');
}

// Sections 1 and 2 on a backend of their own, freed before the model loads.
// Returns the copy bandwidth (read + write).
double measure_synthetic(const Plan& plan, JsonWriter& json) {
  cuda::CudaBackend backend(0);
  std::printf("device: %s\n%s\n\n", backend.name().c_str(), cuda::library_versions().c_str());
  json.string("device", backend.name());
  json.string("libraries", cuda::library_versions());
  const double copy_gbps = measure_copy(backend, plan.copy, json);
  const std::vector<float> weight_rows = random_rows(1, 0.05f);
  const std::vector<float> activation_rows = random_rows(2, 1.0f);
  const double gemm_tflops = measure_gemm(weight_rows, backend, plan.gemm, json);
  std::fflush(stdout);

  std::printf("== decode GEMV: one Llama-3-8B layer's 7 matmuls (no attention), cuda::matmul ==\n");
  std::printf("  %-5s %4s %10s %10s %9s %8s\n", "type", "n_x", "layer MB", "us/layer", "GB/s",
              "vs copy");
  const auto gemv_rows = static_cast<size_t>(cuda::kGemvMaxRows * kMaxDim);
  const cuda::DeviceBuffer x = device_floats(gemv_rows, activation_rows, backend);
  const cuda::DeviceBuffer y(gemv_rows * sizeof(float));
  const SyntheticLayer q4_0 = make_layer(DType::kQ4_0, weight_rows, backend);  // kept for prefill
  json.open("gemv", '[');
  for (const DType type : kGemvTypes) {
    SyntheticLayer other;
    if (type != q4_0.type) other = make_layer(type, weight_rows, backend);
    const SyntheticLayer& layer = type == q4_0.type ? q4_0 : other;
    for (const int64_t n_x : {int64_t{1}, cuda::kGemvMaxRows})
      measure_gemv(layer, n_x, copy_gbps, x, y, backend, plan.gemv, json);
  }
  json.close(']');
  measure_prefill(q4_0, plan.prefill_rows, gemm_tflops, activation_rows, backend, plan.prefill,
                  json);
  std::fflush(stdout);
  return copy_gbps;
}

// ---------------------------------------------------------------------------
// 3. The real model

constexpr int64_t kMaxBatch = 64;
constexpr int64_t kTokensPerSequence = 256;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kBlocksPerSequence = kTokensPerSequence / kBlockSize;
constexpr int64_t kPromptTokens = 128;
constexpr int64_t kPrefillGroup = 16;  // sequences per prefill run
constexpr int64_t kWarmupSteps = 2;    // the graph is captured on a batch size's second step
constexpr int64_t kDecodeSteps = 64;
constexpr int64_t kLongPrompt = 512;
static_assert(kPromptTokens + kWarmupSteps + kDecodeSteps <= kTokensPerSequence);
static_assert(kLongPrompt <= kMaxBatch * kTokensPerSequence);

struct ModelRig {
  const LlamaModel& model;
  CudaForward& forward;
  KvCache& cache;
  std::vector<std::vector<int32_t>> tables;  // sequence s: its own kBlocksPerSequence blocks
};

int32_t prompt_token(int64_t sequence, int64_t position, int64_t n_vocab) {
  return static_cast<int32_t>((sequence * 1009 + position * 7919 + 1) % n_vocab);
}

// One kLongPrompt-token prompt in one run (the last row's logits only), in
// blocks 0.. (the decode prompts overwrite them later).
void measure_model_prefill(ModelRig& rig, Reps reps, JsonWriter& json) {
  std::vector<int32_t> table(static_cast<size_t>((kLongPrompt + kBlockSize - 1) / kBlockSize));
  std::iota(table.begin(), table.end(), 0);
  std::vector<int32_t> tokens;
  for (int64_t p = 0; p < kLongPrompt; ++p)
    tokens.push_back(prompt_token(0, p, rig.model.config().n_vocab));
  const ForwardSequence sequence{table, 0, kLongPrompt};
  const int64_t last_row = kLongPrompt - 1;
  const double seconds = time_median(rig.forward.backend(), reps, [&] {
    rig.forward.run(tokens, {&sequence, 1}, rig.cache, {&last_row, 1}, nullptr);
  });
  const double tokens_per_s = static_cast<double>(kLongPrompt) / seconds;
  std::printf("  prefill, one %ld-token prompt: %.2f ms, %.0f tokens/s\n",
              static_cast<long>(kLongPrompt), seconds * 1e3, tokens_per_s);
  json.open("model_prefill", '{');
  json.integer("prompt_tokens", kLongPrompt);
  json.number("ms", seconds * 1e3);
  json.number("tokens_per_s", tokens_per_s);
  json.close('}');
}

// Prefills sequences [0, batch) with kPromptTokens each (kPrefillGroup at a
// time) and returns each one's greedy next token.
std::vector<int32_t> prefill_prompts(ModelRig& rig, int64_t batch) {
  std::vector<int32_t> next(static_cast<size_t>(batch));
  for (int64_t s0 = 0; s0 < batch; s0 += kPrefillGroup) {
    const int64_t n_seq = std::min(kPrefillGroup, batch - s0);
    std::vector<int32_t> tokens;
    std::vector<ForwardSequence> sequences;
    std::vector<int64_t> last_rows;
    for (int64_t s = s0; s < s0 + n_seq; ++s) {
      for (int64_t p = 0; p < kPromptTokens; ++p)
        tokens.push_back(prompt_token(s, p, rig.model.config().n_vocab));
      sequences.push_back({rig.tables[static_cast<size_t>(s)], 0, kPromptTokens});
      last_rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
    }
    rig.forward.run(tokens, sequences, rig.cache, last_rows, nullptr);
    const std::vector<DeviceSampling> greedy(static_cast<size_t>(n_seq));
    rig.forward.sample(greedy, std::span<int32_t>(next).subspan(static_cast<size_t>(s0),
                                                                static_cast<size_t>(n_seq)));
  }
  return next;
}

// Fresh prompts, kWarmupSteps untimed decode steps, then kDecodeSteps timed
// ones: one row per sequence, every row sampled greedily on the device. One
// row of the table, one object ("graphs" or "no_graphs") in json.
void measure_decode(ModelRig& rig, int64_t batch, bool graphs, double copy_gbps, JsonWriter& json) {
  rig.forward.set_use_graphs(graphs);
  std::vector<int32_t> tokens = prefill_prompts(rig, batch);
  std::vector<ForwardSequence> sequences(static_cast<size_t>(batch));
  std::vector<int64_t> rows(static_cast<size_t>(batch));
  std::iota(rows.begin(), rows.end(), 0);
  const std::vector<DeviceSampling> greedy(static_cast<size_t>(batch));
  auto step = [&](int64_t i) {
    for (size_t s = 0; s < sequences.size(); ++s)
      sequences[s] = {rig.tables[s], kPromptTokens + i, 1};
    rig.forward.run(tokens, sequences, rig.cache, rows, nullptr);
    rig.forward.sample(greedy, tokens);  // run() has already staged the tokens it read
  };
  for (int64_t i = 0; i < kWarmupSteps; ++i) step(i);
  rig.forward.backend().synchronize();
  const int64_t launches_before = rig.forward.graph_launches();
  std::vector<double> step_seconds;
  for (int64_t i = kWarmupSteps; i < kWarmupSteps + kDecodeSteps; ++i) {
    const Clock::time_point t0 = Clock::now();
    step(i);
    rig.forward.backend().synchronize();
    step_seconds.push_back(seconds_between(t0, Clock::now()));
  }
  const int64_t launches = rig.forward.graph_launches() - launches_before;
  const double seconds = std::accumulate(step_seconds.begin(), step_seconds.end(), 0.0);
  const double tokens_per_s = static_cast<double>(batch * kDecodeSteps) / seconds;
  const double step_ms = seconds / static_cast<double>(kDecodeSteps) * 1e3;
  const double median_step_ms = median(step_seconds) * 1e3;
  // The whole model's weights are read once a step, whatever the batch.
  const auto weight_bytes = static_cast<double>(rig.forward.weight_bytes());
  const double weight_gbps = weight_bytes * static_cast<double>(kDecodeSteps) / seconds / kGiga;
  std::printf("  %5ld %7s %10.1f %8.3f %8.3f %12.3f %10.1f %8.3f\n", static_cast<long>(batch),
              graphs ? "on" : "off", tokens_per_s, step_ms, median_step_ms,
              weight_bytes / static_cast<double>(batch) / 1e6, weight_gbps,
              weight_gbps / copy_gbps);
  if (graphs && launches < kDecodeSteps) {
    std::printf("  warning: batch %ld replayed a graph on only %ld of %ld steps\n",
                static_cast<long>(batch), static_cast<long>(launches),
                static_cast<long>(kDecodeSteps));
  }
  std::fflush(stdout);
  json.open(graphs ? "graphs" : "no_graphs", '{');
  json.integer("steps", kDecodeSteps);
  json.number("seconds", seconds);
  json.number("tokens_per_s", tokens_per_s);
  json.number("step_ms", step_ms);
  json.number("median_step_ms", median_step_ms);
  json.number("weight_bytes_per_token", weight_bytes / static_cast<double>(batch));
  json.number("weight_gbps", weight_gbps);
  json.number("ratio_to_copy", weight_gbps / copy_gbps);
  json.integer("graph_launches", launches);
  json.close('}');
}

void measure_model(const std::string& path, double copy_gbps, const Plan& plan, JsonWriter& json) {
  const std::unique_ptr<LlamaModel> model = LlamaModel::load(path);
  CudaForward forward(*model, 0);
  // The device KV cache takes this host cache's layout (the host copy is the
  // KV transfer's staging area, unused here).
  KvCache cache(make_kv_layout(model->config(), kMaxBatch * kBlocksPerSequence, kBlockSize));
  ModelRig rig{*model, forward, cache, {}};
  for (int64_t s = 0; s < kMaxBatch; ++s) {
    std::vector<int32_t> table(static_cast<size_t>(kBlocksPerSequence));
    std::iota(table.begin(), table.end(), static_cast<int32_t>(s * kBlocksPerSequence));
    rig.tables.push_back(std::move(table));
  }
  const std::string name = model->config().name.empty() ? path : model->config().name;
  std::printf("== model %s: %.1f MB of weights on the device ==\n", name.c_str(),
              static_cast<double>(forward.weight_bytes()) / 1e6);
  json.open("model", '{');
  json.string("path", path);
  json.string("name", name);
  json.integer("weight_bytes", static_cast<int64_t>(forward.weight_bytes()));
  json.close('}');

  measure_model_prefill(rig, plan.model_prefill, json);
  std::printf("  decode, %ld steps after %ld-token prompts, greedy sampling on the device:\n",
              static_cast<long>(kDecodeSteps), static_cast<long>(kPromptTokens));
  std::printf("  %5s %7s %10s %8s %8s %12s %10s %8s\n", "batch", "graphs", "tokens/s", "step ms",
              "median", "wt MB/token", "wt GB/s", "vs copy");
  json.open("model_decode", '{');
  static_assert(kMaxBatch == 64, "the JSON keys below");
  for (const auto& [batch, key] : {std::pair<int64_t, const char*>{1, "b1"}, {kMaxBatch, "b64"}}) {
    json.open(key, '{');
    for (const bool graphs : {false, true}) measure_decode(rig, batch, graphs, copy_gbps, json);
    json.close('}');
  }
  json.close('}');
  std::printf(
      "  (weight bytes: CudaForward::weight_bytes(), every uploaded matrix once, the embedding\n"
      "   table too though a step reads only its looked-up rows: GB/s is slightly overstated)\n");
}

// ---------------------------------------------------------------------------

int run(const Options& options) {
  if (cuda::list_devices().empty()) {
    std::printf("no CUDA device: nothing to measure\n");
    return kSkipped;
  }
  if (!std::filesystem::exists(options.model)) {
    std::fprintf(stderr, "duet-cuda-bench: model not found: %s (pass --model PATH)\n",
                 options.model.c_str());
    return 1;
  }
  std::ofstream file;  // opened first, so that a bad path fails before minutes of measuring
  if (!options.json.empty()) {
    file.open(options.json);
    if (!file) {
      std::fprintf(stderr, "duet-cuda-bench: cannot write %s\n", options.json.c_str());
      return 1;
    }
  }
  const Plan plan = make_plan(options.quick);
  const Clock::time_point start = Clock::now();
  JsonWriter json;
  json.open({}, '{');
  json.boolean("quick", options.quick);
  const double copy_gbps = measure_synthetic(plan, json);
  measure_model(options.model, copy_gbps, plan, json);
  json.close('}');
  std::printf("\ntotal %.1f s\n", seconds_between(start, Clock::now()));
  if (!options.json.empty()) {
    file << json.text();
    file.close();
    if (!file) {
      std::fprintf(stderr, "duet-cuda-bench: cannot write %s\n", options.json.c_str());
      return 1;
    }
    std::printf("wrote %s\n", options.json.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) {
  duet::Options options;
  if (const int status = duet::parse_options(argc, argv, options); status >= 0) return status;
  try {
    return duet::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-cuda-bench: %s\n", e.what());
    return 1;
  }
}
