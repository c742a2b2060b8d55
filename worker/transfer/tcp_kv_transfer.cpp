#include "worker/transfer/tcp_kv_transfer.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/timer_slack.h"
#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

// What a transfer being destroyed gives its queued frames to leave.
constexpr auto kFlushOnDestroy = std::chrono::milliseconds(500);
// The longest the thread sleeps: deadlines are checked at least this often.
constexpr auto kTick = std::chrono::milliseconds(50);
// Bytes read from one socket per pass before the others get their turn.
constexpr size_t kReadPerPass = size_t{8} << 20;
// The largest body a frame may announce (a layer's rows of a long chunk are
// far smaller); more is a corrupt stream, and the peer is given up.
constexpr uint64_t kMaxBody = uint64_t{1} << 30;
// Written rows bodies kept for reuse (no fresh pages, no zeroing), and the
// smallest worth keeping.
constexpr size_t kMaxSpares = 64;
constexpr size_t kMinSpareBytes = 4096;
// Each KV socket's send buffer (the kernel caps it at net.core.wmem_max),
// instead of the autotuned one, which starts at 16 KiB.
constexpr int kSendBuffer = 4 << 20;
constexpr size_t kDrainBytes = size_t{1} << 16;

bool would_block() { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

}  // namespace

TcpKvTransfer::TcpKvTransfer(int self, std::map<int, int> sockets, TcpKvTransferOptions options)
    : self_(self),
      options_(options),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      protocol_({}, KvTransferProtocol::LostReceives::kStop),
      drain_(kDrainBytes) {
  DUET_REQUIRE(wake_fd_ >= 0, "kv transfer: eventfd: {}", strerror(errno));
  for (const auto& [rank, fd] : sockets) {
    peers_[rank].fd = fd;
    // Room for a layer's rows and more: send_rows then writes whole frames
    // from the blocks instead of packing what the socket did not take.
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSendBuffer, sizeof kSendBuffer);
  }
  thread_ = std::thread([this] { run(); });
}

TcpKvTransfer::~TcpKvTransfer() {
  const auto patience = Clock::now() + kFlushOnDestroy;
  while (!idle_sends() && Clock::now() < patience) {
    wake_thread();
    std::this_thread::sleep_for(2ms);
  }
  stop_ = true;
  wake_thread();
  thread_.join();
  size_t dropped = 0;
  for (auto& [rank, peer] : peers_) {
    dropped += peer.control.size() + peer.bulk.size() + (peer.writing ? 1 : 0);
    if (peer.fd >= 0) close(peer.fd);
  }
  if (dropped > 0) spdlog::warn("kv transfer: dropped {} unsent frame(s)", dropped);
  close(wake_fd_);
}

bool TcpKvTransfer::idle_sends() {
  std::lock_guard lock(mutex_);
  return std::all_of(peers_.begin(), peers_.end(), [](const auto& entry) {
    const Peer& peer = entry.second;
    return peer.fd < 0 ||
           (peer.control.empty() && peer.bulk.empty() && !peer.writing && !peer.claimed);
  });
}

void TcpKvTransfer::wake_thread() {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof one);
}

// ---------------------------------------------------------------- any thread

void TcpKvTransfer::queue(int destination, Frame frame, Lane lane) {
  const auto bytes = static_cast<int64_t>(frame.head.size() + frame.body.size());
  {
    std::lock_guard lock(mutex_);
    auto it = peers_.find(destination);
    if (it == peers_.end()) {
      // Never linked (a member this rank could not reach): lost to this
      // rank, so that no import waits on it.
      spdlog::error("kv transfer: no connection to rank {}; a frame dropped", destination);
      lost_.push_back(destination);
    }
    if (it == peers_.end() || it->second.fd < 0) {
      if (it == peers_.end()) wake_thread();
      return;  // lost: nothing more goes to it
    }
    (lane == Lane::kControl ? it->second.control : it->second.bulk).push_back(std::move(frame));
  }
  count_sent(bytes);
  wake_thread();
}

std::vector<std::byte> TcpKvTransfer::body_buffer(size_t size) {
  std::lock_guard lock(mutex_);
  return body_buffer_locked(size);
}

std::vector<std::byte> TcpKvTransfer::body_buffer_locked(size_t size) {
  std::vector<std::byte> bytes;
  if (!spares_.empty()) {
    bytes = std::move(spares_.back());
    spares_.pop_back();
  }
  bytes.resize(size);
  return bytes;
}

bool TcpKvTransfer::send_from_blocks(int rank, const kv_wire::Header& header, const KvCache& cache,
                                     std::span<const int32_t> block_table, int64_t layer,
                                     int64_t pos0, int64_t n, KvHeads heads) {
  std::vector<std::byte> head = kv_wire::header_bytes(header);
  send_parts_.clear();
  send_parts_.push_back({head.data(), head.size()});
  // The sender's runs in the packed order (iovec's pointer is not const: only read here).
  auto* base = const_cast<KvElement*>(cache.data());
  for_each_packed_run(
      cache.layout(), layer, block_table, pos0, n, heads, [&](int64_t at, int64_t elems) {
        send_parts_.push_back({base + at, static_cast<size_t>(elems) * sizeof(KvElement)});
      });
  if (send_parts_.size() > static_cast<size_t>(IOV_MAX)) return false;
  const size_t total = head.size() + header.ticket_bytes;
  Peer* found = nullptr;
  int fd = -1;
  {
    std::lock_guard lock(mutex_);
    auto it = peers_.find(rank);
    if (it == peers_.end()) return false;
    found = &it->second;
    Peer& peer = *found;
    if (peer.fd < 0 || peer.claimed || peer.writing || !peer.control.empty() || !peer.bulk.empty())
      return false;
    peer.claimed = true;
    fd = peer.fd;
  }
  Peer& peer = *found;  // the map never loses it
  msghdr message{};
  message.msg_iov = send_parts_.data();
  message.msg_iovlen = send_parts_.size();
  const ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL);
  bool wake = false;
  {
    std::lock_guard lock(mutex_);
    peer.claimed = false;
    if (peer.unclosed >= 0) {  // lost meanwhile: nothing more goes to it
      close(std::exchange(peer.unclosed, -1));
      return true;
    }
    if (sent > 0 && static_cast<size_t>(sent) < total) {
      // The rest leaves from a packed copy, before anything else to this peer.
      Frame frame{std::move(head), body_buffer_locked(header.ticket_bytes)};
      pack_kv_rows(cache.layout(), cache.data(), layer, block_table, pos0, n, heads,
                   reinterpret_cast<KvElement*>(frame.body.data()));
      peer.writing = std::move(frame);
      peer.written = static_cast<size_t>(sent);
    }
    // Frames queued while the socket was claimed, or the rest above.
    wake = peer.writing || !peer.control.empty() || !peer.bulk.empty();
  }
  if (wake) wake_thread();
  if (sent <= 0) return false;  // full, or broken (the thread finds out): packed and queued
  count_sent(static_cast<int64_t>(total));
  return true;
}

void TcpKvTransfer::peers_lost(std::span<const Rank> ranks) {
  {
    std::lock_guard lock(mutex_);
    for (Rank rank : ranks) lost_.push_back(rank.value);
  }
  wake_thread();
}

bool TcpKvTransfer::add_peer(int rank, int fd) {
  std::lock_guard state(state_mutex_);  // the thread is not inside a pass
  {
    std::lock_guard lock(mutex_);
    if (peers_.contains(rank)) {
      close(fd);
      spdlog::warn("kv transfer: rank {} already has a connection; the new one closed", rank);
      return false;
    }
    peers_[rank].fd = fd;
  }
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &kSendBuffer, sizeof kSendBuffer);
  wake_thread();
  return true;
}

void TcpKvTransfer::send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                              const KvCache& cache, std::span<const int32_t> block_table,
                              int64_t head_offset, const KvSource& heads) {
  if (id.value == options_.drop_rows_of && options_.drop_rows_of != 0) return;  // tests only
  const KvLayout& layout = cache.layout();
  const KvHeads local{heads.head_begin - head_offset, heads.head_end - heads.head_begin};
  const size_t elems = static_cast<size_t>(packed_kv_elems(layout, n, local));
  kv_wire::Header header{kv_wire::kMagic,  kv_wire::kRows, id.value, layer, pos0, n, 0,
                         heads.head_begin, heads.head_end};
  header.ticket_bytes = elems * sizeof(KvElement);
  // Checksums are of the packed rows: those frames are always packed.
  if (!options_.checksums &&
      send_from_blocks(decode_rank, header, cache, block_table, layer, pos0, n, local))
    return;
  Frame frame;
  frame.body = body_buffer(elems * sizeof(KvElement));
  auto* rows = reinterpret_cast<KvElement*>(frame.body.data());
  pack_kv_rows(layout, cache.data(), layer, block_table, pos0, n, local, rows);
  if (options_.checksums) header.checksum = kv_wire::rows_checksum({rows, elems});
  frame.head = kv_wire::header_bytes(header);
  queue(decode_rank, std::move(frame), Lane::kBulk);
}

void TcpKvTransfer::send_handoff(int decode_peer, const KvHandoff& handoff) {
  if (handoff.id.value == options_.drop_rows_of && options_.drop_rows_of != 0) {
    spdlog::warn("kv transfer: request {}: rows and handoff dropped (DUET_TEST_DROP_KV_ROWS_OF)",
                 handoff.id.value);
    return;
  }
  // Behind the rows it follows, in the same lane.
  queue(decode_peer, Frame{kv_wire::control_bytes(handoff), {}}, Lane::kBulk);
}

void TcpKvTransfer::forget_imports(const KvCache& cache) {
  std::lock_guard state(state_mutex_);  // the thread is not inside a pass
  drop_queued_starts(cache);
  KvTransferActions actions;
  protocol_.forget_imports(cache, Clock::now(), actions);
  std::vector<KvTransferCall> dropped;  // the owner is going away: no handler runs
  act(actions, dropped);
  // Payloads arriving into `cache` are drained from here on: the socket is
  // ours, so nothing writes the cache once this returns.
  for (auto& [rank, peer] : peers_) {
    if (peer.payload && peer.whole && peer.into == &cache) {
      peer.whole = false;
      peer.runs.clear();
      peer.next_run = 0;
    }
  }
}

// ---------------------------------------------------------------- the thread

void TcpKvTransfer::run() {
  set_thread_timer_slack();
  std::vector<pollfd> fds;
  std::vector<int> ranks;  // of fds[1...]
  while (!stop_) {
    // In a burst the sockets are tested every transfer_poll rather than
    // waited on (see the header). Only this thread writes last_bytes_.
    const bool fast = Clock::now() - last_bytes_ < options_.burst_window;
    fds.clear();
    ranks.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    {
      std::lock_guard lock(mutex_);
      for (auto& [rank, peer] : peers_) {
        if (peer.fd < 0) continue;
        const bool sending =
            !peer.claimed && (peer.writing || !peer.control.empty() || !peer.bulk.empty());
        fds.push_back({peer.fd, static_cast<short>(POLLIN | (sending ? POLLOUT : 0)), 0});
        ranks.push_back(rank);
      }
    }
    const int ready = poll(fds.data(), fds.size(), fast ? 0 : static_cast<int>(kTick.count()));
    if (fds[0].revents & POLLIN) {
      uint64_t count = 0;
      [[maybe_unused]] const ssize_t n = read(wake_fd_, &count, sizeof count);
    }
    std::vector<KvTransferCall> calls;
    {
      std::lock_guard state(state_mutex_);
      apply_losses(calls);
      take_commands(calls);
      for (size_t i = 1; i < fds.size(); ++i) {
        if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        Peer& peer = peers_.at(ranks[i - 1]);
        if (peer.fd >= 0 && !receive(ranks[i - 1], peer, calls))
          lose(ranks[i - 1], peer, "its connection closed", calls);
      }
      for (auto& [rank, peer] : peers_) {  // what the passes queued leaves now
        if (peer.fd >= 0 && !send(rank, peer)) lose(rank, peer, "send failed", calls);
      }
      KvTransferActions actions;
      protocol_.expire(Clock::now(), actions);
      act(actions, calls);
      set_rows_dropped(protocol_.rows_dropped());
    }
    deliver(calls);  // handlers run without the state lock
    if (fast && ready == 0) std::this_thread::sleep_for(options_.transfer_poll);
  }
}

void TcpKvTransfer::take_commands(std::vector<KvTransferCall>& calls) {
  KvTransferActions actions;
  apply_commands(protocol_, actions);
  act(actions, calls);
}

void TcpKvTransfer::apply_losses(std::vector<KvTransferCall>& calls) {
  std::vector<int> lost;
  {
    std::lock_guard lock(mutex_);
    lost.swap(lost_);
  }
  for (int rank : lost) {
    auto it = peers_.find(rank);
    if (it != peers_.end() && it->second.fd >= 0) {
      lose(rank, it->second, "lost, says the coordinator", calls);
    } else {
      const int ranks[] = {rank};
      KvTransferActions actions;
      protocol_.peers_lost(ranks, Clock::now(), actions);
      act(actions, calls);
    }
  }
}

void TcpKvTransfer::lose(int rank, Peer& peer, const char* why,
                         std::vector<KvTransferCall>& calls) {
  {
    std::lock_guard lock(mutex_);
    // A write from the blocks in progress closes it when it returns.
    if (peer.claimed) {
      peer.unclosed = peer.fd;
    } else {
      close(peer.fd);
    }
    peer.fd = -1;
    peer.control.clear();
    peer.bulk.clear();
    peer.writing.reset();
  }
  // Nothing writes the blocks of a payload half-received any more.
  peer.in_body = false;
  peer.payload = false;
  peer.whole = false;
  peer.runs.clear();
  peer.header_got = 0;
  spdlog::info("kv transfer: rank {}: {}; no longer waiting on it", rank, why);
  const int ranks[] = {rank};
  KvTransferActions actions;
  protocol_.peers_lost(ranks, Clock::now(), actions);
  act(actions, calls);
}

bool TcpKvTransfer::receive(int rank, Peer& peer, std::vector<KvTransferCall>& calls) {
  size_t budget = kReadPerPass;
  while (budget > 0) {
    ssize_t n = 0;
    if (!peer.in_body) {
      n = recv(peer.fd, peer.header.data() + peer.header_got, peer.header.size() - peer.header_got,
               0);
    } else if (!peer.payload) {  // a control message, after its header in `message`
      const size_t at = peer.message.size() - peer.body_left;
      n = recv(peer.fd, peer.message.data() + at, peer.body_left, 0);
    } else if (peer.whole) {  // straight into the blocks
      const size_t count = std::min<size_t>(peer.runs.size() - peer.next_run, IOV_MAX);
      n = readv(peer.fd, peer.runs.data() + peer.next_run, static_cast<int>(count));
    } else {
      n = recv(peer.fd, drain_.data(), std::min(drain_.size(), peer.body_left), 0);
    }
    if (n == 0) return false;  // EOF
    if (n < 0) return would_block();
    last_bytes_ = Clock::now();
    budget -= std::min(budget, static_cast<size_t>(n));
    if (!peer.in_body) {
      peer.header_got += static_cast<size_t>(n);
      if (peer.header_got == peer.header.size()) {
        on_header(rank, peer, calls);
        if (peer.fd < 0) return true;  // lost while handling it
      }
      continue;
    }
    peer.body_left -= static_cast<size_t>(n);
    if (peer.payload && peer.whole) {  // advance the runs
      size_t done = static_cast<size_t>(n);
      while (done > 0) {
        iovec& run = peer.runs[peer.next_run];
        const size_t take = std::min(done, run.iov_len);
        run.iov_base = static_cast<std::byte*>(run.iov_base) + take;
        run.iov_len -= take;
        done -= take;
        if (run.iov_len == 0) ++peer.next_run;
      }
    }
    if (peer.body_left == 0) on_frame_end(rank, peer, calls);
  }
  return true;
}

void TcpKvTransfer::on_header(int rank, Peer& peer, std::vector<KvTransferCall>& calls) {
  peer.header_got = 0;
  const std::optional<kv_wire::Header> header = kv_wire::read_header(peer.header);
  const uint64_t body = header ? kv_wire::body_bytes(*header) : 0;
  if (!header || body > kMaxBody) {
    spdlog::error("kv transfer: rank {} sent a frame that is not the transfer's", rank);
    lose(rank, peer, "its stream is broken", calls);
    return;
  }
  // A follower's import may have been registered just before its rows came.
  take_commands(calls);
  peer.in_body = true;
  peer.body_left = body;
  if (header->kind != kv_wire::kRows) {
    peer.payload = false;
    peer.message.assign(peer.header.begin(), peer.header.end());
    peer.message.resize(sizeof(kv_wire::Header) + body);
  } else {
    KvTransferActions actions;
    protocol_.on_message(rank, peer.header, Clock::now(), actions);
    act(actions, calls);
    const std::optional<KvTransferProtocol::PayloadPlace> place = protocol_.payload_place(rank);
    DUET_ASSERT(place.has_value(), "a rows header from rank {} expects no payload", rank);
    peer.payload = true;
    peer.whole = place->into != nullptr && place->bytes == static_cast<int64_t>(body);
    peer.runs.clear();
    peer.next_run = 0;
    peer.into = nullptr;
    if (peer.whole) {
      place_runs(*place, peer);
      peer.into = place->into->cache;
      protocol_.payload_receiving(rank);
    }
  }
  if (body == 0) on_frame_end(rank, peer, calls);
}

void TcpKvTransfer::on_frame_end(int rank, Peer& peer, std::vector<KvTransferCall>& calls) {
  peer.in_body = false;
  KvTransferActions actions;
  if (peer.payload) {
    count_received(static_cast<int64_t>(sizeof(kv_wire::Header) +
                                        kv_wire::body_bytes(*kv_wire::read_header(peer.header))));
    peer.payload = false;
    peer.runs.clear();
    protocol_.payload_landed(rank, peer.whole, Clock::now(), actions);
    peer.whole = false;
  } else {
    count_received(static_cast<int64_t>(peer.message.size()));
    protocol_.on_message(rank, peer.message, Clock::now(), actions);
  }
  act(actions, calls);
}

void TcpKvTransfer::place_runs(const KvTransferProtocol::PayloadPlace& place, Peer& peer) {
  for_each_payload_run(place, [&](KvElement* address, size_t bytes) {
    peer.runs.push_back({address, bytes});
  });
}

bool TcpKvTransfer::send(int rank, Peer& peer) {
  for (;;) {
    const Frame* frame = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (peer.claimed) return true;  // send_from_blocks is writing; it wakes the thread after
      if (!peer.writing) {
        std::deque<Frame>& lane = !peer.control.empty() ? peer.control : peer.bulk;
        if (lane.empty()) return true;
        peer.writing = std::move(lane.front());
        lane.pop_front();
        peer.written = 0;
      }
      frame = &*peer.writing;  // only this thread resets it
    }
    const size_t total = frame->head.size() + frame->body.size();
    iovec parts[2];
    int n_parts = 0;
    if (peer.written < frame->head.size()) {
      parts[n_parts++] = {const_cast<std::byte*>(frame->head.data()) + peer.written,
                          frame->head.size() - peer.written};
      if (!frame->body.empty())
        parts[n_parts++] = {const_cast<std::byte*>(frame->body.data()), frame->body.size()};
    } else {
      const size_t at = peer.written - frame->head.size();
      parts[n_parts++] = {const_cast<std::byte*>(frame->body.data()) + at, frame->body.size() - at};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = static_cast<size_t>(n_parts);
    const ssize_t n = sendmsg(peer.fd, &message, MSG_NOSIGNAL);
    if (n < 0) {
      if (would_block()) return true;
      spdlog::warn("kv transfer: to rank {}: {}", rank, strerror(errno));
      return false;
    }
    peer.written += static_cast<size_t>(n);
    if (peer.written < total) continue;
    std::lock_guard lock(mutex_);
    if (spares_.size() < kMaxSpares && peer.writing->body.capacity() >= kMinSpareBytes)
      spares_.push_back(std::move(peer.writing->body));
    peer.writing.reset();
  }
}

void TcpKvTransfer::act(KvTransferActions& actions, std::vector<KvTransferCall>& calls) {
  while (!actions.empty()) {
    for (KvTransferActions::Send& send : std::exchange(actions.sends, {}))
      queue(send.destination, Frame{std::move(send.bytes), {}}, Lane::kControl);
    // Device transfers are not carried over TCP: nothing asks for them.
    for (const KvTransferActions::DeviceReceive& receive :
         std::exchange(actions.device_receives, {})) {
      spdlog::error("kv transfer: device rows from rank {} over TCP; dropped", receive.source);
    }
    actions.staging_released.clear();
    for (KvTransferCall& call : std::exchange(actions.calls, {})) calls.push_back(std::move(call));
  }
}

}  // namespace duet
