// Collective operations among the ranks of one tensor-parallel instance.
//
// A tensor-parallel forward pass needs three: the sum of every rank's
// partial results (after a row-parallel matrix), the concatenation of every
// rank's slice (vocabulary-parallel logits), and one rank's bytes on all
// (the leader's sampled tokens). The MPI implementation is
// worker/mpi_collective.h; a GPU one (NCCL) fits the same interface.
//
// Every rank of the instance calls the same operations in the same order with
// the same sizes (they block until all have). Results are identical on every
// rank, bit for bit, so ranks never diverge. Thread affinity: the instance's
// engine thread.
#pragma once

#include <cstddef>
#include <span>

namespace duet {

class Collective {
 public:
  virtual ~Collective() = default;

  // This rank's index within the instance, 0 = the leader; and the rank count.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = the sum over ranks of data[i], on every rank.
  virtual void all_reduce_sum(std::span<float> data) = 0;
  // all = every rank's `mine` (all the same length), in rank order.
  virtual void all_gather(std::span<const float> mine, std::span<float> all) = 0;
  // data = rank `root`'s data, on every rank.
  virtual void broadcast(std::span<std::byte> data, int root) = 0;
};

}  // namespace duet
