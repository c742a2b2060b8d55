#include "common/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "common/error.h"

namespace duet {
namespace {

constexpr size_t kSmallPageBytes = 4096;

}  // namespace

HugePageMemory::HugePageMemory(size_t bytes) {
  if (bytes == 0) return;
  const size_t mapped = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  // One huge page more than needed, so that a 2 MiB boundary lies inside;
  // what is before and after it goes back at once.
  const size_t reserve = mapped + kHugePageBytes;
  void* region = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED)
    throw Error(ErrorKind::kInternal,
                format("cannot map {} bytes of memory: {}", reserve, std::strerror(errno)));
  const auto start = reinterpret_cast<uintptr_t>(region);
  const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > start) munmap(region, aligned - start);
  const uintptr_t end = aligned + mapped;
  if (start + reserve > end) munmap(reinterpret_cast<void*>(end), start + reserve - end);
  data_ = reinterpret_cast<std::byte*>(aligned);
  size_ = bytes;
  mapped_ = mapped;
  huge_pages_asked_ = madvise(data_, mapped_, MADV_HUGEPAGE) == 0;
  // Made now, not at first touch: a page fault in the middle of a step
  // would cost that step the zeroing of 2 MiB.
#ifdef MADV_POPULATE_WRITE
  if (madvise(data_, mapped_, MADV_POPULATE_WRITE) == 0) return;
#endif
  for (size_t at = 0; at < mapped_; at += kSmallPageBytes) data_[at] = std::byte{0};
}

HugePageMemory::~HugePageMemory() { release(); }

HugePageMemory::HugePageMemory(HugePageMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      huge_pages_asked_(std::exchange(other.huge_pages_asked_, false)) {}

HugePageMemory& HugePageMemory::operator=(HugePageMemory&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    huge_pages_asked_ = std::exchange(other.huge_pages_asked_, false);
  }
  return *this;
}

void HugePageMemory::release() {
  if (data_ != nullptr) munmap(data_, mapped_);
  data_ = nullptr;
  size_ = 0;
  mapped_ = 0;
  huge_pages_asked_ = false;
}

}  // namespace duet
