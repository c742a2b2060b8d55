// common/huge_pages.h: zeroed, writable memory on a 2 MiB boundary, every page
// made at construction, huge pages asked of the kernel (as /proc/self/smaps
// reports the mapping), and ownership that moves.
#include "common/huge_pages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

namespace duet {
namespace {

// What /proc/self/smaps says of the mapping that holds `address`.
struct Mapping {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  size_t rss_kib = 0;
  std::string flags;  // VmFlags
};

std::optional<Mapping> mapping_of(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::optional<Mapping> found;
  std::string line;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> begin >> dash >> end && dash == '-') {
      if (found) return found;  // the next mapping begins: the one found is whole
      if (begin <= at && at < end) found = Mapping{begin, end, 0, {}};
      continue;
    }
    if (!found) continue;
    if (line.rfind("Rss:", 0) == 0) found->rss_kib = std::stoul(line.substr(4));
    if (line.rfind("VmFlags:", 0) == 0) found->flags = line.substr(8) + " ";
  }
  return found;
}

TEST(HugePageMemory, ZeroedWritableAndOnAHugePageBoundary) {
  const size_t bytes = 3 * kHugePageBytes + 12'345;
  HugePageMemory memory(bytes);
  ASSERT_NE(memory.data(), nullptr);
  EXPECT_EQ(memory.size(), bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(memory.data()) % kHugePageBytes, 0u);
  std::byte* data = memory.data();
  EXPECT_TRUE(std::all_of(data, data + bytes, [](std::byte b) { return b == std::byte{0}; }));
  for (size_t i = 0; i < bytes; i += 997) data[i] = static_cast<std::byte>(i % 251 + 1);
  data[bytes - 1] = std::byte{7};
  for (size_t i = 0; i < bytes - 1; i += 997)
    ASSERT_EQ(data[i], static_cast<std::byte>(i % 251 + 1)) << i;
  EXPECT_EQ(data[bytes - 1], std::byte{7});
}

TEST(HugePageMemory, EveryPageIsMadeAtConstructionAndHugePagesAreAsked) {
  const size_t bytes = 2 * kHugePageBytes + 1;  // three huge pages' worth mapped
  HugePageMemory memory(bytes);
  const std::optional<Mapping> mapping = mapping_of(memory.data());
  ASSERT_TRUE(mapping.has_value());
  const auto begin = reinterpret_cast<uintptr_t>(memory.data());
  EXPECT_LE(mapping->begin, begin);
  EXPECT_GE(mapping->end, begin + 3 * kHugePageBytes);
  // Nothing touched it yet, and all of it is resident.
  EXPECT_GE(mapping->rss_kib * 1024, 3 * kHugePageBytes);
  if (memory.huge_pages_asked()) {
    EXPECT_NE(mapping->flags.find(" hg "), std::string::npos) << mapping->flags;
  } else {
    GTEST_LOG_(INFO) << "this kernel has no transparent huge pages";
  }
}

TEST(HugePageMemory, EmptyAndMoved) {
  HugePageMemory none;
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.data(), nullptr);
  EXPECT_EQ(HugePageMemory(0).data(), nullptr);

  HugePageMemory first(4096);
  first.data()[100] = std::byte{42};
  std::byte* const address = first.data();
  HugePageMemory second(std::move(first));
  EXPECT_TRUE(first.empty());  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  EXPECT_EQ(first.data(), nullptr);
  EXPECT_EQ(second.data(), address);
  EXPECT_EQ(second.data()[100], std::byte{42});

  HugePageMemory third(kHugePageBytes);
  third = std::move(second);  // third's own mapping is released
  EXPECT_EQ(third.data(), address);
  EXPECT_EQ(third.size(), 4096u);
  EXPECT_TRUE(second.empty());  // NOLINT(bugprone-use-after-move)
}

}  // namespace
}  // namespace duet
