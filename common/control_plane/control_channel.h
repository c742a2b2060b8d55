// The control plane's transport: typed messages (common/cluster/control_messages.h)
// between the ranks of the MPI job, driven by one communication thread, and the
// process's one send queue (common/control_plane/send_queue.h), which attached endpoints (the KV
// transfer) post through too: control messages leave ahead of KV payloads, whose
// bytes in flight are bounded per destination.
//
// Every rank of MPI_COMM_WORLD constructs one with the same Transport (a collective
// call): kMpi, on a duplicate of the world communicator, or kTcp, Duet's own sockets
// for ranks on several hosts (docs/FAILURES.md, "What Open MPI 4.1 does when a rank
// dies"), a star: only rank 0 talks to the other ranks. Messages from one rank to
// another arrive in the order they were sent. Only the communication thread calls MPI
// on the channel's communicator or touches the TCP link, and it never blocks on a
// peer; idle, it sleeps up to max_idle_sleep between passes, so a message after an
// idle spell may wait that long (how the thread works: docs/ARCHITECTURE.md, "One
// request, disaggregated"). Instances that join at runtime (coordinator/cluster/
// join_listener.h) are members of no MPI job: rank 0 admits each one's TCP
// connection under an address of its own past the world's ranks, beside the ranks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/cluster/transport.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/control_plane/send_queue.h"
#include "common/net/tcp_frame_link.h"

namespace duet {

// Another user of the communication thread (the KV transfer): one thread per
// process drives every non-blocking MPI operation, each user on its own
// communicator, and every send goes through the channel's post().
class CommEndpoint {
 public:
  virtual ~CommEndpoint() = default;
  // Moves the endpoint's operations on (receives, device work); true when
  // anything happened. Called on the communication thread on every pass.
  virtual bool progress() = 0;
  // Whether operations are in flight: the thread then polls every
  // transfer_poll instead of backing off (as it does while any endpoint's
  // send is in flight).
  virtual bool in_flight() const = 0;
};

// Which link carries the channel's own messages (the endpoints' always go
// over MPI).

struct ControlChannelOptions {
  Transport transport = Transport::kMpi;
  // TCP: how long the ranks have to connect to rank 0 at construction.
  std::chrono::milliseconds connect_timeout{60'000};
  std::chrono::microseconds min_idle_sleep{50};
  std::chrono::microseconds max_idle_sleep{2000};
  // While sends are in flight the thread polls at least this often, so a
  // large (rendezvous) send keeps moving.
  std::chrono::microseconds in_flight_poll{200};
  // While an attached endpoint has operations in flight (a KV transfer).
  std::chrono::microseconds transfer_poll{20};
  // Receives per pass before the thread looks at its send queue again.
  int max_receives_per_pass = 64;
  // Bulk-lane bytes (KV payloads) in flight to one destination at most.
  size_t bulk_window_bytes = size_t{64} << 20;
};

// A joined member's side (a process outside the coordinator's MPI job):
// `socket`, its authenticated, connected control connection to rank 0, owned
// from now on; `self`, the address rank 0 assigned it (>= its world's size).
struct JoinedLink {
  Rank self;
  int socket = -1;
};

struct ReceivedMessage {
  Rank source;
  ControlMessage message;
  // When the communication thread took it off the wire: a dispatcher that
  // falls behind still knows when each rank last spoke.
  std::chrono::steady_clock::time_point arrived{};
};

class ControlChannel final {
 public:
  // Collective over MPI_COMM_WORLD, with the same options.transport on every rank.
  // Starts the communication thread. `mpi` outlives the channel (the
  // destructor frees its communicator). Over TCP, throws Error(kInternal) on
  // every rank when rank 0 cannot listen or a rank did not connect in time.
  explicit ControlChannel(const MpiRuntime& mpi, ControlChannelOptions options = {});
  // A joined member's channel: rank 0 is its only peer, over TCP; no MPI.
  // Its close() waits for rank 0's answering close marker (or the connection's
  // end), not for the cluster's.
  explicit ControlChannel(JoinedLink link, ControlChannelOptions options = {});
  // Without close() (after an error): stops without the closing agreement,
  // giving what was already queued a moment (200 ms) to leave.
  ~ControlChannel();
  ControlChannel(const ControlChannel&) = delete;
  ControlChannel& operator=(const ControlChannel&) = delete;

  // Any thread. The communication thread drives `endpoint` from its next pass
  // until detach(). detach() returns once the thread is not inside it, after
  // giving the endpoint's queued messages up to `flush` to be posted; it
  // drops the rest and returns how many. The endpoint's posted sends stay
  // with the channel until they complete (or the channel abandons them as
  // its own when it stops), so the endpoint may free its communicator then.
  void attach(CommEndpoint& endpoint);
  size_t detach(CommEndpoint& endpoint,
                std::chrono::milliseconds flush = std::chrono::milliseconds(0));
  // Any thread: an attached endpoint has new work; the thread passes at once.
  void wake();

  // Any thread, for an attached endpoint (`from`): the process's one send
  // path. Queues `bytes` for world rank `destination` on the endpoint's
  // communicator `comm` under `tag`, in `lane` (see SendQueue). Messages to
  // one destination in one lane are posted in the order queued.
  void post(const CommEndpoint& from, MPI_Comm comm, int destination, int tag,
            std::vector<std::byte> bytes, SendLane lane);
  // Any thread: a buffer of `size` bytes for post(), a finished send's when
  // one is spare (no allocation on the KV path once it runs).
  std::vector<std::byte> buffer(size_t size);

  Rank rank() const { return rank_; }
  // The MPI world's size (a joined member's: 0). Addresses from world_size()
  // up are joined members.
  int world_size() const { return world_size_; }
  bool joined() const { return joined_; }

  // Rank 0, any thread: from now on `member` (an address >= world_size(),
  // never used before) is a peer over `socket`, an authenticated, connected
  // TCP connection (owned from now on). Its messages arrive in the inbox
  // like a rank's; send(), forget() and the link-lost handler take it. Its
  // close marker (it leaves) is answered with rank 0's, and its connection
  // then closed; close() waits on members not yet gone as on ranks.
  void admit(Rank member, int socket);
  Transport transport() const { return options_.transport; }

  // Any thread. Encodes `message` on the caller's thread, queues it for
  // `destination` (another rank of the world) and wakes the communication
  // thread at once. Over TCP a send between two ranks other than 0 is
  // refused. Throws duet::Error once close() has begun.
  void send(Rank destination, const ControlMessage& message);

  // Any thread. The oldest received message, waiting up to `timeout` on a
  // condition variable (no CPU; a dispatcher thread loops on it); nullopt
  // when none came in time, or at once when the inbox is empty and the
  // channel has finished closing.
  std::optional<ReceivedMessage> receive(std::chrono::milliseconds timeout);
  std::optional<ReceivedMessage> try_receive() { return receive(std::chrono::milliseconds(0)); }
  // receive() until `deadline`; nullopt once it has passed (without waiting
  // at all when it already has).
  std::optional<ReceivedMessage> receive_until(std::chrono::steady_clock::time_point deadline);

  // Any thread. False once nothing more can arrive: the channel finished
  // closing, or stopped (an MPI failure, a failed close). A receive loop ends
  // when receive() returns nullopt and this is false.
  bool receiving() const;

  // Collective: every rank calls it, once, from one thread. Stops new sends,
  // delivers everything already queued, and returns once every rank not
  // forgotten has closed too, with every message sent before anyone's close()
  // received (it stays readable in the inbox). Returns true when every such
  // rank closed within `timeout`; false otherwise, and then the channel is
  // stopped regardless (sends still in flight are abandoned). It agrees on
  // the channel's own messages only: an endpoint's sends still in flight when
  // the ranks have closed get the destructor's moment, then are abandoned.
  bool close(std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Any thread. `intercept` sees every message received from then on, on
  // the communication thread, before it would enter the inbox; a message it
  // returns true for is consumed there (a RanksLost, which must be applied
  // even while this rank's main thread is busy elsewhere). It must be quick
  // and may call forget() and send(); an empty function removes it.
  using Intercept = std::function<bool(const ReceivedMessage&)>;
  void set_intercept(Intercept intercept);

  // Any thread. Over TCP a connection that ends (EOF, a reset) before the
  // peer's close marker is a lost peer: nothing waits on it (close() agrees
  // without it) and messages to it are dropped; an end after the marker is
  // the peer's orderly close. `handler` is called on the communication
  // thread, once per lost rank that was not forgotten, with why ("closed the
  // connection", a reset), so the coordinator counts its instance lost
  // without waiting out the lease (coordinator/cluster/remote_instance.h).
  // It must be quick and may call forget() and send(). After it
  // returns, a receive() waiting (or the next one) returns at once, so that
  // a dispatcher acts on it without waiting out its timeout. Never called
  // over MPI, where a lost peer shows only as its silence.
  using LinkLost = std::function<void(Rank rank, const std::string& why)>;
  void set_link_lost_handler(LinkLost handler);

  // Any thread: `ranks` are lost (dead or stalled, coordinator/cluster/liveness.h);
  // this rank is ignored. Nothing waits on them from then on: close() agrees
  // with the other ranks alone, messages to them still leave if they can but
  // hold nothing up, and a receive from them that had begun is given up. Over
  // TCP the thread closes their sockets on its next pass, once what was queued
  // for them had its chance to leave (what the socket takes at once); later
  // messages to them are dropped (Counters::unsent).
  void forget(std::span<const Rank> ranks);
  // Whether any rank of the MPI world was forgotten, or its TCP connection
  // lost (joined members do not count): MPI_Finalize may then wait on it
  // forever (tests/mpi/failure_probe_main.cpp), so the process leaves without it.
  bool forgot_any() const;

  struct Counters {
    int64_t sent = 0;       // messages handed to MPI
    int64_t received = 0;   // messages decoded into the inbox
    int64_t malformed = 0;  // received but not a control message (logged, dropped)
    // Sends to forgotten (lost) ranks that had not finished: their buffers
    // stay MPI's for good (a bounded leak: at most the bulk window per rank).
    int64_t abandoned_sends = 0;
    int64_t abandoned_bytes = 0;
    // TCP: messages to a rank whose connection had ended or was closed
    // (forgotten), dropped.
    int64_t unsent = 0;
    int64_t links_lost = 0;  // TCP: connections that ended before their close marker
  };
  Counters counters() const;

 private:
  ControlChannel(ControlChannelOptions options, Rank rank, int world_size, bool joined);
  // Tags of the channel's own messages (on its communicator, or in a frame's
  // header over TCP).
  static constexpr int kMessageTag = 1;  // one encoded ControlMessage
  static constexpr int kCloseTag = 2;    // empty: the sender has closed; nothing follows it

  struct Outgoing {
    MPI_Comm comm = MPI_COMM_NULL;
    int destination = 0;
    int tag = 0;
    SendLane lane = SendLane::kControl;
    std::vector<std::byte> bytes;        // owned until the send completes
    const CommEndpoint* from = nullptr;  // null: the channel's own message
    MPI_Request request = MPI_REQUEST_NULL;
  };
  // A message being received: its buffer is MPI's until the request is done.
  struct Incoming {
    Rank source;
    int tag = 0;
    std::vector<std::byte> bytes;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  // The TCP link's parts (control_channel_tcp.cpp).
  void connect_tcp(const MpiRuntime& mpi);  // the constructor's, over TCP
  void notify_thread();                     // under mutex_ or not: the thread looks again
  bool linked(int rank) const;              // whether messages to `rank` can go over the link
  bool over_tcp(int rank) const;            // whether messages to `rank` go over TCP, not MPI
  void apply_admissions();                  // pass and mutex_ held: new members onto the link
  void answer_close(int member);            // the thread: a member's close marker answered
  void drain_wake_fd();
  bool receive_tcp();          // frames into the inbox, ended connections noted
  void run();                  // the communication thread
  void queue_close_markers();  // under mutex_
  bool post_sends(std::vector<Outgoing>& fresh);
  bool test_sends();
  bool receive_some();
  bool start_receives();             // probed messages into incoming_
  bool finish_receives();            // finished ones, in order per source, into the inbox
  void apply_forgotten();            // under mutex_: new forget() calls
  void abandon(Outgoing& outgoing);  // under mutex_
  bool peers_settled() const;        // under mutex_: every other rank closed or forgotten
  void flush_for(std::chrono::milliseconds limit);
  void abandon_in_flight();

  const ControlChannelOptions options_;
  const Rank rank_;
  const int world_size_;
  const bool joined_;              // a joined member's channel (JoinedLink)
  MPI_Comm comm_ = MPI_COMM_NULL;  // used by the communication thread only (after construction)

  // Communication thread only.
  std::vector<Outgoing> in_flight_;
  int64_t n_endpoint_sends_in_flight_ = 0;
  std::vector<bool> closed_by_;    // by rank: its close marker arrived
  std::deque<Incoming> incoming_;  // receives begun, in the order they were matched
  // Receives from forgotten ranks that may never finish: kept (and at the
  // end leaked) because MPI may still write their buffers.
  std::vector<Incoming> abandoned_receives_;
  std::vector<Outgoing> abandoned_sends_;  // to forgotten ranks; see abandon()
  std::vector<bool> forgotten_seen_;       // by rank: apply_forgotten ran for it
  // TCP: the link (null over MPI), each rank's connection ended (EOF, reset),
  // and the forgotten ranks whose sockets close after this pass's sends.
  std::unique_ptr<TcpFrameLink> tcp_;
  std::vector<bool> ended_;
  std::vector<int> to_drop_;
  int wake_fd_ = -1;  // TCP: an eventfd the thread polls; written by notify_thread()

  // Held by the communication thread through each pass's MPI work (taking
  // from the queue and posting, testing, receiving, driving the endpoints):
  // whoever holds it knows that no message is between the queue and MPI.
  std::mutex pass_mutex_;
  std::vector<CommEndpoint*> endpoints_;  // guarded by pass_mutex_
  Intercept intercept_;                   // guarded by pass_mutex_
  LinkLost link_lost_;                    // guarded by pass_mutex_

  mutable std::mutex mutex_;                    // guards the members below
  std::condition_variable wake_;                // the communication thread waits here
  std::condition_variable inbox_ready_;         // receivers and close() wait here
  std::condition_variable taken_;               // detach() waits here for the queue to move
  SendQueue<Outgoing> queue_;                   // queued by send() and post(), not yet posted
  std::vector<std::vector<std::byte>> spares_;  // finished sends' buffers, for buffer()
  int64_t own_pending_ = 0;                     // the channel's own messages queued or in flight
  std::deque<ReceivedMessage> inbox_;
  bool woken_ = false;                 // wake(), send() or post() since the thread last looked
  bool closing_ = false;               // close() began: no more sends
  bool close_markers_queued_ = false;  // behind every message send() queued
  bool closed_ = false;                // every rank closed; the thread has ended
  bool stop_ = false;                  // end the thread now, without the closing agreement
  bool thread_done_ = false;           // nothing queued will be posted any more
  std::vector<bool> forgotten_;        // by rank: forget() named it
  // Members admitted and not yet on the link (address, socket); every
  // by-rank vector already covers them.
  std::vector<std::pair<int, int>> admitted_;
  bool forget_pending_ = false;     // forget() since the thread last applied it
  bool link_lost_any_ = false;      // a TCP connection ended before its close marker
  int64_t receive_interrupts_ = 0;  // receive() calls to return at once (a link lost)
  Counters counters_;

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace duet
