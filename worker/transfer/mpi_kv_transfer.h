// KvTransfer (worker/transfer/kv_transfer.h) over MPI point-to-point: for CPU
// instances on one host (between hosts `duet serve` uses TcpKvTransfer unless
// told --kv-transport mpi), and for GPU instances, whose device pairs
// (worker/transfer/transfer_kind.h) send headers over MPI and payloads through
// a DeviceKvLink, and whose other pairs send rows over MPI from the GPU
// engine's host staging copy. A thin adapter: every rule is KvTransferProtocol's.
//
// It has its own communicator and no thread: the control channel's
// communication thread calls progress() on every pass, and every send leaves
// through the channel's one send queue. Headers (tag 1) go in its control lane,
// payloads (tag 2) in its bulk lane: a handoff follows every rows header its
// sender sent but never waits for their payloads, and no order or cancel waits
// behind KV. How a payload moves (packed, by CMA, or device to device):
// docs/ARCHITECTURE.md, "One request, disaggregated".
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

#include "common/control_plane/control_channel.h"
#include "worker/transfer/cma_staging.h"
#include "worker/transfer/device/device_kv_link.h"
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
                std::unique_ptr<DeviceKvLink> device = nullptr);
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
  const std::unique_ptr<DeviceKvLink> device_;
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
