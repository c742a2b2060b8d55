// DeviceCollective (worker/parallel/device_collective.h) over NCCL: ncclAllReduce,
// ncclAllGather and ncclBroadcast on a communicator of the instance's ranks
// alone, one GPU per rank. Built only with the CUDA backend (DUET_HAVE_CUDA);
// this header is plain C++ (no NCCL, CUDA or MPI).
//
// Set-up, one process per rank: the leader calls unique_id() and hands the
// bytes to its followers by any means (MPI); every rank then constructs its
// NcclCollective with them (collective: each constructor returns once all
// ranks of the instance have called theirs). A test may drive several GPUs
// from one process: on_devices().
//
// Keep this communicator and its streams for the tensor-parallel collectives
// alone: the KV transfer gets its own (operations of two communicators can
// block each other on the GPU unless every rank orders them alike). A posted
// operation that its peers never match (a dead rank) can only end by abort().
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "worker/parallel/device_collective.h"

namespace duet {

class NcclCollective final : public DeviceCollective {
 public:
  // A new NCCL unique id (ncclGetUniqueId) as bytes, for every rank's
  // constructor. Call it once per communicator, on one rank.
  static constexpr size_t kUniqueIdBytes = 128;  // sizeof(ncclUniqueId)
  static std::vector<std::byte> unique_id();

  // Rank `rank` of `size`, on CUDA device `device`: makes `device` the
  // calling thread's current device, then joins the communicator
  // (ncclCommInitRank), waiting for the other ranks. Throws duet::Error:
  // kInvalidArgument for an id of the wrong size or a rank outside [0, size),
  // kUnsupported when the machine has no such device, kInternal when CUDA or
  // NCCL fails.
  NcclCollective(std::span<const std::byte> unique_id, int rank, int size, int device);

  // For one process driving several GPUs (tests): one communicator of
  // devices.size() ranks, rank r on devices[r] (ncclCommInitAll). The devices
  // must exist (else kUnsupported) and be distinct (NCCL refuses two ranks on
  // one GPU: kInvalidArgument). One thread may then drive every rank inside
  // ncclGroupStart/ncclGroupEnd, or one thread per rank without.
  static std::vector<std::unique_ptr<NcclCollective>> on_devices(std::span<const int> devices);

  // Destroys the communicator (ncclCommDestroy, which waits for this rank's
  // queued operations: abort() first when a peer may be gone), or nothing
  // more after abort(). Destroying or aborting waits until every CUDA graph
  // that captured its operations has been destroyed (NCCL keeps resources for
  // them): destroy those graphs first.
  ~NcclCollective() override;
  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }

  void all_reduce_sum(float* data, int64_t n, void* stream) override;
  void all_gather(const float* mine, float* all, int64_t n_per_rank, void* stream) override;
  void broadcast(void* data, size_t bytes, int root, void* stream) override;

  // Ends every operation posted on the communicator, on the GPU too, and
  // frees it (ncclCommAbort); their results are undefined. The object is
  // unusable after (operations throw kInvalidArgument) but for its
  // destructor; a second abort() does nothing. May be called from another
  // thread while the owner waits on a stream (never while the owner is inside
  // another call of this object): how a watchdog frees a rank stuck on a dead
  // peer.
  void abort();

 private:
  NcclCollective(int rank, int size, int device);  // no communicator yet
  void* usable_comm() const;                       // the ncclComm_t, or throws

  void* comm_ = nullptr;  // ncclComm_t; null until initialized
  std::atomic<bool> aborted_{false};
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
};

}  // namespace duet
