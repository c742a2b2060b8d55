// TcpFrameLink (common/net/tcp_frame_link.h) over socket pairs in one
// process: frames whole and in order both ways (one larger than the socket
// buffers, one empty), a peer that closes after its last frames, bytes that
// are not frames, drop(), and wait()'s wake-ups.
#include "common/net/tcp_frame_link.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kA = 0;
constexpr int kB = 3;

// Two links joined by a non-blocking socket pair: a (rank kA) and b (rank kB).
struct Pair {
  std::unique_ptr<TcpFrameLink> a, b;
  int fd_a = -1, fd_b = -1;
};

Pair joined_links(size_t max_frame_bytes = TcpFrameLink::kDefaultMaxFrameBytes) {
  int fds[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
  Pair pair;
  pair.fd_a = fds[0];
  pair.fd_b = fds[1];
  pair.a = std::make_unique<TcpFrameLink>(std::map<int, int>{{kB, fds[0]}}, max_frame_bytes);
  pair.b = std::make_unique<TcpFrameLink>(std::map<int, int>{{kA, fds[1]}}, max_frame_bytes);
  return pair;
}

std::vector<std::byte> bytes_of(size_t n, uint8_t seed) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return out;
}

// Pumps both links until `want` frames reached b or something ended.
struct Received {
  std::vector<TcpFrameLink::Frame> frames;
  std::vector<TcpFrameLink::Ended> ended;
};
Received pump_until(Pair& pair, size_t want, std::chrono::milliseconds patience = 5s) {
  Received got;
  std::vector<TcpFrameLink::Frame> ignored_frames;
  std::vector<TcpFrameLink::Ended> ignored_ended;
  const auto deadline = Clock::now() + patience;
  while (got.frames.size() < want && got.ended.empty() && Clock::now() < deadline) {
    if (pair.a) pair.a->pump(ignored_frames, ignored_ended);
    pair.b->pump(got.frames, got.ended);
    pair.b->wait(-1, 10ms);
  }
  return got;
}

TEST(TcpFrameLink, FramesArriveWholeAndInOrder) {
  Pair pair = joined_links();
  // 8 MiB is far more than a socket pair's buffers: it needs many pumps on
  // both sides, and the frames behind it must wait for it.
  const std::vector<size_t> sizes = {5, 0, size_t{8} << 20, 1, 70'000, 3};
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(pair.a->queue(kB, static_cast<uint32_t>(100 + i),
                              bytes_of(sizes[i], static_cast<uint8_t>(i))));
  }
  EXPECT_TRUE(pair.a->writing());
  Received got = pump_until(pair, sizes.size());
  ASSERT_TRUE(got.ended.empty());
  ASSERT_EQ(got.frames.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(got.frames[i].peer, kA);
    EXPECT_EQ(got.frames[i].tag, 100 + i);
    EXPECT_EQ(got.frames[i].body, bytes_of(sizes[i], static_cast<uint8_t>(i))) << "frame " << i;
  }
  EXPECT_FALSE(pair.a->writing());

  // And back the other way on the same connection.
  ASSERT_TRUE(pair.b->queue(kA, 7, bytes_of(12, 9)));
  std::vector<TcpFrameLink::Frame> back;
  std::vector<TcpFrameLink::Ended> ended;
  for (int i = 0; i < 100 && back.empty(); ++i) {
    pair.b->pump(back, ended);
    pair.a->wait(-1, 10ms);
    pair.a->pump(back, ended);
  }
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].peer, kB);
  EXPECT_EQ(back[0].tag, 7u);
  EXPECT_TRUE(ended.empty());
}

TEST(TcpFrameLink, APeerThatClosesEndsAfterItsLastFrames) {
  Pair pair = joined_links();
  ASSERT_TRUE(pair.a->queue(kB, 1, bytes_of(10, 1)));
  ASSERT_TRUE(pair.a->queue(kB, 2, bytes_of(20, 2)));
  std::vector<TcpFrameLink::Frame> frames;
  std::vector<TcpFrameLink::Ended> ended;
  pair.a->pump(frames, ended);  // a socket pair takes 30 bytes at once
  pair.a.reset();               // closes its socket
  Received got = pump_until(pair, 3);
  ASSERT_EQ(got.frames.size(), 2u);
  EXPECT_EQ(got.frames[1].tag, 2u);
  ASSERT_EQ(got.ended.size(), 1u);
  EXPECT_EQ(got.ended[0].peer, kA);
  EXPECT_EQ(got.ended[0].why, "closed the connection");
  EXPECT_FALSE(pair.b->connected(kA));
  EXPECT_FALSE(pair.b->queue(kA, 1, {}));
  // Reported once.
  got.ended.clear();
  pair.b->pump(got.frames, got.ended);
  EXPECT_TRUE(got.ended.empty());
}

TEST(TcpFrameLink, BytesThatAreNotFramesEndTheConnection) {
  Pair pair = joined_links(/*max_frame_bytes=*/1024);
  // A header that announces 1 GiB: not this link's bytes.
  const unsigned char junk[8] = {0, 0, 0, 0x40, 1, 0, 0, 0};
  ASSERT_EQ(send(pair.fd_a, junk, sizeof junk, 0), 8);
  Received got = pump_until(pair, 1);
  EXPECT_TRUE(got.frames.empty());
  ASSERT_EQ(got.ended.size(), 1u);
  EXPECT_NE(got.ended[0].why.find("1073741824-byte frame"), std::string::npos) << got.ended[0].why;
}

TEST(TcpFrameLink, DropLetsQueuedBytesLeaveAndReportsNothing) {
  Pair pair = joined_links();
  ASSERT_TRUE(pair.a->queue(kB, 5, bytes_of(100, 5)));
  pair.a->drop(kB);
  EXPECT_FALSE(pair.a->connected(kB));
  EXPECT_FALSE(pair.a->queue(kB, 6, {}));
  EXPECT_FALSE(pair.a->writing());
  std::vector<TcpFrameLink::Frame> frames;
  std::vector<TcpFrameLink::Ended> ended;
  pair.a->pump(frames, ended);
  EXPECT_TRUE(ended.empty());  // dropped on purpose: not an end to report
  // The peer gets the frame queued before the drop, then the end.
  Received got = pump_until(pair, 2);
  ASSERT_EQ(got.frames.size(), 1u);
  EXPECT_EQ(got.frames[0].tag, 5u);
  ASSERT_EQ(got.ended.size(), 1u);
}

TEST(TcpFrameLink, WaitReturnsOnTheWakeFdOnBytesOrAfterItsTimeout) {
  Pair pair = joined_links();
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  ASSERT_GE(wake, 0);
  auto start = Clock::now();
  pair.b->wait(wake, 100ms);
  EXPECT_GE(Clock::now() - start, 90ms);  // nothing to read: the whole timeout

  const uint64_t one = 1;
  ASSERT_EQ(write(wake, &one, sizeof one), 8);
  start = Clock::now();
  pair.b->wait(wake, 5000ms);
  EXPECT_LT(Clock::now() - start, 1000ms);
  uint64_t drained = 0;
  ASSERT_EQ(read(wake, &drained, sizeof drained), 8);

  ASSERT_TRUE(pair.a->queue(kB, 1, bytes_of(4, 0)));
  std::vector<TcpFrameLink::Frame> frames;
  std::vector<TcpFrameLink::Ended> ended;
  pair.a->pump(frames, ended);
  start = Clock::now();
  pair.b->wait(wake, 5000ms);
  EXPECT_LT(Clock::now() - start, 1000ms);
  close(wake);
}

}  // namespace
}  // namespace duet
