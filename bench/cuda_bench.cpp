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
//      implies, and the prefill rate of one prompt (--prefill-tokens, default
//      512) in model TFLOP/s against the GEMM roofline.
//
// Every GPU section is timed on the host with std::chrono around
// CudaBackend::synchronize(), after warm-up runs; figures are medians of
// repetitions (decode: the total of 64 steps, and the median step). Prints a
// table and writes the figures as JSON (--json).
//
//   duet-cuda-bench --model models/SmolLM2-135M-Instruct.Q4_1.gguf --json out.json [--quick]
//                   [--prefill-tokens N]
//
// Exits 77 (skipped) on a machine without a CUDA device, 2 on a bad command line.
//
// The sections live in bench/cuda/ (rig.h, synthetic.h, model_bench.h); here,
// the command line and the run.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "bench/cuda/model_bench.h"
#include "bench/cuda/rig.h"
#include "bench/cuda/synthetic.h"
#include "kernels/cuda/device.h"

namespace duet::cuda_bench {
namespace {

constexpr int kSkipped = 77;
constexpr int kUsageError = 2;

// ---------------------------------------------------------------------------
// Command line

struct Options {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string json;  // empty: no JSON file
  bool quick = false;
  int64_t prefill_tokens = 512;  // the model's prefill prompt
};

void print_usage(std::FILE* to) {
  std::fputs(
      "usage: duet-cuda-bench [--model PATH] [--json OUT.json] [--quick]\n"
      "  --model PATH   GGUF model for the decode/prefill figures\n"
      "                 (default models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
      "  --json PATH    also write the figures as JSON to PATH\n"
      "  --quick        fewer repetitions and a smaller synthetic prefill\n"
      "  --prefill-tokens N  the model's prefill prompt length (default 512, at most 16384)\n",
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
    } else if (arg == "--prefill-tokens") {
      std::string text;
      if (!value(text)) return kUsageError;
      char* end = nullptr;
      options.prefill_tokens = std::strtoll(text.c_str(), &end, 10);
      if (*end != '\0' || options.prefill_tokens < 1 ||
          options.prefill_tokens > kMaxPrefillTokens) {
        std::fprintf(stderr, "duet-cuda-bench: --prefill-tokens takes 1 to %ld, not '%s'\n",
                     static_cast<long>(kMaxPrefillTokens), text.c_str());
        return kUsageError;
      }
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
  const Rooflines rooflines = measure_synthetic(plan, json);
  measure_model(options.model, rooflines, plan, options.prefill_tokens, json);
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
}  // namespace duet::cuda_bench

int main(int argc, char** argv) {
  duet::cuda_bench::Options options;
  if (const int status = duet::cuda_bench::parse_options(argc, argv, options); status >= 0)
    return status;
  try {
    return duet::cuda_bench::run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-cuda-bench: %s\n", e.what());
    return 1;
  }
}
