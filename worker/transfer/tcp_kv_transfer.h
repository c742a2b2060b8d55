// KvTransfer (worker/transfer/kv_transfer.h) over TCP sockets of its own, for
// CPU instances between hosts (`duet serve --kv-transport`; why not MPI there:
// docs/FAILURES.md, "What Open MPI 4.1 does when a rank dies"). A thin adapter,
// as MpiKvTransfer is: every rule is KvTransferProtocol's.
//
// One non-blocking socket per peer, made at start-up (common/net/tcp_connect.h)
// or, for an instance that joined later, when it did (add_peer), and one thread that poll()s them
// and a wake-up eventfd: no call waits on a peer. Each peer's control lane (orders, cancels) goes
// ahead of its bulk lane (rows, and handoffs, which follow their rows); a frame begun is finished
// first, so a control frame waits for one rows frame at most. send_rows writes
// from the blocks when the socket is idle, else packs and queues; rows land
// straight in the reserved blocks (readv), or are drained. A lost peer (EOF, a
// reset, a broken pipe, peers_lost): its socket closed, its frames dropped, the
// protocol told; an import half-received from it fails and frees its blocks
// (no quarantine: KvTransferProtocol::LostReceives::kStop).
//
// Threads: see KvTransfer. counters() and peers_lost from any thread.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "common/net/tcp_connect.h"
#include "worker/transfer/kv_transfer_adapter.h"
#include "worker/transfer/kv_transfer_protocol.h"
#include "worker/transfer/kv_transfer_wire.h"

namespace duet {

// The KV connections' hello (connect_tcp_peers): the lower rank of each pair dials.
inline constexpr TcpPurpose kKvPurpose{0x4856'4b44, "kv transfer"};  // "DKVH"

struct TcpKvTransferOptions {
  // As MpiKvTransferOptions'.
  bool checksums = false;
  uint64_t drop_rows_of = 0;  // tests only
  // For burst_window after bytes last came, the thread tests its sockets
  // every transfer_poll instead of waiting in poll() to be woken. The window
  // spans the gaps between the frames of rows sent back to back; it is far
  // shorter than a layer's compute, and than the 5 ms MpiKvTransfer polls
  // fast for after rows (KvTransferProtocol::fast_poll), because poll() sees
  // what MPI's progress engine does not. Between a prefill's layers the
  // thread sleeps in poll() again (what it costs and saves: docs/BENCHMARKS.md,
  // "Disaggregated serving: the KV transfer").
  std::chrono::microseconds transfer_poll{20};
  std::chrono::microseconds burst_window{500};
};

class TcpKvTransfer final : public KvTransferAdapter {
 public:
  // `sockets`: a connected socket to every peer, by world rank (owned from
  // now on). Starts the thread.
  TcpKvTransfer(int self, std::map<int, int> sockets, TcpKvTransferOptions options = {});
  // Gives the queued frames a moment to leave, then stops the thread and
  // closes every socket.
  ~TcpKvTransfer() override;
  TcpKvTransfer(const TcpKvTransfer&) = delete;
  TcpKvTransfer& operator=(const TcpKvTransfer&) = delete;

  void forget_imports(const KvCache& cache) override;
  void send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                 const KvCache& cache, std::span<const int32_t> block_table, int64_t head_offset,
                 const KvSource& heads) override;
  void send_handoff(int decode_peer, const KvHandoff& handoff) override;
  void peers_lost(std::span<const Rank> ranks) override;
  // A connected socket to a peer met after start-up (an instance that joined
  // the cluster: worker/transfer/kv_member_links.h), owned from now on;
  // frames to `rank` go to it from now on. False, the socket closed, when
  // `rank` has or had one. Any thread.
  bool add_peer(int rank, int fd);

  int self() const { return self_; }

 private:
  // A header (with a control message after it) and a rows payload (or none).
  struct Frame {
    std::vector<std::byte> head;
    std::vector<std::byte> body;
  };
  enum class Lane { kControl, kBulk };
  // What one peer's socket is doing. The send lanes are guarded by mutex_;
  // the rest is the thread's.
  struct Peer {
    int fd = -1;  // -1: lost
    std::deque<Frame> control;
    std::deque<Frame> bulk;
    std::optional<Frame> writing;  // the frame begun
    size_t written = 0;
    // send_from_blocks is writing a frame to the socket without the lock:
    // the thread leaves the socket's sending alone, and a loss closes the
    // socket only once the write has returned (`unclosed`).
    bool claimed = false;
    int unclosed = -1;
    // The frame being received: its header, then its body.
    std::array<std::byte, sizeof(kv_wire::Header)> header{};
    size_t header_got = 0;
    bool in_body = false;
    std::vector<std::byte> message;  // a control frame: header and body
    size_t body_left = 0;
    bool payload = false;           // the body is a rows payload
    bool whole = false;             // into an import's blocks (`runs`), else drained
    const KvCache* into = nullptr;  // the cache `runs` point into
    std::vector<iovec> runs;        // what is left of the blocks to fill, in order
    size_t next_run = 0;
  };

  void run();  // the thread
  void wake_thread() override;
  // Any thread: a frame into a peer's lane (dropped when the peer is lost).
  void queue(int destination, Frame frame, Lane lane);
  // Any thread: a body of `size` bytes, a written frame's when there is one
  // (its pages made and, for the usual size, not zeroed again).
  std::vector<std::byte> body_buffer(size_t size);
  // Under mutex_: the same.
  std::vector<std::byte> body_buffer_locked(size_t size);
  // The engine thread (send_rows): writes a rows frame straight from the
  // sender's blocks when `rank`'s socket is idle; false when it wrote
  // nothing (the caller packs and queues it). What the socket does not take
  // at once is packed and becomes the frame begun. The socket is claimed
  // for the write, which runs without the lock: the thread, polling and
  // queueing meanwhile, never waits for it.
  bool send_from_blocks(int rank, const kv_wire::Header& header, const KvCache& cache,
                        std::span<const int32_t> block_table, int64_t layer, int64_t pos0,
                        int64_t n, KvHeads heads);

  // The thread, under state_mutex_: each feeds the protocol events and carries
  // out their actions, collecting the handler calls.
  void take_commands(std::vector<KvTransferCall>& calls);
  void apply_losses(std::vector<KvTransferCall>& calls);
  // Reads what `rank`'s socket holds; false when the peer is lost.
  bool receive(int rank, Peer& peer, std::vector<KvTransferCall>& calls);
  // A whole header came: what its body needs.
  void on_header(int rank, Peer& peer, std::vector<KvTransferCall>& calls);
  void on_frame_end(int rank, Peer& peer, std::vector<KvTransferCall>& calls);
  // Writes what the socket takes; false when the peer is lost.
  bool send(int rank, Peer& peer);
  void lose(int rank, Peer& peer, const char* why, std::vector<KvTransferCall>& calls);
  void act(KvTransferActions& actions, std::vector<KvTransferCall>& calls);
  // The runs of `place`'s blocks, in the packed order.
  void place_runs(const KvTransferProtocol::PayloadPlace& place, Peer& peer);
  bool idle_sends();  // no frame queued or begun to a live peer

  const int self_;
  const TcpKvTransferOptions options_;
  const int wake_fd_;
  std::atomic<bool> stop_{false};

  // The thread's state: it holds the mutex while it works on it;
  // forget_imports takes it from another thread.
  mutable std::mutex state_mutex_;
  KvTransferProtocol protocol_;
  std::vector<std::byte> drain_;    // a drained payload's bytes go here
  Clock::time_point last_bytes_{};  // when a socket last gave any

  mutable std::mutex mutex_;  // guards the members below and every Peer's send lanes
  std::vector<std::vector<std::byte>> spares_;  // written frames' bodies, for the next rows
  std::vector<iovec> send_parts_;  // send_from_blocks' header and runs (engine thread), reused
  // Grows (add_peer) under both locks, never shrinks: a Peer found stays.
  std::map<int, Peer> peers_;
  std::vector<int> lost_;  // ranks lost since the last pass

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
