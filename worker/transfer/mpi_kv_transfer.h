// KvTransfer over MPI point-to-point (worker/transfer/kv_transfer.h), for CPU
// instances on one host (shared memory) or across hosts (TCP), and for GPU
// instances with a DeviceKvLinks (worker/transfer/device_kv_links.h) for the
// pairs whose KV moves device to device (worker/transfer/kv_link.h): their rows
// headers and every control message still go over MPI, their payloads
// through the links (NCCL or CUDA IPC). Any other pair with a GPU side
// moves its rows over MPI through the GPU engine's host staging copy.
//
// It has its own communicator, duplicated from MPI_COMM_WORLD, and no thread
// of its own: it attaches to the control channel's communication thread,
// which calls progress() on every pass, so one thread per process drives
// every non-blocking MPI operation.
//
// On the wire, on tag 1, every message starts with an 80-byte header:
//   rows:    the request, layer, first position and count of one layer of
//            one chunk, the KV heads it carries (and, when checksums are on,
//            the payload's checksum);
//            its payload follows as the next message on tag 2;
//   control: a Cap'n Proto control message (PrefillOrder, Cancel, KvHandoff)
//            after the header.
// The rows are packed on the sending engine thread into a staging buffer
// (one memcpy per block run per head: the sender's blocks are free to be
// reused as soon as send_rows returns) and sent as one contiguous message.
// The receiver, knowing from the header where they go, receives them
// straight into the reserved blocks with one MPI derived datatype
// (hindexed over the block runs, per K/V and head): no receive buffer, no
// second copy. Messages between two ranks keep their order, so a payload is
// always the next tag-2 message from its header's source.
//
// Sends are MPI_Isend from buffers the transfer owns until MPI_Test says
// they are done; headers are received with MPI_Improbe then MPI_Mrecv,
// payloads with MPI_Recv of the datatype.
//
// Device rows: a header of kind "device rows" names the payload's place in
// the sender's staging (a ticket) instead of preceding an MPI payload. The
// receiver starts the links' receipt at once and counts the rows only
// when it completes; an import that ends (fails, is cancelled, expires)
// with receipts in flight reports its end once the last one is done, so
// nothing writes its blocks after on_failed or on_released. When the
// links need the sender to free its staging (IPC), a "rows done" header
// goes back with the ticket.
//
// Threads: see KvTransfer. counters() from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "common/mpi/control_channel.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/device_kv_links.h"
#include "worker/transfer/device_receipts.h"
#include "worker/transfer/kv_transfer.h"

namespace duet {

struct MpiKvTransferOptions {
  // Checksum every rows message on the sender, verify it on the receiver; a
  // mismatch fails the import.
  bool checksums = false;
};

class MpiKvTransfer final : public KvTransfer, private CommEndpoint {
 public:
  // Collective over MPI_COMM_WORLD: every rank constructs one, in the same
  // order relative to other collectives (right after its ControlChannel).
  // `channel` outlives the transfer. `device`: the links for this rank's
  // GPU pairs (null: every pair over MPI).
  MpiKvTransfer(ControlChannel& channel, MpiKvTransferOptions options = {},
                std::unique_ptr<DeviceKvLinks> device = nullptr);
  // Detaches from the thread, gives sends in flight a moment to finish, and
  // frees the communicator. Destroy it before the channel closes.
  ~MpiKvTransfer() override;
  MpiKvTransfer(const MpiKvTransfer&) = delete;
  MpiKvTransfer& operator=(const MpiKvTransfer&) = delete;

  void set_handlers(Handlers handlers) override;
  void start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) override;
  void expect_import(ImportPlan plan) override;
  void abort_import(RequestId id) override;
  void forget_imports(const KvCache& cache) override;
  void send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                 const KvCache& cache, std::span<const int32_t> block_table, int64_t head_offset,
                 const KvSource& heads) override;
  void send_handoff(int decode_peer, const KvHandoff& handoff) override;
  bool device_link(int peer) const override;

  struct Counters {
    int64_t messages_sent = 0;
    int64_t bytes_sent = 0;  // headers and payloads
    int64_t messages_received = 0;
    int64_t bytes_received = 0;
    int64_t rows_dropped = 0;  // rows messages for no live import (aborted or failed)
    int64_t imports_completed = 0;
    int64_t imports_failed = 0;
    int64_t device_bytes_sent = 0;  // rows payloads through the device links
    int64_t device_bytes_received = 0;
  };
  Counters counters() const;

 private:
  struct Outgoing {
    int destination = 0;
    int tag = 0;
    std::vector<std::byte> bytes;  // owned until the send completes
    MPI_Request request = MPI_REQUEST_NULL;
  };
  struct Source {
    KvSource heads;
    int64_t rows_announced = 0;  // positions x layers whose rows headers came
    int64_t rows_received = 0;   // of them, in place (device rows land later)
  };
  struct Import {
    ImportPlan plan;
    std::vector<Source> sources;
    int leader = -1;  // the prefill leader whose handoff ends it; -1: a follower's import
    std::optional<KvHandoff> handoff;

    int64_t rows_expected() const {  // per source
      return (plan.n_prompt - plan.send_from) * plan.cache->layout().n_layers;
    }
    bool all_rows() const;
  };
  struct Start {
    int leader = -1;
    std::optional<PrefillOrder> order;  // a leader's import
    ImportPlan plan;
  };
  // A finished import's outcome, delivered outside the lock.
  struct Outcome {
    RequestId id;
    enum class Kind { kComplete, kFailed, kReleased } kind = Kind::kComplete;
    KvHandoff handoff;
    ServeError error;
  };

  bool progress() override;
  bool in_flight() const override;

  void queue(int destination, int tag, std::vector<std::byte> bytes);  // any thread
  std::vector<std::byte> control_bytes(const ControlMessage& message);
  std::vector<std::byte> take_buffer(size_t size);  // any thread: from the spares
  void process_commands(std::vector<Outcome>& outcomes);
  bool post_sends();
  bool test_sends();
  bool receive_some(std::vector<Outcome>& outcomes);
  void on_rows(int source, std::span<const std::byte> header, std::vector<Outcome>& outcomes);
  // Receives the rows payload that follows a header from `source`: into the
  // import's blocks through a derived datatype, or (`into` null) discarded.
  // False (and discarded) when its size is not the header's.
  bool receive_payload(int source, const Import* into, int64_t layer, int64_t pos0, int64_t n,
                       KvHeads heads);
  // A device rows header: its receipt started (into the import's blocks, or
  // drained when `into` is null).
  void receive_device_rows(int source, std::span<const std::byte> header, Import* into,
                           std::vector<Outcome>& outcomes);
  // The links' finished receipts: rows counted, acks sent, held ends released.
  bool poll_device(std::vector<Outcome>& outcomes);
  // Ends import `it` with `outcome` now, or once its receipts are done.
  void end_import(RequestId id, Outcome outcome, std::vector<Outcome>& outcomes);
  // Completes `id` when its handoff (a leader's) and every row are in.
  void complete_if_done(RequestId id, std::vector<Outcome>& outcomes);
  // Tells the prefill leader of a leader's import that it is withdrawn.
  void cancel_at_source(RequestId id, const Import& import);
  void on_control(int source, std::span<const std::byte> payload, std::vector<Outcome>& outcomes);
  void expire(std::vector<Outcome>& outcomes);
  void fail(RequestId id, ServeError error, std::vector<Outcome>& outcomes);
  void deliver(std::vector<Outcome>& outcomes);

  ControlChannel& channel_;
  const MpiKvTransferOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  const std::unique_ptr<DeviceKvLinks> device_;

  // The communication thread's state: that thread holds the mutex while it
  // works on it; forget_imports takes it from another thread.
  mutable std::mutex state_mutex_;
  std::vector<Outgoing> in_flight_;
  std::map<RequestId, Import> imports_;
  std::map<RequestId, Clock::time_point> gone_;  // aborted or failed: their rows are dropped
  Clock::time_point last_rows_at_{};
  std::vector<std::byte> receive_buffer_;
  std::vector<int> type_lengths_;  // the receive datatype's runs, reused
  std::vector<MPI_Aint> type_addresses_;
  std::vector<KvElement> check_rows_;  // rows repacked to verify a checksum
  DeviceReceipts<Outcome> receipts_;   // device payloads in flight, ends held for them

  // Held while a handler runs and by set_handlers: once that returns, the old
  // handlers are not running and will not run again.
  std::mutex handlers_mutex_;
  Handlers handlers_;  // guarded by handlers_mutex_

  mutable std::mutex mutex_;  // guards the members below
  std::deque<Outgoing> outbox_;
  std::deque<Start> starts_;
  std::deque<RequestId> aborts_;
  std::vector<std::vector<std::byte>> spares_;  // finished send buffers, for reuse
  Counters counters_;
};

}  // namespace duet
