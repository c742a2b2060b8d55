// Zeroed memory on transparent huge pages, for large arrays read in scattered
// pieces. The KV cache is read a block at a time (attention, the KV
// transfers' 2 KiB runs from blocks the block tables scatter over the
// pool), so on 4 KiB pages nearly every run is a page of its own and a TLB
// miss. Where the kernel lets a region ask for huge pages (transparent huge
// pages "madvise" or "always"), each 2 MiB of the pool is one page.
//
// The mapping starts on a 2 MiB boundary, so that every whole 2 MiB of it can
// be a huge page, and its pages are all made (zeroed) at construction, as a
// zeroed std::vector's would be; where the kernel has no huge pages to give,
// they are ordinary pages and nothing else changes.
#pragma once

#include <cstddef>

namespace duet {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

class HugePageMemory final {
 public:
  HugePageMemory() = default;
  // `bytes` of zeroed memory (none for 0). Throws kInternal when the address
  // space cannot be had.
  explicit HugePageMemory(size_t bytes);
  ~HugePageMemory();
  HugePageMemory(HugePageMemory&& other) noexcept;
  HugePageMemory& operator=(HugePageMemory&& other) noexcept;
  HugePageMemory(const HugePageMemory&) = delete;
  HugePageMemory& operator=(const HugePageMemory&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Whether the kernel took the request for huge pages (madvise); it may
  // still give ordinary pages where it has no huge ones free.
  bool huge_pages_asked() const { return huge_pages_asked_; }

 private:
  void release();

  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_ = 0;  // size_ rounded up to whole huge pages
  bool huge_pages_asked_ = false;
};

}  // namespace duet
