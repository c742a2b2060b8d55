// TcpKvTransfer (worker/transfer/tcp_kv_transfer.h) over loopback, in one
// process, no MPI: two ranks connect as duet serve's start-up connects them
// (connect_tcp_peers), then
// - a decode rank imports a prompt's rows from a prefill rank: every row
//   lands in the reserved blocks, checksums on, and the import completes;
// - a prefill rank that dies with a payload half-sent (the test plays it on
//   a raw socket) fails the import kUnavailable and its blocks come back
//   (no quarantine: the socket is closed, nothing writes them any more);
// - bytes that are not the transfer's give the peer up the same way;
// - an abort reaches the prefill side as a cancel, and releases;
// - a peer that stops reading (stalled, SIGSTOP) holds nothing up: sends
//   queue, and the transfer still ends in its flush time;
// - rows without checksums leave straight from the blocks while the socket
//   takes them, then partly, then packed and queued: on the wire every
//   frame is whole and in order (the test reads the raw stream).

#include "worker/transfer/tcp_kv_transfer.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "tests/worker/transfer/tcp_transfer_testing.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/kv_transfer_wire.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

constexpr int kPrefill = 1;
constexpr int kDecode = 2;
constexpr RequestId kId{11};
constexpr int64_t kPrompt = 37;  // over several blocks, the last one partial
constexpr auto kPatience = 10s;  // any wait in these tests

KvLayout test_layout() {
  KvLayout layout;
  layout.n_layers = 3;
  layout.n_kv_heads = 2;
  layout.head_dim = 8;
  layout.block_size = 16;
  layout.n_blocks = 8;
  return layout;
}

// Connected sockets between kPrefill and kDecode, as the start-up makes them.
std::pair<int, int> connected_pair() { return connected_tcp_pair(kPrefill, kDecode); }

class TcpKvTransferTest : public ::testing::Test {
 protected:
  // `decode_poll`: how often the decode side tests its socket while rows are expected.
  explicit TcpKvTransferTest(
      std::chrono::microseconds decode_poll = TcpKvTransferOptions{}.transfer_poll) {
    const auto [prefill_fd, decode_fd] = connected_pair();
    prefill_fd_ = prefill_fd;
    TcpKvTransferOptions options{true};
    options.transfer_poll = decode_poll;
    options.burst_window = std::max(options.burst_window, 100 * decode_poll);
    decode_ = std::make_unique<TcpKvTransfer>(kDecode, std::map<int, int>{{kPrefill, decode_fd}},
                                              options);
    decode_->set_handlers(decode_calls_.handlers());
    // The prefill cache: every element tells its place.
    for (int64_t i = 0; i < prefill_cache_.layout().total_elems(); ++i)
      prefill_cache_.data()[i] = static_cast<KvElement>(1 + i % 30000);
  }
  ~TcpKvTransferTest() override {
    prefill_.reset();
    decode_.reset();
    if (prefill_fd_ >= 0) close(prefill_fd_);
  }

  // The prefill side as a TcpKvTransfer of its own.
  void start_prefill() {
    prefill_ = std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd_}},
                                               TcpKvTransferOptions{true});
    prefill_fd_ = -1;
    prefill_->set_handlers(prefill_calls_.handlers());
  }

  void start_import() {
    start_whole_import(*decode_, kPrefill, kId, kPrompt, decode_cache_, decode_blocks_, kPatience);
  }

  std::vector<KvElement> packed(const KvCache& cache, const std::vector<int32_t>& blocks,
                                int64_t layer) {
    return packed_rows(cache, blocks, layer, kPrompt);
  }

  // The prefill side's handoff after all of the prompt's rows.
  void hand_off(int32_t first_token) {
    KvHandoff handoff{kId};
    handoff.first_token = first_token;
    handoff.rows_sent = kPrompt * prefill_cache_.layout().n_layers;
    prefill_->send_handoff(kDecode, handoff);
  }

  // The import completed with the handoff's first token, and every layer's
  // rows in the decode side's blocks are the prefill side's.
  void expect_completed(int32_t first_token) {
    ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.completed.empty(); }));
    EXPECT_EQ(decode_calls_.completed[0].second.first_token, first_token);
    EXPECT_TRUE(decode_calls_.failed.empty());
    for (int64_t layer = 0; layer < prefill_cache_.layout().n_layers; ++layer) {
      EXPECT_EQ(packed(decode_cache_, decode_blocks_, layer),
                packed(prefill_cache_, prefill_blocks_, layer))
          << "layer " << layer;
    }
  }

  KvCache prefill_cache_{test_layout()};
  KvCache decode_cache_{test_layout()};
  const std::vector<int32_t> prefill_blocks_{4, 0, 6};
  const std::vector<int32_t> decode_blocks_{1, 7, 3};
  int prefill_fd_ = -1;
  Calls decode_calls_, prefill_calls_;
  std::unique_ptr<TcpKvTransfer> decode_;
  std::unique_ptr<TcpKvTransfer> prefill_;
};

TEST_F(TcpKvTransferTest, RowsLandInTheReservedBlocksAndTheImportCompletes) {
  start_prefill();
  start_import();
  ASSERT_TRUE(prefill_calls_.wait([&] { return !prefill_calls_.orders.empty(); }));
  EXPECT_EQ(prefill_calls_.orders[0].first, kDecode);
  const int64_t layers = prefill_cache_.layout().n_layers;
  for (int64_t layer = 0; layer < layers; ++layer) {  // in two chunks, as a prefill does
    prefill_->send_rows(kDecode, kId, layer, 0, 20, prefill_cache_, prefill_blocks_, 0,
                        all_kv_heads_of(prefill_cache_));
  }
  for (int64_t layer = 0; layer < layers; ++layer) {
    prefill_->send_rows(kDecode, kId, layer, 20, kPrompt - 20, prefill_cache_, prefill_blocks_, 0,
                        all_kv_heads_of(prefill_cache_));
  }
  hand_off(42);
  expect_completed(42);
  const KvTransferAdapter::Counters sent = prefill_->counters();
  EXPECT_EQ(sent.messages_sent, 2 * layers + 1);
  EXPECT_EQ(decode_->counters().bytes_received, sent.bytes_sent);
}

// Once bytes have come, the decode side tests its socket every transfer_poll
// (for burst_window) instead of waiting in poll(): with a long poll, what
// arrives while it sleeps (the second chunk, the handoff) is still taken,
// whole and in order.
class TcpKvTransferSlowPollTest : public TcpKvTransferTest {
 protected:
  TcpKvTransferSlowPollTest() : TcpKvTransferTest(std::chrono::milliseconds(30)) {}
};

TEST_F(TcpKvTransferSlowPollTest, RowsThatArriveBetweenTestsLandAndTheImportCompletes) {
  start_prefill();
  start_import();
  ASSERT_TRUE(prefill_calls_.wait([&] { return !prefill_calls_.orders.empty(); }));
  const int64_t layers = prefill_cache_.layout().n_layers;
  for (int64_t layer = 0; layer < layers; ++layer) {
    prefill_->send_rows(kDecode, kId, layer, 0, 20, prefill_cache_, prefill_blocks_, 0,
                        all_kv_heads_of(prefill_cache_));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the decode side now polls
  for (int64_t layer = 0; layer < layers; ++layer) {
    prefill_->send_rows(kDecode, kId, layer, 20, kPrompt - 20, prefill_cache_, prefill_blocks_, 0,
                        all_kv_heads_of(prefill_cache_));
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  hand_off(7);
  expect_completed(7);
}

TEST_F(TcpKvTransferTest, AnAbortCancelsAtThePrefillSideAndReleases) {
  start_prefill();
  start_import();
  ASSERT_TRUE(prefill_calls_.wait([&] { return !prefill_calls_.orders.empty(); }));
  decode_->abort_import(kId);
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.released.empty(); }));
  ASSERT_TRUE(prefill_calls_.wait([&] { return !prefill_calls_.cancels.empty(); }));
  EXPECT_EQ(prefill_calls_.cancels[0], kId);
}

// The prefill side, played on the raw socket: a rows header and half its
// payload, then the process dies (the socket closes).
TEST_F(TcpKvTransferTest, APeerLostMidPayloadFailsTheImportAndReleasesItsBlocks) {
  start_import();
  const std::vector<KvElement> rows = packed(prefill_cache_, prefill_blocks_, 0);
  kv_wire::Header header{kv_wire::kMagic, kv_wire::kRows, kId.value, 0, 0, kPrompt, 0, 0, 2};
  header.ticket_bytes = rows.size() * sizeof(KvElement);
  std::vector<std::byte> frame = kv_wire::header_bytes(header);
  const auto* bytes = reinterpret_cast<const std::byte*>(rows.data());
  frame.insert(frame.end(), bytes, bytes + header.ticket_bytes / 2);
  ASSERT_EQ(send(prefill_fd_, frame.data(), frame.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(frame.size()));
  std::this_thread::sleep_for(100ms);  // the decode side is receiving into the blocks
  close(prefill_fd_);
  prefill_fd_ = -1;
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.failed.empty(); }));
  EXPECT_EQ(decode_calls_.failed[0].second.kind, ServeErrorKind::kUnavailable);
  EXPECT_TRUE(decode_calls_.quarantined.empty());
  EXPECT_EQ(decode_->counters().imports_quarantined, 0);
}

TEST_F(TcpKvTransferTest, BytesThatAreNotTheTransfersGiveThePeerUp) {
  start_import();
  const std::vector<std::byte> junk(sizeof(kv_wire::Header), std::byte{0x5a});
  ASSERT_EQ(send(prefill_fd_, junk.data(), junk.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(junk.size()));
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.failed.empty(); }));
  EXPECT_EQ(decode_calls_.failed[0].second.kind, ServeErrorKind::kUnavailable);
}

TEST(TcpKvTransferStall, APeerThatStopsReadingHoldsNothingUp) {
  const auto [prefill_fd, decode_fd] = connected_pair();  // the decode side never reads
  KvCache cache{test_layout()};
  const std::vector<int32_t> blocks{0, 1, 2};
  auto transfer =
      std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd}});
  const auto start = std::chrono::steady_clock::now();
  int64_t sent = 0;
  for (int rep = 0; rep < 6000; ++rep) {  // far more than the sockets' buffers hold
    for (int64_t layer = 0; layer < cache.layout().n_layers; ++layer) {
      transfer->send_rows(kDecode, kId, layer, 0, kPrompt, cache, blocks, 0,
                          all_kv_heads_of(cache));
    }
    sent = transfer->counters().bytes_sent;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_GT(sent, int64_t{32} << 20);
  const auto stop = std::chrono::steady_clock::now();
  transfer.reset();  // its frames cannot all leave: it gives them up after its flush time
  EXPECT_LT(std::chrono::steady_clock::now() - stop, 3s);
  close(decode_fd);
}

// Reads `bytes` from non-blocking `fd` into `into`; false on EOF or after kPatience.
bool read_exact(int fd, std::byte* into, size_t bytes) {
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (bytes > 0) {
    const ssize_t n = recv(fd, into, bytes, 0);
    if (n > 0) {
      into += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    if (std::chrono::steady_clock::now() > deadline) return false;
    pollfd wait{fd, POLLIN, 0};
    poll(&wait, 1, 100);
  }
  return true;
}

TEST(TcpKvTransferFrames, RowsFromTheBlocksArriveWholeAndInOrder) {
  const auto [prefill_fd, decode_fd] = connected_pair();  // the test reads decode_fd itself
  KvLayout layout = test_layout();
  layout.head_dim = 64;
  layout.n_blocks = 64;
  constexpr int64_t kTokens = 1000;  // 500 KB of rows per layer, the last block partial
  KvCache cache{layout};
  for (int64_t i = 0; i < layout.total_elems(); ++i)
    cache.data()[i] = static_cast<KvElement>(1 + i % 30011);
  std::vector<int32_t> blocks;
  for (int32_t b = 0; b < 63; ++b) blocks.push_back((b * 37 + 11) % 64);  // scattered
  auto transfer =
      std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd}});
  // 24 frames, 12 MB: more than the socket buffers hold, so the first leave
  // whole from the blocks, one partly, and the rest packed and queued.
  constexpr int kReps = 8;
  for (int rep = 0; rep < kReps; ++rep) {
    for (int64_t layer = 0; layer < layout.n_layers; ++layer)
      transfer->send_rows(kDecode, kId, layer, 0, kTokens, cache, blocks, 0,
                          all_kv_heads_of(cache));
  }
  const KvHeads heads = all_kv_heads(layout);
  std::vector<KvElement> expected(static_cast<size_t>(packed_kv_elems(layout, kTokens, heads)));
  std::vector<std::byte> body(expected.size() * sizeof(KvElement));
  for (int rep = 0; rep < kReps; ++rep) {
    for (int64_t layer = 0; layer < layout.n_layers; ++layer) {
      kv_wire::Header header;
      ASSERT_TRUE(read_exact(decode_fd, reinterpret_cast<std::byte*>(&header), sizeof header))
          << "rep " << rep << " layer " << layer;
      ASSERT_EQ(header.magic, kv_wire::kMagic);
      ASSERT_EQ(header.kind, kv_wire::kRows);
      ASSERT_EQ(header.layer, layer);
      ASSERT_EQ(header.n, kTokens);
      ASSERT_EQ(header.ticket_bytes, body.size());
      ASSERT_TRUE(read_exact(decode_fd, body.data(), body.size()));
      pack_kv_rows(layout, cache.data(), layer, blocks, 0, kTokens, heads, expected.data());
      ASSERT_EQ(std::memcmp(body.data(), expected.data(), body.size()), 0)
          << "rep " << rep << " layer " << layer;
    }
  }
  EXPECT_EQ(transfer->counters().bytes_sent,
            int64_t{kReps} * layout.n_layers *
                static_cast<int64_t>(sizeof(kv_wire::Header) + body.size()));
  transfer.reset();
  close(decode_fd);
}

// Reads frames from `fd` until `frames` came or the stream breaks: the rows
// frames' bodies checked against `expected` (one layer's packed rows, any
// layer), the handoffs counted. Returns {rows frames, handoffs}; -1, -1 on a
// frame that is not whole.
std::pair<int, int> read_frames(int fd, int frames, const std::vector<KvElement>& expected) {
  std::vector<std::byte> body;
  int rows = 0;
  int handoffs = 0;
  for (int i = 0; i < frames; ++i) {
    std::array<std::byte, sizeof(kv_wire::Header)> head{};
    if (!read_exact(fd, head.data(), head.size())) return {-1, -1};
    const std::optional<kv_wire::Header> header = kv_wire::read_header(head);
    if (!header) return {-1, -1};
    body.resize(kv_wire::body_bytes(*header));
    if (!read_exact(fd, body.data(), body.size())) return {-1, -1};
    if (header->kind == kv_wire::kRows) {
      if (body.size() != expected.size() * sizeof(KvElement) ||
          std::memcmp(body.data(), expected.data(), body.size()) != 0)
        return {-1, -1};
      ++rows;
    } else {
      ++handoffs;
    }
  }
  return {rows, handoffs};
}

// send_rows writes from the blocks without the lock while another thread
// queues frames to the same peer and the transfer's own thread writes them:
// every frame arrives whole, none inside another. (A check of the stream
// under concurrent senders; the narrowest interleavings, a queued frame
// written in the instant between a partial write from the blocks and its
// rest being queued, come too rarely for it to catch reliably.)
TEST(TcpKvTransferFrames, FramesQueuedDuringAWriteFromTheBlocksStayWhole) {
  const auto [prefill_fd, decode_fd] = connected_pair();
  KvLayout layout = test_layout();
  layout.head_dim = 64;
  layout.n_blocks = 64;
  constexpr int64_t kTokens = 512;
  KvCache cache{layout};
  for (int64_t i = 0; i < layout.total_elems(); ++i)
    cache.data()[i] = static_cast<KvElement>(1 + i % 30011);
  std::vector<int32_t> blocks;
  for (int32_t b = 0; b < 32; ++b) blocks.push_back((b * 37 + 11) % 64);
  for (int64_t layer = 1; layer < layout.n_layers; ++layer) {  // every layer's rows alike
    std::copy_n(cache.data(), layout.layer_elems(), cache.data() + layer * layout.layer_elems());
  }
  std::vector<KvElement> expected(
      static_cast<size_t>(packed_kv_elems(layout, kTokens, all_kv_heads(layout))));
  pack_kv_rows(layout, cache.data(), 0, blocks, 0, kTokens, expected.data());
  constexpr int kRowsFrames = 400;
  constexpr int kHandoffs = 400;
  // The reader starts late: the socket fills, and writes from the blocks
  // and the thread's writes of queued frames take turns at its edge.
  auto read = std::async(std::launch::async, [&, fd = decode_fd] {
    std::this_thread::sleep_for(20ms);
    return read_frames(fd, kRowsFrames + kHandoffs, expected);
  });
  auto transfer =
      std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd}});
  std::thread handoffs([&] {
    for (int i = 0; i < kHandoffs; ++i)
      transfer->send_handoff(
          kDecode, KvHandoff{RequestId{1000 + static_cast<uint64_t>(i)}, 0, 0, 0, 0, std::nullopt});
  });
  for (int i = 0; i < kRowsFrames; ++i) {
    transfer->send_rows(kDecode, kId, i % layout.n_layers, 0, kTokens, cache, blocks, 0,
                        all_kv_heads_of(cache));
  }
  handoffs.join();
  ASSERT_EQ(read.wait_for(kPatience), std::future_status::ready);
  EXPECT_EQ(read.get(), std::make_pair(kRowsFrames, kHandoffs));
  transfer.reset();
  close(decode_fd);
}

// A peer lost while send_rows may be writing to it: the socket is closed
// (once the write has returned) and nothing hangs.
TEST(TcpKvTransferFrames, APeerLostDuringWritesFromTheBlocksIsClosed) {
  const auto [prefill_fd, decode_fd] = connected_pair();
  KvCache cache{test_layout()};
  const std::vector<int32_t> blocks{0, 1, 2};
  auto drain = std::async(std::launch::async, [fd = decode_fd] {
    std::vector<std::byte> sink(1 << 16);
    const auto deadline = std::chrono::steady_clock::now() + kPatience;
    while (std::chrono::steady_clock::now() < deadline) {
      const ssize_t n = recv(fd, sink.data(), sink.size(), 0);
      if (n == 0) return true;  // EOF: the prefill side closed it
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
      if (n < 0) {
        pollfd wait{fd, POLLIN, 0};
        poll(&wait, 1, 100);
      }
    }
    return false;
  });
  auto transfer =
      std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd}});
  std::thread writer([&] {
    for (int rep = 0; rep < 3000; ++rep) {
      transfer->send_rows(kDecode, kId, rep % cache.layout().n_layers, 0, kPrompt, cache, blocks, 0,
                          all_kv_heads_of(cache));
    }
  });
  std::this_thread::sleep_for(5ms);
  const Rank lost[] = {Rank{kDecode}};
  transfer->peers_lost(lost);
  writer.join();
  ASSERT_EQ(drain.wait_for(kPatience), std::future_status::ready);
  EXPECT_TRUE(drain.get());
  transfer.reset();
  close(decode_fd);
}

}  // namespace
}  // namespace duet
