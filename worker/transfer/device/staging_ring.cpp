#include "worker/transfer/device/staging_ring.h"

#include <algorithm>

#include "common/error.h"

namespace duet {

StagingRing::StagingRing(size_t capacity, size_t alignment)
    : capacity_(capacity), alignment_(alignment) {
  DUET_REQUIRE(alignment > 0 && (alignment & (alignment - 1)) == 0,
               "staging ring alignment {} is not a power of two", alignment);
  DUET_REQUIRE(capacity >= alignment, "a staging ring of {} bytes", capacity);
}

std::optional<size_t> StagingRing::acquire(size_t bytes) {
  DUET_REQUIRE(bytes > 0 && bytes <= capacity_,
               "a {}-byte KV payload does not fit a {}-byte staging ring", bytes, capacity_);
  const size_t size = (bytes + alignment_ - 1) / alignment_ * alignment_;
  size_t offset = 0;
  if (!regions_.empty()) {
    // Live bytes run from the oldest region's offset to the newest's end,
    // around the ring; the free space is the rest.
    const size_t tail = regions_.front().offset;
    const size_t head = regions_.back().end;
    const bool wrapped = regions_.back().offset < tail;
    if (wrapped) {
      // The free space is [head, tail).
      if (tail - head < size) return std::nullopt;
      offset = head;
    } else if (capacity_ - head >= size) {
      offset = head;
    } else if (tail >= size) {
      offset = 0;  // wraps: the ring's end stays unused until the tail passes it
    } else {
      return std::nullopt;
    }
  }
  regions_.push_back({offset, offset + size, false});
  return offset;
}

void StagingRing::release(size_t offset) {
  const auto it = std::find_if(regions_.begin(), regions_.end(),
                               [&](const Region& r) { return r.offset == offset && !r.released; });
  DUET_ASSERT(it != regions_.end(), "no staging region at offset {} to give back", offset);
  it->released = true;
  while (!regions_.empty() && regions_.front().released) regions_.pop_front();
}

}  // namespace duet
