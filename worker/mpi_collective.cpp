#include "worker/mpi_collective.h"

#include <algorithm>
#include <climits>

#include "common/error.h"

namespace duet {
namespace {

int count_of(size_t n, const char* what) {
  DUET_REQUIRE(n <= static_cast<size_t>(INT_MAX),
               "collective: {} of {} elements is over MPI's count limit", what, n);
  return static_cast<int>(n);
}

}  // namespace

MpiCollective::MpiCollective(const MpiRuntime& mpi, std::span<const Rank> ranks, int instance_id) {
  const auto self = std::find(ranks.begin(), ranks.end(), mpi.rank());
  DUET_REQUIRE(ranks.empty() || self != ranks.end(),
               "collective: rank {} is not one of the instance's ranks", mpi.rank().value);
  const int color = ranks.empty() ? MPI_UNDEFINED : instance_id;
  // The key orders the new communicator as the instance lists its ranks.
  const int key = ranks.empty() ? 0 : static_cast<int>(self - ranks.begin());
  DUET_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm_));
  if (comm_ == MPI_COMM_NULL) return;
  DUET_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DUET_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  DUET_ASSERT(size_ == static_cast<int>(ranks.size()) && rank_ == key,
              "collective: the split gave rank {} of {}, expected {} of {}", rank_, size_, key,
              ranks.size());
}

MpiCollective::~MpiCollective() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCollective::all_reduce_sum(std::span<float> data) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data.data(), count_of(data.size(), "all_reduce"),
                               MPI_FLOAT, MPI_SUM, comm_));
}

void MpiCollective::all_gather(std::span<const float> mine, std::span<float> all) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_REQUIRE(all.size() == mine.size() * static_cast<size_t>(size_),
               "collective: all_gather of {} floats per rank needs {} floats, got {}", mine.size(),
               mine.size() * static_cast<size_t>(size_), all.size());
  const int count = count_of(mine.size(), "all_gather");
  DUET_MPI_CHECK(MPI_Allgather(mine.data(), count, MPI_FLOAT, all.data(), count, MPI_FLOAT, comm_));
}

void MpiCollective::broadcast(std::span<std::byte> data, int root) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_REQUIRE(root >= 0 && root < size_, "collective: broadcast root {} of {} ranks", root, size_);
  DUET_MPI_CHECK(MPI_Bcast(data.data(), count_of(data.size(), "broadcast"), MPI_BYTE, root, comm_));
}

}  // namespace duet
