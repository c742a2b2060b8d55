// What the command-line programs (`duet`, `duet-client`) share around CLI11:
// reading the command line, with --help and bad flags handled alike.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <optional>

namespace duet::tools {

// Parses the command line into `app`. nullopt: the program goes on. Else it
// exits with the code returned: 0 after --help (printed on stdout), or
// `error_code` after a bad command line, said in one line on stderr as
// "<program>: <kind>: <what> (see <program> --help)".
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             const char* program, const char* kind,
                                             int error_code) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s: %s (see %s --help)\n", program, kind, e.what(), program);
    return error_code;
  }
  return std::nullopt;
}

}  // namespace duet::tools
