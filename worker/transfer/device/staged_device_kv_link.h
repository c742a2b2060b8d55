// What the two GPU device transfers (worker/transfer/device/device_kv_link.h),
// CudaIpcKvLink and NcclKvLink, share: each side's staging on one
// CUDA device, the sending half (send() waits up to the patience for room in
// the send staging and packs the rows there on the compute stream), the front
// of the receiving half (receive() checks a payload and numbers its receipt),
// and where a receipt's rows go. How a payload crosses from one staging into
// the other, and when each side's staging is free again, is the subclass's:
// it answers the hooks below.
//
// Plain C++ (the CUDA calls are in the .cpp); built with the CUDA backend.
// Threads: as DeviceKvLink. send_mutex_ guards the send staging's ring
// (the engine thread acquires, the communication thread releases) and what
// a subclass reads in sends_to() and queue_send().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/model/kv_layout.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/device/device_kv_link.h"
#include "worker/transfer/device/device_rows_staging.h"

namespace duet {

class StagedDeviceKvLink : public DeviceKvLink {
 public:
  struct Options {
    size_t send_staging_bytes = size_t{256} << 20;
    size_t receive_staging_bytes = size_t{256} << 20;
    size_t table_entries = size_t{1} << 16;  // block-table entries in flight
    // How long send() waits for room in the send staging before it gives up
    // (NCCL: and a posted send or receive for its peer, before the
    // connection to that peer is given up).
    std::chrono::milliseconds patience{std::chrono::seconds(30)};
  };

  StagedDeviceKvLink(const StagedDeviceKvLink&) = delete;
  StagedDeviceKvLink& operator=(const StagedDeviceKvLink&) = delete;

  std::optional<DeviceRowsTicket> send(int peer, const KvLayout& layout, const DeviceKv& kv,
                                       int64_t layer, std::span<const int32_t> block_table,
                                       int64_t pos0, int64_t n, KvHeads heads) final;
  uint64_t receive(int peer, const DeviceRowsTicket& ticket, const KvLayout& layout,
                   const DeviceKv* kv, std::span<const int32_t> block_table, int64_t layer,
                   int64_t pos0, int64_t n, KvHeads heads) final;
  // Frees the payload's send staging: the receiver's word that it is done
  // with it (it pulled the payload, as over CUDA IPC). A transfer whose
  // sends free their own staging overrides it.
  void released(int peer, const DeviceRowsTicket& ticket) override;
  std::vector<std::string> take_notes() final;

 protected:
  // On CUDA device `device`, with send staging when the rank `sends` and
  // receive staging when it `receives`; `kind` names the transfer in
  // messages ("NCCL"). Throws kUnsupported without the GPU.
  StagedDeviceKvLink(const char* kind, int device, bool sends, bool receives, Options options);

  // A payload as receive() is told of it, for check() and queue_receipt().
  struct Payload {
    int peer = 0;
    DeviceRowsTicket ticket;
    KvLayout layout;
    const DeviceKv* kv = nullptr;  // null: nobody wants the rows (drained)
    std::span<const int32_t> block_table;
    int64_t layer = 0, pos0 = 0, n = 0;
    KvHeads heads;
  };

  // Where a receipt's rows go: all its unpack reads.
  struct RowsDestination {
    KvLayout layout;
    DeviceKv kv;                       // invalid: drained
    std::vector<int32_t> block_table;  // the blocks of [pos0, pos0 + n) alone, pos0 from the first
    int64_t layer = 0, pos0 = 0, n = 0;
    KvHeads heads;
  };
  static RowsDestination destination(const Payload& payload);

  // Queues on `stream` (cudaStream_t) the unpack of `rows` from the receive
  // staging at `staging_offset` into their blocks, under the block table at
  // `table` (device memory).
  void unpack(const RowsDestination& rows, const int32_t* table, size_t staging_offset,
              void* stream) const;

  const int device_;
  const Options options_;

  // The send side: the engine thread packs into send_staging_, under
  // send_mutex_, with send_tables_ its own.
  mutable std::mutex send_mutex_;
  std::condition_variable send_room_;
  std::unique_ptr<DeviceStaging> send_staging_;
  std::unique_ptr<TableStaging> send_tables_;

  // The receive side (the communication thread's).
  std::unique_ptr<DeviceStaging> receive_staging_;
  std::unique_ptr<TableStaging> receive_tables_;
  std::vector<std::string> notes_;  // for the owner's log

 private:
  // With send_mutex_ held: whether rows may go to `peer` now. send()
  // returns nullopt when they may not, before it waits for room or while it
  // waits.
  virtual bool sends_to(int peer) const = 0;
  // Runs on kv.stream's host side right after the packing is queued (a CUDA
  // IPC transfer records its interprocess event there).
  virtual void after_pack(void* /*stream*/) {}
  // The rows are packed into the send staging at `offset`: the subclass
  // takes the payload on. false: it does not go after all (and the subclass
  // has freed its staging); send() returns nullopt.
  virtual bool queue_send(int /*peer*/, size_t /*offset*/, size_t /*bytes*/) { return true; }

  // Throws kInvalidArgument for a payload that this transfer cannot take
  // (its rows header came off the wire), before anything is queued.
  virtual void check(const Payload& payload) const = 0;
  // Starts taking `payload` as receipt `receipt`, which completes in a
  // later poll().
  virtual void queue_receipt(uint64_t receipt, const Payload& payload) = 0;

  // Frees the send staging at `offset` and wakes a send() waiting for room.
  void release_send_staging(size_t offset);

  const char* const kind_;
  uint64_t next_receipt_ = 1;  // the communication thread's
};

}  // namespace duet
