// Collectives among the ranks of one tensor-parallel instance on GPU memory: the
// device twin of worker/parallel/collective.h (NCCL: worker/parallel/nccl_collective.h).
// Plain C++: a stream is a cudaStream_t passed as void*.
// - Every rank calls the same operations in the same order with the same sizes (and
//   root); one that another rank never matches waits on the GPU forever (only
//   aborting ends it). n == 0 (bytes == 0) is a no-op on every rank alike.
// - Pointers are device pointers on this rank's GPU, `stream` one of its streams.
//   An operation is queued on `stream` and returns without waiting for the GPU or
//   the other ranks; it runs after the work queued before it, the host learns its
//   result only by waiting for the stream, and buffers stay valid until then.
// - Legal inside a CUDA graph capture (replayed with the same pointers and sizes);
//   a graph of collectives is itself collective: every rank launches its match.
// - all_reduce_sum adds in NCCL's order (by size and machine), unlike MpiCollective:
//   the same bits on every rank, but they may depend on the call's length and
//   differ in the last bits from TP=1.
// Thread affinity: one thread at a time per object (the instance's engine thread);
// only where an implementation says so may another thread abort it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet {

class DeviceCollective {
 public:
  virtual ~DeviceCollective() = default;

  // This rank's index within the instance, 0 = the leader; and the rank count.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = the sum over ranks of data[i], on every rank, in place. (n)
  virtual void all_reduce_sum(float* data, int64_t n, void* stream) = 0;
  // all = every rank's `mine`, in rank order: all[r * n_per_rank + i] = rank
  // r's mine[i]. mine: (n_per_rank), all: (size() * n_per_rank); they do not
  // overlap, except that mine may be this rank's own slice of all.
  virtual void all_gather(const float* mine, float* all, int64_t n_per_rank, void* stream) = 0;
  // data = rank `root`'s data, on every rank, in place. (bytes)
  virtual void broadcast(void* data, size_t bytes, int root, void* stream) = 0;
};

}  // namespace duet
