// `duet`: the command-line entry point. Wiring only; each subcommand lives in
// its own file. Errors print one line on stderr and exit with code 2.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "common/error.h"
#include "tools/command_line.h"
#include "tools/generate_command.h"
#include "tools/profile_command.h"
#include "tools/serve_command.h"

int main(int argc, char** argv) {
  auto logger = spdlog::stderr_color_mt("duet");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");

  CLI::App app{"Duet: disaggregated LLM serving"};
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "Log more detail to stderr");
  duet::tools::GenerateArgs generate_args;
  duet::tools::add_generate_command(app, generate_args);
  duet::tools::ServeArgs serve_args;
  duet::tools::add_serve_command(app, serve_args);
  duet::tools::ProfileArgs profile_args;
  duet::tools::add_profile_command(app, profile_args);

  if (const auto exit_code = duet::tools::parse_command_line(app, argc, argv, "duet", "error", 2)) {
    return *exit_code;
  }
  spdlog::set_level(verbose ? spdlog::level::debug : spdlog::level::info);

  try {
    if (app.got_subcommand("generate")) return duet::tools::run_generate(generate_args);
    if (app.got_subcommand("serve")) return duet::tools::run_serve(serve_args);
    if (app.got_subcommand("profile")) return duet::tools::run_profile(profile_args);
  } catch (const duet::Error& e) {
    std::fprintf(stderr, "duet: %s: %s\n", std::string(duet::error_kind_name(e.kind())).c_str(),
                 e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
