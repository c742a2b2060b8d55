// `duet serve`: one colocated instance behind the Cap'n Proto and HTTP fronts.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace duet::tools {

struct ServeArgs {
  std::string model;
  std::string model_name;  // the id clients name; default: the file's stem
  std::string host = "127.0.0.1";
  int rpc_port = 7433;   // 0: any free port (printed)
  int http_port = 8000;  // 0: any free port (printed)
  std::string api_key;   // empty: none; else both fronts require it
  int threads = 0;       // 0: all hardware threads
  std::string kv_cache_mem = "1GiB";
  int64_t max_running = 64;
  int64_t step_tokens = 512;
  int64_t max_waiting = 256;
  int64_t max_prompt_tokens = 0;  // 0: the model's context
  int64_t max_tokens = 0;         // 0: the model's context
  int64_t default_max_tokens = 256;
  size_t max_body_bytes = 1 << 20;
};

void add_serve_command(CLI::App& app, ServeArgs& args);

// Serves until SIGINT or SIGTERM; returns the process exit code.
int run_serve(const ServeArgs& args);

}  // namespace duet::tools
