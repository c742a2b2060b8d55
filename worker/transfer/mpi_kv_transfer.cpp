#include "worker/transfer/mpi_kv_transfer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <utility>

#include "common/cluster/control_messages.h"
#include "common/error.h"
#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

constexpr int kTag = 1;                   // headers (and control messages)
constexpr int kPayloadTag = 2;            // the rows after a rows header
constexpr uint32_t kMagic = 0x3156'4b44;  // "DKV1"
constexpr uint32_t kRows = 1;             // an MPI payload follows on kPayloadTag
constexpr uint32_t kControl = 2;          // a control message follows in this message
constexpr uint32_t kDeviceRows = 3;       // the payload goes through the device links
constexpr uint32_t kRowsDone = 4;         // receiver -> sender: a device payload's staging is free

struct WireHeader {
  uint32_t magic = kMagic;
  uint32_t kind = 0;
  uint64_t request = 0;
  int64_t layer = 0;
  int64_t pos0 = 0;
  int64_t n = 0;
  uint64_t checksum = 0;   // of the rows payload; 0: not computed
  int64_t head_begin = 0;  // the global KV heads [head_begin, head_end) in the payload
  int64_t head_end = 0;
  uint64_t ticket_offset = 0;  // device rows and rows done: the payload's DeviceRowsTicket
  uint64_t ticket_bytes = 0;
};
static_assert(sizeof(WireHeader) == 80);

// A gone request's id is remembered this long, so that its late rows are
// recognised and dropped rather than reported as strays.
constexpr auto kGoneMemory = std::chrono::minutes(5);
// What a transfer being destroyed gives its sends in flight.
constexpr auto kFlushOnDestroy = std::chrono::milliseconds(500);
constexpr size_t kMaxSpares = 64;
// How long after a rows message the communication thread keeps polling fast.
constexpr auto kFastPollAfterRows = std::chrono::milliseconds(5);
// How long forget_imports waits for device payloads before it gives their links up.
constexpr auto kForgetPatience = std::chrono::seconds(5);

}  // namespace

MpiKvTransfer::MpiKvTransfer(ControlChannel& channel, MpiKvTransferOptions options,
                             std::unique_ptr<DeviceKvLinks> device)
    : channel_(channel), options_(options), device_(std::move(device)) {
  DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  channel_.attach(*this);
}

MpiKvTransfer::~MpiKvTransfer() {
  channel_.detach(*this);  // from here on only this thread touches comm_
  const auto deadline = Clock::now() + kFlushOnDestroy;
  try {
    post_sends();
    while (!in_flight_.empty() && Clock::now() < deadline) {
      test_sends();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  } catch (const std::exception& e) {
    spdlog::error("kv transfer: {}", e.what());
  }
  // A send MPI has not finished cannot be taken back: its buffer is leaked.
  for (Outgoing& outgoing : in_flight_) {
    MPI_Request_free(&outgoing.request);
    static_cast<void>(new std::vector<std::byte>(std::move(outgoing.bytes)));
  }
  if (!in_flight_.empty())
    spdlog::warn("kv transfer: abandoned {} unfinished send(s)", in_flight_.size());
  MPI_Comm_free(&comm_);
}

void MpiKvTransfer::set_handlers(Handlers handlers) {
  std::lock_guard lock(handlers_mutex_);
  handlers_ = std::move(handlers);
}

MpiKvTransfer::Counters MpiKvTransfer::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

// ---------------------------------------------------------------- any thread

std::vector<std::byte> MpiKvTransfer::take_buffer(size_t size) {
  std::vector<std::byte> buffer;
  {
    std::lock_guard lock(mutex_);
    if (!spares_.empty()) {
      buffer = std::move(spares_.back());
      spares_.pop_back();
    }
  }
  buffer.resize(size);
  return buffer;
}

void MpiKvTransfer::queue(int destination, int tag, std::vector<std::byte> bytes) {
  DUET_REQUIRE(bytes.size() <= static_cast<size_t>(INT_MAX),
               "kv transfer: a {}-byte message is over MPI's 2 GiB count limit", bytes.size());
  {
    std::lock_guard lock(mutex_);
    outbox_.push_back(Outgoing{destination, tag, std::move(bytes)});
  }
  channel_.wake();
}

std::vector<std::byte> MpiKvTransfer::control_bytes(const ControlMessage& message) {
  const std::vector<std::byte> encoded = encode_control_message(message);
  std::vector<std::byte> bytes = take_buffer(sizeof(WireHeader) + encoded.size());
  WireHeader header;
  header.kind = kControl;
  std::memcpy(bytes.data(), &header, sizeof header);
  std::memcpy(bytes.data() + sizeof header, encoded.data(), encoded.size());
  return bytes;
}

void MpiKvTransfer::start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) {
  {
    std::lock_guard lock(mutex_);
    starts_.push_back(Start{prefill_leader, order, std::move(plan)});
  }
  channel_.wake();
}

void MpiKvTransfer::expect_import(ImportPlan plan) {
  {
    std::lock_guard lock(mutex_);
    starts_.push_back(Start{-1, std::nullopt, std::move(plan)});
  }
  channel_.wake();
}

void MpiKvTransfer::abort_import(RequestId id) {
  {
    std::lock_guard lock(mutex_);
    aborts_.push_back(id);
  }
  channel_.wake();
}

void MpiKvTransfer::send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                              const KvCache& cache, std::span<const int32_t> block_table,
                              int64_t head_offset, const KvSource& heads) {
  const KvLayout& layout = cache.layout();
  const KvHeads local{heads.head_begin - head_offset, heads.head_end - heads.head_begin};
  if (cache.device_copy().valid() && device_link(decode_rank)) {
    const std::optional<DeviceRowsTicket> ticket =
        device_->send(decode_rank, layout, cache.device_copy(), layer, block_table, pos0, n, local);
    if (!ticket) {
      // The receiver's import fails on the handoff's row count or its deadline.
      spdlog::warn(
          "kv transfer: request {}: the device link to rank {} is full or broken; "
          "layer {} rows not sent",
          id.value, decode_rank, layer);
      return;
    }
    WireHeader header{kMagic, kDeviceRows,      id.value,       layer,          pos0,         n,
                      0,      heads.head_begin, heads.head_end, ticket->offset, ticket->bytes};
    std::vector<std::byte> head = take_buffer(sizeof header);
    std::memcpy(head.data(), &header, sizeof header);
    {
      std::lock_guard lock(mutex_);
      counters_.device_bytes_sent += static_cast<int64_t>(ticket->bytes);
    }
    queue(decode_rank, kTag, std::move(head));
    return;
  }
  const size_t elems = static_cast<size_t>(packed_kv_elems(layout, n, local));
  std::vector<std::byte> payload = take_buffer(elems * sizeof(KvElement));
  auto* rows = reinterpret_cast<KvElement*>(payload.data());
  pack_kv_rows(layout, cache.data(), layer, block_table, pos0, n, local, rows);
  WireHeader header{kMagic, kRows, id.value, layer, pos0, n, 0, heads.head_begin, heads.head_end};
  if (options_.checksums)
    header.checksum = kv_checksum(std::span<const KvElement>(rows, elems)) | 1;
  std::vector<std::byte> head = take_buffer(sizeof header);
  std::memcpy(head.data(), &header, sizeof header);
  queue(decode_rank, kTag, std::move(head));
  queue(decode_rank, kPayloadTag, std::move(payload));
}

void MpiKvTransfer::send_handoff(int decode_peer, const KvHandoff& handoff) {
  queue(decode_peer, kTag, control_bytes(handoff));
}

bool MpiKvTransfer::device_link(int peer) const {
  return device_ != nullptr && device_->carries(peer);
}

// ---------------------------------------------------------------- the communication thread

// Fast polling costs the decode rank CPU, and an import may wait seconds in
// the prefill side's queue: poll fast while sends are in flight, for a moment
// after rows arrived (more follow as the prefill side computes), and while an
// import has all its rows (its handoff comes within one layer's compute).
bool MpiKvTransfer::in_flight() const {
  std::lock_guard state(state_mutex_);
  if (!in_flight_.empty()) return true;
  if (device_ != nullptr && (device_->busy() || receipts_.holding())) return true;
  if (imports_.empty()) return false;
  if (Clock::now() - last_rows_at_ < kFastPollAfterRows) return true;
  return std::any_of(imports_.begin(), imports_.end(),
                     [](const auto& entry) { return entry.second.all_rows(); });
}

bool MpiKvTransfer::Import::all_rows() const {
  const int64_t expected = rows_expected();
  return std::all_of(sources.begin(), sources.end(),
                     [&](const Source& source) { return source.rows_received >= expected; });
}

bool MpiKvTransfer::progress() {
  std::vector<Outcome> outcomes;
  bool active = false;
  {
    std::lock_guard state(state_mutex_);
    process_commands(outcomes);
    active = post_sends() || active;
    active = test_sends() || active;
    active = receive_some(outcomes) || active;
    if (device_ != nullptr) active = poll_device(outcomes) || active;
    if (!imports_.empty() || !gone_.empty()) expire(outcomes);
  }
  active = active || !outcomes.empty();
  deliver(outcomes);  // handlers run without the state lock
  return active;
}

void MpiKvTransfer::forget_imports(const KvCache& cache) {
  std::lock_guard state(state_mutex_);  // the communication thread is not inside progress()
  {
    std::lock_guard lock(mutex_);
    std::erase_if(starts_, [&](const Start& start) { return start.plan.cache == &cache; });
  }
  for (auto it = imports_.begin(); it != imports_.end();) {
    if (it->second.plan.cache != &cache) {
      ++it;
      continue;
    }
    cancel_at_source(it->first, it->second);
    gone_[it->first] = Clock::now();
    it = imports_.erase(it);
  }
  // Device payloads may still be landing in `cache` (one engine, one cache
  // per rank: wait for all of them). Their outcomes go to no handler.
  if (device_ == nullptr) return;
  std::vector<Outcome> dropped;
  const auto patience = Clock::now() + kForgetPatience;
  while (!receipts_.empty()) {
    if (Clock::now() > patience) {
      spdlog::warn("kv transfer: device payloads still in flight at shutdown; giving up links");
      for (int peer = 0; peer < channel_.world_size(); ++peer) {
        if (device_link(peer)) device_->abandon(peer);
      }
    }
    if (!poll_device(dropped)) std::this_thread::sleep_for(std::chrono::microseconds(200));
    dropped.clear();
    if (Clock::now() > patience + kForgetPatience) break;
  }
}

void MpiKvTransfer::cancel_at_source(RequestId id, const Import& import) {
  if (import.leader >= 0) queue(import.leader, kTag, control_bytes(Cancel{id}));
}

void MpiKvTransfer::process_commands(std::vector<Outcome>& outcomes) {
  std::deque<Start> starts;
  std::deque<RequestId> aborts;
  {
    std::lock_guard lock(mutex_);
    starts.swap(starts_);
    aborts.swap(aborts_);
  }
  for (Start& start : starts) {
    const RequestId id = start.plan.id;
    Import import;
    for (const KvSource& source : start.plan.sources) import.sources.push_back({source, 0});
    import.plan = std::move(start.plan);
    import.leader = start.leader;
    imports_[id] = std::move(import);  // before the order leaves: its rows find it
    gone_.erase(id);
    if (start.order) queue(start.leader, kTag, control_bytes(*start.order));
  }
  for (RequestId id : aborts) {
    auto it = imports_.find(id);
    if (it != imports_.end()) {
      cancel_at_source(id, it->second);
      imports_.erase(it);
      gone_[id] = Clock::now();
    }
    // Nothing writes its blocks any more once no device receipt of it is in
    // flight (MPI rows are unpacked on this thread).
    end_import(id, Outcome{id, Outcome::Kind::kReleased, {}, {}}, outcomes);
  }
}

bool MpiKvTransfer::post_sends() {
  std::deque<Outgoing> fresh;
  {
    std::lock_guard lock(mutex_);
    fresh.swap(outbox_);
  }
  if (fresh.empty()) return false;
  int64_t bytes = 0;
  for (Outgoing& outgoing : fresh) {
    in_flight_.push_back(std::move(outgoing));
    Outgoing& posted = in_flight_.back();
    bytes += static_cast<int64_t>(posted.bytes.size());
    DUET_MPI_CHECK(MPI_Isend(posted.bytes.data(), static_cast<int>(posted.bytes.size()), MPI_BYTE,
                             posted.destination, posted.tag, comm_, &posted.request));
  }
  std::lock_guard lock(mutex_);
  counters_.messages_sent += static_cast<int64_t>(fresh.size());
  counters_.bytes_sent += bytes;
  return true;
}

bool MpiKvTransfer::test_sends() {
  std::vector<std::vector<std::byte>> done_buffers;
  std::erase_if(in_flight_, [&](Outgoing& outgoing) {
    int done = 0;
    DUET_MPI_CHECK(MPI_Test(&outgoing.request, &done, MPI_STATUS_IGNORE));
    if (done) done_buffers.push_back(std::move(outgoing.bytes));
    return done != 0;
  });
  if (done_buffers.empty()) return false;
  std::lock_guard lock(mutex_);
  for (auto& buffer : done_buffers) {
    if (spares_.size() < kMaxSpares) spares_.push_back(std::move(buffer));
  }
  return true;
}

bool MpiKvTransfer::receive_some(std::vector<Outcome>& outcomes) {
  bool any = false;
  for (int i = 0; i < 64; ++i) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    DUET_MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, kTag, comm_, &flag, &message, &status));
    if (!flag) break;
    any = true;
    int count = 0;
    DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
    receive_buffer_.resize(static_cast<size_t>(count));
    DUET_MPI_CHECK(MPI_Mrecv(receive_buffer_.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
    {
      std::lock_guard lock(mutex_);
      ++counters_.messages_received;
      counters_.bytes_received += count;
    }
    const std::span<const std::byte> bytes(receive_buffer_.data(), receive_buffer_.size());
    WireHeader header;
    if (bytes.size() < sizeof header ||
        (std::memcpy(&header, bytes.data(), sizeof header), header.magic != kMagic)) {
      spdlog::error("kv transfer: dropped a {}-byte message from rank {} that is not ours",
                    bytes.size(), status.MPI_SOURCE);
      continue;
    }
    if (header.kind == kRows || header.kind == kDeviceRows) {
      on_rows(status.MPI_SOURCE, bytes.first(sizeof header), outcomes);
    } else if (header.kind == kRowsDone) {
      if (device_ != nullptr)
        device_->released(status.MPI_SOURCE, {header.ticket_offset, header.ticket_bytes});
    } else if (header.kind == kControl) {
      on_control(status.MPI_SOURCE, bytes.subspan(sizeof header), outcomes);
    } else {
      spdlog::error("kv transfer: dropped a message of unknown kind {} from rank {}", header.kind,
                    status.MPI_SOURCE);
    }
  }
  return any;
}

void MpiKvTransfer::on_rows(int source, std::span<const std::byte> header,
                            std::vector<Outcome>& outcomes) {
  WireHeader h;
  std::memcpy(&h, header.data(), sizeof h);
  const RequestId id{h.request};
  auto it = imports_.find(id);
  if (it == imports_.end()) {
    // Registered after this pass began (a follower's import, told by its
    // leader just before the order left)?
    process_commands(outcomes);
    it = imports_.find(id);
  }
  const bool device_rows = h.kind == kDeviceRows;
  if (device_rows && !device_link(source)) {
    spdlog::error("kv transfer: device rows from rank {}, which has no device link here", source);
    return;
  }
  if (it == imports_.end()) {
    if (device_rows) {
      receive_device_rows(source, header, nullptr, outcomes);
    } else {
      receive_payload(source, nullptr, 0, 0, 0, {});
    }
    std::lock_guard lock(mutex_);
    ++counters_.rows_dropped;
    if (!gone_.contains(id))
      spdlog::warn("kv transfer: rows for unknown request {} from rank {}", id.value, source);
    return;
  }
  Import& import = it->second;
  const ImportPlan& plan = import.plan;
  const KvLayout& layout = plan.cache->layout();
  auto from = std::find_if(import.sources.begin(), import.sources.end(),
                           [&](const Source& s) { return s.heads.rank == source; });
  if (from == import.sources.end() || h.head_begin != from->heads.head_begin ||
      h.head_end != from->heads.head_end || h.layer < 0 || h.layer >= layout.n_layers ||
      h.pos0 < plan.send_from || h.n <= 0 || h.pos0 + h.n > plan.n_prompt ||
      (device_rows && !plan.cache->device_copy().valid())) {
    if (device_rows) {
      receive_device_rows(source, header, nullptr, outcomes);
    } else {
      receive_payload(source, nullptr, 0, 0, 0, {});
    }
    fail(id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: a malformed rows header from rank {} (layer {}, positions "
                      "[{}, {}) of a {}-token prompt, KV heads [{}, {}))",
                      source, h.layer, h.pos0, h.pos0 + h.n, plan.n_prompt, h.head_begin,
                      h.head_end)},
         outcomes);
    return;
  }
  if (device_rows) {
    receive_device_rows(source, header, &import, outcomes);
    return;
  }
  const KvHeads heads{h.head_begin - plan.head_offset, h.head_end - h.head_begin};
  if (!receive_payload(source, &import, h.layer, h.pos0, h.n, heads)) {
    fail(id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: rows of layer {} from rank {} are not the size their header "
                      "says",
                      h.layer, source)},
         outcomes);
    return;
  }
  if (h.checksum != 0) {
    check_rows_.resize(static_cast<size_t>(packed_kv_elems(layout, h.n, heads)));
    pack_kv_rows(layout, plan.cache->data(), h.layer, plan.block_table, h.pos0, h.n, heads,
                 check_rows_.data());
    if ((kv_checksum(check_rows_) | 1) != h.checksum) {
      fail(id,
           {ServeErrorKind::kInternal,
            fmt::format("KV transfer: checksum mismatch in layer {} positions [{}, {}) from "
                        "rank {}",
                        h.layer, h.pos0, h.pos0 + h.n, source)},
           outcomes);
      return;
    }
  }
  from->rows_announced += h.n;
  from->rows_received += h.n;
  last_rows_at_ = Clock::now();
  complete_if_done(id, outcomes);
}

void MpiKvTransfer::receive_device_rows(int source, std::span<const std::byte> header, Import* into,
                                        std::vector<Outcome>& outcomes) {
  WireHeader h;
  std::memcpy(&h, header.data(), sizeof h);
  const DeviceRowsTicket ticket{h.ticket_offset, h.ticket_bytes};
  if (into == nullptr) {  // nobody wants the rows: the links drain them
    try {
      device_->receive(source, ticket, {}, nullptr, {}, h.layer, h.pos0, h.n, {});
    } catch (const Error& e) {
      // An NCCL link matches receives with sends by order: one payload not
      // received puts every later one out of step, so the link is given up.
      spdlog::error("kv transfer: device rows from rank {} not drained: {}", source, e.what());
      device_->abandon(source);
    }
    return;
  }
  const RequestId id{h.request};
  const ImportPlan& plan = into->plan;
  const KvHeads heads{h.head_begin - plan.head_offset, h.head_end - h.head_begin};
  uint64_t receipt = 0;
  try {
    receipt = device_->receive(source, ticket, plan.cache->layout(), &plan.cache->device_copy(),
                               plan.block_table, h.layer, h.pos0, h.n, heads);
  } catch (const Error& e) {
    receive_device_rows(source, header, nullptr, outcomes);  // drained, if it can be
    fail(id, {ServeErrorKind::kInternal, std::string("KV transfer: ") + e.what()}, outcomes);
    return;
  }
  receipts_.add(receipt, id, source, h.n);
  auto from = std::find_if(into->sources.begin(), into->sources.end(),
                           [&](const Source& s) { return s.heads.rank == source; });
  from->rows_announced += h.n;
  last_rows_at_ = Clock::now();
  std::lock_guard lock(mutex_);
  counters_.device_bytes_received += static_cast<int64_t>(ticket.bytes);
}

bool MpiKvTransfer::poll_device(std::vector<Outcome>& outcomes) {
  std::vector<DeviceKvLinks::Done> done;
  try {
    done = device_->poll();
  } catch (const std::exception& e) {
    // The device links give up the pairs it can blame; this thread goes on.
    spdlog::error("kv transfer: device links: {}", e.what());
    return false;
  }
  for (const std::string& note : device_->take_notes())
    spdlog::error("kv transfer: device links: {}", note);
  for (const DeviceKvLinks::Done& d : done) {
    if (d.ack) {
      WireHeader ack;
      ack.kind = kRowsDone;
      ack.ticket_offset = d.ack->offset;
      ack.ticket_bytes = d.ack->bytes;
      std::vector<std::byte> bytes = take_buffer(sizeof ack);
      std::memcpy(bytes.data(), &ack, sizeof ack);
      queue(d.peer, kTag, std::move(bytes));
    }
    const auto rows = receipts_.finish(d.receipt, d.ok, outcomes);
    if (!rows) continue;  // drained, or its import is over
    auto it = imports_.find(rows->id);
    if (it == imports_.end()) continue;
    if (!rows->ok) {
      fail(rows->id,
           {ServeErrorKind::kUnavailable,
            fmt::format("KV transfer: the device link from rank {} broke", rows->source)},
           outcomes);
      continue;
    }
    auto from = std::find_if(it->second.sources.begin(), it->second.sources.end(),
                             [&](const Source& s) { return s.heads.rank == rows->source; });
    from->rows_received += rows->n;
    last_rows_at_ = Clock::now();
    complete_if_done(rows->id, outcomes);
  }
  return !done.empty();
}

void MpiKvTransfer::end_import(RequestId id, Outcome outcome, std::vector<Outcome>& outcomes) {
  receipts_.end(id, std::move(outcome), outcomes);
}

void MpiKvTransfer::complete_if_done(RequestId id, std::vector<Outcome>& outcomes) {
  auto it = imports_.find(id);
  const Import& import = it->second;
  if (!import.all_rows() || (import.leader >= 0 && !import.handoff)) return;
  KvHandoff handoff = import.handoff.value_or(KvHandoff{id});
  imports_.erase(it);
  end_import(id, Outcome{id, Outcome::Kind::kComplete, std::move(handoff), {}}, outcomes);
}

bool MpiKvTransfer::receive_payload(int source, const Import* into, int64_t layer, int64_t pos0,
                                    int64_t n, KvHeads heads) {
  MPI_Message message;
  MPI_Status status;
  DUET_MPI_CHECK(MPI_Mprobe(source, kPayloadTag, comm_, &message, &status));
  int count = 0;
  DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
  {
    std::lock_guard lock(mutex_);
    ++counters_.messages_received;
    counters_.bytes_received += count;
  }
  const KvLayout* layout = into != nullptr ? &into->plan.cache->layout() : nullptr;
  if (into == nullptr || heads.first < 0 || heads.count <= 0 ||
      heads.first + heads.count > layout->n_kv_heads ||
      count != packed_kv_elems(*layout, n, heads) * static_cast<int64_t>(sizeof(KvElement))) {
    // Not wanted (or not the size its header says): received into scratch, dropped.
    receive_buffer_.resize(static_cast<size_t>(count));
    DUET_MPI_CHECK(MPI_Mrecv(receive_buffer_.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
    return into == nullptr;
  }
  // The packed order (K then V, head, position, dim) as runs of the blocks.
  type_lengths_.clear();
  type_addresses_.clear();
  const int64_t slot_bytes = layout->head_dim * static_cast<int64_t>(sizeof(KvElement));
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t head = heads.first; head < heads.first + heads.count; ++head) {
      for (int64_t done = 0; done < n;) {
        const int64_t pos = pos0 + done;
        const int64_t slot = pos % layout->block_size;
        const int64_t run = std::min(layout->block_size - slot, n - done);
        const int64_t block = into->plan.block_table[static_cast<size_t>(pos / layout->block_size)];
        const int64_t offset =
            layout->k_offset(layer, block, head, slot) + (kv == 1 ? layout->kv_elems() : 0);
        MPI_Aint address = 0;
        DUET_MPI_CHECK(MPI_Get_address(into->plan.cache->data() + offset, &address));
        type_addresses_.push_back(address);
        type_lengths_.push_back(static_cast<int>(run * slot_bytes));
        done += run;
      }
    }
  }
  MPI_Datatype rows;
  DUET_MPI_CHECK(MPI_Type_create_hindexed(static_cast<int>(type_lengths_.size()),
                                          type_lengths_.data(), type_addresses_.data(), MPI_BYTE,
                                          &rows));
  DUET_MPI_CHECK(MPI_Type_commit(&rows));
  const int code = MPI_Mrecv(MPI_BOTTOM, 1, rows, &message, MPI_STATUS_IGNORE);
  MPI_Type_free(&rows);
  DUET_MPI_CHECK(code);
  return true;
}

void MpiKvTransfer::on_control(int source, std::span<const std::byte> payload,
                               std::vector<Outcome>& outcomes) {
  ControlMessage message;
  try {
    message = decode_control_message(payload);
  } catch (const Error& e) {
    spdlog::error("kv transfer: dropped a message from rank {}: {}", source, e.what());
    return;
  }
  if (auto* order = std::get_if<PrefillOrder>(&message)) {
    std::lock_guard lock(handlers_mutex_);
    if (handlers_.on_order) handlers_.on_order(source, std::move(*order));
  } else if (const auto* cancel = std::get_if<Cancel>(&message)) {
    std::lock_guard lock(handlers_mutex_);
    if (handlers_.on_cancel) handlers_.on_cancel(source, cancel->id);
  } else if (const auto* handoff = std::get_if<KvHandoff>(&message)) {
    auto it = imports_.find(handoff->id);
    if (it == imports_.end()) return;  // aborted or failed already
    Import& import = it->second;
    if (import.leader != source) {
      spdlog::error("kv transfer: a handoff for request {} from rank {}, not its prefill rank {}",
                    handoff->id.value, source, import.leader);
      return;
    }
    if (handoff->error) {
      fail(handoff->id, *handoff->error, outcomes);
      return;
    }
    // Every row the leader sent is in (its messages keep their order); the
    // other prefill ranks' rows may still come.
    const int64_t expected = import.rows_expected();
    auto own = std::find_if(import.sources.begin(), import.sources.end(),
                            [&](const Source& s) { return s.heads.rank == source; });
    const int64_t from_leader = own == import.sources.end() ? expected : own->rows_announced;
    if (from_leader != expected || handoff->rows_sent != expected) {
      fail(handoff->id,
           {ServeErrorKind::kInternal,
            fmt::format("KV transfer: {} rows arrived and {} were sent, {} expected", from_leader,
                        handoff->rows_sent, expected)},
           outcomes);
      return;
    }
    import.handoff = *handoff;
    complete_if_done(handoff->id, outcomes);
  } else {
    spdlog::error("kv transfer: dropped an unexpected {} message from rank {}",
                  control_message_name(message), source);
  }
}

void MpiKvTransfer::fail(RequestId id, ServeError error, std::vector<Outcome>& outcomes) {
  auto it = imports_.find(id);
  if (it == imports_.end()) return;
  spdlog::warn("kv transfer: request {}: {}", id.value, error.message);
  cancel_at_source(id, it->second);  // the prefill side stops too
  imports_.erase(it);
  gone_[id] = Clock::now();
  end_import(id, Outcome{id, Outcome::Kind::kFailed, {}, std::move(error)}, outcomes);
}

void MpiKvTransfer::expire(std::vector<Outcome>& outcomes) {
  const auto now = Clock::now();
  std::vector<RequestId> late;
  for (const auto& [id, import] : imports_) {
    if (now >= import.plan.deadline) late.push_back(id);
  }
  for (RequestId id : late) {
    // Device payloads still in flight keep the import's outcome held until
    // they land (DeviceReceipts); a link that never delivers them is given
    // up by its links' own patience, not here: a late import alone says
    // nothing of the link, which other imports may be using well.
    std::string missing;
    for (const Source& source : imports_.at(id).sources) {
      if (source.rows_received < imports_.at(id).rows_expected())
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", source.heads.rank);
    }
    fail(id,
         {ServeErrorKind::kUnavailable,
          fmt::format("KV transfer did not complete in time (rows missing from rank(s): {})",
                      missing.empty() ? "none; no handoff" : missing)},
         outcomes);
  }
  std::erase_if(gone_, [&](const auto& entry) { return now - entry.second > kGoneMemory; });
}

void MpiKvTransfer::deliver(std::vector<Outcome>& outcomes) {
  if (outcomes.empty()) return;
  {
    std::lock_guard lock(mutex_);
    for (const Outcome& outcome : outcomes) {
      if (outcome.kind == Outcome::Kind::kComplete) ++counters_.imports_completed;
      if (outcome.kind == Outcome::Kind::kFailed) ++counters_.imports_failed;
    }
  }
  std::lock_guard lock(handlers_mutex_);
  for (Outcome& outcome : outcomes) {
    switch (outcome.kind) {
      case Outcome::Kind::kComplete:
        if (handlers_.on_complete) handlers_.on_complete(outcome.id, outcome.handoff);
        break;
      case Outcome::Kind::kFailed:
        if (handlers_.on_failed) handlers_.on_failed(outcome.id, outcome.error);
        break;
      case Outcome::Kind::kReleased:
        if (handlers_.on_released) handlers_.on_released(outcome.id);
        break;
    }
  }
  outcomes.clear();
}

}  // namespace duet
