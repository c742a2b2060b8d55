#include "worker/parallel/mpi_collective.h"

#include <algorithm>
#include <climits>
#include <thread>

#include "common/error.h"

namespace duet {
namespace {

constexpr int kCommandTag = 7;
constexpr auto kSpinAfterMessage = std::chrono::milliseconds(2);
constexpr auto kFirstPause = std::chrono::microseconds(50);
constexpr auto kLongestPause = std::chrono::microseconds(5000);

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
  if (comm_ == MPI_COMM_NULL) return;
  try {
    finish_posts(true);
  } catch (const std::exception&) {
    // Freeing the communicator is all that is left to do.
  }
  MPI_Comm_free(&comm_);
}

void MpiCollective::all_reduce_sum(std::span<float> data) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  // Not MPI_Allreduce: Open MPI picks its algorithm, and so the order in
  // which it adds three or more ranks' values, by the message size. A
  // token's hidden state would then depend on how many rows share its
  // batch, and the engine promises it does not. Every rank's partials are
  // gathered and added in rank order instead: the same bits on every rank
  // for any length.
  const size_t n = data.size();
  const int count = count_of(n, "all_reduce");
  partials_.resize(n * static_cast<size_t>(size_));
  DUET_MPI_CHECK(
      MPI_Allgather(data.data(), count, MPI_FLOAT, partials_.data(), count, MPI_FLOAT, comm_));
  for (size_t i = 0; i < n; ++i) {
    float sum = partials_[i];
    for (int r = 1; r < size_; ++r) sum += partials_[static_cast<size_t>(r) * n + i];
    data[i] = sum;
  }
}

void MpiCollective::all_gather(std::span<const float> mine, std::span<float> all) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_REQUIRE(all.size() == mine.size() * static_cast<size_t>(size_),
               "collective: all_gather of {} floats per rank needs {} floats, got {}", mine.size(),
               mine.size() * static_cast<size_t>(size_), all.size());
  const int count = count_of(mine.size(), "all_gather");
  DUET_MPI_CHECK(MPI_Allgather(mine.data(), count, MPI_FLOAT, all.data(), count, MPI_FLOAT, comm_));
}

void MpiCollective::all_gather(std::span<const std::byte> mine, std::span<std::byte> all) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_REQUIRE(all.size() == mine.size() * static_cast<size_t>(size_),
               "collective: all_gather of {} bytes per rank needs {} bytes, got {}", mine.size(),
               mine.size() * static_cast<size_t>(size_), all.size());
  const int count = count_of(mine.size(), "all_gather");
  DUET_MPI_CHECK(MPI_Allgather(mine.data(), count, MPI_BYTE, all.data(), count, MPI_BYTE, comm_));
}

void MpiCollective::finish_posts(bool wait) {
  while (!posts_.empty()) {
    std::vector<MPI_Request>& requests = posts_.front().requests;
    int done = 0;
    if (wait) {
      DUET_MPI_CHECK(
          MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE));
      done = 1;
    } else {
      DUET_MPI_CHECK(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                                 MPI_STATUSES_IGNORE));
    }
    if (!done) return;
    posts_.pop_front();
  }
}

void MpiCollective::post(std::span<const std::byte> message) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL && rank_ == 0, "collective: only a leader posts");
  finish_posts(false);
  Post& post = posts_.emplace_back();
  post.bytes.assign(message.begin(), message.end());
  const int count = count_of(post.bytes.size(), "post");
  post.requests.resize(static_cast<size_t>(size_ - 1));
  for (int follower = 1; follower < size_; ++follower) {
    DUET_MPI_CHECK(MPI_Isend(post.bytes.data(), count, MPI_BYTE, follower, kCommandTag, comm_,
                             &post.requests[static_cast<size_t>(follower - 1)]));
  }
}

std::vector<std::byte> MpiCollective::next_message() {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL && rank_ != 0, "collective: only a follower waits");
  using Clock = std::chrono::steady_clock;
  auto pause = kFirstPause;
  for (;;) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    DUET_MPI_CHECK(MPI_Improbe(0, kCommandTag, comm_, &flag, &message, &status));
    if (flag) {
      int count = 0;
      DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
      std::vector<std::byte> bytes(static_cast<size_t>(count));
      DUET_MPI_CHECK(MPI_Mrecv(bytes.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE));
      last_message_ = Clock::now();
      return bytes;
    }
    // Right after a message the next one (the next step) is near: poll
    // without sleeping; later sleep longer and longer.
    if (Clock::now() - last_message_ < kSpinAfterMessage) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kLongestPause);
  }
}

void MpiCollective::broadcast(std::span<std::byte> data, int root) {
  DUET_REQUIRE(comm_ != MPI_COMM_NULL, "collective: this rank is in no instance");
  DUET_REQUIRE(root >= 0 && root < size_, "collective: broadcast root {} of {} ranks", root, size_);
  DUET_MPI_CHECK(MPI_Bcast(data.data(), count_of(data.size(), "broadcast"), MPI_BYTE, root, comm_));
}

}  // namespace duet
