// KvTransferProtocol (worker/transfer/kv_transfer_protocol.h) with rows that
// move through device transfer (rank 1 has one; the fixture,
// tests/worker/transfer/kv_transfer_peer.h, plays the device transfer's receipts): rows count
// when their receipt finishes, and an import that ends with a receipt in
// flight (aborted, failed, expired, forgotten) reports its end only once the
// receipt is done, so nothing writes its blocks after on_failed or
// on_released.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "tests/worker/transfer/kv_transfer_peer.h"
#include "worker/transfer/kv_transfer_protocol.h"

namespace duet {
namespace {

using Kind = KvTransferCall::Kind;

class KvTransferDevicePeer : public KvTransferPeer {
 protected:
  KvTransferDevicePeer() : KvTransferPeer({false, true, false}) {
    // Only its presence matters here: the protocol never touches device memory.
    cache_.set_device_copy(DeviceKv{cache_.data(), 0, nullptr});
  }

  // Rank `source` sends the rows of `layer` through the device transfer's at `ticket`.
  void send_device_rows(int source, int64_t layer, uint64_t ticket) {
    kv_wire::Header h{kv_wire::kMagic, kv_wire::kDeviceRows, kId.value, layer, 0, kPrompt, 0, 0,
                      kHeads};
    h.ticket_offset = ticket;
    h.ticket_bytes = 256;
    header(source, kv_wire::header_bytes(h));
  }

  // The one device receipt the last events asked for.
  KvTransferActions::DeviceReceive take_receive() {
    EXPECT_EQ(out_.device_receives.size(), 1u);
    KvTransferActions::DeviceReceive receive = out_.device_receives.at(0);
    out_.device_receives.clear();
    return receive;
  }

  // The device transfer took the receipt the last events asked for, as `receipt`.
  void receipt_started(uint64_t receipt) {
    const KvTransferActions::DeviceReceive receive = take_receive();
    ASSERT_NE(receive.into, nullptr);
    protocol_.device_receipt_started(receive, receipt, now_);
  }

  void receipt_done(uint64_t receipt, bool ok = true,
                    std::optional<DeviceRowsTicket> ack = std::nullopt) {
    protocol_.device_receipt_done({receipt, kLeader, ok, ack}, now_, out_);
  }
};

TEST_F(KvTransferDevicePeer, RowsCountWhenTheirReceiptsFinish) {
  start();
  sends();
  send_device_rows(kLeader, 0, 0);
  const KvTransferActions::DeviceReceive receive = take_receive();
  EXPECT_EQ(receive.source, kLeader);
  EXPECT_EQ(receive.ticket.offset, 0u);
  EXPECT_NE(receive.into, nullptr);
  EXPECT_FALSE(protocol_.payload_place(kLeader).has_value());  // no MPI payload follows
  EXPECT_EQ(receive.heads.count, kHeads);
  protocol_.device_receipt_started(receive, 1, now_);
  send_device_rows(kLeader, 1, 256);
  receipt_started(2);
  handoff(kLeader, kLayers * kPrompt);  // every header is in; receipts still in flight
  receipt_done(1);
  EXPECT_TRUE(calls().empty());
  receipt_done(2, true, DeviceRowsTicket{256, 256});
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kComplete});
  const std::vector<KvTransferActions::Send> acks = sends();
  ASSERT_EQ(acks.size(), 1u);  // the sender's staging is free again
  EXPECT_EQ(acks[0].destination, kLeader);
  const std::optional<kv_wire::Header> ack = kv_wire::read_header(acks[0].bytes);
  ASSERT_TRUE(ack.has_value());
  EXPECT_EQ(ack->kind, kv_wire::kRowsDone);
  EXPECT_EQ(ack->ticket_offset, 256u);
  EXPECT_TRUE(protocol_.device_receipts_done());
}

TEST_F(KvTransferDevicePeer, AnAbortWaitsForTheReceiptInFlight) {
  start();
  sends();
  send_device_rows(kLeader, 0, 0);
  receipt_started(1);
  protocol_.abort_import(kId, now_, out_);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
  EXPECT_TRUE(calls().empty());  // the payload may still be landing in its blocks
  EXPECT_TRUE(protocol_.holding());
  receipt_done(1);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
  EXPECT_TRUE(protocol_.device_receipts_done());
}

TEST_F(KvTransferDevicePeer, AnExpiredImportReportsItsFailureOnceTheReceiptIsDone) {
  start();
  send_device_rows(kLeader, 0, 0);
  receipt_started(1);
  advance(kPatience);
  EXPECT_TRUE(calls().empty());
  EXPECT_FALSE(protocol_.importing(kId));
  receipt_done(1);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  protocol_.abort_import(kId, now_, out_);  // the owner's withdrawal: released, once
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
}

TEST_F(KvTransferDevicePeer, AReceiptTheLinksRefuseFailsTheImport) {
  start();
  sends();
  send_device_rows(kLeader, 0, 0);
  protocol_.device_receipt_failed(take_receive(), "a ticket of 256 bytes for 512", now_, out_);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.message, "KV transfer: a ticket of 256 bytes for 512");
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
}

TEST_F(KvTransferDevicePeer, ABrokenLinkFailsTheImport) {
  start();
  send_device_rows(kLeader, 0, 0);
  receipt_started(1);
  receipt_done(1, false);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  EXPECT_NE(failed[0].error.message.find("device transfer from rank 1 broke"), std::string::npos);
}

TEST_F(KvTransferDevicePeer, DeviceRowsForNobodyAreDrained) {
  send_device_rows(kLeader, 0, 0);  // no import
  const KvTransferActions::DeviceReceive receive = take_receive();
  EXPECT_EQ(receive.into, nullptr);
  EXPECT_EQ(protocol_.rows_dropped(), 1);
  receipt_done(9);  // a drained receipt is nobody's
  EXPECT_TRUE(out_.empty());
}

TEST_F(KvTransferDevicePeer, DeviceRowsFromARankWithoutALinkAreDropped) {
  start(plan({{kLeader, 0, 1}, {kOther, 1, 2}}));
  sends();
  send_device_rows(kOther, 0, 0);
  EXPECT_TRUE(out_.empty());  // no receipt to start, nothing to drain
  EXPECT_TRUE(protocol_.importing(kId));
}

TEST_F(KvTransferDevicePeer, DeviceRowsIntoACacheWithoutADeviceCopyFailTheImport) {
  cache_.set_device_copy({});
  start();
  sends();
  send_device_rows(kLeader, 0, 0);
  EXPECT_EQ(take_receive().into, nullptr);  // drained
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kFailed});
}

TEST_F(KvTransferDevicePeer, ARowsDoneNoteReleasesTheStaging) {
  kv_wire::Header note;
  note.kind = kv_wire::kRowsDone;
  note.ticket_offset = 512;
  note.ticket_bytes = 128;
  header(kLeader, kv_wire::header_bytes(note));
  ASSERT_EQ(out_.staging_released.size(), 1u);
  EXPECT_EQ(out_.staging_released[0].peer, kLeader);
  EXPECT_EQ(out_.staging_released[0].ticket.offset, 512u);
  EXPECT_EQ(out_.staging_released[0].ticket.bytes, 128u);
}

TEST_F(KvTransferDevicePeer, AForgottenImportsReceiptsStillFinishWithoutAHandler) {
  start();
  send_device_rows(kLeader, 0, 0);
  receipt_started(1);
  sends();
  protocol_.forget_imports(cache_, now_, out_);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
  EXPECT_FALSE(protocol_.device_receipts_done());  // its owner waits for this one
  receipt_done(1);
  EXPECT_TRUE(protocol_.device_receipts_done());
  EXPECT_TRUE(calls().empty());
}

}  // namespace
}  // namespace duet
