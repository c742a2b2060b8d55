// `duet generate`: run a model on one prompt and stream the text to stdout.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace duet {
struct GenerateOptions;
}

namespace duet::tools {

struct GenerateArgs {
  std::string model;
  std::string prompt;
  bool chat = false;
  std::string chat_template;  // --chat-template: a name or template text; empty: the model's
  int64_t n_tokens = 128;
  float temperature = 0.0f;
  uint64_t seed = 0;
  // Every control below defaults to off (see common/sampling.h).
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repeat_penalty = 1.0f;
  int32_t repeat_last_n = 64;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  std::vector<std::string> stop;  // stop strings, not printed (see common/text/stop_matcher.h)
  int threads = 0;                // 0: all hardware threads
  std::string device = "cpu";     // cpu, cuda or cuda:N
  bool no_kv_cache = false;
  bool token_ids = false;   // print the generated ids on stderr (JSON lines carry them always)
  bool ignore_eos = false;  // exactly n_tokens: end-of-generation tokens do not end it
  // Batch mode: every line of this file is a prompt, run through the batching engine.
  std::string prompts_file;
  std::string kv_cache_mem =
      "0.2";  // bytes ("512MiB", "2GiB", "1000000") or a fraction of free memory
  int64_t max_running = 64;
  int64_t step_tokens = 512;  // the engine's token budget per step (both modes)
};

// Batch mode (tools/batch_generate.cpp); `options` are already validated.
int run_batch_generate(const GenerateArgs& args, const GenerateOptions& options);

void add_generate_command(CLI::App& app, GenerateArgs& args);

// Returns the process exit code.
int run_generate(const GenerateArgs& args);

}  // namespace duet::tools
