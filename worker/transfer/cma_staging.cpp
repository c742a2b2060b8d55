#include "worker/transfer/cma_staging.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "common/error.h"

namespace duet {
namespace {

constexpr size_t kAlignment = 256;

// Copies `bytes` at `remote` in process `pid` into `local`; the bytes copied.
ssize_t read_remote(int64_t pid, std::span<const iovec> local, uint64_t remote, size_t bytes) {
  iovec from{reinterpret_cast<void*>(remote), bytes};
  return process_vm_readv(static_cast<pid_t>(pid), local.data(), local.size(), &from, 1, 0);
}

// A hash of this host's name (what MPI_Get_processor_name says on Linux).
uint64_t host_hash() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return 0;
  return std::hash<std::string>{}(name);
}

}  // namespace

CmaStaging::CmaStaging(size_t capacity)
    : capacity_(capacity), ring_offsets_(std::max(capacity, kAlignment), kAlignment) {
  if (capacity_ == 0) return;
  DUET_REQUIRE(capacity_ >= kAlignment, "a CMA staging of {} bytes is under {}", capacity_,
               kAlignment);
  // Address space only: pages are made as payloads first touch them.
  void* ring = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (ring == MAP_FAILED)
    throw Error(ErrorKind::kInternal,
                format("CMA staging: mmap of {} bytes: {}", capacity_, std::strerror(errno)));
  ring_ = static_cast<std::byte*>(ring);
  // Huge pages where the kernel has them: fewer pages for the packing to
  // fault in and for each read to pin.
  madvise(ring_, capacity_, MADV_HUGEPAGE);
  std::random_device entropy;
  nonce_ = (static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^ static_cast<uint64_t>(getpid());
  nonce_ |= 1;  // never 0, the value of an untouched page
  std::memcpy(ring_, &nonce_, sizeof nonce_);
}

CmaStaging::~CmaStaging() {
  // Payloads no receiver has answered for stay readable while this process
  // lives (their receivers may be slow, not gone): the ring is then left mapped.
  if (ring_ != nullptr && n_held() == 0) munmap(ring_, capacity_);
}

CmaStaging::Endpoint CmaStaging::endpoint() const {
  return {static_cast<int64_t>(getpid()), reinterpret_cast<uint64_t>(ring_), capacity_, nonce_,
          host_hash()};
}

bool CmaStaging::can_read(const Endpoint& peer) {
  if (peer.capacity == 0 || peer.address == 0 || peer.host != host_hash()) return false;
  uint64_t nonce = 0;
  const iovec into{&nonce, sizeof nonce};
  return read_remote(peer.pid, {&into, 1}, peer.address, sizeof nonce) ==
             static_cast<ssize_t>(sizeof nonce) &&
         nonce == peer.nonce;
}

void CmaStaging::add_reader(int rank) {
  DUET_ASSERT(capacity_ > 0, "rank {} reads a CMA staging this rank does not have", rank);
  readers_.insert(rank);
}

void CmaStaging::add_source(int rank, const Endpoint& peer) { sources_[rank] = peer; }

std::optional<CmaStaging::Region> CmaStaging::acquire(int rank, size_t bytes) {
  if (!sends_to(rank) || bytes == 0 || bytes > capacity_) return std::nullopt;
  std::lock_guard lock(mutex_);
  const std::optional<size_t> offset = ring_offsets_.acquire(bytes);
  if (!offset) return std::nullopt;
  held_[rank].insert(*offset);
  return Region{{*offset, bytes}, ring_ + *offset};
}

bool CmaStaging::release(int rank, const DeviceRowsTicket& ticket) {
  std::lock_guard lock(mutex_);
  auto it = held_.find(rank);
  if (it == held_.end() || it->second.erase(ticket.offset) == 0) return false;
  ring_offsets_.release(ticket.offset);
  return true;
}

void CmaStaging::release_all(int rank) {
  std::lock_guard lock(mutex_);
  auto it = held_.find(rank);
  if (it == held_.end()) return;
  for (uint64_t offset : it->second) ring_offsets_.release(offset);
  held_.erase(it);
}

size_t CmaStaging::n_held() const {
  std::lock_guard lock(mutex_);
  size_t n = 0;
  for (const auto& [rank, offsets] : held_) n += offsets.size();
  return n;
}

std::optional<std::string> CmaStaging::read(int rank, const DeviceRowsTicket& ticket,
                                            std::span<const iovec> runs) const {
  const auto source = sources_.find(rank);
  if (source == sources_.end()) return format("rank {} has no CMA staging this rank reads", rank);
  const Endpoint& peer = source->second;
  if (ticket.bytes == 0 || ticket.offset > peer.capacity ||
      ticket.bytes > peer.capacity - ticket.offset)
    return format("a ticket [{}, +{}) outside rank {}'s {}-byte CMA staging", ticket.offset,
                  ticket.bytes, rank, peer.capacity);
  size_t total = 0;
  for (const iovec& run : runs) total += run.iov_len;
  if (total != ticket.bytes)
    return format("a {}-byte CMA payload from rank {} for {} bytes of rows", ticket.bytes, rank,
                  total);
  // At most IOV_MAX runs per call.
  size_t done = 0;
  for (size_t first = 0; first < runs.size(); first += IOV_MAX) {
    const std::span<const iovec> batch =
        runs.subspan(first, std::min<size_t>(IOV_MAX, runs.size() - first));
    size_t bytes = 0;
    for (const iovec& run : batch) bytes += run.iov_len;
    const ssize_t got = read_remote(peer.pid, batch, peer.address + ticket.offset + done, bytes);
    if (got != static_cast<ssize_t>(bytes)) {
      return got < 0 ? format("reading rank {}'s CMA staging: {}", rank, std::strerror(errno))
                     : format("reading rank {}'s CMA staging: {} of {} bytes", rank, got, bytes);
    }
    done += bytes;
  }
  return std::nullopt;
}

}  // namespace duet
