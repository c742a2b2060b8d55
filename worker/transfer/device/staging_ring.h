// Space for KV rows payloads in one fixed buffer (a device transfer's send or
// receive staging), handed out in order around a ring and given back in any
// order: a region is reused only once it and every region handed out before
// it are back. Pure bookkeeping of offsets; the memory is the caller's.
//
// Not thread-safe: its owner serializes the calls.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>

namespace duet {

class StagingRing {
 public:
  // `capacity` bytes; every offset handed out is a multiple of `alignment`
  // (a power of two).
  explicit StagingRing(size_t capacity, size_t alignment = 256);

  // The offset of `bytes` contiguous free bytes, or nullopt while they do not
  // fit (they may once regions come back). Throws kInvalidArgument for more
  // than the capacity or zero bytes.
  std::optional<size_t> acquire(size_t bytes);
  // Gives back the region at `offset` (one acquire handed out and not given
  // back yet; DUET_ASSERT otherwise).
  void release(size_t offset);

  size_t capacity() const { return capacity_; }
  size_t n_regions() const { return regions_.size(); }  // handed out, not yet reusable
  bool empty() const { return regions_.empty(); }

 private:
  struct Region {
    size_t offset = 0;
    size_t end = 0;  // the offset after it
    bool released = false;
  };

  const size_t capacity_;
  const size_t alignment_;
  std::deque<Region> regions_;  // in the order handed out: the oldest first
};

}  // namespace duet
