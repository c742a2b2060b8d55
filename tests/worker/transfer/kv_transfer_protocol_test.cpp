// KvTransferProtocol (worker/transfer/kv_transfer_protocol.h) without MPI,
// rows over MPI (the fixture, tests/worker/transfer/kv_transfer_peer.h, plays the
// prefill ranks, the adapter and the clock). Every failure path of an
// import: a deadline passing with rows missing, rows for an import already
// over, a checksum mismatch, a payload of the wrong size, cancels from either
// side, a handoff before all rows, rows headers twice, out of order or
// outside the plan, a peer that never answers.
#include "worker/transfer/kv_transfer_protocol.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "tests/worker/transfer/kv_transfer_peer.h"
#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

using Kind = KvTransferCall::Kind;

TEST_F(KvTransferPeer, CompletesOnceEveryRowAndTheHandoffAreIn) {
  start();
  ASSERT_EQ(out_.sends.size(), 1u);  // the order, to the prefill leader
  EXPECT_EQ(out_.sends[0].destination, kLeader);
  const std::optional<ControlMessage> order = control_in(out_.sends[0]);
  ASSERT_TRUE(order && std::holds_alternative<PrefillOrder>(*order));
  EXPECT_EQ(std::get<PrefillOrder>(*order).request.id, kId);
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    for (int64_t pos0 = 0; pos0 < kPrompt; pos0 += 4) {
      send_rows(kLeader, layer, pos0, 4);
      EXPECT_TRUE(land(kLeader));
    }
  }
  EXPECT_TRUE(calls().empty());  // every row, but no handoff yet
  handoff(kLeader, kLayers * kPrompt);
  const std::vector<KvTransferCall> done = calls();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].kind, Kind::kComplete);
  EXPECT_EQ(done[0].handoff.first_token, 42);
  EXPECT_TRUE(rows_written(kLeader, 0, kPrompt));
  EXPECT_TRUE(rows_written(kLeader, 1, kPrompt));
  EXPECT_FALSE(protocol_.importing(kId));
}

TEST_F(KvTransferPeer, AHandoffAheadOfItsPayloadsWaitsForThemToLand) {
  start();
  for (int64_t layer = 0; layer < kLayers; ++layer) send_rows(kLeader, layer, 0, kPrompt);
  handoff(kLeader, kLayers * kPrompt);  // the headers came; the payloads are behind
  EXPECT_TRUE(calls().empty());
  EXPECT_TRUE(protocol_.fast_poll(now_ + std::chrono::seconds(1)));
  EXPECT_TRUE(land(kLeader));
  EXPECT_TRUE(calls().empty());
  EXPECT_TRUE(land(kLeader));
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kComplete});
}

TEST_F(KvTransferPeer, RowsHeadersOutOfOrderAreCounted) {
  start();
  send_rows(kLeader, 1, 4, 4);
  send_rows(kLeader, 0, 4, 4);
  send_rows(kLeader, 1, 0, 4);
  send_rows(kLeader, 0, 0, 4);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(land(kLeader));
  handoff(kLeader, kLayers * kPrompt);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kComplete});
  EXPECT_TRUE(rows_written(kLeader, 0, kPrompt));
}

TEST_F(KvTransferPeer, ADeadlinePassingWithRowsMissingFailsTheImportOnce) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  EXPECT_TRUE(land(kLeader));
  sends();
  advance(kPatience - std::chrono::milliseconds(1));
  EXPECT_TRUE(calls().empty());
  advance(std::chrono::milliseconds(1));
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  EXPECT_NE(failed[0].error.message.find("rows missing from rank(s): 1"), std::string::npos);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});  // the prefill side stops too
  // Nothing ends twice: no second failure, no second cancel; the owner's
  // abort afterwards is answered once, and late rows are never written.
  advance(kPatience);
  protocol_.abort_import(kId, now_, out_);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
  EXPECT_TRUE(cancels_sent().empty());
  send_rows(kLeader, 1, 0, kPrompt);
  EXPECT_FALSE(land(kLeader));
  EXPECT_FALSE(rows_written(kLeader, 1, kPrompt));
  EXPECT_EQ(protocol_.rows_dropped(), 1);
  EXPECT_TRUE(calls().empty());
}

TEST_F(KvTransferPeer, APeerThatNeverAnswersFailsAtTheDeadline) {
  KvTransfer::ImportPlan tp = plan({{kLeader, 0, 1}, {kOther, 1, 2}});
  start(std::move(tp));
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    send_rows(kLeader, layer, 0, kPrompt, {kLeader, 0, 1});
    EXPECT_TRUE(land(kLeader));
  }
  handoff(kLeader, kLayers * kPrompt);
  EXPECT_TRUE(calls().empty());  // rank 2's heads never come
  advance(kPatience);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("rows missing from rank(s): 2"), std::string::npos);
  EXPECT_FALSE(protocol_.fast_poll(now_));
}

TEST_F(KvTransferPeer, RowsOfAnAbortedImportAreDrainedNeverWritten) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);  // its payload is on its way
  sends();
  protocol_.abort_import(kId, now_, out_);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
  EXPECT_FALSE(land(kLeader));  // drained
  send_rows(kLeader, 1, 0, kPrompt);
  EXPECT_FALSE(land(kLeader));
  EXPECT_FALSE(rows_written(kLeader, 0, kPrompt));
  EXPECT_FALSE(rows_written(kLeader, 1, kPrompt));
  handoff(kLeader, kLayers * kPrompt);
  EXPECT_TRUE(calls().empty());
  EXPECT_FALSE(protocol_.payload_place(kLeader).has_value());
}

TEST_F(KvTransferPeer, RowsOfAForgottenImportAreDrainedWithoutAHandler) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  sends();
  protocol_.forget_imports(cache_, now_, out_);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
  EXPECT_FALSE(land(kLeader));
  EXPECT_FALSE(rows_written(kLeader, 0, kPrompt));
  EXPECT_TRUE(calls().empty());
  EXPECT_TRUE(protocol_.device_receipts_done());
}

TEST_F(KvTransferPeer, AnImportOfTheSameIdAfterAnAbortGetsNoneOfTheOldRows) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);  // for the first import
  protocol_.abort_import(kId, now_, out_);
  start();
  EXPECT_FALSE(land(kLeader));  // the old payload: drained
  send_rows(kLeader, 0, 0, kPrompt);
  EXPECT_TRUE(land(kLeader));
}

TEST_F(KvTransferPeer, AChecksumMismatchFailsTheImport) {
  start();
  const std::vector<KvElement> good = rows(kLeader, 0, 0, kPrompt, {kLeader, 0, kHeads});
  send_rows(kLeader, 0, 0, kPrompt, {kLeader, 0, kHeads}, kv_wire::rows_checksum(good));
  EXPECT_TRUE(land(kLeader));
  EXPECT_TRUE(calls().empty());
  std::vector<KvElement> bad = rows(kLeader, 1, 0, kPrompt, {kLeader, 0, kHeads});
  const uint64_t sum = kv_wire::rows_checksum(bad);
  bad[5] ^= 1;  // one bit flipped on the way
  header(kLeader, rows_header(1, 0, kPrompt, {kLeader, 0, kHeads}, sum));
  EXPECT_TRUE(land(kLeader, bad));
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("checksum mismatch in layer 1"), std::string::npos);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
}

TEST_F(KvTransferPeer, APayloadNotTheSizeItsHeaderSaysFailsTheImport) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  const std::optional<KvTransferProtocol::PayloadPlace> place = protocol_.payload_place(kLeader);
  ASSERT_TRUE(place && place->into != nullptr);
  EXPECT_EQ(place->bytes, 2 * kHeads * kPrompt * kHeadDim * 2);
  protocol_.payload_landed(kLeader, false, now_, out_);  // drained by the adapter
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("not the size"), std::string::npos);
}

TEST_F(KvTransferPeer, TheDecodeSideCancelsAtThePrefillLeader) {
  start();
  sends();
  protocol_.abort_import(kId, now_, out_);
  ASSERT_EQ(out_.sends.size(), 1u);
  const std::optional<ControlMessage> cancel = control_in(out_.sends[0]);
  ASSERT_TRUE(cancel && std::holds_alternative<Cancel>(*cancel));
  EXPECT_EQ(std::get<Cancel>(*cancel).id, kId);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
  // An abort of an import that already ended releases at once, cancels nothing.
  sends();
  protocol_.abort_import(RequestId{99}, now_, out_);
  EXPECT_TRUE(out_.sends.empty());
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
}

TEST_F(KvTransferPeer, ThePrefillSideCancelsAnOrderOrFailsAnImport) {
  // Prefill side: the decode peer withdrew an order.
  protocol_.on_message(3, kv_wire::control_bytes(Cancel{RequestId{5}}), now_, out_);
  const std::vector<KvTransferCall> withdrawn = calls();
  ASSERT_EQ(kinds(withdrawn), std::vector<Kind>{Kind::kCancel});
  EXPECT_EQ(withdrawn[0].peer, 3);
  EXPECT_EQ(withdrawn[0].id, RequestId{5});
  // Decode side: the prefill side gave up on the order.
  start();
  sends();
  KvHandoff refusal{kId};
  refusal.error = ServeError{ServeErrorKind::kOverloaded, "prefill queue full"};
  header(kLeader, kv_wire::control_bytes(refusal));
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kOverloaded);
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});
}

TEST_F(KvTransferPeer, AHandoffBeforeAllRowsFailsTheImport) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);  // layer 1 never sent: the handoff is behind it
  EXPECT_TRUE(land(kLeader));
  handoff(kLeader, kLayers * kPrompt);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("8 rows arrived and 16 were sent, 16 expected"),
            std::string::npos);
}

TEST_F(KvTransferPeer, AHandoffFromAnotherRankIsIgnored) {
  start();
  handoff(kOther, 0);
  EXPECT_TRUE(calls().empty());
  EXPECT_TRUE(protocol_.importing(kId));
}

TEST_F(KvTransferPeer, RowsThatCameTwiceFailTheImport) {
  start();
  send_rows(kLeader, 0, 0, 4);
  EXPECT_TRUE(land(kLeader));
  send_rows(kLeader, 0, 0, 4);  // the same header again
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("came twice"), std::string::npos);
  EXPECT_FALSE(land(kLeader));  // its payload: drained
}

TEST_F(KvTransferPeer, RowsOverlappingEarlierOnesFailTheImport) {
  start();
  send_rows(kLeader, 1, 4, 4);
  send_rows(kLeader, 1, 2, 4);  // positions 4 and 5 again
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kFailed});
}

TEST_F(KvTransferPeer, RowsOutsideThePlanFailTheImport) {
  const auto malformed = [&](int source, int64_t layer, int64_t pos0, int64_t n, KvSource heads) {
    start();
    sends();
    header(source, rows_header(layer, pos0, n, heads));
    const std::vector<KvTransferCall> failed = calls();
    EXPECT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
    EXPECT_FALSE(land(source));  // drained
    return failed.empty() ? std::string() : failed[0].error.message;
  };
  EXPECT_NE(malformed(kLeader, kLayers, 0, 4, {kLeader, 0, kHeads}).find("malformed rows header"),
            std::string::npos);
  malformed(kLeader, 0, kPrompt - 2, 4, {kLeader, 0, kHeads});  // past the prompt
  malformed(kLeader, 0, 0, 0, {kLeader, 0, kHeads});            // no rows
  malformed(kLeader, 0, 0, 4, {kLeader, 0, 1});                 // not the plan's heads
  malformed(kOther, 0, 0, 4, {kOther, 0, kHeads});              // not a source
}

TEST_F(KvTransferPeer, MessagesThatAreNotOursOrForNobodyAreDropped) {
  protocol_.on_message(kLeader, std::vector<std::byte>(12), now_, out_);
  std::vector<std::byte> garbage = kv_wire::control_bytes(Cancel{kId});
  garbage.resize(garbage.size() - 8);
  protocol_.on_message(kLeader, garbage, now_, out_);
  send_rows(kLeader, 0, 0, 4);  // no import
  EXPECT_FALSE(land(kLeader));
  EXPECT_EQ(protocol_.rows_dropped(), 1);
  EXPECT_TRUE(out_.empty());
}

TEST_F(KvTransferPeer, AFollowerCompletesOnItsRowsAlone) {
  protocol_.start_import(-1, std::nullopt, plan({{kLeader, 1, 2}, {kOther, 0, 1}}), out_);
  EXPECT_TRUE(out_.sends.empty());  // no order: its leader sent it
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    send_rows(kOther, layer, 0, kPrompt, {kOther, 0, 1});
    send_rows(kLeader, layer, 0, kPrompt, {kLeader, 1, 2});
  }
  for (int i = 0; i < kLayers; ++i) EXPECT_TRUE(land(kOther));
  EXPECT_TRUE(calls().empty());
  for (int i = 0; i < kLayers; ++i) EXPECT_TRUE(land(kLeader));
  const std::vector<KvTransferCall> done = calls();
  ASSERT_EQ(kinds(done), std::vector<Kind>{Kind::kComplete});
  EXPECT_EQ(done[0].handoff.id, kId);
  EXPECT_EQ(done[0].handoff.first_token, -1);
  EXPECT_TRUE(rows_written(kOther, 0, kPrompt, {kOther, 0, 1}));
  EXPECT_TRUE(rows_written(kLeader, 1, kPrompt, {kLeader, 1, 2}));
}

TEST_F(KvTransferPeer, AnOrderReachesThePrefillSide) {
  PrefillOrder order;
  order.request.id = RequestId{11};
  order.send_from = 3;
  protocol_.on_message(4, kv_wire::control_bytes(order), now_, out_);
  const std::vector<KvTransferCall> orders = calls();
  ASSERT_EQ(kinds(orders), std::vector<Kind>{Kind::kOrder});
  EXPECT_EQ(orders[0].peer, 4);
  EXPECT_EQ(orders[0].order.send_from, 3);
}

// ---------------------------------------------------------------- lost peers

TEST_F(KvTransferPeer, ALostPrefillLeaderFailsItsImportUnavailable) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  EXPECT_TRUE(land(kLeader));
  send_rows(kLeader, 1, 0, kPrompt);  // announced, never to come
  sends();
  const std::vector<int> lost = {kLeader};
  protocol_.peers_lost(lost, now_, out_);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  EXPECT_NE(failed[0].error.message.find("rank(s) 1 lost"), std::string::npos);
  EXPECT_FALSE(protocol_.importing(kId));
  EXPECT_FALSE(protocol_.payload_place(kLeader).has_value());  // nothing more expected
  EXPECT_EQ(protocol_.imports_quarantined(), 0);
}

TEST_F(KvTransferPeer, AnotherRanksLossLeavesTheImportAlone) {
  start();
  const std::vector<int> lost = {5};
  protocol_.peers_lost(lost, now_, out_);
  EXPECT_TRUE(calls().empty());
  EXPECT_TRUE(protocol_.importing(kId));
}

TEST_F(KvTransferPeer, ALostRowsSourceOfATensorParallelImportFailsIt) {
  start(plan({{kLeader, 0, 1}, {kOther, 1, 2}}));
  const std::vector<int> lost = {kOther};
  protocol_.peers_lost(lost, now_, out_);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(cancels_sent(), std::vector<int>{kLeader});  // the live leader stops too
}

TEST_F(KvTransferPeer, AnImportStartedTowardALostRankFailsAtTheNextExpire) {
  const std::vector<int> lost = {kLeader};
  protocol_.peers_lost(lost, now_, out_);
  start();
  EXPECT_TRUE(calls().empty());
  advance(std::chrono::milliseconds(1));
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kFailed});
}

TEST_F(KvTransferPeer, APayloadHalfReceivedFromALostRankQuarantinesTheImport) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  protocol_.payload_receiving(kLeader);  // MPI is writing the blocks...
  const std::vector<int> lost = {kLeader};
  protocol_.peers_lost(lost, now_, out_);  // ...and never will finish
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kQuarantined});
  EXPECT_EQ(protocol_.imports_quarantined(), 1);
  protocol_.abort_import(kId, now_, out_);  // the engine's cancel: no release, ever
  advance(std::chrono::minutes(10));
  EXPECT_TRUE(calls().empty());
}

// An adapter that owns its receive buffers (its own socket) stops the
// receive when the rank is lost: nothing more is written, so the import
// fails as any other waiting on a lost rank, and its blocks come back.
class KvTransferStoppingPeer : public KvTransferPeer {
 protected:
  KvTransferStoppingPeer() : KvTransferPeer({}, KvTransferProtocol::LostReceives::kStop) {}
};

TEST_F(KvTransferStoppingPeer, APayloadHalfReceivedFromALostRankFailsTheImport) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  protocol_.payload_receiving(kLeader);
  const std::vector<int> lost = {kLeader};
  protocol_.peers_lost(lost, now_, out_);
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_EQ(failed[0].error.kind, ServeErrorKind::kUnavailable);
  EXPECT_EQ(protocol_.imports_quarantined(), 0);
  EXPECT_FALSE(protocol_.payload_place(kLeader).has_value());  // nothing more from it
}

TEST_F(KvTransferStoppingPeer, AnAbortHeldForAPayloadFromALostRankReleasesAtTheLoss) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  protocol_.payload_receiving(kLeader);
  protocol_.abort_import(kId, now_, out_);
  EXPECT_TRUE(calls().empty());  // held while the payload arrives
  const std::vector<int> lost = {kLeader};
  protocol_.peers_lost(lost, now_, out_);
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
  advance(std::chrono::minutes(10));
  EXPECT_TRUE(calls().empty());
}

TEST_F(KvTransferPeer, AnAbortWhileAPayloadArrivesReleasesOnceItLands) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  protocol_.payload_receiving(kLeader);
  protocol_.abort_import(kId, now_, out_);
  EXPECT_TRUE(calls().empty());      // MPI still writes its blocks
  advance(std::chrono::seconds(5));  // past its deadline: still held, not failed
  EXPECT_TRUE(calls().empty());
  EXPECT_FALSE(land(kLeader));  // landed (drained: nobody wants it now)
  EXPECT_EQ(kinds(calls()), std::vector<Kind>{Kind::kReleased});
}

TEST_F(KvTransferPeer, AFailureWhileAPayloadArrivesIsReportedOnceItLands) {
  start();
  send_rows(kLeader, 0, 0, kPrompt);
  protocol_.payload_receiving(kLeader);
  advance(kPatience);  // the deadline passes with the payload still arriving
  EXPECT_TRUE(calls().empty());
  EXPECT_FALSE(land(kLeader));
  const std::vector<KvTransferCall> failed = calls();
  ASSERT_EQ(kinds(failed), std::vector<Kind>{Kind::kFailed});
  EXPECT_NE(failed[0].error.message.find("did not complete in time"), std::string::npos);
}

}  // namespace
}  // namespace duet
