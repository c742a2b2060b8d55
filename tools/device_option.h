// The --device option of `duet generate` and `duet serve`: cpu, cuda or
// cuda:N, checked when the command line is parsed.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "common/error.h"
#include "worker/model/model_forward.h"

namespace duet::tools {

inline CLI::Validator device_validator() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        try {
          parse_device(value);
          return {};
        } catch (const Error& e) {
          return e.what();
        }
      },
      "cpu|cuda|cuda:N");
}

}  // namespace duet::tools
