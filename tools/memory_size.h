// Memory sizes on command lines: "512MiB", "2GiB", "1000000" (bytes) or
// "0.25" (a fraction of the memory available now).
#pragma once

#include <cstdint>
#include <string>

namespace duet::tools {

// MemAvailable from /proc/meminfo, in bytes (1 GiB if it cannot be read).
int64_t available_memory_bytes();

// Throws duet::Error (kInvalidArgument) naming `option` for anything else.
int64_t parse_memory_size(const std::string& text, const std::string& option);

}  // namespace duet::tools
