#include "worker/transfer/device/nccl_kv_link.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "kernels/cuda/check.h"

namespace duet {
namespace {

static_assert(sizeof(ncclUniqueId) == NcclKvLink::kUniqueIdBytes);

// At most this many operations in one ncclGroupStart/ncclGroupEnd.
constexpr size_t kMaxGroupOps = 256;

void bind(int device) { DUET_CUDA_CHECK(cudaSetDevice(device)); }

ncclComm_t as_comm(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Connections made when a communicator is created, not at its first
// transfers (NCCL's default since 2.22): a pair's first large payload then
// cannot wait on the host for a connection its busy peer has yet to make,
// and connect() warms up everything. Read by NCCL when it first creates a
// communicator in the process; a value the user set is kept.
void connect_at_init() { ::setenv("NCCL_RUNTIME_CONNECT", "0", 0); }

}  // namespace

std::vector<std::byte> NcclKvLink::unique_id() {
  connect_at_init();
  ncclUniqueId id;
  DUET_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::byte> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

void* NcclKvLink::join(std::span<const std::byte> unique_id, int n_ranks, int rank, int device) {
  ncclUniqueId id;
  DUET_REQUIRE(unique_id.size() == sizeof id, "an NCCL unique id of {} bytes, not {}",
               unique_id.size(), sizeof id);
  DUET_REQUIRE(n_ranks >= 1 && rank >= 0 && rank < n_ranks, "NCCL rank {} of {}", rank, n_ranks);
  std::memcpy(&id, unique_id.data(), sizeof id);
  bind(device);
  connect_at_init();
  ncclComm_t comm = nullptr;
  DUET_NCCL_CHECK(ncclCommInitRank(&comm, n_ranks, id, rank));
  return comm;
}

NcclKvLink::NcclKvLink(int device, bool sends, bool receives, Options options)
    : StagedDeviceKvLink("NCCL", device, sends, receives, options) {}

NcclKvLink::~NcclKvLink() {
  cudaSetDevice(device_);
  const bool in_flight = !receipts_.empty() || !sends_.empty();
  for (auto& [peer, p] : peers_) {
    if (p.broken) continue;  // aborted already
    // Work still posted may never be matched (the peer is going away too).
    if (in_flight) {
      ncclCommAbort(as_comm(p.comm));
    } else {
      ncclCommDestroy(as_comm(p.comm));
    }
  }
  for (auto& [peer, p] : peers_) p.stream.reset();  // synchronized: nothing runs on the staging
}

void NcclKvLink::add_peer(int peer, void* comm, int peer_rank) {
  DUET_ASSERT(comm != nullptr && !peers_.contains(peer), "rank {}'s NCCL connection added twice",
              peer);
  bind(device_);
  Peer p;
  p.comm = comm;
  p.rank = peer_rank;
  int n_ranks = 0;
  DUET_NCCL_CHECK(ncclCommCount(as_comm(comm), &n_ranks));
  p.to_self = n_ranks == 1;
  p.stream = std::make_unique<DeviceStream>();
  std::lock_guard lock(send_mutex_);
  peers_.emplace(peer, std::move(p));
}

void NcclKvLink::connect(int peer) {
  bind(device_);
  const Peer& p = peers_.at(peer);
  cuda::DeviceBuffer bytes(2);
  DUET_NCCL_CHECK(ncclGroupStart());
  DUET_NCCL_CHECK(ncclSend(bytes.as<std::byte>(), 1, ncclUint8, p.rank, as_comm(p.comm),
                           as_stream(p.stream->get())));
  DUET_NCCL_CHECK(ncclRecv(bytes.as<std::byte>() + 1, 1, ncclUint8, p.rank, as_comm(p.comm),
                           as_stream(p.stream->get())));
  DUET_NCCL_CHECK(ncclGroupEnd());
  p.stream->synchronize();
}

bool NcclKvLink::carries(int peer) const {
  std::lock_guard lock(send_mutex_);
  return peers_.contains(peer);
}

// ---------------------------------------------------------------- the engine thread

bool NcclKvLink::sends_to(int peer) const {
  const auto it = peers_.find(peer);
  return it != peers_.end() && !it->second.broken;
}

// Packed (and waited for) before the send is posted.
bool NcclKvLink::queue_send(int peer, size_t offset, size_t bytes) {
  auto queued = std::make_unique<Send>();
  queued->peer = peer;
  queued->offset = offset;
  queued->bytes = bytes;
  std::lock_guard lock(send_mutex_);
  if (peers_.at(peer).broken) {  // broken while this thread packed
    send_staging_->release(offset);
    return false;
  }
  sends_.push_back(std::move(queued));
  return true;
}

// ---------------------------------------------------------------- the communication thread

void NcclKvLink::check(const Payload& payload) const {
  DUET_ASSERT(peers_.contains(payload.peer) && receive_staging_ != nullptr,
              "rows from rank {}, which has no NCCL connection here", payload.peer);
  const DeviceRowsTicket& ticket = payload.ticket;
  DUET_REQUIRE(ticket.bytes > 0 && ticket.bytes <= receive_staging_->capacity() &&
                   (payload.kv == nullptr ||
                    ticket.bytes == payload_bytes(payload.layout, payload.n, payload.heads)),
               "rank {}'s NCCL payload of {} bytes is not its rows' size (or over the {}-byte "
               "receive staging)",
               payload.peer, ticket.bytes, receive_staging_->capacity());
}

void NcclKvLink::queue_receipt(uint64_t id, const Payload& payload) {
  if (peers_.at(payload.peer).broken) {  // its send was ended with the communicator
    abandoned_.push_back(Done{id, payload.peer, false, std::nullopt});
    return;
  }
  bind(device_);  // the receipt's event belongs to this transfer's device
  auto receipt = std::make_unique<Receipt>();
  receipt->id = id;
  receipt->peer = payload.peer;
  receipt->bytes = payload.ticket.bytes;
  receipt->rows = destination(payload);
  receipts_.push_back(std::move(receipt));
}

std::vector<DeviceKvLink::Done> NcclKvLink::poll() {
  std::vector<Done> done = std::move(abandoned_);
  abandoned_.clear();
  {
    std::lock_guard lock(send_mutex_);
    if (sends_.empty() && receipts_.empty()) return done;
  }
  bind(device_);
  try {
    post(done);
    collect(done);
    check_peers(done);
  } catch (...) {
    // What finished (or broke) so far is not lost: the next poll() hands it out.
    abandoned_.insert(abandoned_.begin(), done.begin(), done.end());
    throw;
  }
  return done;
}

void NcclKvLink::post(std::vector<Done>& done) {
  std::vector<Send*> sends;
  {
    std::lock_guard lock(send_mutex_);
    for (auto& s : sends_) {
      if (sends.size() == kMaxGroupOps / 2) break;
      if (!s->posted && !peers_.at(s->peer).broken) sends.push_back(s.get());
    }
  }
  // Receives in the order their headers came, each with its staging and (to
  // unpack) its table slot reserved first: one that finds no room stops the
  // rest, which wait for room in order.
  std::vector<Receipt*> receipts;
  for (auto& r : receipts_) {
    if (r->posted) continue;
    if (receipts.size() == kMaxGroupOps / 2) break;
    const std::optional<size_t> offset = receive_staging_->acquire(r->bytes);
    if (!offset) break;
    if (r->rows.kv.valid()) {
      const std::optional<TableStaging::Slot> table =
          receive_tables_->upload(r->rows.block_table, peers_.at(r->peer).stream->get());
      if (!table) {
        receive_staging_->release(*offset);
        break;
      }
      r->table_offset = table->offset;
      r->has_table = true;
    }
    r->staging_offset = *offset;
    receipts.push_back(r.get());
  }
  // A rank's sends to itself run on the stream its receives do: each must
  // go in one group with its receive, or it would wait for it forever.
  for (auto& [peer, p] : peers_) {
    if (!p.to_self) continue;
    const auto mine = [&](const auto* op) { return op->peer == peer; };
    const auto n_sends = std::count_if(sends.begin(), sends.end(), mine);
    const auto n_receipts = std::count_if(receipts.begin(), receipts.end(), mine);
    for (auto extra = n_sends - std::min(n_sends, n_receipts); extra > 0; --extra) {
      sends.erase(std::find_if(sends.rbegin(), sends.rend(), mine).base() - 1);
    }
    for (auto extra = n_receipts - std::min(n_sends, n_receipts); extra > 0; --extra) {
      auto it = std::find_if(receipts.rbegin(), receipts.rend(), mine).base() - 1;
      receive_staging_->release((*it)->staging_offset);
      if ((*it)->has_table) receive_tables_->release((*it)->table_offset);
      (*it)->has_table = false;
      receipts.erase(it);
    }
  }
  if (sends.empty() && receipts.empty()) return;
  bool grouped = true;
  ncclGroupStart();
  for (Send* s : sends) {
    const Peer& p = peers_.at(s->peer);
    grouped = grouped && ncclSend(send_staging_->at(s->offset), s->bytes, ncclUint8, p.rank,
                                  as_comm(p.comm), as_stream(p.stream->get())) == ncclSuccess;
  }
  for (Receipt* r : receipts) {
    const Peer& p = peers_.at(r->peer);
    grouped =
        grouped && ncclRecv(receive_staging_->at(r->staging_offset), r->bytes, ncclUint8, p.rank,
                            as_comm(p.comm), as_stream(p.stream->get())) == ncclSuccess;
  }
  const ncclResult_t ended = ncclGroupEnd();
  // Posted (or refused) as one group: none of them may be posted again,
  // whatever happens below, or the pair's order of operations would slip.
  const auto now = std::chrono::steady_clock::now();
  for (Send* s : sends) {
    s->posted_at = now;
    s->posted = true;
  }
  for (Receipt* r : receipts) {
    r->posted_at = now;
    r->posted = true;
  }
  bool queued = grouped && ended == ncclSuccess;
  std::string why = ncclGetErrorString(ended);
  if (queued) {
    // Behind the transfers on each peer's stream (NCCL launched them at
    // ncclGroupEnd): the unpacks, then the events that say they are done.
    try {
      for (Send* s : sends) s->done.record(peers_.at(s->peer).stream->get());
      for (Receipt* r : receipts) {
        void* stream = peers_.at(r->peer).stream->get();
        if (r->rows.kv.valid()) {
          unpack(r->rows, receive_tables_->device_at(r->table_offset), r->staging_offset, stream);
        }
        r->done.record(stream);
      }
    } catch (const std::exception& e) {
      queued = false;
      why = e.what();
    }
  }
  if (!queued) {
    // NCCL refused the group, or what follows it could not be queued: every
    // connection in it is given up (its operations end with the communicator).
    notes_.push_back(format("a group of {} NCCL send(s) and {} receive(s) failed: {}", sends.size(),
                            receipts.size(), why));
    std::vector<int> peers;
    for (Send* s : sends) peers.push_back(s->peer);
    for (Receipt* r : receipts) peers.push_back(r->peer);
    for (int peer : peers) break_link(peer, done);
  }
}

void NcclKvLink::collect(std::vector<Done>& done) {
  {
    std::lock_guard lock(send_mutex_);
    bool freed = false;
    std::erase_if(sends_, [&](const std::unique_ptr<Send>& s) {
      if (!s->posted || !s->done.done()) return false;
      send_staging_->release(s->offset);
      freed = true;
      return true;
    });
    if (freed) send_room_.notify_all();
  }
  // Each peer's receipts finish in order on its stream; peers independently.
  // Which ones are asked first (a query may throw), then they go.
  std::vector<bool> finished;
  finished.reserve(receipts_.size());
  for (const auto& r : receipts_) finished.push_back(r->posted && r->done.done());
  size_t i = 0;
  std::erase_if(receipts_, [&](const std::unique_ptr<Receipt>& r) {
    if (!finished[i++]) return false;
    receive_staging_->release(r->staging_offset);
    if (r->has_table) receive_tables_->release(r->table_offset);
    done.push_back(Done{r->id, r->peer, true, std::nullopt});
    return true;
  });
}

// A connection is given up when NCCL reports an asynchronous error on it, or when
// a send or receive posted on it has waited longer than the patience (its
// peer stopped: nothing else can end a posted operation).
void NcclKvLink::check_peers(std::vector<Done>& done) {
  const auto now = std::chrono::steady_clock::now();
  std::vector<int> broken;
  for (auto& [peer, p] : peers_) {
    if (p.broken) continue;
    ncclResult_t async = ncclSuccess;
    const bool queried = ncclCommGetAsyncError(as_comm(p.comm), &async) == ncclSuccess;
    bool stuck = !queried || (async != ncclSuccess && async != ncclInProgress);
    for (const auto& r : receipts_) {
      if (r->peer == peer && r->posted && now - r->posted_at > options_.patience) stuck = true;
    }
    {
      std::lock_guard lock(send_mutex_);
      for (const auto& s : sends_) {
        if (s->peer == peer && s->posted && now - s->posted_at > options_.patience) stuck = true;
      }
    }
    if (stuck) broken.push_back(peer);
  }
  for (int peer : broken) {
    notes_.push_back(format("the NCCL connection to rank {} is stuck or failed", peer));
    break_link(peer, done);
  }
}

void NcclKvLink::abandon(int peer) {
  if (!peers_.contains(peer)) return;
  bind(device_);
  break_link(peer, abandoned_);  // its receipts complete (not ok) in the next poll()
}

void NcclKvLink::break_link(int peer, std::vector<Done>& done) {
  Peer& p = peers_.at(peer);
  if (p.broken) return;
  ncclCommAbort(as_comm(p.comm));  // ends the operations posted on it, on the GPU too
  {
    std::lock_guard lock(send_mutex_);
    p.broken = true;  // from here on nothing touches the freed communicator
  }
  p.comm = nullptr;
  // Nothing of it runs on the staging any more (an error here is the abort's).
  cudaStreamSynchronize(as_stream(p.stream->get()));
  cudaGetLastError();
  notes_.push_back(
      format("the NCCL connection to rank {} is given up: KV transfers with it fail until "
             "the cluster restarts",
             peer));
  {
    std::lock_guard lock(send_mutex_);
    std::erase_if(sends_, [&](const std::unique_ptr<Send>& s) {
      if (s->peer != peer) return false;
      send_staging_->release(s->offset);
      return true;
    });
  }
  send_room_.notify_all();
  std::erase_if(receipts_, [&](const std::unique_ptr<Receipt>& r) {
    if (r->peer != peer) return false;
    if (r->posted) receive_staging_->release(r->staging_offset);
    if (r->has_table) receive_tables_->release(r->table_offset);
    done.push_back(Done{r->id, r->peer, false, std::nullopt});
    return true;
  });
}

void NcclKvLink::released(int, const DeviceRowsTicket&) {}

bool NcclKvLink::busy() const {
  if (!receipts_.empty() || !abandoned_.empty()) return true;
  std::lock_guard lock(send_mutex_);
  return !sends_.empty();
}

}  // namespace duet
