#include "tools/memory_size.h"

#include <fmt/format.h>

#include <fstream>

#include "common/error.h"

namespace duet::tools {

int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return int64_t{1} << 30;
}

int64_t parse_memory_size(const std::string& text, const std::string& option) {
  size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  DUET_REQUIRE(used > 0 && value > 0.0, "{} '{}' is not a size or a fraction", option, text);
  if (unit.empty() && value < 1.0) return static_cast<int64_t>(value * available_memory_bytes());
  if (unit.empty() || unit == "B") return static_cast<int64_t>(value);
  if (unit == "KiB") return static_cast<int64_t>(value * 1024);
  if (unit == "MiB") return static_cast<int64_t>(value * 1024 * 1024);
  if (unit == "GiB") return static_cast<int64_t>(value * 1024 * 1024 * 1024);
  throw Error(ErrorKind::kInvalidArgument,
              fmt::format("{} '{}': unknown unit '{}' (B, KiB, MiB, GiB)", option, text, unit));
}

}  // namespace duet::tools
