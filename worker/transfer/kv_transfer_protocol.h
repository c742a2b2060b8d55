// The KV transfer's rules (worker/transfer/kv_transfer.h), decode side and
// prefill side, without I/O: a state machine that an adapter (MpiKvTransfer,
// TcpKvTransfer) feeds with events (commands, messages and payloads from
// ranks, device receipts, CMA reads, lost peers, time) and that answers with
// actions (KvTransferActions), carried out before the next event. Events that
// may look at the clock take `now`, the caller's time (tests use milliseconds).
//
// Every rule that decides an import's fate from what arrives, or fails to
// arrive by when, lives here: where its rows go, which rows of which source
// came (a rows header twice, or one outside the plan, fails it), each payload's
// size and checksum, the handoff, and its end (complete, failed, released),
// reported once. An import that ends with device receipts in flight reports its
// end once the last one is done, so nothing writes its blocks after on_failed
// or on_released. Requests gone are remembered a while; their late rows drop quietly.
//
// Not thread-safe: the adapter's communication thread owns it, and the
// adapter's lock guards it when another thread forgets imports.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/serving.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/device/device_kv_link.h"
#include "worker/transfer/device/device_receipts.h"
#include "worker/transfer/kv_transfer.h"
#include "worker/transfer/kv_transfer_wire.h"

namespace duet {

// A handler of KvTransfer::Handlers to call, with its arguments.
struct KvTransferCall {
  // kQuarantined: the import failed with rows from a lost rank half-received
  // into its blocks; MPI may write them at any time, so they are never freed.
  enum class Kind { kOrder, kCancel, kComplete, kFailed, kReleased, kQuarantined };
  Kind kind = Kind::kComplete;
  RequestId id;
  int peer = -1;       // kOrder, kCancel: the rank the message came from
  PrefillOrder order;  // kOrder
  KvHandoff handoff;   // kComplete
  ServeError error;    // kFailed
};

struct KvTransferActions {
  // A header or control message (kv_wire::kHeaderTag, the control lane).
  struct Send {
    int destination = 0;
    std::vector<std::byte> bytes;
  };
  // Start the device transfer' receipt of a device rows payload from `source`:
  // into `into`'s blocks, then tell the protocol device_receipt_started (or
  // device_receipt_failed); or, `into` null, drain it (nobody wants it).
  // `into` is valid until the next event; an event asks for one at most.
  struct DeviceReceive {
    int source = 0;
    RequestId id;
    DeviceRowsTicket ticket;
    const KvTransfer::ImportPlan* into = nullptr;
    int64_t layer = 0;
    int64_t pos0 = 0;
    int64_t n = 0;
    KvHeads heads;          // of `into`'s cache
    uint64_t checksum = 0;  // CMA reads: the rows' checksum (0: none)
  };
  // Copy a CMA rows payload out of `source`'s staging
  // (worker/transfer/cma_staging.h) into `into`'s blocks, or, `into` null,
  // nothing (nobody wants it); then tell the protocol cma_read_done, which
  // answers "rows done". The fields are a device receipt's.
  using CmaRead = DeviceReceive;
  // The device transfer' staging `ticket` at `peer` is free again (sender side).
  struct StagingReleased {
    int peer = 0;
    DeviceRowsTicket ticket;
  };

  std::vector<Send> sends;
  std::vector<DeviceReceive> device_receives;
  std::vector<CmaRead> cma_reads;
  std::vector<StagingReleased> staging_released;
  std::vector<KvTransferCall> calls;  // in order, outside the adapter's locks

  bool empty() const {
    return sends.empty() && device_receives.empty() && cma_reads.empty() &&
           staging_released.empty() && calls.empty();
  }
};

class KvTransferProtocol {
 public:
  using Clock = KvTransfer::Clock;
  using ImportPlan = KvTransfer::ImportPlan;
  using Actions = KvTransferActions;

  // What becomes of an import whose payload from a rank that is lost was
  // being received into its blocks.
  enum class LostReceives {
    // The receive may still write the blocks at any time (MPI owns it): the
    // import ends kQuarantined, its blocks never released.
    kQuarantine,
    // The adapter stops the receive itself when it learns of the loss (its
    // own socket, closed): the import fails kUnavailable, and an end it held
    // for the payload (released, failed) is reported at once.
    kStop,
  };

  // `device_peers[r]`: rows to or from world rank r move through the device
  // transfer (ranks past its end do not).
  explicit KvTransferProtocol(std::vector<bool> device_peers = {},
                              LostReceives lost_receives = LostReceives::kQuarantine);

  // ---------------------------------------------------------------- commands
  // A decode leader's import (`order` for `leader`, sent at once) or, with
  // no order, a decode follower's (`leader` -1: it completes on its rows
  // alone). Registered before the order leaves, so its rows find it.
  void start_import(int leader, std::optional<PrefillOrder> order, ImportPlan plan, Actions& out);
  // The import is withdrawn: its prefill leader is told (Cancel), and
  // on_released follows once nothing writes its blocks any more (at once,
  // for an import already over).
  void abort_import(RequestId id, Clock::time_point now, Actions& out);
  // Ends every import into `cache` without a handler call; their prefill
  // leaders are told. Device receipts in flight into `cache` may still land
  // (the caller waits for device_receipts_done()).
  void forget_imports(const KvCache& cache, Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- messages
  // A message on the header tag from `source`.
  void on_message(int source, std::span<const std::byte> bytes, Clock::time_point now,
                  Actions& out);

  // Where the next rows payload from `source` goes: `into`'s blocks (and
  // `bytes`, its size by its header), or nowhere (`into` null: its import
  // is over or never was; drain it). Nullopt: no payload is expected from
  // `source`.
  struct PayloadPlace {
    const ImportPlan* into = nullptr;  // valid until the next event
    int64_t layer = 0;
    int64_t pos0 = 0;
    int64_t n = 0;
    KvHeads heads;      // of `into`'s cache
    int64_t bytes = 0;  // the packed rows' size
  };
  std::optional<PayloadPlace> payload_place(int source) const;
  // The ranks payloads are expected from, in rank order.
  std::vector<int> payload_sources() const;
  // The payload payload_place(source) placed is being received into its
  // import's blocks (a receive MPI finishes later): until payload_landed,
  // the import's end (failed, released) is held, so that nothing frees the
  // blocks while MPI may write them.
  void payload_receiving(int source);
  // The payload payload_place(source) placed has been received: into the
  // blocks (`whole`), or drained (not whole: not the size its header said,
  // or nobody wanted it).
  void payload_landed(int source, bool whole, Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- device receipts
  void device_receipt_started(const Actions::DeviceReceive& receive, uint64_t receipt,
                              Clock::time_point now);
  // The device transfer refused the payload (their error `why`); it was drained.
  void device_receipt_failed(const Actions::DeviceReceive& receive, const std::string& why,
                             Clock::time_point now, Actions& out);
  void device_receipt_done(const DeviceKvLink::Done& done, Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- CMA reads
  // The adapter has carried out `read` (in the same event: its import is
  // still live): every byte in place (`error` nullopt), or why not. The
  // sender is answered "rows done" either way.
  void cma_read_done(const Actions::CmaRead& read, const std::optional<std::string>& error,
                     Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- lost peers
  // `ranks` are lost (the coordinator's word, coordinator/cluster/liveness.h):
  // every import that waits on one of them (its prefill leader, or a source
  // of its rows) fails kUnavailable (now, or for an import started later, at
  // the next expire), and no payload is expected from them any more. An
  // import whose payload from one of them was being received
  // (payload_receiving) ends kQuarantined instead: MPI may still write its
  // blocks, so they are never released (abort_import does nothing for it);
  // with LostReceives::kStop the adapter has stopped that receive before it
  // calls this, so the import fails (or releases) as any other.
  void peers_lost(std::span<const int> ranks, Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- time
  // Fails the imports whose deadline has passed; forgets gone requests after
  // a while.
  void expire(Clock::time_point now, Actions& out);

  // ---------------------------------------------------------------- state
  // Whether the communication thread should poll fast: payloads are expected
  // for a live import, rows came a moment ago (more follow as the prefill
  // side computes), or an import has all its rows (its handoff comes within
  // one layer's compute).
  bool fast_poll(Clock::time_point now) const;
  // Ended imports waiting for their device receipts.
  bool holding() const { return receipts_.holding(); }
  // No device receipt in flight, no end held for one.
  bool device_receipts_done() const { return receipts_.empty(); }
  bool importing(RequestId id) const { return imports_.contains(id); }
  // Rows messages for no live import (aborted, failed, or never known).
  int64_t rows_dropped() const { return rows_dropped_; }
  int64_t imports_quarantined() const { return static_cast<int64_t>(quarantined_.size()); }

 private:
  struct Source {
    KvSource heads;
    int64_t rows_announced = 0;  // positions x layers whose rows headers came
    int64_t rows_received = 0;   // of them, in place (payloads land later)
    std::map<std::pair<int64_t, int64_t>, int64_t> arrived;  // (layer, pos0) -> end, by header

    // Records the header of rows [pos0, pos0 + n) of `layer`; false when
    // some of them came already.
    bool arrive(int64_t layer, int64_t pos0, int64_t n);
  };
  struct Import {
    ImportPlan plan;
    uint64_t serial = 0;  // tells apart two imports of one id, one after the other
    std::vector<Source> sources;
    int leader = -1;  // the prefill leader whose handoff ends it; -1: a follower's import
    std::optional<KvHandoff> handoff;

    int64_t rows_expected() const;  // per source
    bool all_rows() const;
    Source* source(int rank);
  };
  // A rows payload announced by its header and not yet landed.
  struct ExpectedPayload {
    RequestId id;
    uint64_t serial = 0;  // 0: nobody's (drained)
    int64_t layer = 0;
    int64_t pos0 = 0;
    int64_t n = 0;
    KvHeads heads;
    uint64_t checksum = 0;
  };

  void on_rows(int source, const kv_wire::Header& header, Clock::time_point now, Actions& out);
  void land(int source, bool whole, Clock::time_point now, Actions& out);  // payload_landed's work
  void on_control(int source, std::span<const std::byte> payload, Clock::time_point now,
                  Actions& out);
  void on_handoff(int source, const KvHandoff& handoff, Clock::time_point now, Actions& out);
  // What the header's payload needs when nobody takes it: drained.
  void drain(int source, const kv_wire::Header& header, Actions& out);
  // Whether the header fits its import's plan (source, heads, positions).
  bool fits(const Import& import, int source, const kv_wire::Header& header) const;
  // The import a payload is for, while it lasts.
  const Import* live(const ExpectedPayload& payload) const;
  // Whether rows [pos0, pos0 + n) of `layer` (`heads`) in `import`'s blocks
  // have `checksum` (0: not checked); fails the import if not.
  bool rows_match(const Import& import, int source, int64_t layer, int64_t pos0, int64_t n,
                  KvHeads heads, uint64_t checksum, Clock::time_point now, Actions& out);
  // Counts `n` rows of `source` in place; completes the import if they were its last.
  void rows_in_place(RequestId id, int source, int64_t n, Clock::time_point now, Actions& out);
  void complete_if_done(RequestId id, Actions& out);
  // Ends import `id` with `call` now, or once its device receipts are done.
  void end_import(RequestId id, KvTransferCall call, Actions& out);
  void fail(RequestId id, ServeError error, Clock::time_point now, Actions& out);
  // Fails import `id` when it waits on a lost rank.
  void fail_if_lost(RequestId id, Clock::time_point now, Actions& out);
  // Removes a live import: its prefill leader is told, its late rows dropped.
  void withdraw(std::map<RequestId, Import>::iterator it, Clock::time_point now, Actions& out);
  bool device_transfer(int rank) const;

  const std::vector<bool> device_peers_;
  const LostReceives lost_receives_;
  std::map<RequestId, Import> imports_;
  uint64_t next_serial_ = 1;
  std::map<int, std::deque<ExpectedPayload>> payloads_;  // by source rank, in header order
  std::map<RequestId, Clock::time_point> gone_;  // aborted or failed: their rows are dropped
  Clock::time_point last_rows_at_{};
  std::vector<KvElement> check_rows_;        // rows repacked to verify a checksum
  DeviceReceipts<KvTransferCall> receipts_;  // device payloads in flight, ends held for them
  int64_t rows_dropped_ = 0;
  std::set<int> lost_;                  // ranks the coordinator said are lost
  std::set<RequestId> quarantined_;     // imports whose blocks are never released
  std::map<int, RequestId> receiving_;  // by source: the import its payload is being received into
  std::map<RequestId, KvTransferCall> held_ends_;  // ends waiting for such a payload
};

// Calls `run(address, bytes)` for each run of the blocks a payload fills, in
// the packed order (worker/kv/kv_rows.h): where an adapter
// receives the payload straight into the blocks (an MPI datatype, a readv).
template <typename Run>
void for_each_payload_run(const KvTransferProtocol::PayloadPlace& place, Run&& run) {
  const KvTransfer::ImportPlan& plan = *place.into;
  for_each_packed_run(plan.cache->layout(), place.layer, plan.block_table, place.pos0, place.n,
                      place.heads, [&](int64_t at, int64_t elems) {
                        run(plan.cache->data() + at,
                            static_cast<size_t>(elems) * sizeof(KvElement));
                      });
}

}  // namespace duet
