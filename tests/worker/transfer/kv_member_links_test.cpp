// KV links with instances that join after start-up (worker/transfer/
// kv_member_links.h) and a rank's transfer split between the job's ranks and
// those members (worker/transfer/split_kv_transfer.h), over loopback in one
// process:
// - a decode rank imports one prompt from a prefill rank of the job (a link
//   made at start-up) and one from a member (a link it took on its
//   listener, the member proving the key): both land whole, each from its
//   own transfer, and an abort of the member's import reaches the member;
// - a dialer with another key links nothing, and the listener hands no
//   socket on;
// - a frame for a rank never linked fails its import at once, not at the
//   deadline;
// - a member the coordinator says is lost fails only the imports from it.

#include "worker/transfer/kv_member_links.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/worker/transfer/tcp_transfer_testing.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/split_kv_transfer.h"
#include "worker/transfer/tcp_kv_transfer.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

constexpr int kPrefill = 1;  // a rank of the job
constexpr int kDecode = 2;   // a rank of the job
constexpr int kWorld = 3;    // the job's world size: members are 3 and up
constexpr int kMember = 5;   // a prefill member
constexpr int64_t kPrompt = 21;
constexpr auto kLong = 60s;  // a deadline no test should reach

KvLayout test_layout() {
  KvLayout layout;
  layout.n_layers = 2;
  layout.n_kv_heads = 2;
  layout.head_dim = 8;
  layout.block_size = 16;
  layout.n_blocks = 8;
  return layout;
}

ClusterKey key() { return ClusterKey::from_bytes("a-test-cluster-key-of-at-least-32-bytes"); }

// The decode rank: its transfer split between the job and members, its
// listener taking members' links; a prefill rank of the job; a prefill
// member that dials the decode rank.
class KvMemberLinksTest : public ::testing::Test {
 protected:
  KvMemberLinksTest() {
    const auto [prefill_fd, decode_fd] = connected_tcp_pair(kPrefill, kDecode);
    decode_ = std::make_unique<SplitKvTransfer>(
        std::make_unique<TcpKvTransfer>(kDecode, std::map<int, int>{{kPrefill, decode_fd}}),
        std::make_unique<TcpKvTransfer>(kDecode, std::map<int, int>{}), kWorld);
    decode_->set_handlers(decode_calls_.handlers());
    listener_.start([this](int rank, int fd) {
      {
        std::lock_guard lock(linked_mutex_);
        linked_.push_back(rank);
      }
      decode_->members().add_peer(rank, fd);
    });
    job_prefill_ =
        std::make_unique<TcpKvTransfer>(kPrefill, std::map<int, int>{{kDecode, prefill_fd}});
    job_prefill_->set_handlers(job_calls_.handlers());
    member_ = std::make_unique<TcpKvTransfer>(kMember, std::map<int, int>{});
    member_->set_handlers(member_calls_.handlers());
    for (int64_t i = 0; i < prefill_cache_.layout().total_elems(); ++i)
      prefill_cache_.data()[i] = static_cast<KvElement>(1 + i % 30000);
  }

  KvLinkAddress decode_address() const { return listener_.address(kDecode, "this host"); }

  // The member links with the decode rank, as a joiner does.
  void link_member() {
    const std::vector<KvLinkAddress> peers{decode_address()};
    for (const auto& [rank, fd] : dial_kv_links(kMember, peers, "this host", key()))
      ASSERT_TRUE(member_->add_peer(rank, fd));
  }

  // An import of kPrompt rows from `prefill` into `blocks`.
  void start_import(RequestId id, int prefill, std::vector<int32_t> blocks) {
    start_whole_import(*decode_, prefill, id, kPrompt, decode_cache_, std::move(blocks), kLong);
  }

  // `from` ships every layer's rows and the handoff for `id`.
  void ship(TcpKvTransfer& from, RequestId id, int32_t first_token) {
    for (int64_t layer = 0; layer < prefill_cache_.layout().n_layers; ++layer) {
      from.send_rows(kDecode, id, layer, 0, kPrompt, prefill_cache_, prefill_blocks_, 0,
                     all_kv_heads_of(prefill_cache_));
    }
    KvHandoff handoff{id};
    handoff.first_token = first_token;
    handoff.rows_sent = kPrompt * prefill_cache_.layout().n_layers;
    from.send_handoff(kDecode, handoff);
  }

  void expect_rows(const std::vector<int32_t>& blocks) {
    for (int64_t layer = 0; layer < prefill_cache_.layout().n_layers; ++layer) {
      EXPECT_EQ(packed_rows(decode_cache_, blocks, layer, kPrompt),
                packed_rows(prefill_cache_, prefill_blocks_, layer, kPrompt))
          << "layer " << layer;
    }
  }

  KvCache prefill_cache_{test_layout()};
  KvCache decode_cache_{test_layout()};
  const std::vector<int32_t> prefill_blocks_{4, 0};
  Calls decode_calls_, job_calls_, member_calls_;
  std::vector<int> linked() {
    std::lock_guard lock(linked_mutex_);
    return linked_;
  }

  std::mutex linked_mutex_;
  std::vector<int> linked_;  // by the listener's thread, before the dialer's answer
  // Destroyed in reverse: the listener before the transfer it adds to.
  std::unique_ptr<SplitKvTransfer> decode_;
  KvLinkListener listener_{key()};
  std::unique_ptr<TcpKvTransfer> job_prefill_;
  std::unique_ptr<TcpKvTransfer> member_;
};

TEST_F(KvMemberLinksTest, ImportsFromTheJobAndFromAMemberBothLandWhole) {
  link_member();
  EXPECT_EQ(linked(), std::vector<int>{kMember});
  start_import(RequestId{11}, kPrefill, {1, 2});
  start_import(RequestId{12}, kMember, {5, 6});
  ASSERT_TRUE(job_calls_.wait([&] { return !job_calls_.orders.empty(); }));
  ASSERT_TRUE(member_calls_.wait([&] { return !member_calls_.orders.empty(); }));
  EXPECT_EQ(job_calls_.orders[0].second.request.id, RequestId{11});
  EXPECT_EQ(member_calls_.orders[0].first, kDecode);
  EXPECT_EQ(member_calls_.orders[0].second.request.id, RequestId{12});
  ship(*job_prefill_, RequestId{11}, 40);
  ship(*member_, RequestId{12}, 41);
  ASSERT_TRUE(decode_calls_.wait([&] { return decode_calls_.completed.size() == 2; }));
  EXPECT_TRUE(decode_calls_.failed.empty());
  expect_rows({1, 2});
  expect_rows({5, 6});
  EXPECT_EQ(decode_->counters().imports_completed, 2);

  // An abort of a member's import reaches the member, and releases.
  start_import(RequestId{13}, kMember, {3, 7});
  ASSERT_TRUE(member_calls_.wait([&] { return member_calls_.orders.size() == 2; }));
  decode_->abort_import(RequestId{13});
  ASSERT_TRUE(member_calls_.wait([&] { return !member_calls_.cancels.empty(); }));
  EXPECT_EQ(member_calls_.cancels[0], RequestId{13});
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.released.empty(); }));
  EXPECT_TRUE(job_calls_.cancels.empty());
}

TEST_F(KvMemberLinksTest, ADialerWithAnotherKeyLinksNothing) {
  const std::vector<KvLinkAddress> peers{decode_address()};
  const ClusterKey other = ClusterKey::from_bytes("another-cluster-key-of-at-least-32-bytes");
  EXPECT_TRUE(dial_kv_links(kMember, peers, "this host", other).empty());
  EXPECT_TRUE(linked().empty());
  link_member();  // the right key still links
  EXPECT_EQ(linked(), std::vector<int>{kMember});
}

TEST_F(KvMemberLinksTest, AnImportFromARankNeverLinkedFailsAtOnce) {
  const auto start = std::chrono::steady_clock::now();
  start_import(RequestId{21}, kMember, {1, 2});  // no link_member()
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.failed.empty(); }));
  EXPECT_EQ(decode_calls_.failed[0].second.kind, ServeErrorKind::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST_F(KvMemberLinksTest, ALostMemberFailsOnlyTheImportsFromIt) {
  link_member();
  start_import(RequestId{31}, kPrefill, {1, 2});
  start_import(RequestId{32}, kMember, {5, 6});
  ASSERT_TRUE(member_calls_.wait([&] { return !member_calls_.orders.empty(); }));
  const Rank lost[] = {Rank{kMember}};
  decode_->peers_lost(lost);
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.failed.empty(); }));
  EXPECT_EQ(decode_calls_.failed[0].first, RequestId{32});
  ship(*job_prefill_, RequestId{31}, 50);
  ASSERT_TRUE(decode_calls_.wait([&] { return !decode_calls_.completed.empty(); }));
  EXPECT_EQ(decode_calls_.completed[0].first, RequestId{31});
  expect_rows({1, 2});
}

}  // namespace
}  // namespace duet
