// KV rows between two processes of one host by cross-memory attach (CMA: Linux
// process_vm_readv), for MpiKvTransfer (worker/transfer/mpi_kv_transfer.h). The
// sender packs a rows payload into its staging and sends only the rows header,
// which names the payload's place there (a ticket); the receiver copies it out of
// the sender's memory straight into the import's blocks, one system call over the
// block runs, and answers "rows done"; the sender then reuses the region (why one
// copy beats MPI's: docs/BENCHMARKS.md, "Disaggregated serving: the KV transfer").
//
// The staging is one fixed ring per sending rank, shared by its receivers. A
// payload that finds no room goes over MPI: a sender never waits for "rows done",
// a receiver that never answers pins at most the ring, and its regions come back
// when it is declared lost (release_all). The receiver pulls, so an import that
// ends mid-transfer has no writer left to fear. A rank reads a peer's staging only
// if the peer has its host name and reading its nonce worked (decided at start-up).
//
// Threads: acquire() on the engine thread; release(), release_all() and read() on the
// transfer's communication thread; the setup (add_*) before either. A mutex guards the ring.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "worker/transfer/device/device_kv_link.h"
#include "worker/transfer/device/staging_ring.h"

namespace duet {

class CmaStaging {
 public:
  // What a rank publishes about its staging (plain bytes, gathered over MPI).
  struct Endpoint {
    int64_t pid = 0;
    uint64_t address = 0;   // the ring's first byte in the owner's address space
    uint64_t capacity = 0;  // 0: the owner sends nothing by CMA
    uint64_t nonce = 0;     // the ring's first 8 bytes until the setup is over
    uint64_t host = 0;      // a hash of the owner's host name
  };
  // A region of the ring, to pack a payload into.
  struct Region {
    DeviceRowsTicket ticket;
    std::byte* data = nullptr;
  };

  // `capacity` bytes of ring (0: none; this rank then only receives).
  explicit CmaStaging(size_t capacity);
  // Unmaps the ring unless a receiver still holds a region of it.
  ~CmaStaging();
  CmaStaging(const CmaStaging&) = delete;
  CmaStaging& operator=(const CmaStaging&) = delete;

  Endpoint endpoint() const;
  // Whether this process can read `peer`'s staging: a peer of the same host
  // name (as Open MPI tells hosts apart) whose nonce it reads.
  static bool can_read(const Endpoint& peer);

  // Setup: rank `rank` reads this rank's staging / this rank reads `rank`'s.
  void add_reader(int rank);
  void add_source(int rank, const Endpoint& peer);
  bool sends_to(int rank) const { return readers_.contains(rank); }
  bool receives_from(int rank) const { return sources_.contains(rank); }

  // Sender: room for a `bytes`-byte payload to `rank`, or nullopt while the
  // ring has none (the payload then goes over MPI).
  std::optional<Region> acquire(int rank, size_t bytes);
  // Sender: `rank` is done with `ticket`. False (nothing changes) for a
  // ticket this rank does not hold for it.
  bool release(int rank, const DeviceRowsTicket& ticket);
  // Sender: `rank` is lost; every region it held comes back.
  void release_all(int rank);
  // Sender: regions held, by every receiver.
  size_t n_held() const;

  // Receiver: copies the payload `ticket` of `rank`'s staging into `runs`
  // (their lengths add up to ticket.bytes). nullopt when every byte arrived,
  // else why not (the sender is gone, or the ticket is not inside its ring).
  std::optional<std::string> read(int rank, const DeviceRowsTicket& ticket,
                                  std::span<const iovec> runs) const;

 private:
  std::byte* ring_ = nullptr;  // mmap'd, capacity_ bytes
  const size_t capacity_;
  uint64_t nonce_ = 0;
  std::set<int> readers_;
  std::map<int, Endpoint> sources_;

  mutable std::mutex mutex_;  // guards the members below
  StagingRing ring_offsets_;
  std::map<int, std::set<uint64_t>> held_;  // by receiver: the offsets it holds
};

}  // namespace duet
