// KvTransfer over MPI point-to-point (worker/transfer/kv_transfer.h), for CPU
// instances on one host (shared memory; across hosts `duet serve` uses
// TcpKvTransfer unless told --kv-transport mpi), and for GPU
// instances with a DeviceKvTransfer (worker/transfer/device/device_kv_transfer.h) for the
// pairs whose KV moves device to device (worker/transfer/transfer_kind.h): their rows
// headers and every control message still go over MPI, their payloads
// through the device transfer (NCCL or CUDA IPC). Any other pair with a GPU side
// moves its rows over MPI through the GPU engine's host staging copy.
//
// A thin adapter: the protocol's rules (the imports, the rows expected,
// checksums, deadlines, device receipts) are KvTransferProtocol's
// (worker/transfer/kv_transfer_protocol.h); this class turns MPI receives and
// device completions into its events and carries out its actions.
//
// It has its own communicator, duplicated from MPI_COMM_WORLD, and no thread
// of its own: it attaches to the control channel's communication thread,
// which calls progress() on every pass, so one thread per process drives
// every non-blocking MPI operation, and every send leaves through the
// channel's one send queue (common/mpi/send_queue.h).
//
// On the wire (worker/transfer/kv_transfer_wire.h), every message on tag 1
// starts with an 80-byte header: rows headers, control messages (orders,
// cancels, handoffs), device rows headers and rows-done notes. A rows
// header's payload follows on tag 2. Headers travel in the send queue's
// control lane and payloads in its bulk lane: a handoff follows every rows
// header its sender sent (one lane keeps their order) but never waits for
// their payloads, and a cancel or an order never waits behind KV.
// Between two ranks of one host whose kernel allows it, the payload does not
// travel as a message at all: the sender packs it into its CMA staging and
// the header (kind "CMA rows") names its place there; the receiver copies it
// straight into the reserved blocks out of the sender's memory and answers
// "rows done" (worker/transfer/cma_staging.h). A payload that finds the
// staging full goes as below.
// Otherwise the rows are packed on the sending engine thread into a staging buffer
// (one memcpy per block run per head: the sender's blocks are free to be
// reused as soon as send_rows returns) and sent as one contiguous message.
// The receiver, knowing from the header where they go, receives them
// straight into the reserved blocks with one MPI derived datatype
// (hindexed over the block runs, in the packed order): no receive buffer, no
// second copy. Payloads from one rank arrive in their headers' order, so the
// next tag-2 message from a rank is the payload its oldest unmatched header
// announced; the receiver takes it when it is there (MPI_Improbe), never
// waiting for it, and counts its rows once it is in place.
//
// Device rows: a header of kind "device rows" names the payload's place in
// the sender's staging (a ticket) instead of preceding an MPI payload. The
// receiver starts the device transfer's receipt at once and counts the rows only
// when it completes; an import that ends (fails, is cancelled, expires)
// with receipts in flight reports its end once the last one is done, so
// nothing writes its blocks after on_failed or on_released. When the
// device transfer needs the sender to free its staging (IPC), a "rows done" header
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
#include <span>
#include <vector>

#include "common/mpi/control_channel.h"
#include "worker/transfer/cma_staging.h"
#include "worker/transfer/device/device_kv_transfer.h"
#include "worker/transfer/kv_transfer_adapter.h"
#include "worker/transfer/kv_transfer_protocol.h"

namespace duet {

struct MpiKvTransferOptions {
  // Checksum every rows message on the sender, verify it on the receiver; a
  // mismatch fails the import.
  bool checksums = false;
  // Tests only: this rank never sends the rows nor the handoff of request
  // `drop_rows_of` (0: none), so its import never completes and fails at its
  // deadline. `duet serve` sets it from DUET_TEST_DROP_KV_ROWS_OF.
  uint64_t drop_rows_of = 0;
  // Bytes of CMA staging on a sending rank (0: no CMA; every payload over
  // MPI). Address space, touched as payloads use it.
  size_t cma_staging_bytes = size_t{64} << 20;
};

class MpiKvTransfer final : public KvTransferAdapter, private CommEndpoint {
 public:
  // Collective over MPI_COMM_WORLD: every rank constructs one, in the same
  // order relative to other collectives (right after its ControlChannel).
  // `channel` outlives the transfer. `device`: the device transfer for this rank's
  // GPU pairs (null: every pair over MPI).
  MpiKvTransfer(ControlChannel& channel, MpiKvTransferOptions options = {},
                std::unique_ptr<DeviceKvTransfer> device = nullptr);
  // Gives the payloads in its CMA staging a moment to be read, detaches from
  // the thread, gives its queued sends a moment to be posted (the channel
  // sees the posted ones through), and frees the communicator.
  ~MpiKvTransfer() override;
  MpiKvTransfer(const MpiKvTransfer&) = delete;
  MpiKvTransfer& operator=(const MpiKvTransfer&) = delete;

  void forget_imports(const KvCache& cache) override;
  void send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                 const KvCache& cache, std::span<const int32_t> block_table, int64_t head_offset,
                 const KvSource& heads) override;
  void send_handoff(int decode_peer, const KvHandoff& handoff) override;
  bool device_transfer(int peer) const override;
  // Receives from lost ranks that had begun are given up (their buffers
  // kept: MPI may still write them), and nothing sent to them is waited on.
  void peers_lost(std::span<const Rank> ranks) override;

 private:
  bool progress() override;
  bool in_flight() const override;
  void wake_thread() override { channel_.wake(); }

  // Any thread: into the channel's send queue.
  void queue(int destination, int tag, std::vector<std::byte> bytes, SendLane lane);

  // The communication thread, under state_mutex_. Each feeds the protocol
  // events and carries out their actions, collecting the handler calls.
  bool take_commands(std::vector<KvTransferCall>& calls);
  bool receive_headers(std::vector<KvTransferCall>& calls);
  bool receive_payloads(std::vector<KvTransferCall>& calls);
  bool poll_device(std::vector<KvTransferCall>& calls);
  void act(KvTransferActions& actions, std::vector<KvTransferCall>& calls);
  // Starts a device receipt the protocol asked for, and answers it.
  void start_receipt(const KvTransferActions::DeviceReceive& receive, KvTransferActions& actions);
  // A device payload nobody takes: the device transfer drain it (or give the connection up).
  void drain_device(const KvTransferActions::DeviceReceive& receive);
  // Collective, from the constructor: which ranks read whose CMA staging.
  void connect_cma();
  // Carries out a CMA read into its import's blocks: nullopt, or why not.
  std::optional<std::string> read_cma(const KvTransferActions::CmaRead& read);
  // Starts receiving the payload `message` straight into the blocks `place` names.
  MPI_Request receive_into_blocks(MPI_Message& message,
                                  const KvTransferProtocol::PayloadPlace& place);
  // The communication thread: lost ranks' receives given up, the protocol told.
  void apply_losses(std::vector<KvTransferCall>& calls);

  ControlChannel& channel_;
  const MpiKvTransferOptions options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  const std::unique_ptr<DeviceKvTransfer> device_;
  const std::unique_ptr<CmaStaging> cma_;  // its setup is the constructor's

  // The communication thread's state: that thread holds the mutex while it
  // works on it; forget_imports takes it from another thread.
  mutable std::mutex state_mutex_;
  KvTransferProtocol protocol_;
  // Headers being received, by source, oldest first (handled in that order).
  struct HeaderReceive {
    std::vector<std::byte> bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  std::map<int, std::deque<HeaderReceive>> header_receives_;
  // The payload being received from each source (one at a time, in order).
  struct PayloadReceive {
    MPI_Request request = MPI_REQUEST_NULL;
    bool whole = false;              // into its import's blocks; else into scratch
    std::vector<std::byte> scratch;  // a drained payload's bytes
  };
  std::map<int, PayloadReceive> payload_receives_;
  // Receives from lost ranks that may never finish: kept (and at the end
  // leaked), because MPI may still write them.
  std::vector<std::vector<std::byte>> abandoned_buffers_;
  bool abandoned_any_ = false;
  std::vector<int> type_lengths_;  // the receive datatype's runs, reused
  std::vector<MPI_Aint> type_addresses_;
  std::vector<iovec> cma_runs_;  // a CMA read's block runs, reused

  mutable std::mutex mutex_;  // guards the members below
  std::vector<int> lost_;     // ranks lost since the last pass
};

}  // namespace duet
