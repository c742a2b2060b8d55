#include "worker/transfer/mpi_kv_transfer.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <utility>

#include "common/error.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/kv_transfer_wire.h"

namespace duet {
namespace {

// What a transfer being destroyed gives its queued sends to be posted.
constexpr auto kFlushOnDestroy = std::chrono::milliseconds(500);
// How long forget_imports waits for device payloads before it gives their device transfers up.
constexpr auto kForgetPatience = std::chrono::seconds(5);
// Messages (headers, then payloads) received per pass before the thread
// looks at its other work again.
constexpr int kMaxReceivesPerPass = 64;
// MPI_Test calls in a row on a payload still arriving, per pass.
constexpr int kPayloadTestsPerPass = 64;

// Which world ranks `device` carries rows to and from.
std::vector<bool> device_peers(int world_size, const DeviceKvLink* device) {
  std::vector<bool> peers(static_cast<size_t>(world_size), false);
  for (int peer = 0; device != nullptr && peer < world_size; ++peer)
    peers[static_cast<size_t>(peer)] = device->carries(peer);
  return peers;
}

}  // namespace

MpiKvTransfer::MpiKvTransfer(ControlChannel& channel, MpiKvTransferOptions options,
                             std::unique_ptr<DeviceKvLink> device)
    : channel_(channel),
      options_(options),
      device_(std::move(device)),
      cma_(std::make_unique<CmaStaging>(options_.cma_staging_bytes)),
      protocol_(device_peers(channel.world_size(), device_.get())) {
  DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  connect_cma();
  channel_.attach(*this);
}

void MpiKvTransfer::connect_cma() {
  int world = 0, rank = 0;
  DUET_MPI_CHECK(MPI_Comm_size(comm_, &world));
  DUET_MPI_CHECK(MPI_Comm_rank(comm_, &rank));
  const CmaStaging::Endpoint mine = cma_->endpoint();
  std::vector<CmaStaging::Endpoint> endpoints(static_cast<size_t>(world));
  DUET_MPI_CHECK(
      MPI_Allgather(&mine, sizeof mine, MPI_BYTE, endpoints.data(), sizeof mine, MPI_BYTE, comm_));
  // reads[s]: this rank reads rank s's staging. Every rank probes before
  // any rank leaves the second gather, so no payload has overwritten a nonce.
  std::vector<uint8_t> reads(static_cast<size_t>(world), 0);
  std::vector<int> sources, readers;
  for (int s = 0; s < world; ++s) {
    const CmaStaging::Endpoint& peer = endpoints[static_cast<size_t>(s)];
    if (s == rank || options_.cma_staging_bytes == 0 || !CmaStaging::can_read(peer)) continue;
    reads[static_cast<size_t>(s)] = 1;
    cma_->add_source(s, peer);
    sources.push_back(s);
  }
  std::vector<uint8_t> all_reads(static_cast<size_t>(world) * static_cast<size_t>(world));
  DUET_MPI_CHECK(
      MPI_Allgather(reads.data(), world, MPI_UINT8_T, all_reads.data(), world, MPI_UINT8_T, comm_));
  for (int r = 0; r < world; ++r) {
    if (all_reads[static_cast<size_t>(r) * static_cast<size_t>(world) +
                  static_cast<size_t>(rank)] == 0)
      continue;
    cma_->add_reader(r);
    readers.push_back(r);
  }
  if (!sources.empty() || !readers.empty()) {
    spdlog::info(
        "kv transfer: rank {}: rows to ranks [{}] and from ranks [{}] by cross-memory attach "
        "({} MiB staging)",
        rank, fmt::join(readers, ", "), fmt::join(sources, ", "), options_.cma_staging_bytes >> 20);
  }
}

MpiKvTransfer::~MpiKvTransfer() {
  // Payloads in CMA staging: their receivers get a moment to read them and
  // answer (the thread, still attached, takes the answers).
  const auto patience = Clock::now() + kFlushOnDestroy;
  while (cma_->n_held() > 0 && Clock::now() < patience)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const size_t dropped = channel_.detach(*this, kFlushOnDestroy);
  if (dropped > 0) spdlog::warn("kv transfer: dropped {} unposted send(s)", dropped);
  // Sends still in flight on the communicator complete normally after this.
  // Receives from lost ranks never do: their buffers stay MPI's, and the
  // communicator they name is not freed.
  if (abandoned_any_) {
    for (std::vector<std::byte>& bytes : abandoned_buffers_)
      static_cast<void>(new std::vector<std::byte>(std::move(bytes)));  // leaked
    return;
  }
  MPI_Comm_free(&comm_);
}

void MpiKvTransfer::peers_lost(std::span<const Rank> ranks) {
  {
    std::lock_guard lock(mutex_);
    for (Rank rank : ranks) lost_.push_back(rank.value);
  }
  channel_.wake();
}

void MpiKvTransfer::apply_losses(std::vector<KvTransferCall>& calls) {
  std::vector<int> lost;
  {
    std::lock_guard lock(mutex_);
    lost.swap(lost_);
  }
  if (lost.empty()) return;
  for (int rank : lost) {
    cma_->release_all(rank);  // what it never answered is free again
    if (auto it = header_receives_.find(rank); it != header_receives_.end()) {
      for (HeaderReceive& receive : it->second)
        abandoned_buffers_.push_back(std::move(receive.bytes));
      abandoned_any_ = abandoned_any_ || !it->second.empty();
      header_receives_.erase(it);
    }
    if (auto it = payload_receives_.find(rank); it != payload_receives_.end()) {
      abandoned_buffers_.push_back(std::move(it->second.scratch));
      abandoned_any_ = true;
      payload_receives_.erase(it);
    }
  }
  KvTransferActions actions;
  protocol_.peers_lost(lost, Clock::now(), actions);
  act(actions, calls);
}

// ---------------------------------------------------------------- any thread

void MpiKvTransfer::queue(int destination, int tag, std::vector<std::byte> bytes, SendLane lane) {
  count_sent(static_cast<int64_t>(bytes.size()));
  channel_.post(*this, comm_, destination, tag, std::move(bytes), lane);
}

void MpiKvTransfer::send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                              const KvCache& cache, std::span<const int32_t> block_table,
                              int64_t head_offset, const KvSource& heads) {
  if (id.value == options_.drop_rows_of && options_.drop_rows_of != 0) return;  // tests only
  const KvLayout& layout = cache.layout();
  const KvHeads local{heads.head_begin - head_offset, heads.head_end - heads.head_begin};
  kv_wire::Header header{kv_wire::kMagic,  kv_wire::kRows, id.value, layer, pos0, n, 0,
                         heads.head_begin, heads.head_end};
  if (cache.device_copy().valid() && device_transfer(decode_rank)) {
    const std::optional<DeviceRowsTicket> ticket =
        device_->send(decode_rank, layout, cache.device_copy(), layer, block_table, pos0, n, local);
    if (!ticket) {
      // The receiver's import fails on the handoff's row count or its deadline.
      spdlog::warn(
          "kv transfer: request {}: the device transfer to rank {} is full or broken; "
          "layer {} rows not sent",
          id.value, decode_rank, layer);
      return;
    }
    header.kind = kv_wire::kDeviceRows;
    header.ticket_offset = ticket->offset;
    header.ticket_bytes = ticket->bytes;
    count_device_sent(static_cast<int64_t>(ticket->bytes));
    queue(decode_rank, kv_wire::kHeaderTag, kv_wire::header_bytes(header), SendLane::kControl);
    return;
  }
  const size_t elems = static_cast<size_t>(packed_kv_elems(layout, n, local));
  if (const auto region = cma_->acquire(decode_rank, elems * sizeof(KvElement))) {
    auto* rows = reinterpret_cast<KvElement*>(region->data);
    pack_kv_rows(layout, cache.data(), layer, block_table, pos0, n, local, rows);
    if (options_.checksums) header.checksum = kv_wire::rows_checksum({rows, elems});
    header.kind = kv_wire::kCmaRows;
    header.ticket_offset = region->ticket.offset;
    header.ticket_bytes = region->ticket.bytes;
    count_cma_sent(static_cast<int64_t>(region->ticket.bytes));
    queue(decode_rank, kv_wire::kHeaderTag, kv_wire::header_bytes(header), SendLane::kControl);
    return;
  }
  std::vector<std::byte> payload = channel_.buffer(elems * sizeof(KvElement));
  DUET_REQUIRE(payload.size() <= static_cast<size_t>(INT_MAX),
               "kv transfer: a {}-byte message is over MPI's 2 GiB count limit", payload.size());
  auto* rows = reinterpret_cast<KvElement*>(payload.data());
  pack_kv_rows(layout, cache.data(), layer, block_table, pos0, n, local, rows);
  if (options_.checksums) header.checksum = kv_wire::rows_checksum({rows, elems});
  queue(decode_rank, kv_wire::kHeaderTag, kv_wire::header_bytes(header), SendLane::kControl);
  queue(decode_rank, kv_wire::kPayloadTag, std::move(payload), SendLane::kBulk);
}

void MpiKvTransfer::send_handoff(int decode_peer, const KvHandoff& handoff) {
  if (handoff.id.value == options_.drop_rows_of && options_.drop_rows_of != 0) {
    spdlog::warn("kv transfer: request {}: rows and handoff dropped (DUET_TEST_DROP_KV_ROWS_OF)",
                 handoff.id.value);
    return;
  }
  queue(decode_peer, kv_wire::kHeaderTag, kv_wire::control_bytes(handoff), SendLane::kControl);
}

bool MpiKvTransfer::device_transfer(int peer) const {
  return device_ != nullptr && device_->carries(peer);
}

void MpiKvTransfer::forget_imports(const KvCache& cache) {
  std::lock_guard state(state_mutex_);  // the communication thread is not inside progress()
  drop_queued_starts(cache);
  KvTransferActions actions;
  protocol_.forget_imports(cache, Clock::now(), actions);
  std::vector<KvTransferCall> dropped;  // the owner is going away: no handler runs
  act(actions, dropped);
  // Device payloads may still be landing in `cache` (one engine, one cache
  // per rank: wait for all of them).
  if (device_ == nullptr) return;
  const auto patience = Clock::now() + kForgetPatience;
  while (!protocol_.device_receipts_done()) {
    if (Clock::now() > patience) {
      spdlog::warn(
          "kv transfer: device payloads still in flight at shutdown; giving up their connections");
      for (int peer = 0; peer < channel_.world_size(); ++peer) {
        if (device_transfer(peer)) device_->abandon(peer);
      }
    }
    if (!poll_device(dropped)) std::this_thread::sleep_for(std::chrono::microseconds(200));
    dropped.clear();
    if (Clock::now() > patience + kForgetPatience) break;
  }
}

// ---------------------------------------------------------------- the communication thread

// Fast polling costs the decode rank CPU, and an import may wait seconds in
// the prefill side's queue: poll fast while device payloads are in flight
// and while the protocol expects rows soon (KvTransferProtocol::fast_poll).
bool MpiKvTransfer::in_flight() const {
  std::lock_guard state(state_mutex_);
  if (device_ != nullptr && (device_->busy() || protocol_.holding())) return true;
  return protocol_.fast_poll(Clock::now());
}

bool MpiKvTransfer::progress() {
  std::vector<KvTransferCall> calls;
  bool active = false;
  {
    std::lock_guard state(state_mutex_);
    apply_losses(calls);
    active = take_commands(calls) || active;
    active = receive_headers(calls) || active;
    active = receive_payloads(calls) || active;
    if (device_ != nullptr) active = poll_device(calls) || active;
    KvTransferActions actions;
    protocol_.expire(Clock::now(), actions);
    act(actions, calls);
    set_rows_dropped(protocol_.rows_dropped());
  }
  active = active || !calls.empty();
  deliver(calls);  // handlers run without the state lock
  return active;
}

bool MpiKvTransfer::take_commands(std::vector<KvTransferCall>& calls) {
  KvTransferActions actions;
  const bool any = apply_commands(protocol_, actions);
  act(actions, calls);
  return any;
}

bool MpiKvTransfer::receive_headers(std::vector<KvTransferCall>& calls) {
  bool any = false;
  for (int i = 0; i < kMaxReceivesPerPass; ++i) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    DUET_MPI_CHECK(
        MPI_Improbe(MPI_ANY_SOURCE, kv_wire::kHeaderTag, comm_, &flag, &message, &status));
    if (!flag) break;
    any = true;
    int count = 0;
    DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
    std::deque<HeaderReceive>& from = header_receives_[status.MPI_SOURCE];
    from.push_back(HeaderReceive{std::vector<std::byte>(static_cast<size_t>(count))});
    DUET_MPI_CHECK(
        MPI_Imrecv(from.back().bytes.data(), count, MPI_BYTE, &message, &from.back().request));
  }
  // Each source's headers in the order they were sent: its oldest first.
  for (auto& [source, from] : header_receives_) {
    while (!from.empty()) {
      int done = 0;
      DUET_MPI_CHECK(MPI_Test(&from.front().request, &done, MPI_STATUS_IGNORE));
      if (!done) break;
      any = true;
      const std::vector<std::byte> bytes = std::move(from.front().bytes);
      from.pop_front();
      count_received(static_cast<int64_t>(bytes.size()));
      // A follower's import may have been registered after this pass began
      // (its leader told it just before the order left): take it first.
      take_commands(calls);
      KvTransferActions actions;
      protocol_.on_message(source, bytes, Clock::now(), actions);
      act(actions, calls);
    }
  }
  return any;
}

bool MpiKvTransfer::receive_payloads(std::vector<KvTransferCall>& calls) {
  int received = 0;
  for (int source : protocol_.payload_sources()) {
    while (received < kMaxReceivesPerPass) {
      const std::optional<KvTransferProtocol::PayloadPlace> place = protocol_.payload_place(source);
      if (!place) break;
      auto pending = payload_receives_.find(source);
      if (pending == payload_receives_.end()) {
        int flag = 0;
        MPI_Message message;
        MPI_Status status;
        DUET_MPI_CHECK(MPI_Improbe(source, kv_wire::kPayloadTag, comm_, &flag, &message, &status));
        if (!flag) break;  // not sent yet: it is received on a later pass
        int count = 0;
        DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
        count_received(count);
        PayloadReceive receive;
        receive.whole = place->into != nullptr && count == place->bytes;
        if (receive.whole) {
          receive.request = receive_into_blocks(message, *place);
          protocol_.payload_receiving(source);
        } else {  // not wanted, or not the size its header says: into scratch, dropped
          receive.scratch.resize(static_cast<size_t>(count));
          DUET_MPI_CHECK(
              MPI_Imrecv(receive.scratch.data(), count, MPI_BYTE, &message, &receive.request));
        }
        pending = payload_receives_.emplace(source, std::move(receive)).first;
      }
      // A payload into the blocks' datatype arrives in fragments, each moved
      // inside an MPI call: test it a bounded number of times in a row (a
      // way out stays: a later pass finishes what this one does not).
      int done = 0;
      for (int test = 0; test < kPayloadTestsPerPass && done == 0; ++test)
        DUET_MPI_CHECK(MPI_Test(&pending->second.request, &done, MPI_STATUS_IGNORE));
      if (!done) break;  // still arriving: a later pass finishes it
      ++received;
      const bool whole = pending->second.whole;
      payload_receives_.erase(pending);
      KvTransferActions actions;
      protocol_.payload_landed(source, whole, Clock::now(), actions);
      act(actions, calls);
    }
  }
  return received > 0;
}

MPI_Request MpiKvTransfer::receive_into_blocks(MPI_Message& message,
                                               const KvTransferProtocol::PayloadPlace& place) {
  // The packed order (worker/kv/kv_rows.h) as runs of the blocks.
  type_lengths_.clear();
  type_addresses_.clear();
  for_each_payload_run(place, [&](KvElement* address, size_t bytes) {
    MPI_Aint mpi_address = 0;
    DUET_MPI_CHECK(MPI_Get_address(address, &mpi_address));
    type_addresses_.push_back(mpi_address);
    type_lengths_.push_back(static_cast<int>(bytes));
  });
  MPI_Datatype rows;
  DUET_MPI_CHECK(MPI_Type_create_hindexed(static_cast<int>(type_lengths_.size()),
                                          type_lengths_.data(), type_addresses_.data(), MPI_BYTE,
                                          &rows));
  DUET_MPI_CHECK(MPI_Type_commit(&rows));
  MPI_Request request = MPI_REQUEST_NULL;
  const int code = MPI_Imrecv(MPI_BOTTOM, 1, rows, &message, &request);
  MPI_Type_free(&rows);  // the receive keeps what it needs of it
  DUET_MPI_CHECK(code);
  return request;
}

std::optional<std::string> MpiKvTransfer::read_cma(const KvTransferActions::CmaRead& read) {
  cma_runs_.clear();
  const KvTransferProtocol::PayloadPlace place{read.into, read.layer, read.pos0,
                                               read.n,    read.heads, 0};
  for_each_payload_run(place, [&](KvElement* address, size_t bytes) {
    cma_runs_.push_back({address, bytes});
  });
  std::optional<std::string> error = cma_->read(read.source, read.ticket, cma_runs_);
  if (!error) count_cma_received(static_cast<int64_t>(read.ticket.bytes));
  return error;
}

bool MpiKvTransfer::poll_device(std::vector<KvTransferCall>& calls) {
  std::vector<DeviceKvLink::Done> done;
  try {
    done = device_->poll();
  } catch (const std::exception& e) {
    // The device transfer give up the pairs they can blame; this thread goes on.
    spdlog::error("kv transfer: device transfer: {}", e.what());
    return false;
  }
  for (const std::string& note : device_->take_notes())
    spdlog::error("kv transfer: device transfer: {}", note);
  for (const DeviceKvLink::Done& d : done) {
    KvTransferActions actions;
    protocol_.device_receipt_done(d, Clock::now(), actions);
    act(actions, calls);
  }
  return !done.empty();
}

void MpiKvTransfer::act(KvTransferActions& actions, std::vector<KvTransferCall>& calls) {
  while (!actions.empty()) {
    for (KvTransferActions::Send& send : std::exchange(actions.sends, {}))
      queue(send.destination, kv_wire::kHeaderTag, std::move(send.bytes), SendLane::kControl);
    for (const KvTransferActions::StagingReleased& released :
         std::exchange(actions.staging_released, {})) {
      if (device_transfer(released.peer)) {
        device_->released(released.peer, released.ticket);
      } else if (!cma_->release(released.peer, released.ticket)) {
        spdlog::error("kv transfer: rank {} gave back CMA staging [{}, +{}) it does not hold",
                      released.peer, released.ticket.offset, released.ticket.bytes);
      }
    }
    for (const KvTransferActions::CmaRead& read : std::exchange(actions.cma_reads, {})) {
      std::optional<std::string> error;
      if (read.into != nullptr) error = read_cma(read);
      protocol_.cma_read_done(read, error, Clock::now(), actions);
    }
    for (const KvTransferActions::DeviceReceive& receive :
         std::exchange(actions.device_receives, {}))
      start_receipt(receive, actions);
    for (KvTransferCall& call : std::exchange(actions.calls, {})) calls.push_back(std::move(call));
  }
}

void MpiKvTransfer::start_receipt(const KvTransferActions::DeviceReceive& receive,
                                  KvTransferActions& actions) {
  if (receive.into == nullptr) {
    drain_device(receive);
    return;
  }
  const ImportPlan& plan = *receive.into;
  uint64_t receipt = 0;
  try {
    receipt = device_->receive(receive.source, receive.ticket, plan.cache->layout(),
                               &plan.cache->device_copy(), plan.block_table, receive.layer,
                               receive.pos0, receive.n, receive.heads);
  } catch (const Error& e) {
    drain_device(receive);
    protocol_.device_receipt_failed(receive, e.what(), Clock::now(), actions);
    return;
  }
  protocol_.device_receipt_started(receive, receipt, Clock::now());
  count_device_received(static_cast<int64_t>(receive.ticket.bytes));
}

void MpiKvTransfer::drain_device(const KvTransferActions::DeviceReceive& receive) {
  try {
    device_->receive(receive.source, receive.ticket, {}, nullptr, {}, receive.layer, receive.pos0,
                     receive.n, {});
  } catch (const Error& e) {
    // An NCCL connection matches receives with sends by order: one payload not
    // received puts every later one out of step, so the connection is given up.
    spdlog::error("kv transfer: device rows from rank {} not drained: {}", receive.source,
                  e.what());
    device_->abandon(receive.source);
  }
}

}  // namespace duet
