// `duet generate`: run a model on one prompt and stream the text to stdout.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace duet::tools {

struct GenerateArgs {
  std::string model;
  std::string prompt;
  bool chat = false;
  int64_t n_tokens = 128;
  float temperature = 0.0f;
  uint64_t seed = 0;
  int threads = 0;  // 0: all hardware threads
  bool no_kv_cache = false;
};

void add_generate_command(CLI::App& app, GenerateArgs& args);

// Returns the process exit code.
int run_generate(const GenerateArgs& args);

}  // namespace duet::tools
