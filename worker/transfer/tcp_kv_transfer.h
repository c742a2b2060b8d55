// KvTransfer over TCP sockets of its own (worker/transfer/kv_transfer.h), for
// CPU instances, chosen between hosts (`duet serve --kv-transport`): Open MPI
// 4.1's TCP transport can wedge a survivor that was moving large messages to
// or from a rank that died (docs/FAILURES.md), while a socket Duet owns only
// ever reports the death (EOF, a reset) and is closed.
//
// A thin adapter, as MpiKvTransfer is: the protocol's rules are
// KvTransferProtocol's (worker/transfer/kv_transfer_protocol.h); this class
// turns bytes from the sockets into its events and carries out its actions.
//
// One connected socket per peer (a prefill rank with each decode rank), made
// at start-up (common/net/tcp_connect.h, kKvPurpose), and one thread of its own
// that poll()s them and a wake-up eventfd; every socket is non-blocking, and
// no call ever waits on a peer. Within burst_window of the last bytes
// received the thread does not wait in poll() but tests the sockets every
// transfer_poll: a thread asleep on a socket must be woken for each burst
// that arrives, and over loopback the sender's own sendmsg pays for the
// wake-up (rows sent back to back took 7-11% longer that way). Rows a
// prefill sends as it computes come a layer's compute apart, so between
// layers the thread sleeps in poll() again: an import costs the decode side
// about as much CPU as when the thread always waited there.
//
// On the wire every message is a frame (worker/transfer/kv_transfer_wire.h):
// the 80-byte header, then its body: a control message (order, cancel,
// handoff) or a rows payload, its size in the header. Each peer has two send
// lanes, the control lane (orders, cancels) ahead of the bulk lane (rows
// frames, and handoffs, which must follow their rows); a frame begun is
// finished before the next, so a control frame waits for one rows frame at
// most. A rows frame whose peer's socket is idle leaves straight from the
// sender's blocks: send_rows writes it itself (one sendmsg over the header
// and the block runs, which the kernel copies before it returns), and only
// what the socket does not take at once is packed and left to the thread,
// first in line; otherwise the rows are packed and queued. A rows payload is
// received straight into the import's reserved blocks (readv over the block
// runs in the packed order, as the protocol's PayloadPlace says), or drained
// when nobody wants it.
//
// A lost peer (EOF, a reset, a broken pipe, or peers_lost from the
// coordinator's word): its socket is closed, its queued frames dropped, and
// the protocol told. Since a closed socket writes nothing any more, an import
// half-received from it fails and its blocks come back (no quarantine:
// KvTransferProtocol::LostReceives::kStop).
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
  // what MPI's progress engine does not.
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
  std::map<int, Peer> peers_;      // the map itself is fixed after construction
  std::vector<int> lost_;          // ranks lost since the last pass

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
