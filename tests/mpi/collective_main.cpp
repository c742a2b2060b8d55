// MpiCollective under mpirun -np 6: rank 0 in no instance (the coordinator's
// place), instance 0 on ranks 1-2 (TP 2), instance 1 on ranks 3-5 (TP 3).
// Both instances run their collectives at the same time, with different
// sizes and counts, to show their communicators never mix. Checks, per
// instance: all_reduce_sum equals the sum (within float rounding) and is
// bit-identical on every rank, also for a 1M-float vector (MPI's segmented
// algorithms); all_gather concatenates in rank order; broadcast from each
// root. Exits non-zero (with the reason on stderr) on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "worker/parallel/mpi_collective.h"

namespace duet {
namespace {

int failures = 0;

void check(bool ok, const char* what, int rank) {
  if (ok) return;
  std::fprintf(stderr, "collective_test: rank %d: %s\n", rank, what);
  ++failures;
}

// Rank r's contribution to element i: not exactly representable sums, so the
// reduction order matters and identical results across ranks mean something.
float value(int r, size_t i) {
  return 0.1f * static_cast<float>(r + 1) + 1e-3f * static_cast<float>(i % 977);
}

void exercise(Collective& c, int world_rank, size_t n) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = value(c.rank(), i);
  c.all_reduce_sum(data);
  bool close = true;
  for (size_t i = 0; i < n; ++i) {
    double expected = 0;
    for (int r = 0; r < c.size(); ++r) expected += value(r, i);
    close = close && std::fabs(data[i] - expected) <= 1e-5 * std::fabs(expected) + 1e-6;
  }
  check(close, "all_reduce_sum is not the sum", world_rank);

  // Every rank holds the same bits: gather everyone's result and compare.
  std::vector<float> everyone(n * static_cast<size_t>(c.size()));
  c.all_gather(data, everyone);
  for (int r = 0; r < c.size(); ++r) {
    check(std::memcmp(everyone.data() + n * static_cast<size_t>(r), data.data(),
                      n * sizeof(float)) == 0,
          "ranks hold different all_reduce results", world_rank);
  }

  std::vector<float> mine(5), all(5 * static_cast<size_t>(c.size()));
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(c.rank() * 100 + i);
  c.all_gather(mine, all);
  for (int r = 0; r < c.size(); ++r) {
    for (size_t i = 0; i < mine.size(); ++i) {
      check(all[static_cast<size_t>(r) * mine.size() + i] == static_cast<float>(r * 100 + i),
            "all_gather is out of rank order", world_rank);
    }
  }

  for (int root = 0; root < c.size(); ++root) {
    std::vector<std::byte> bytes(37, std::byte{0});
    if (c.rank() == root) {
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(root * 31 + i);
    }
    c.broadcast(bytes, root);
    for (size_t i = 0; i < bytes.size(); ++i) {
      check(bytes[i] == static_cast<std::byte>(root * 31 + i), "broadcast lost the root's bytes",
            world_rank);
    }
  }
}

int run() {
  MpiRuntime mpi;
  DUET_REQUIRE(mpi.world_size() == 6, "run under mpirun -np 6 (got {})", mpi.world_size());
  const std::vector<Rank> a = {Rank{1}, Rank{2}};
  const std::vector<Rank> b = {Rank{3}, Rank{4}, Rank{5}};
  const int r = mpi.rank().value;
  const std::vector<Rank>* mine = r == 0 ? nullptr : (r <= 2 ? &a : &b);
  MpiCollective collective(mpi, mine == nullptr ? std::span<const Rank>() : *mine, r <= 2 ? 0 : 1);
  if (mine != nullptr) {
    check(collective.size() == static_cast<int>(mine->size()), "wrong size", r);
    check(collective.rank() == (r <= 2 ? r - 1 : r - 3), "ranks not in the instance's order", r);
    // Different work per instance: TP 2 runs more, smaller operations.
    const int rounds = r <= 2 ? 6 : 3;
    for (int i = 0; i < rounds; ++i) exercise(collective, r, r <= 2 ? 4096 : 1000);
    exercise(collective, r, size_t{1} << 20);
  } else {
    check(collective.size() == 0, "the coordinator got a communicator", r);
  }
  if (failures == 0) std::printf("collective_test: rank %d ok\n", r);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace duet

int main() {
  try {
    return duet::run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collective_test: %s\n", e.what());
    return 2;
  }
}
