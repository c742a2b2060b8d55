// CmaStaging (worker/transfer/cma_staging.h) within one process, which may
// read its own memory by cross-memory attach as it would a peer's: payloads
// land scattered over any runs, the ring refuses what does not fit (the
// sender then uses MPI), regions come back from their holder only, and a
// read that cannot be done says why instead of copying anything.
#include "worker/transfer/cma_staging.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <vector>

namespace duet {
namespace {

constexpr int kReceiver = 2;

// A staging this process sends to kReceiver from and, as kReceiver, reads.
struct Loopback {
  explicit Loopback(size_t capacity) : staging(capacity) {
    staging.add_reader(kReceiver);
    staging.add_source(kReceiver, staging.endpoint());
  }
  CmaStaging staging;
};

// `bytes` of a counting pattern from `seed`.
std::vector<std::byte> pattern(size_t bytes, int seed) {
  std::vector<std::byte> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<std::byte>((i * 7 + seed) & 0xff);
  return out;
}

TEST(CmaStaging, AReadScattersThePayloadOverTheRuns) {
  Loopback loop(1 << 20);
  const std::optional<CmaStaging::Region> region = loop.staging.acquire(kReceiver, 3000);
  ASSERT_TRUE(region.has_value());
  const std::vector<std::byte> sent = pattern(3000, 3);
  std::memcpy(region->data, sent.data(), sent.size());
  // Runs of uneven lengths, in an order other than memory's.
  std::vector<std::byte> a(1000), b(1500), c(500);
  const std::vector<iovec> runs{{b.data(), 1500}, {c.data(), 500}, {a.data(), 1000}};
  EXPECT_EQ(loop.staging.read(kReceiver, region->ticket, runs), std::nullopt);
  std::vector<std::byte> got(b);
  got.insert(got.end(), c.begin(), c.end());
  got.insert(got.end(), a.begin(), a.end());
  EXPECT_EQ(got, sent);
  EXPECT_TRUE(loop.staging.release(kReceiver, region->ticket));
  EXPECT_EQ(loop.staging.n_held(), 0u);
}

TEST(CmaStaging, MoreRunsThanOneSystemCallTakes) {
  Loopback loop(1 << 20);
  constexpr size_t kRuns = 2500, kRun = 16;  // over IOV_MAX (1024) runs
  const std::optional<CmaStaging::Region> region = loop.staging.acquire(kReceiver, kRuns * kRun);
  ASSERT_TRUE(region.has_value());
  const std::vector<std::byte> sent = pattern(kRuns * kRun, 11);
  std::memcpy(region->data, sent.data(), sent.size());
  std::vector<std::byte> got(kRuns * kRun);
  std::vector<iovec> runs;
  for (size_t i = 0; i < kRuns; ++i) runs.push_back({got.data() + i * kRun, kRun});
  EXPECT_EQ(loop.staging.read(kReceiver, region->ticket, runs), std::nullopt);
  EXPECT_EQ(got, sent);
}

TEST(CmaStaging, OnlyTheRightNonceIsReadable) {
  CmaStaging staging(1 << 16);
  CmaStaging::Endpoint endpoint = staging.endpoint();
  EXPECT_TRUE(CmaStaging::can_read(endpoint));
  endpoint.nonce ^= 1u << 7;
  EXPECT_FALSE(CmaStaging::can_read(endpoint));
  // Another host's name: never read, even where the kernel would allow it.
  CmaStaging::Endpoint elsewhere = staging.endpoint();
  elsewhere.host ^= 1;
  EXPECT_FALSE(CmaStaging::can_read(elsewhere));
  // A rank without staging publishes nothing to read.
  CmaStaging none(0);
  EXPECT_EQ(none.endpoint().capacity, 0u);
  EXPECT_FALSE(CmaStaging::can_read(none.endpoint()));
  EXPECT_FALSE(none.acquire(kReceiver, 16).has_value());
}

TEST(CmaStaging, AFullRingRefusesUntilRegionsComeBack) {
  Loopback loop(4096);
  const auto first = loop.staging.acquire(kReceiver, 2048);
  const auto second = loop.staging.acquire(kReceiver, 2048);
  ASSERT_TRUE(first && second);
  EXPECT_FALSE(loop.staging.acquire(kReceiver, 256).has_value());   // full: MPI carries it
  EXPECT_FALSE(loop.staging.acquire(kReceiver, 8192).has_value());  // more than the ring
  EXPECT_TRUE(loop.staging.release(kReceiver, first->ticket));
  const auto third = loop.staging.acquire(kReceiver, 2048);
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->ticket.offset, 0u);
  EXPECT_EQ(loop.staging.n_held(), 2u);
}

TEST(CmaStaging, RegionsComeBackFromTheirHolderOnly) {
  Loopback loop(1 << 16);
  constexpr int kOther = 3;
  loop.staging.add_reader(kOther);
  const auto mine = loop.staging.acquire(kReceiver, 512);
  const auto its = loop.staging.acquire(kOther, 512);
  ASSERT_TRUE(mine && its);
  EXPECT_FALSE(loop.staging.release(kOther, mine->ticket));     // not its region
  EXPECT_FALSE(loop.staging.release(kReceiver, {12345, 512}));  // no region there
  EXPECT_TRUE(loop.staging.release(kReceiver, mine->ticket));
  EXPECT_FALSE(loop.staging.release(kReceiver, mine->ticket));  // twice
  EXPECT_FALSE(loop.staging.acquire(4, 512).has_value());       // a rank that does not read it
  EXPECT_EQ(loop.staging.n_held(), 1u);
}

TEST(CmaStaging, ALostReceiverGivesEveryRegionBack) {
  Loopback loop(4096);
  ASSERT_TRUE(loop.staging.acquire(kReceiver, 2048));
  ASSERT_TRUE(loop.staging.acquire(kReceiver, 2048));
  loop.staging.release_all(kReceiver);
  EXPECT_EQ(loop.staging.n_held(), 0u);
  EXPECT_TRUE(loop.staging.acquire(kReceiver, 4096).has_value());
}

TEST(CmaStaging, AReadThatCannotBeDoneSaysWhy) {
  Loopback loop(4096);
  std::vector<std::byte> into(256);
  const std::vector<iovec> runs{{into.data(), into.size()}};
  // Outside the sender's ring, or not the size of the rows.
  EXPECT_NE(loop.staging.read(kReceiver, {4000, 256}, runs), std::nullopt);
  EXPECT_NE(loop.staging.read(kReceiver, {0, 128}, runs), std::nullopt);
  // From a rank whose staging this one does not read.
  EXPECT_NE(loop.staging.read(7, {0, 256}, runs), std::nullopt);
  // From a sender that is gone.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  CmaStaging::Endpoint gone = loop.staging.endpoint();
  gone.pid = child;
  loop.staging.add_source(8, gone);
  const std::optional<std::string> why = loop.staging.read(8, {0, 256}, runs);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("rank 8"), std::string::npos) << *why;
}

}  // namespace
}  // namespace duet
