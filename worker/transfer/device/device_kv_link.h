// A device KV link: how the rows payloads of a KV transfer move between two
// GPUs, device to device, never through host memory. The protocol (orders,
// rows headers, handoffs, cancels, deadlines) stays with the KvTransfer that
// owns the link (worker/transfer/mpi_kv_transfer.h): it sends each rows header
// over MPI as always, and the payload, the packed rows of worker/kv/kv_rows.h,
// goes through the link. Two implementations, on the staging and the send and
// receive fronts they share (worker/transfer/device/staged_device_kv_link.h):
// NcclKvLink (worker/transfer/device/nccl_kv_link.h; GPUs of different hosts)
// and CudaIpcKvLink (worker/transfer/device/cuda_ipc_kv_link.h; GPUs of one
// host, or one GPU shared by two ranks).
//
// An import ends (completes, fails or is released) only when none of its
// receipts is pending: after on_released or on_failed nothing writes its blocks.
// Threads: send() on the engine thread; everything else on the transfer's
// communication thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/model/kv_layout.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_rows.h"

namespace duet {

// Where a payload sits in its sender's staging, as the rows header carries it.
struct DeviceRowsTicket {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

class DeviceKvLink {
 public:
  virtual ~DeviceKvLink() = default;

  // Whether rows to or from world rank `peer` go through this device transfer.
  virtual bool carries(int peer) const = 0;

  // Sender, engine thread. Packs rows [pos0, pos0 + n) of `layer` (the local
  // KV heads `heads`) from `kv` under `block_table` and starts moving them to
  // `peer`. Waits while the staging is full, up to the device transfer's patience;
  // nullopt when it stayed full or the connection to `peer` is broken (the rows
  // are not sent and the receiver's deadline fails the import). The packing,
  // into staging the link owns, is queued on the compute stream ahead of
  // whatever overwrites the blocks: they may be reused as soon as send() returns.
  virtual std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                               int64_t layer, std::span<const int32_t> block_table,
                                               int64_t pos0, int64_t n, KvHeads heads) = 0;

  // Receiver. Starts taking the payload `ticket` from `peer` into `kv` under
  // `block_table` (null kv: nobody wants the rows; they are drained, and the
  // layout and table are not read). Throws kInvalidArgument for a ticket
  // that is not the rows' size. The payload is unpacked on the link's own
  // stream; the receipt it returns completes in a later poll(), once its rows
  // are in place (a CUDA event has fired), and only then does the transfer
  // count them, so attention never reads a layer still in flight.
  virtual uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                           const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                           int64_t pos0, int64_t n, KvHeads heads) = 0;

  // A completed receipt; `ack` when the sender must be told that its staging
  // for the payload is free again (its transfer calls released()).
  struct Done {
    uint64_t receipt = 0;
    int peer = 0;
    bool ok = true;  // false: the connection broke and the rows did not all arrive
    std::optional<DeviceRowsTicket> ack;
  };
  // Posts what send() and receive() queued and collects what finished. The
  // transfer calls it on every pass of its thread.
  virtual std::vector<Done> poll() = 0;

  // Sender: the receiver is done with `ticket` from this rank's staging.
  virtual void released(int peer, const DeviceRowsTicket& ticket) = 0;

  // Gives up on the receipts from `peer` (a payload that could not even be
  // drained, or a shutdown with payloads still in flight): they complete,
  // not ok, in the next poll(). A device transfer that cannot cancel work
  // in flight breaks the connection to `peer` for good (NCCL aborts its
  // communicator); one whose work always finishes may simply let it finish.
  virtual void abandon(int peer) = 0;

  // Whether anything is queued or in flight (the transfer polls fast then).
  virtual bool busy() const = 0;

  // What went wrong since the last call (a connection given up, and why), for the
  // owner's log: the device transfer itself logs nothing.
  virtual std::vector<std::string> take_notes() { return {}; }
};

}  // namespace duet
