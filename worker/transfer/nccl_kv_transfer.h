// DeviceKvTransfer (worker/transfer/device_kv_transfer.h) between GPUs of different
// hosts (or of one host, by choice), over NCCL point-to-point.
//
// Each peer has its own two-rank communicator (made at start, in the one
// order worker/transfer/transfer_kind.h's nccl_pairs gives every rank; never one per
// request) and its own CUDA stream, separate from the compute stream and
// from any tensor-parallel communicator. Only the transfer's communication
// thread calls NCCL: send() packs the payload into the send staging on the
// engine thread and queues it; poll() posts every queued send and every
// receive whose rows header has arrived as one ncclGroupStart/ncclGroupEnd,
// then queues each receive's unpack behind it on the peer's stream and an
// event after that. A rows header always means its ncclSend is posted (the
// sender only sends the header when send() succeeded), so every receive
// posted here is matched; rows nobody wants any more are still received
// (into staging) and dropped. Sends and receives between two ranks go in
// the order of their headers, which MPI keeps.
//
// A posted NCCL operation cannot be cancelled, only ended by aborting its
// communicator: abandon(peer), an asynchronous NCCL error, or a send still
// unmatched after the patience breaks the connection to that peer for good. Its
// receipts then complete not ok, and later sends to it return nullopt.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "worker/transfer/device_kv_transfer.h"
#include "worker/transfer/device_rows_staging.h"

namespace duet {

class NcclKvTransfer final : public DeviceKvTransfer {
 public:
  struct Options {
    size_t send_staging_bytes = size_t{256} << 20;
    size_t receive_staging_bytes = size_t{256} << 20;
    size_t table_entries = size_t{1} << 16;  // block-table entries in flight
    // How long send() waits for send staging, and a posted send for its
    // receiver, before the connection to that peer is given up.
    std::chrono::milliseconds patience{std::chrono::seconds(30)};
  };

  // A new NCCL unique id as bytes (one per communicator, made by one rank).
  static constexpr size_t kUniqueIdBytes = 128;
  static std::vector<std::byte> unique_id();
  // Joins the communicator of `n_ranks` that `unique_id` names as `rank`, on
  // CUDA device `device` (collective: returns once every rank has joined).
  // The result is an ncclComm_t, for add_peer.
  static void* join(std::span<const std::byte> unique_id, int n_ranks, int rank, int device);

  // On CUDA device `device`, with send staging when the rank `sends` and
  // receive staging when it `receives`. Throws kUnsupported without the GPU.
  NcclKvTransfer(int device, bool sends, bool receives, Options options);
  // Destroys every communicator, aborting those with work still posted.
  ~NcclKvTransfer() override;
  NcclKvTransfer(const NcclKvTransfer&) = delete;
  NcclKvTransfer& operator=(const NcclKvTransfer&) = delete;

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
  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) override;
  uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                   const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                   int64_t pos0, int64_t n, KvHeads heads) override;
  std::vector<Done> poll() override;
  // NCCL frees the send staging itself when the send completes: nothing to do.
  void released(int peer, const DeviceRowsTicket& ticket) override;
  void abandon(int peer) override;
  bool busy() const override;
  std::vector<std::string> take_notes() override;

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
    KvLayout layout;
    DeviceKv kv;                       // invalid: drained
    std::vector<int32_t> block_table;  // the blocks of [pos0, pos0 + n) alone, pos0 from the first
    int64_t layer = 0, pos0 = 0, n = 0;
    KvHeads heads;
    bool posted = false;
    std::chrono::steady_clock::time_point posted_at;
    size_t staging_offset = 0, table_offset = 0;
    bool has_table = false;
    DeviceEvent done;
  };

  void post(std::vector<Done>& done);     // queued sends and receives, one group
  void collect(std::vector<Done>& done);  // finished sends and receipts
  void check_peers(std::vector<Done>& done);
  // Aborts the peer's communicator; its receipts complete not ok.
  void break_link(int peer, std::vector<Done>& done);
  void release_send(const Send& send);

  const int device_;
  const Options options_;
  std::map<int, Peer> peers_;  // fixed after start-up but for `broken`

  // Send staging: the engine thread packs, the communication thread posts
  // and frees. Guarded by send_mutex_, with the queued and posted sends.
  mutable std::mutex send_mutex_;
  std::condition_variable send_room_;
  std::unique_ptr<DeviceStaging> send_staging_;
  std::unique_ptr<TableStaging> send_tables_;
  std::deque<std::unique_ptr<Send>> sends_;

  // The receive side (the communication thread's).
  std::unique_ptr<DeviceStaging> receive_staging_;
  std::unique_ptr<TableStaging> receive_tables_;
  std::deque<std::unique_ptr<Receipt>> receipts_;  // in the order received
  std::vector<Done> abandoned_;                    // for the next poll()
  std::vector<std::string> notes_;                 // for the owner's log
  uint64_t next_receipt_ = 1;
};

}  // namespace duet
