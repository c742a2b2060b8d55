#include "worker/transfer/kv_transfer_protocol.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include "common/cluster/control_messages.h"
#include "common/error.h"

namespace duet {
namespace {

// A gone request's id is remembered this long, so that its late rows are
// recognised and dropped rather than reported as strays.
constexpr auto kGoneMemory = std::chrono::minutes(5);
// How long after a rows message the communication thread keeps polling fast:
// past the gaps between rows sent back to back, well short of a layer's
// compute on a CPU (5 ms kept a decode rank's thread polling between a CPU
// prefill's layers: 60-80 ms of CPU per 512-token import against 29 ms).
constexpr auto kFastPollAfterRows = std::chrono::microseconds(1000);

KvTransferCall call_of(KvTransferCall::Kind kind, RequestId id) {
  KvTransferCall call;
  call.kind = kind;
  call.id = id;
  return call;
}

}  // namespace

KvTransferProtocol::KvTransferProtocol(std::vector<bool> device_peers, LostReceives lost_receives)
    : device_peers_(std::move(device_peers)), lost_receives_(lost_receives) {}

bool KvTransferProtocol::device_transfer(int rank) const {
  return rank >= 0 && static_cast<size_t>(rank) < device_peers_.size() &&
         device_peers_[static_cast<size_t>(rank)];
}

int64_t KvTransferProtocol::Import::rows_expected() const {
  return (plan.n_prompt - plan.send_from) * plan.cache->layout().n_layers;
}

bool KvTransferProtocol::Import::all_rows() const {
  const int64_t expected = rows_expected();
  return std::all_of(sources.begin(), sources.end(),
                     [&](const Source& source) { return source.rows_received >= expected; });
}

KvTransferProtocol::Source* KvTransferProtocol::Import::source(int rank) {
  auto it = std::find_if(sources.begin(), sources.end(),
                         [&](const Source& s) { return s.heads.rank == rank; });
  return it == sources.end() ? nullptr : &*it;
}

bool KvTransferProtocol::Source::arrive(int64_t layer, int64_t pos0, int64_t n) {
  auto next = arrived.lower_bound({layer, pos0});
  if (next != arrived.end() && next->first.first == layer && next->first.second < pos0 + n)
    return false;
  if (next != arrived.begin()) {
    const auto previous = std::prev(next);
    if (previous->first.first == layer && previous->second > pos0) return false;
  }
  arrived.emplace_hint(next, std::pair{layer, pos0}, pos0 + n);
  return true;
}

// ---------------------------------------------------------------- commands

void KvTransferProtocol::start_import(int leader, std::optional<PrefillOrder> order,
                                      ImportPlan plan, Actions& out) {
  const RequestId id = plan.id;
  Import import;
  for (const KvSource& source : plan.sources) import.sources.push_back(Source{source});
  import.plan = std::move(plan);
  import.serial = next_serial_++;
  import.leader = leader;
  imports_[id] = std::move(import);  // before the order leaves: its rows find it
  gone_.erase(id);
  if (order) out.sends.push_back({leader, kv_wire::control_bytes(*order)});
}

void KvTransferProtocol::fail_if_lost(RequestId id, Clock::time_point now, Actions& out) {
  const Import& import = imports_.at(id);
  std::set<int> waited_on;  // the leader and every source, once each
  if (import.leader >= 0) waited_on.insert(import.leader);
  for (const Source& source : import.sources) waited_on.insert(source.heads.rank);
  std::string lost;
  for (int rank : waited_on) {
    if (lost_.contains(rank)) lost += fmt::format("{}{}", lost.empty() ? "" : ", ", rank);
  }
  if (lost.empty()) return;
  fail(id,
       {ServeErrorKind::kUnavailable,
        fmt::format("KV transfer: rank(s) {} lost before the rows came", lost)},
       now, out);
}

void KvTransferProtocol::peers_lost(std::span<const int> ranks, Clock::time_point now,
                                    Actions& out) {
  for (int rank : ranks) {
    lost_.insert(rank);
    payloads_.erase(rank);  // nothing more comes from it
    const auto r = receiving_.find(rank);
    if (r == receiving_.end()) continue;
    // Its payload was being received into an import's blocks and never
    // lands: the blocks stay MPI's, so the import ends quarantined, whatever
    // end it had or was holding.
    const RequestId id = r->second;
    receiving_.erase(r);
    if (lost_receives_ == LostReceives::kStop) {
      // The receive is over and nothing writes the blocks: an end held for
      // it goes now; a live import fails below, as one waiting on `rank`.
      if (const auto held = held_ends_.find(id); held != held_ends_.end()) {
        KvTransferCall call = std::move(held->second);
        held_ends_.erase(held);
        receipts_.end(id, std::move(call), out.calls);
      }
      continue;
    }
    spdlog::warn(
        "kv transfer: request {}: rows from lost rank {} half-received; its blocks are "
        "quarantined",
        id.value, rank);
    if (const auto it = imports_.find(id); it != imports_.end()) withdraw(it, now, out);
    held_ends_.erase(id);
    quarantined_.insert(id);
    out.calls.push_back(call_of(KvTransferCall::Kind::kQuarantined, id));
  }
  std::vector<RequestId> live_imports;
  for (const auto& [id, import] : imports_) live_imports.push_back(id);
  for (RequestId id : live_imports) fail_if_lost(id, now, out);
}

void KvTransferProtocol::abort_import(RequestId id, Clock::time_point now, Actions& out) {
  if (quarantined_.contains(id)) return;  // its blocks are never released
  auto it = imports_.find(id);
  if (it != imports_.end()) withdraw(it, now, out);
  // Nothing writes its blocks any more once no device receipt of it is in
  // flight: its MPI payloads still to come are drained.
  end_import(id, call_of(KvTransferCall::Kind::kReleased, id), out);
}

void KvTransferProtocol::forget_imports(const KvCache& cache, Clock::time_point now, Actions& out) {
  for (auto it = imports_.begin(); it != imports_.end();) {
    auto next = std::next(it);
    if (it->second.plan.cache == &cache) withdraw(it, now, out);
    it = next;
  }
}

void KvTransferProtocol::withdraw(std::map<RequestId, Import>::iterator it, Clock::time_point now,
                                  Actions& out) {
  const RequestId id = it->first;
  if (it->second.leader >= 0)  // the prefill side stops too
    out.sends.push_back({it->second.leader, kv_wire::control_bytes(Cancel{id})});
  imports_.erase(it);
  gone_[id] = now;
}

// ---------------------------------------------------------------- messages

void KvTransferProtocol::on_message(int source, std::span<const std::byte> bytes,
                                    Clock::time_point now, Actions& out) {
  const std::optional<kv_wire::Header> header = kv_wire::read_header(bytes);
  if (!header) {
    spdlog::error("kv transfer: dropped a {}-byte message from rank {} that is not ours",
                  bytes.size(), source);
    return;
  }
  switch (header->kind) {
    case kv_wire::kRows:
    case kv_wire::kDeviceRows:
    case kv_wire::kCmaRows:
      on_rows(source, *header, now, out);
      return;
    case kv_wire::kRowsDone:
      out.staging_released.push_back({source, {header->ticket_offset, header->ticket_bytes}});
      return;
    case kv_wire::kControl:
      on_control(source, bytes.subspan(sizeof(kv_wire::Header)), now, out);
      return;
    default:
      spdlog::error("kv transfer: dropped a message of unknown kind {} from rank {}", header->kind,
                    source);
  }
}

void KvTransferProtocol::on_rows(int source, const kv_wire::Header& h, Clock::time_point now,
                                 Actions& out) {
  const RequestId id{h.request};
  const bool device_rows = h.kind == kv_wire::kDeviceRows;
  if (device_rows && !device_transfer(source)) {
    spdlog::error("kv transfer: device rows from rank {}, which has no device transfer here",
                  source);
    return;
  }
  auto it = imports_.find(id);
  if (it == imports_.end()) {
    drain(source, h, out);
    ++rows_dropped_;
    if (!gone_.contains(id))
      spdlog::warn("kv transfer: rows for unknown request {} from rank {}", id.value, source);
    return;
  }
  Import& import = it->second;
  const ImportPlan& plan = import.plan;
  if (!fits(import, source, h)) {
    drain(source, h, out);
    fail(id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: a malformed rows header from rank {} (layer {}, positions "
                      "[{}, {}) of a {}-token prompt, KV heads [{}, {}))",
                      source, h.layer, h.pos0, h.pos0 + h.n, plan.n_prompt, h.head_begin,
                      h.head_end)},
         now, out);
    return;
  }
  Source& from = *import.source(source);
  if (!from.arrive(h.layer, h.pos0, h.n)) {
    drain(source, h, out);
    fail(id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: rows of layer {} positions [{}, {}) from rank {} came twice",
                      h.layer, h.pos0, h.pos0 + h.n, source)},
         now, out);
    return;
  }
  const KvHeads heads{h.head_begin - plan.head_offset, h.head_end - h.head_begin};
  if (device_rows) {  // announced once the device transfer have taken the receipt
    out.device_receives.push_back(
        {source, id, {h.ticket_offset, h.ticket_bytes}, &plan, h.layer, h.pos0, h.n, heads});
    return;
  }
  if (h.kind == kv_wire::kCmaRows) {  // announced once read
    out.cma_reads.push_back({source,
                             id,
                             {h.ticket_offset, h.ticket_bytes},
                             &plan,
                             h.layer,
                             h.pos0,
                             h.n,
                             heads,
                             h.checksum});
    return;
  }
  payloads_[source].push_back({id, import.serial, h.layer, h.pos0, h.n, heads, h.checksum});
  from.rows_announced += h.n;
  last_rows_at_ = now;
}

bool KvTransferProtocol::fits(const Import& import, int source, const kv_wire::Header& h) const {
  const ImportPlan& plan = import.plan;
  const KvLayout& layout = plan.cache->layout();
  auto from = std::find_if(import.sources.begin(), import.sources.end(),
                           [&](const Source& s) { return s.heads.rank == source; });
  return from != import.sources.end() && h.head_begin == from->heads.head_begin &&
         h.head_end == from->heads.head_end && h.head_begin < h.head_end &&
         h.head_begin >= plan.head_offset && h.head_end - plan.head_offset <= layout.n_kv_heads &&
         h.layer >= 0 && h.layer < layout.n_layers && h.pos0 >= plan.send_from && h.n > 0 &&
         h.pos0 + h.n <= plan.n_prompt &&
         (h.kind != kv_wire::kDeviceRows || plan.cache->device_copy().valid());
}

void KvTransferProtocol::drain(int source, const kv_wire::Header& h, Actions& out) {
  const RequestId id{h.request};
  if (h.kind == kv_wire::kDeviceRows) {
    out.device_receives.push_back(
        {source, id, {h.ticket_offset, h.ticket_bytes}, nullptr, h.layer, h.pos0, h.n, {}});
  } else if (h.kind == kv_wire::kCmaRows) {
    out.cma_reads.push_back(
        {source, id, {h.ticket_offset, h.ticket_bytes}, nullptr, h.layer, h.pos0, h.n, {}});
  } else {
    payloads_[source].push_back({id, 0, h.layer, h.pos0, h.n, {}, 0});
  }
}

void KvTransferProtocol::on_control(int source, std::span<const std::byte> payload,
                                    Clock::time_point now, Actions& out) {
  ControlMessage message;
  try {
    message = decode_control_message(payload);
  } catch (const Error& e) {
    spdlog::error("kv transfer: dropped a message from rank {}: {}", source, e.what());
    return;
  }
  if (auto* order = std::get_if<PrefillOrder>(&message)) {
    KvTransferCall call = call_of(KvTransferCall::Kind::kOrder, order->request.id);
    call.peer = source;
    call.order = std::move(*order);
    out.calls.push_back(std::move(call));
  } else if (const auto* cancel = std::get_if<Cancel>(&message)) {
    KvTransferCall call = call_of(KvTransferCall::Kind::kCancel, cancel->id);
    call.peer = source;
    out.calls.push_back(std::move(call));
  } else if (const auto* handoff = std::get_if<KvHandoff>(&message)) {
    on_handoff(source, *handoff, now, out);
  } else {
    spdlog::error("kv transfer: dropped an unexpected {} message from rank {}",
                  control_message_name(message), source);
  }
}

void KvTransferProtocol::on_handoff(int source, const KvHandoff& handoff, Clock::time_point now,
                                    Actions& out) {
  auto it = imports_.find(handoff.id);
  if (it == imports_.end()) return;  // aborted or failed already
  Import& import = it->second;
  if (import.leader != source) {
    spdlog::error("kv transfer: a handoff for request {} from rank {}, not its prefill rank {}",
                  handoff.id.value, source, import.leader);
    return;
  }
  if (handoff.error) {
    fail(handoff.id, *handoff.error, now, out);
    return;
  }
  // Every rows header the leader sent is in (its headers keep their order;
  // their payloads may still be landing); the other prefill ranks' rows may
  // still come.
  const int64_t expected = import.rows_expected();
  const Source* own = import.source(source);
  const int64_t from_leader = own == nullptr ? expected : own->rows_announced;
  if (from_leader != expected || handoff.rows_sent != expected) {
    fail(handoff.id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: {} rows arrived and {} were sent, {} expected", from_leader,
                      handoff.rows_sent, expected)},
         now, out);
    return;
  }
  import.handoff = handoff;
  complete_if_done(handoff.id, out);
}

// ---------------------------------------------------------------- payloads

const KvTransferProtocol::Import* KvTransferProtocol::live(const ExpectedPayload& payload) const {
  if (payload.serial == 0) return nullptr;
  auto it = imports_.find(payload.id);
  return it != imports_.end() && it->second.serial == payload.serial ? &it->second : nullptr;
}

std::optional<KvTransferProtocol::PayloadPlace> KvTransferProtocol::payload_place(
    int source) const {
  auto it = payloads_.find(source);
  if (it == payloads_.end()) return std::nullopt;
  const ExpectedPayload& payload = it->second.front();
  PayloadPlace place{nullptr, payload.layer, payload.pos0, payload.n, payload.heads, 0};
  if (const Import* import = live(payload)) {
    place.into = &import->plan;
    place.bytes = packed_kv_elems(import->plan.cache->layout(), payload.n, payload.heads) *
                  static_cast<int64_t>(sizeof(KvElement));
  }
  return place;
}

std::vector<int> KvTransferProtocol::payload_sources() const {
  std::vector<int> sources;
  for (const auto& [source, payloads] : payloads_) sources.push_back(source);
  return sources;
}

void KvTransferProtocol::payload_landed(int source, bool whole, Clock::time_point now,
                                        Actions& out) {
  // An end held for this payload is reported once it is handled.
  std::optional<RequestId> receiving;
  if (const auto r = receiving_.find(source); r != receiving_.end()) {
    receiving = r->second;
    receiving_.erase(r);
  }
  land(source, whole, now, out);
  if (!receiving) return;
  if (const auto held = held_ends_.find(*receiving); held != held_ends_.end()) {
    KvTransferCall call = std::move(held->second);
    held_ends_.erase(held);
    receipts_.end(*receiving, std::move(call), out.calls);
  }
}

void KvTransferProtocol::land(int source, bool whole, Clock::time_point now, Actions& out) {
  auto it = payloads_.find(source);
  DUET_ASSERT(it != payloads_.end(), "a payload from rank {} that no header announced", source);
  const ExpectedPayload payload = it->second.front();
  it->second.pop_front();
  if (it->second.empty()) payloads_.erase(it);
  const Import* import = live(payload);
  if (import == nullptr) return;  // drained: its import is over
  if (!whole) {
    fail(payload.id,
         {ServeErrorKind::kInternal,
          fmt::format("KV transfer: rows of layer {} from rank {} are not the size their header "
                      "says",
                      payload.layer, source)},
         now, out);
    return;
  }
  if (!rows_match(*import, source, payload.layer, payload.pos0, payload.n, payload.heads,
                  payload.checksum, now, out))
    return;
  rows_in_place(payload.id, source, payload.n, now, out);
}

bool KvTransferProtocol::rows_match(const Import& import, int source, int64_t layer, int64_t pos0,
                                    int64_t n, KvHeads heads, uint64_t checksum,
                                    Clock::time_point now, Actions& out) {
  if (checksum == 0) return true;
  const ImportPlan& plan = import.plan;
  const KvLayout& layout = plan.cache->layout();
  check_rows_.resize(static_cast<size_t>(packed_kv_elems(layout, n, heads)));
  pack_kv_rows(layout, plan.cache->data(), layer, plan.block_table, pos0, n, heads,
               check_rows_.data());
  if (kv_wire::rows_checksum(check_rows_) == checksum) return true;
  fail(plan.id,
       {ServeErrorKind::kInternal,
        fmt::format("KV transfer: checksum mismatch in layer {} positions [{}, {}) from rank {}",
                    layer, pos0, pos0 + n, source)},
       now, out);
  return false;
}

// ---------------------------------------------------------------- device receipts

void KvTransferProtocol::device_receipt_started(const Actions::DeviceReceive& receive,
                                                uint64_t receipt, Clock::time_point now) {
  auto it = imports_.find(receive.id);
  DUET_ASSERT(it != imports_.end() && receive.into == &it->second.plan,
              "a device receipt for request {}, whose import is not live", receive.id.value);
  receipts_.add(receipt, receive.id, receive.source, receive.n);
  it->second.source(receive.source)->rows_announced += receive.n;
  last_rows_at_ = now;
}

void KvTransferProtocol::device_receipt_failed(const Actions::DeviceReceive& receive,
                                               const std::string& why, Clock::time_point now,
                                               Actions& out) {
  fail(receive.id, {ServeErrorKind::kInternal, "KV transfer: " + why}, now, out);
}

void KvTransferProtocol::device_receipt_done(const DeviceKvLink::Done& done, Clock::time_point now,
                                             Actions& out) {
  if (done.ack) {  // the sender's staging is free again
    kv_wire::Header ack;
    ack.kind = kv_wire::kRowsDone;
    ack.ticket_offset = done.ack->offset;
    ack.ticket_bytes = done.ack->bytes;
    out.sends.push_back({done.peer, kv_wire::header_bytes(ack)});
  }
  const auto rows = receipts_.finish(done.receipt, done.ok, out.calls);
  if (!rows || !imports_.contains(rows->id)) return;  // drained, or its import is over
  if (!rows->ok) {
    fail(rows->id,
         {ServeErrorKind::kUnavailable,
          fmt::format("KV transfer: the device transfer from rank {} broke", rows->source)},
         now, out);
    return;
  }
  rows_in_place(rows->id, rows->source, rows->n, now, out);
}

// ---------------------------------------------------------------- CMA reads

void KvTransferProtocol::cma_read_done(const Actions::CmaRead& read,
                                       const std::optional<std::string>& error,
                                       Clock::time_point now, Actions& out) {
  kv_wire::Header ack;  // the sender's staging is free again
  ack.kind = kv_wire::kRowsDone;
  ack.ticket_offset = read.ticket.offset;
  ack.ticket_bytes = read.ticket.bytes;
  out.sends.push_back({read.source, kv_wire::header_bytes(ack)});
  if (read.into == nullptr) return;  // drained
  auto it = imports_.find(read.id);
  DUET_ASSERT(it != imports_.end() && read.into == &it->second.plan,
              "a CMA read for request {}, whose import is not live", read.id.value);
  if (error) {
    fail(read.id, {ServeErrorKind::kUnavailable, "KV transfer: " + *error}, now, out);
    return;
  }
  if (!rows_match(it->second, read.source, read.layer, read.pos0, read.n, read.heads, read.checksum,
                  now, out))
    return;
  it->second.source(read.source)->rows_announced += read.n;
  last_rows_at_ = now;
  rows_in_place(read.id, read.source, read.n, now, out);
}

// ---------------------------------------------------------------- ends

void KvTransferProtocol::rows_in_place(RequestId id, int source, int64_t n, Clock::time_point now,
                                       Actions& out) {
  imports_.at(id).source(source)->rows_received += n;
  last_rows_at_ = now;
  complete_if_done(id, out);
}

void KvTransferProtocol::complete_if_done(RequestId id, Actions& out) {
  auto it = imports_.find(id);
  const Import& import = it->second;
  if (!import.all_rows() || (import.leader >= 0 && !import.handoff)) return;
  KvTransferCall call = call_of(KvTransferCall::Kind::kComplete, id);
  call.handoff = import.handoff.value_or(KvHandoff{id});
  imports_.erase(it);
  end_import(id, std::move(call), out);
}

void KvTransferProtocol::end_import(RequestId id, KvTransferCall call, Actions& out) {
  for (const auto& [source, receiving] : receiving_) {
    if (receiving == id) {  // MPI is writing its blocks: the end waits for the payload
      held_ends_[id] = std::move(call);
      return;
    }
  }
  receipts_.end(id, std::move(call), out.calls);
}

void KvTransferProtocol::payload_receiving(int source) {
  const auto it = payloads_.find(source);
  DUET_ASSERT(it != payloads_.end() && !it->second.empty(),
              "a payload receive from rank {} that no header announced", source);
  if (live(it->second.front()) != nullptr) receiving_[source] = it->second.front().id;
}

void KvTransferProtocol::fail(RequestId id, ServeError error, Clock::time_point now, Actions& out) {
  auto it = imports_.find(id);
  if (it == imports_.end()) return;
  spdlog::warn("kv transfer: request {}: {}", id.value, error.message);
  withdraw(it, now, out);
  KvTransferCall call = call_of(KvTransferCall::Kind::kFailed, id);
  call.error = std::move(error);
  end_import(id, std::move(call), out);
}

// ---------------------------------------------------------------- time

void KvTransferProtocol::expire(Clock::time_point now, Actions& out) {
  std::vector<RequestId> late;
  for (const auto& [id, import] : imports_) {
    if (now >= import.plan.deadline) late.push_back(id);
  }
  // Imports started since a loss toward a lost rank.
  if (!lost_.empty()) {
    std::vector<RequestId> all;
    for (const auto& [id, import] : imports_) all.push_back(id);
    for (RequestId id : all) fail_if_lost(id, now, out);
  }
  std::erase_if(late, [&](RequestId id) { return !imports_.contains(id); });
  for (RequestId id : late) {
    // Device payloads still in flight keep the import's end held until they
    // land (DeviceReceipts); a connection that never delivers them is given up by
    // its device transfer' own patience, not here: a late import alone says nothing of
    // the connection, which other imports may be using well.
    const Import& import = imports_.at(id);
    std::string missing;
    for (const Source& source : import.sources) {
      if (source.rows_received < import.rows_expected())
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", source.heads.rank);
    }
    fail(id,
         {ServeErrorKind::kUnavailable,
          fmt::format("KV transfer did not complete in time (rows missing from rank(s): {})",
                      missing.empty() ? "none; no handoff" : missing)},
         now, out);
  }
  std::erase_if(gone_, [&](const auto& entry) { return now - entry.second > kGoneMemory; });
}

bool KvTransferProtocol::fast_poll(Clock::time_point now) const {
  if (imports_.empty()) return false;
  for (const auto& [source, payloads] : payloads_) {
    if (std::any_of(payloads.begin(), payloads.end(),
                    [&](const ExpectedPayload& payload) { return live(payload) != nullptr; }))
      return true;
  }
  if (now - last_rows_at_ < kFastPollAfterRows) return true;
  return std::any_of(imports_.begin(), imports_.end(),
                     [](const auto& entry) { return entry.second.all_rows(); });
}

}  // namespace duet
