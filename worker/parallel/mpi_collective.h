// Collective (worker/parallel/collective.h) over MPI: blocking MPI_Allreduce,
// MPI_Allgather and MPI_Bcast on a communicator of the instance's ranks
// alone, so an instance's collectives never mix with another instance's, the
// control channel's or the KV transfer's traffic.
//
// Creating it is collective over MPI_COMM_WORLD (MPI_Comm_split): every rank
// of the job constructs one, in the same order relative to other collectives;
// a rank in no instance (the coordinator) passes no ranks and gets an empty
// collective (size 0) that it must not use.
//
// The leader's commands go point to point on the same communicator (its own
// tag; collectives never match point-to-point messages).
//
// all_reduce_sum adds the ranks' values in rank order, whatever the length
// (see there), so every rank holds the same bits (checked by
// collective_test), which the bitwise-identical-ranks promise needs, and a
// row's sum does not depend on the rows beside it.
#pragma once

#include <mpi.h>

#include <chrono>
#include <deque>
#include <span>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/mpi_runtime.h"
#include "worker/parallel/collective.h"

namespace duet {

class MpiCollective final : public Collective {
 public:
  // `ranks`: the instance this rank belongs to (world ranks, leader first),
  // or empty for a rank in none. `instance_id` tells instances apart.
  MpiCollective(const MpiRuntime& mpi, std::span<const Rank> ranks, int instance_id);
  ~MpiCollective() override;
  MpiCollective(const MpiCollective&) = delete;
  MpiCollective& operator=(const MpiCollective&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(std::span<float> data) override;
  void all_gather(std::span<const float> mine, std::span<float> all) override;
  void all_gather(std::span<const std::byte> mine, std::span<std::byte> all) override;
  void broadcast(std::span<std::byte> data, int root) override;
  void post(std::span<const std::byte> message) override;
  std::vector<std::byte> next_message() override;

 private:
  void finish_posts(bool wait);  // frees the buffers of the posts that completed

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<float> partials_;  // every rank's, for all_reduce_sum
  // The leader's posts in flight: their buffers live until MPI is done.
  struct Post {
    std::vector<std::byte> bytes;
    std::vector<MPI_Request> requests;
  };
  std::deque<Post> posts_;
  std::chrono::steady_clock::time_point last_message_{};  // a follower's
  int rank_ = 0;
  int size_ = 0;
};

}  // namespace duet
