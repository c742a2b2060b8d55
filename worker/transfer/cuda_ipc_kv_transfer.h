// DeviceKvTransfer (worker/transfer/device_kv_transfer.h) between ranks whose GPUs are
// in one host (NCCL refuses two ranks on one GPU; between two GPUs of a host
// a peer copy needs no communicator), over CUDA IPC.
//
// A sending rank makes one send staging allocation (plain cudaMalloc, as IPC
// requires) and one interprocess event, and exports their handles once; each
// receiving rank opens a sender's handles once, at start. Sending packs a
// payload into the send staging on the compute stream and records the event
// after it; the rows header (over MPI) then names the payload's offset. The
// receiver makes its own stream wait for the sender's event (the header left
// after the record, so the wait covers the packing), copies the payload from
// the sender's staging into its own, unpacks it into the import's blocks,
// and records a local event: the receipt completes when that fires, and its
// Done carries the ticket back so that the sender's transfer frees the
// region (the receiver pulls: the sender never writes the receiver's blocks,
// so a cancelled import's blocks are safe once its receipts are done).
//
// The handles are plain bytes (exported(), add_sender()), carried by
// whatever the caller has: MPI at start-up, a socketpair in the GPU check.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <vector>

#include "worker/transfer/device_kv_transfer.h"
#include "worker/transfer/device_rows_staging.h"

namespace duet {

class CudaIpcKvTransfer final : public DeviceKvTransfer {
 public:
  struct Options {
    size_t send_staging_bytes = size_t{256} << 20;
    size_t receive_staging_bytes = size_t{256} << 20;
    size_t table_entries = size_t{1} << 16;  // block-table entries in flight
    // How long send() waits for room in the send staging before it gives up.
    std::chrono::milliseconds patience{std::chrono::seconds(30)};
  };
  static constexpr size_t kExportBytes = 160;

  // On CUDA device `device`: the send side's staging and event when `sends`,
  // the receive side's when `receives`. Throws kUnsupported without the GPU.
  CudaIpcKvTransfer(int device, bool sends, bool receives, Options options);
  ~CudaIpcKvTransfer() override;
  CudaIpcKvTransfer(const CudaIpcKvTransfer&) = delete;
  CudaIpcKvTransfer& operator=(const CudaIpcKvTransfer&) = delete;

  // This rank's send staging and event handles (kExportBytes; sends only).
  std::vector<std::byte> exported() const;
  // A rank this one sends to.
  void add_receiver(int peer);
  // A rank this one receives from, with its exported() bytes (opened here,
  // once). Throws kInvalidArgument for bytes exported() did not make.
  void add_sender(int peer, std::span<const std::byte> exported);

  bool carries(int peer) const override;
  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) override;
  uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                   const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                   int64_t pos0, int64_t n, KvHeads heads) override;
  std::vector<Done> poll() override;
  void released(int peer, const DeviceRowsTicket& ticket) override;
  // IPC copies always finish: the receipts of `peer` simply complete.
  void abandon(int peer) override;
  bool busy() const override;
  std::vector<std::string> take_notes() override;

 private:
  struct Sender {             // a rank this one receives from
    void* staging = nullptr;  // its send staging, mapped here
    void* event = nullptr;    // cudaEvent_t of its interprocess event
    size_t bytes = 0;
  };
  // A payload to take: waiting for room, then in flight until `done`.
  struct Receipt {
    uint64_t id = 0;
    int peer = 0;
    DeviceRowsTicket ticket;
    KvLayout layout;
    DeviceKv kv;                       // invalid: drained
    std::vector<int32_t> block_table;  // the blocks of [pos0, pos0 + n) alone, pos0 from the first
    int64_t layer = 0, pos0 = 0, n = 0;
    KvHeads heads;
    bool started = false;
    bool ok = true;  // false: its copy could not be queued (it completes not ok)
    size_t staging_offset = 0, table_offset = 0;
    DeviceEvent done;
  };

  bool start(Receipt& receipt);     // false: no room yet
  std::vector<std::string> notes_;  // for the owner's log

  const int device_;
  const Options options_;

  // The send side. The engine thread acquires staging, the communication
  // thread releases it.
  std::unique_ptr<DeviceStaging> send_staging_;
  std::unique_ptr<TableStaging> send_tables_;
  void* send_event_ = nullptr;  // cudaEvent_t, interprocess
  std::set<int> receivers_;
  mutable std::mutex send_mutex_;  // guards send_staging_'s ring
  std::condition_variable send_room_;

  // The receive side (the communication thread's).
  std::unique_ptr<DeviceStaging> receive_staging_;
  std::unique_ptr<TableStaging> receive_tables_;
  std::unique_ptr<DeviceStream> stream_;
  std::map<int, Sender> senders_;
  std::deque<std::unique_ptr<Receipt>> receipts_;  // in the order received
  uint64_t next_receipt_ = 1;
};

}  // namespace duet
