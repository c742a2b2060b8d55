// KvTransferProtocol (worker/transfer/kv_transfer_protocol.h) with rows that
// the decode rank reads out of the prefill rank's CMA staging
// (worker/transfer/cma_staging.h; the fixture,
// tests/worker/transfer/kv_transfer_peer.h, plays the read): the rows count
// once read, every read is answered "rows done" so that the sender's staging
// comes back (read or failed, wanted or drained), a read that fails or brings
// rows that do not match their checksum fails the import.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "tests/worker/transfer/kv_transfer_peer.h"
#include "worker/transfer/kv_transfer_protocol.h"

namespace duet {
namespace {

using Kind = KvTransferCall::Kind;

class KvTransferCmaPeer : public KvTransferPeer {
 protected:
  // Rank kLeader's rows of `layer` wait in its staging at `ticket`.
  void send_cma_rows(int64_t layer, uint64_t ticket, uint64_t checksum = 0, RequestId id = kId) {
    kv_wire::Header h{kv_wire::kMagic, kv_wire::kCmaRows, id.value, layer, 0,
                      kPrompt,         checksum,          0,        kHeads};
    h.ticket_offset = ticket;
    h.ticket_bytes = 256;
    header(kLeader, kv_wire::header_bytes(h));
  }

  // The one read the last event asked for.
  KvTransferActions::CmaRead take_read() {
    EXPECT_EQ(out_.cma_reads.size(), 1u);
    KvTransferActions::CmaRead read = out_.cma_reads.at(0);
    out_.cma_reads.clear();
    return read;
  }

  // The read brings `rows` into the blocks it names (as the adapter's
  // scatter over the block runs would), or fails with `error`.
  void read_done(const KvTransferActions::CmaRead& read, const std::vector<KvElement>& rows,
                 std::optional<std::string> error = std::nullopt) {
    if (!error && read.into != nullptr) {
      unpack_kv_rows(cache_.layout(), cache_.data(), read.layer, read.into->block_table, read.pos0,
                     read.n, read.heads, rows.data());
    }
    protocol_.cma_read_done(read, error, now_, out_);
  }

  // The ticket offsets of the "rows done" notes sent to kLeader since the last look.
  std::vector<uint64_t> rows_done_sent() {
    std::vector<uint64_t> offsets;
    for (const KvTransferActions::Send& send : sends()) {
      const std::optional<kv_wire::Header> h = kv_wire::read_header(send.bytes);
      if (h && h->kind == kv_wire::kRowsDone && send.destination == kLeader)
        offsets.push_back(h->ticket_offset);
    }
    return offsets;
  }

  static std::vector<KvElement> leader_rows(int64_t layer) {
    return rows(kLeader, layer, 0, kPrompt, {kLeader, 0, kHeads});
  }
};

TEST_F(KvTransferCmaPeer, RowsCountOnceRead) {
  start();
  sends();
  send_cma_rows(0, 0);
  const KvTransferActions::CmaRead first = take_read();
  EXPECT_EQ(first.source, kLeader);
  EXPECT_EQ(first.ticket.offset, 0u);
  EXPECT_EQ(first.ticket.bytes, 256u);
  ASSERT_NE(first.into, nullptr);
  EXPECT_EQ(first.heads.count, kHeads);
  EXPECT_FALSE(protocol_.payload_place(kLeader).has_value());  // no MPI payload follows
  read_done(first, leader_rows(0));
  EXPECT_EQ(rows_done_sent(), std::vector<uint64_t>{0});
  send_cma_rows(1, 256);
  read_done(take_read(), leader_rows(1));
  EXPECT_EQ(rows_done_sent(), std::vector<uint64_t>{256});
  EXPECT_TRUE(calls().empty());
  handoff(kLeader, kLayers * kPrompt);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kComplete});
  EXPECT_TRUE(rows_written(kLeader, 0, kPrompt));
  EXPECT_TRUE(rows_written(kLeader, 1, kPrompt));
}

TEST_F(KvTransferCmaPeer, AFailedReadFailsTheImportAndStillFreesTheStaging) {
  start();
  sends();
  send_cma_rows(0, 512);
  read_done(take_read(), {}, "reading rank 1's CMA staging: No such process");
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  EXPECT_NE(failed[0].error.message.find("No such process"), std::string::npos);
  EXPECT_EQ(rows_done_sent(), std::vector<uint64_t>{512});
  // Its later rows are drained, and still answered.
  send_cma_rows(1, 768);
  const KvTransferActions::CmaRead late = take_read();
  EXPECT_EQ(late.into, nullptr);
  read_done(late, {});
  EXPECT_EQ(rows_done_sent(), std::vector<uint64_t>{768});
  EXPECT_TRUE(calls().empty());
}

TEST_F(KvTransferCmaPeer, RowsForNobodyAreAnsweredWithoutAnyRead) {
  send_cma_rows(0, 1024, 0, RequestId{99});
  const KvTransferActions::CmaRead read = take_read();
  EXPECT_EQ(read.into, nullptr);  // nothing to copy: the adapter only answers
  read_done(read, {});
  EXPECT_EQ(rows_done_sent(), std::vector<uint64_t>{1024});
  EXPECT_TRUE(calls().empty());
  EXPECT_EQ(protocol_.rows_dropped(), 1);
}

TEST_F(KvTransferCmaPeer, RowsThatDoNotMatchTheirChecksumFailTheImport) {
  start();
  sends();
  const std::vector<KvElement> good = leader_rows(0);
  send_cma_rows(0, 0, kv_wire::rows_checksum(good));
  read_done(take_read(), good);
  EXPECT_TRUE(calls().empty());
  std::vector<KvElement> bad = leader_rows(1);
  send_cma_rows(1, 256, kv_wire::rows_checksum(bad));
  bad[3] = static_cast<KvElement>(0);
  read_done(take_read(), bad);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("checksum mismatch in layer 1"), std::string::npos)
      << failed[0].error.message;
  EXPECT_EQ(rows_done_sent(), (std::vector<uint64_t>{0, 256}));
}

TEST_F(KvTransferCmaPeer, TheSenderFreesItsStagingOnRowsDone) {
  kv_wire::Header done;
  done.kind = kv_wire::kRowsDone;
  done.ticket_offset = 4096;
  done.ticket_bytes = 256;
  header(2, kv_wire::header_bytes(done));
  ASSERT_EQ(out_.staging_released.size(), 1u);
  EXPECT_EQ(out_.staging_released[0].peer, 2);
  EXPECT_EQ(out_.staging_released[0].ticket.offset, 4096u);
}

}  // namespace
}  // namespace duet
