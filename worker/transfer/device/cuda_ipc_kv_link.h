// DeviceKvLink (worker/transfer/device/device_kv_link.h) between ranks whose GPUs are
// in one host, over CUDA IPC (NCCL refuses two ranks on one GPU; between two GPUs of a
// host a peer copy needs no communicator).
//
// A sending rank makes one send staging allocation (plain cudaMalloc, as IPC requires)
// and one interprocess event, and exports their handles once; each receiving rank opens
// a sender's handles once, at start. Sending packs a payload into the send staging on the
// compute stream and records the event after it; the rows header (over MPI) then names
// the payload's offset. The receiver's stream waits for that event (the header left after
// the record, so the wait covers the packing), copies the payload into its own staging,
// unpacks it into the import's blocks and records a local event: the receipt completes
// when that fires, its Done carrying the ticket back so the sender's transfer frees the
// region. The receiver pulls: the sender never writes the receiver's blocks, so a
// cancelled import's blocks are safe once its receipts are done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <vector>

#include "worker/transfer/device/device_rows_staging.h"
#include "worker/transfer/device/staged_device_kv_link.h"

namespace duet {

class CudaIpcKvLink final : public StagedDeviceKvLink {
 public:
  static constexpr size_t kExportBytes = 160;

  // On CUDA device `device`: the send side's staging and event when `sends`,
  // the receive side's when `receives`. Throws kUnsupported without the GPU.
  CudaIpcKvLink(int device, bool sends, bool receives, Options options);
  ~CudaIpcKvLink() override;
  CudaIpcKvLink(const CudaIpcKvLink&) = delete;
  CudaIpcKvLink& operator=(const CudaIpcKvLink&) = delete;

  // This rank's send staging and event handles (kExportBytes; sends only):
  // plain bytes, carried by whatever the caller has (MPI at start-up, a
  // socketpair in the GPU check).
  std::vector<std::byte> exported() const;
  // A rank this one sends to.
  void add_receiver(int peer);
  // A rank this one receives from, with its exported() bytes (opened here,
  // once). Throws kInvalidArgument for bytes exported() did not make.
  void add_sender(int peer, std::span<const std::byte> exported);

  bool carries(int peer) const override;
  std::vector<Done> poll() override;
  // IPC copies always finish: the receipts of `peer` simply complete.
  void abandon(int peer) override;
  bool busy() const override;

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
    RowsDestination rows;
    bool started = false;
    bool ok = true;  // false: its copy could not be queued (it completes not ok)
    size_t staging_offset = 0, table_offset = 0;
    DeviceEvent done;
  };

  bool sends_to(int peer) const override;
  void after_pack(void* stream) override;
  void check(const Payload& payload) const override;
  void queue_receipt(uint64_t receipt, const Payload& payload) override;
  bool start(Receipt& receipt);  // false: no room yet

  // The send side: the receivers are guarded by send_mutex_.
  void* send_event_ = nullptr;  // cudaEvent_t, interprocess
  std::set<int> receivers_;

  // The receive side (the communication thread's).
  std::unique_ptr<DeviceStream> stream_;
  std::map<int, Sender> senders_;
  std::deque<std::unique_ptr<Receipt>> receipts_;  // in the order received
};

}  // namespace duet
