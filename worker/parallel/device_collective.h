// Collective operations among the ranks of one tensor-parallel instance, on
// GPU memory: the device twin of worker/parallel/collective.h, for a forward pass whose
// activations live on the GPU (the sum after a row-parallel matrix, the
// concatenation of vocabulary-parallel logits, the leader's tokens on every
// rank). The NCCL implementation is worker/parallel/nccl_collective.h. Plain C++: a
// stream is a cudaStream_t passed as void*.
//
// Contract:
// - Every rank of the instance calls the same operations in the same order
//   with the same sizes (and the same root); an operation another rank never
//   matches waits on the GPU forever (only aborting ends it).
// - Pointers are device pointers on this rank's GPU, and `stream` is a stream
//   of that GPU. An operation is queued on `stream` and returns: it never
//   waits for the GPU or for the other ranks, it runs after the work queued
//   before it on `stream`, and the host learns its result only by waiting for
//   the stream. Buffers must stay valid until the stream has passed it.
// - Every operation is legal inside a CUDA graph stream capture: the graph
//   then replays it with the same pointers and sizes, and a graph of
//   collectives is itself collective (every rank launches its matching graph).
// - n == 0 (bytes == 0) is a no-op on every rank alike.
// - Numerics: unlike MpiCollective, the order in which all_reduce_sum adds
//   the ranks' values is NCCL's (its algorithm, chosen by size and machine).
//   The results are identical on every rank, but an element's bits may
//   depend on the length of the call it is summed in, and may differ in the
//   last bits from a TP=1 run.
//
// Thread affinity: one thread at a time per object (the instance's engine
// thread); only where an implementation says so may another thread abort it.
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
