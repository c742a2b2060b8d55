// Reads golden fixtures (JSON made by tests/golden/make_*.py) and checks
// their versioned header.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace duet::testing {

inline nlohmann::json read_golden(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open golden file " + path.string());
  nlohmann::json golden = nlohmann::json::parse(in);
  if (golden.value("format_version", 0) != 1) {
    throw std::runtime_error(path.string() + ": unknown golden format_version");
  }
  return golden;
}

}  // namespace duet::testing
