// Collective operations among the ranks of one tensor-parallel instance.
//
// A tensor-parallel forward pass needs three: the sum of every rank's
// partial results (after a row-parallel matrix), the concatenation of every
// rank's slice (vocabulary-parallel logits), and one rank's bytes on all
// (the leader's sampled tokens). The MPI implementation is
// worker/parallel/mpi_collective.h; a GPU one (NCCL) fits the same interface.
//
// Every rank of the instance calls the same operations in the same order with
// the same sizes (they block until all have). Results are identical on every
// rank, bit for bit, so ranks never diverge. Thread affinity: the instance's
// engine thread.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace duet {

class Collective {
 public:
  virtual ~Collective() = default;

  // This rank's index within the instance, 0 = the leader; and the rank count.
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[i] = the sum over ranks of data[i], on every rank, added in rank
  // order: the same bits for an element whatever the length of `data` (a
  // batch's rows do not change each other's sums).
  virtual void all_reduce_sum(std::span<float> data) = 0;
  // all = every rank's `mine` (all the same length), in rank order.
  virtual void all_gather(std::span<const float> mine, std::span<float> all) = 0;
  // The same for bytes (small status exchanges).
  virtual void all_gather(std::span<const std::byte> mine, std::span<std::byte> all) = 0;
  // data = rank `root`'s data, on every rank.
  virtual void broadcast(std::span<std::byte> data, int root) = 0;

  // The leader's commands to its followers, outside the collectives: post()
  // on the leader sends `message` to every follower and returns at once
  // (messages arrive in order); next_message() on a follower waits for the
  // next one without spinning while none comes (a follower may idle for
  // hours), and quickly while they come one step after another.
  virtual void post(std::span<const std::byte> message) = 0;
  virtual std::vector<std::byte> next_message() = 0;
};

}  // namespace duet
