// The fixture of KvTransferProtocol's tests: a decode rank's protocol and KV
// cache, and everything around them played by the test: the prefill ranks
// (their wire messages, made with kv_wire), the MPI adapter (a payload lands
// where payload_place says, through unpack_kv_rows, as the adapter's derived
// datatype would put it) and the clock.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "common/cluster/control_messages.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/kv_transfer_protocol.h"
#include "worker/transfer/kv_transfer_wire.h"

namespace duet {

class KvTransferPeer : public ::testing::Test {
 protected:
  using Clock = KvTransfer::Clock;

  static constexpr RequestId kId{7};
  static constexpr int kLeader = 1;  // the prefill leader
  static constexpr int kOther = 2;   // another prefill rank (tensor parallelism)
  static constexpr int64_t kLayers = 2;
  static constexpr int64_t kHeads = 2;
  static constexpr int64_t kHeadDim = 4;
  static constexpr int64_t kPrompt = 8;
  static constexpr std::chrono::seconds kPatience{1};  // from the start to the deadline

  // `device_peers`, `lost_receives`: as KvTransferProtocol's.
  explicit KvTransferPeer(std::vector<bool> device_peers = {},
                          KvTransferProtocol::LostReceives lost_receives =
                              KvTransferProtocol::LostReceives::kQuarantine)
      : protocol_(std::move(device_peers), lost_receives) {}

  static KvLayout test_layout() {
    KvLayout layout;
    layout.n_layers = kLayers;
    layout.n_kv_heads = kHeads;
    layout.head_dim = kHeadDim;
    layout.block_size = 4;
    layout.n_blocks = 8;
    return layout;
  }

  // Positions [0, kPrompt) into blocks 2 and 5, from `sources`.
  KvTransfer::ImportPlan plan(std::vector<KvSource> sources = {{kLeader, 0, kHeads}}) {
    return {kId, 0, kPrompt, std::move(sources), 0, &cache_, {2, 5}, now_ + kPatience};
  }
  // A decode leader's import from kLeader.
  void start(KvTransfer::ImportPlan import) {
    PrefillOrder order;
    order.request.id = import.id;
    protocol_.start_import(kLeader, order, std::move(import), out_);
  }
  void start() { start(plan()); }

  // The rows rank `source` holds for `layer`, positions [pos0, pos0 + n), of
  // the global KV heads `heads`, packed: every element tells its place.
  static std::vector<KvElement> rows(int source, int64_t layer, int64_t pos0, int64_t n,
                                     KvSource heads) {
    std::vector<KvElement> packed;
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t head = heads.head_begin; head < heads.head_end; ++head) {
        for (int64_t pos = pos0; pos < pos0 + n; ++pos) {
          for (int64_t d = 0; d < kHeadDim; ++d) {
            const int64_t place =
                (((source * kLayers + layer) * 2 + kv) * kHeads + head) * kPrompt * kHeadDim +
                pos * kHeadDim + d;
            packed.push_back(static_cast<KvElement>(1 + place));
          }
        }
      }
    }
    return packed;
  }

  static std::vector<std::byte> rows_header(int64_t layer, int64_t pos0, int64_t n, KvSource heads,
                                            uint64_t checksum = 0, RequestId id = kId) {
    return kv_wire::header_bytes({kv_wire::kMagic, kv_wire::kRows, id.value, layer, pos0, n,
                                  checksum, heads.head_begin, heads.head_end});
  }

  void header(int source, std::span<const std::byte> bytes) {
    protocol_.on_message(source, bytes, now_, out_);
  }

  // Rank `source` sends rows: the header arrives now, the payload in land().
  void send_rows(int source, int64_t layer, int64_t pos0, int64_t n,
                 KvSource heads = {kLeader, 0, kHeads}, uint64_t checksum = 0) {
    header(source, rows_header(layer, pos0, n, heads, checksum));
    in_transit_[source].push_back(rows(source, layer, pos0, n, heads));
  }

  // The next payload from `source` lands (`payload`, or what send_rows sent):
  // into the blocks the protocol names, or drained. True: into the blocks.
  bool land(int source, std::optional<std::vector<KvElement>> payload = std::nullopt) {
    if (!payload && !in_transit_[source].empty()) {
      payload = std::move(in_transit_[source].front());
      in_transit_[source].pop_front();
    }
    const std::optional<KvTransferProtocol::PayloadPlace> place = protocol_.payload_place(source);
    if (!place) {
      ADD_FAILURE() << "no payload expected from rank " << source;
      return false;
    }
    const std::vector<KvElement> elements = payload.value_or(std::vector<KvElement>{});
    const bool whole = place->into != nullptr &&
                       static_cast<int64_t>(elements.size() * sizeof(KvElement)) == place->bytes;
    if (whole) {
      unpack_kv_rows(cache_.layout(), cache_.data(), place->layer, place->into->block_table,
                     place->pos0, place->n, place->heads, elements.data());
    }
    protocol_.payload_landed(source, whole, now_, out_);
    return whole;
  }

  // Whether the cache holds what `source` sent of `layer`, positions
  // [0, n), of `heads`.
  bool rows_written(int source, int64_t layer, int64_t n, KvSource heads = {kLeader, 0, kHeads}) {
    std::vector<KvElement> held(static_cast<size_t>(packed_kv_elems(
        cache_.layout(), n, {heads.head_begin, heads.head_end - heads.head_begin})));
    const std::vector<int32_t> table{2, 5};
    pack_kv_rows(cache_.layout(), cache_.data(), layer, table, 0, n,
                 {heads.head_begin, heads.head_end - heads.head_begin}, held.data());
    return held == rows(source, layer, 0, n, heads);
  }

  void handoff(int source, int64_t rows_sent) {
    KvHandoff handoff{kId};
    handoff.first_token = 42;
    handoff.rows_sent = rows_sent;
    header(source, kv_wire::control_bytes(handoff));
  }

  // The clock moves on by `step`; the protocol hears of it.
  void advance(Clock::duration step) {
    now_ += step;
    protocol_.expire(now_, out_);
  }

  // The handler calls (or sends) since the last look.
  std::vector<KvTransferCall> calls() { return std::exchange(out_.calls, {}); }
  std::vector<KvTransferActions::Send> sends() { return std::exchange(out_.sends, {}); }

  static std::vector<KvTransferCall::Kind> kinds(const std::vector<KvTransferCall>& calls) {
    std::vector<KvTransferCall::Kind> kinds;
    for (const KvTransferCall& call : calls) kinds.push_back(call.kind);
    return kinds;
  }

  // The control message a send carries; nullopt for a bare header.
  static std::optional<ControlMessage> control_in(const KvTransferActions::Send& send) {
    const std::optional<kv_wire::Header> header = kv_wire::read_header(send.bytes);
    if (!header || header->kind != kv_wire::kControl) return std::nullopt;
    return decode_control_message(std::span(send.bytes).subspan(sizeof(kv_wire::Header)));
  }

  // The ranks the cancels among the sends since the last look went to.
  std::vector<int> cancels_sent() {
    std::vector<int> ranks;
    for (const KvTransferActions::Send& send : sends()) {
      const std::optional<ControlMessage> message = control_in(send);
      if (message && std::holds_alternative<Cancel>(*message)) ranks.push_back(send.destination);
    }
    return ranks;
  }

  KvCache cache_{test_layout()};
  KvTransferProtocol protocol_;
  KvTransferActions out_;
  Clock::time_point now_ = Clock::time_point{} + std::chrono::hours(1);
  std::map<int, std::deque<std::vector<KvElement>>> in_transit_;  // payloads sent, not landed
};

}  // namespace duet
