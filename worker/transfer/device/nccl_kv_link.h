// DeviceKvLink (worker/transfer/device/device_kv_link.h) between GPUs of
// different hosts (or of one host, by choice), over NCCL point-to-point.
//
// Each peer has its own two-rank communicator (made at start, in the one order
// that nccl_pairs of worker/transfer/transfer_kind.h gives every rank; never one
// per request) and its own CUDA stream, apart from the compute stream and from
// any tensor-parallel communicator. Only the transfer's communication thread
// calls NCCL: send() packs the payload into the send staging on the engine
// thread and queues it; poll() posts every queued send and every receive whose
// rows header has arrived as one ncclGroupStart/ncclGroupEnd, then queues each
// receive's unpack and an event behind it on the peer's stream. A rows header
// is only sent after its send() succeeded, so every receive posted is matched;
// rows nobody wants any more are still received (into staging) and dropped.
// Sends and receives between two ranks go in their headers' order, which MPI keeps.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "worker/transfer/device/device_rows_staging.h"
#include "worker/transfer/device/staged_device_kv_link.h"

namespace duet {

class NcclKvLink final : public StagedDeviceKvLink {
 public:
  // A new NCCL unique id as bytes (one per communicator, made by one rank).
  static constexpr size_t kUniqueIdBytes = 128;
  static std::vector<std::byte> unique_id();
  // Joins the communicator of `n_ranks` that `unique_id` names as `rank`, on
  // CUDA device `device` (collective: returns once every rank has joined).
  // The result is an ncclComm_t, for add_peer.
  static void* join(std::span<const std::byte> unique_id, int n_ranks, int rank, int device);

  // On CUDA device `device`, with send staging when the rank `sends` and
  // receive staging when it `receives`. Throws kUnsupported without the GPU.
  NcclKvLink(int device, bool sends, bool receives, Options options);
  // Destroys every communicator, aborting those with work still posted.
  ~NcclKvLink() override;
  NcclKvLink(const NcclKvLink&) = delete;
  NcclKvLink& operator=(const NcclKvLink&) = delete;

  // World rank `peer` is rank `peer_rank` of `comm` (an ncclComm_t from
  // join(); the device transfer owns it from now on). A one-rank communicator whose
  // peer is this rank itself (peer_rank 0) sends to itself.
  void add_peer(int peer, void* comm, int peer_rank);
  // Makes NCCL set up its connection to `peer` now (one byte each way, in
  // one group; the peer calls it too, at the same point of its start-up):
  // NCCL connects lazily, and a first transfer's ncclGroupEnd would
  // otherwise wait inside the communication thread for the peer's.
  void connect(int peer);

  bool carries(int peer) const override;
  std::vector<Done> poll() override;
  // NCCL frees the send staging itself when the send completes: nothing to do.
  void released(int peer, const DeviceRowsTicket& ticket) override;
  // A posted NCCL operation cannot be cancelled, only ended by aborting its
  // communicator: abandon(peer), an asynchronous NCCL error, or a send still
  // unmatched after the patience breaks the connection to that peer for good.
  // Its receipts then complete not ok, and later sends to it return nullopt.
  void abandon(int peer) override;
  bool busy() const override;

 private:
  struct Peer {
    void* comm = nullptr;  // ncclComm_t
    int rank = 0;          // the peer's rank in comm
    std::unique_ptr<DeviceStream> stream;
    bool to_self = false;  // a one-rank communicator: the rank sends to itself
    bool broken = false;
  };
  struct Send {  // packed, waiting to be posted, then in flight
    int peer = 0;
    size_t offset = 0;
    size_t bytes = 0;
    bool posted = false;
    std::chrono::steady_clock::time_point posted_at;
    DeviceEvent done;
  };
  struct Receipt {
    uint64_t id = 0;
    int peer = 0;
    size_t bytes = 0;
    RowsDestination rows;
    bool posted = false;
    std::chrono::steady_clock::time_point posted_at;
    size_t staging_offset = 0, table_offset = 0;
    bool has_table = false;
    DeviceEvent done;
  };

  bool sends_to(int peer) const override;
  bool queue_send(int peer, size_t offset, size_t bytes) override;
  void check(const Payload& payload) const override;
  void queue_receipt(uint64_t receipt, const Payload& payload) override;
  void post(std::vector<Done>& done);     // queued sends and receives, one group
  void collect(std::vector<Done>& done);  // finished sends and receipts
  void check_peers(std::vector<Done>& done);
  // Aborts the peer's communicator; its receipts complete not ok.
  void break_link(int peer, std::vector<Done>& done);

  std::map<int, Peer> peers_;  // fixed after start-up but for `broken`

  // The send staging's payloads: the engine thread packs and queues, the
  // communication thread posts and frees. Guarded by send_mutex_, with
  // peers_' `broken`.
  std::deque<std::unique_ptr<Send>> sends_;

  // The receive side (the communication thread's).
  std::deque<std::unique_ptr<Receipt>> receipts_;  // in the order received
  std::vector<Done> abandoned_;                    // for the next poll()
};

}  // namespace duet
