// StagingRing: regions handed out in order, given back in any order, never
// overlapping a live one; against a model that tracks every byte.
#include "worker/transfer/device/staging_ring.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

TEST(StagingRing, HandsOutAlignedRegionsInOrder) {
  StagingRing ring(4096, 256);
  EXPECT_EQ(ring.acquire(100), 0u);
  EXPECT_EQ(ring.acquire(256), 256u);
  EXPECT_EQ(ring.acquire(300), 512u);  // rounded up to 512 bytes
  EXPECT_EQ(ring.acquire(1), 1024u);
  EXPECT_EQ(ring.n_regions(), 4u);
}

TEST(StagingRing, FullUntilTheOldestComesBack) {
  StagingRing ring(1024, 256);
  ASSERT_EQ(ring.acquire(512), 0u);
  ASSERT_EQ(ring.acquire(512), 512u);
  EXPECT_FALSE(ring.acquire(1).has_value());
  ring.release(512);  // the newer one: nothing reusable yet (the oldest is live)
  EXPECT_FALSE(ring.acquire(256).has_value());
  ring.release(0);
  EXPECT_TRUE(ring.empty());
  EXPECT_EQ(ring.acquire(1024), 0u);
}

TEST(StagingRing, WrapsAroundLeavingTheEndUnused) {
  StagingRing ring(1024, 256);
  ASSERT_EQ(ring.acquire(256), 0u);
  ASSERT_EQ(ring.acquire(512), 256u);
  ring.release(0);
  // 256 bytes free at the end, 256 at the start: a 512-byte region fits neither.
  EXPECT_FALSE(ring.acquire(512).has_value());
  EXPECT_EQ(ring.acquire(256), 768u);
  EXPECT_EQ(ring.acquire(256), 0u);  // wrapped
  EXPECT_FALSE(ring.acquire(256).has_value());
  ring.release(256);
  EXPECT_EQ(ring.acquire(512), 256u);  // between the wrapped head and the tail
}

TEST(StagingRing, RefusesWhatCanNeverFit) {
  StagingRing ring(1024, 256);
  EXPECT_THROW(ring.acquire(1025), Error);
  EXPECT_THROW(ring.acquire(0), Error);
  EXPECT_THROW(StagingRing(1024, 100), Error);
  EXPECT_THROW(StagingRing(64, 256), Error);
}

TEST(StagingRing, GivingBackTwiceIsOurBug) {
  StagingRing ring(1024, 256);
  const size_t offset = *ring.acquire(256);
  ASSERT_EQ(ring.acquire(256), 256u);
  ring.release(offset);
  EXPECT_THROW(ring.release(offset), Error);
}

// Random acquires and out-of-order releases: no live regions overlap, every
// offset is aligned and inside the ring, and an empty ring has all its room.
TEST(StagingRing, RandomTrafficNeverOverlaps) {
  std::mt19937 rng(7);
  StagingRing ring(1 << 16, 64);
  std::map<size_t, size_t> live;  // offset -> size (rounded)
  for (int step = 0; step < 20000; ++step) {
    if (!live.empty() && (rng() % 3 == 0 || live.size() > 40)) {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      ring.release(it->first);
      live.erase(it);
      continue;
    }
    const size_t bytes = 1 + rng() % 9000;
    const std::optional<size_t> offset = ring.acquire(bytes);
    if (!offset) continue;
    const size_t size = (bytes + 63) / 64 * 64;
    ASSERT_EQ(*offset % 64, 0u);
    ASSERT_LE(*offset + size, ring.capacity());
    auto next = live.lower_bound(*offset);
    if (next != live.end()) {
      ASSERT_LE(*offset + size, next->first) << "step " << step;
    }
    if (next != live.begin()) {
      auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second, *offset) << "step " << step;
    }
    live[*offset] = size;
  }
  for (const auto& [offset, size] : live) ring.release(offset);
  EXPECT_TRUE(ring.empty());
  EXPECT_EQ(ring.acquire(ring.capacity()), 0u);
}

}  // namespace
}  // namespace duet
