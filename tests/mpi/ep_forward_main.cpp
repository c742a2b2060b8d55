// mpi_ep_forward_test: expert parallelism on the tiny mixture-of-experts
// fixtures (tests/fixtures/tiny_shapes/: qwen3moe, 8 experts 3 used; Mixtral's
// llama, 4 experts 2 used) under mpirun -np 3, one compute thread per rank:
//   world rank 0     the whole model: the reference
//   world ranks 1-2  EP=2 (TP=2 on the same ranks): each holds half the experts
// Each instance runs the fixture's 24 golden ids as one prefill with logits for
// every row, and again as chunks of 7 and 5 then one token per step (the paged
// cache, the one-token order). Every rank's logits of both runs must hash to
// rank 0's, bit for bit: a token's expert output is computed whole on the rank
// holding the expert, so the split changes nothing.
//
// With a model path (and a step count) as arguments it measures instead: a
// 128-token prefill then that many decode steps on each instance, reporting the
// decode step time and the share of it the EP instance spends in its
// collectives (the all-reduce that completes the experts' outputs, and the
// attention's gathers).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "common/hash.h"
#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "worker/model/cpu_forward.h"
#include "worker/parallel/mpi_collective.h"

namespace duet {
namespace {

constexpr int kWorldSize = 3;
constexpr const char* kFixtures[] = {"tiny_qwen3moe_tied.gguf", "tiny_mixtral_untied.gguf"};

struct Instance {
  int size = 1;
  int rank = 0;
  int first = 0;
};

Instance instance_of(int world_rank) {
  return world_rank == 0 ? Instance{1, 0, 0} : Instance{2, world_rank - 1, 1};
}

// One sequence fed in steps of `chunks` sizes (then one token per step) into a
// fresh cache; the logits of every row.
std::vector<float> run_sequence(const LlamaModel& model, CpuForward& forward,
                                std::span<const int32_t> ids, std::span<const int64_t> chunks,
                                bool all_rows = true) {
  const auto n = static_cast<int64_t>(ids.size());
  const int64_t n_vocab = model.config().n_vocab;
  const int64_t n_blocks = (n + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize;
  KvCache cache(model.kv_layout(n_blocks));
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.rbegin(), table.rend(), 0);
  std::vector<float> logits(static_cast<size_t>(n * n_vocab));
  int64_t pos = 0;
  for (size_t step = 0; pos < n; ++step) {
    const int64_t size = std::min(step < chunks.size() ? chunks[step] : 1, n - pos);
    std::vector<int64_t> rows(static_cast<size_t>(all_rows ? size : 1));
    std::iota(rows.begin(), rows.end(), all_rows ? 0 : size - 1);
    const ForwardSequence seq{table, pos, size, pos + size - 1};
    forward.run(ids.subspan(static_cast<size_t>(pos), static_cast<size_t>(size)), {&seq, 1}, cache,
                rows, logits.data() + (all_rows ? pos : pos + size - 1) * n_vocab);
    pos += size;
  }
  return logits;
}

uint64_t hash_of(const std::vector<float>& v) {
  return fnv1a_words(v.data(), v.size() * sizeof(float));
}

// The fixtures' bit-identity check; returns the failures (rank 0's list).
std::vector<std::string> check_fixtures(const MpiRuntime& mpi, const Instance& place) {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tiny_shapes.json"));
  std::vector<std::string> failures;
  for (const char* file : kFixtures) {
    std::vector<int32_t> ids;
    for (const auto& m : golden["models"]) {
      if (m["file"] == file) ids = m["ids"].get<std::vector<int32_t>>();
    }
    DUET_REQUIRE(!ids.empty(), "{} is not in tiny_shapes.json", file);
    const auto model = LlamaModel::load(testing::fixture_path("fixtures/tiny_shapes") / file,
                                        TpPlacement{place.rank, place.size});
    std::vector<Rank> ranks;
    for (int r = 0; r < place.size; ++r) ranks.push_back(Rank{place.first + r});
    MpiCollective collective(mpi, ranks, place.first);
    cpu::ThreadPool pool(1);
    CpuForward forward(*model, cpu::kernel_table(cpu::isa_from_environment()), pool,
                       place.size == 1 ? nullptr : &collective);
    const int64_t whole[] = {static_cast<int64_t>(ids.size())};
    const int64_t chunks[] = {7, 5};
    const uint64_t mine[3] = {hash_of(run_sequence(*model, forward, ids, whole)),
                              hash_of(run_sequence(*model, forward, ids, chunks)),
                              static_cast<uint64_t>(model->layer(0).experts.size())};
    uint64_t all[3 * kWorldSize] = {};
    DUET_MPI_CHECK(MPI_Gather(mine, 3, MPI_UINT64_T, all, 3, MPI_UINT64_T, 0, MPI_COMM_WORLD));
    if (mpi.rank().value != 0) continue;
    const int64_t n_experts = model->config().n_experts;
    for (int r = 0; r < kWorldSize; ++r) {
      const Instance other = instance_of(r);
      const bool prefill_same = all[3 * r] == all[0];
      const bool chunked_same = all[3 * r + 1] == all[1];
      const auto held = static_cast<int64_t>(all[3 * r + 2]);
      const int64_t expected = n_experts / other.size + (other.rank < n_experts % other.size);
      std::printf("  %-26s rank %d (EP=%d): %lld of %lld experts, prefill %s, chunked %s\n", file,
                  r, other.size, static_cast<long long>(held), static_cast<long long>(n_experts),
                  prefill_same ? "identical" : "DIFFERENT",
                  chunked_same ? "identical" : "DIFFERENT");
      if (!prefill_same || !chunked_same || held != expected) {
        failures.push_back(
            duet::format("{} on world rank {}: prefill {}, chunked {}, {} experts "
                         "held ({} expected)",
                         file, r, prefill_same, chunked_same, held, expected));
      }
    }
  }
  return failures;
}

// The measurement mode: a prefill of 128 tokens and `steps` decode steps.
void measure(const MpiRuntime& mpi, const Instance& place, const std::filesystem::path& path,
             int steps) {
  const auto model = LlamaModel::load(path, TpPlacement{place.rank, place.size},
                                      &cpu::kernel_table(cpu::isa_from_environment()));
  std::vector<Rank> ranks;
  for (int r = 0; r < place.size; ++r) ranks.push_back(Rank{place.first + r});
  MpiCollective collective(mpi, ranks, place.first);
  cpu::ThreadPool pool(1);
  CpuForward forward(*model, cpu::kernel_table(cpu::isa_from_environment()), pool,
                     place.size == 1 ? nullptr : &collective);
  std::vector<int32_t> ids(static_cast<size_t>(128 + steps));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(model->config().n_vocab));
  }
  const int64_t prompt[] = {128};
  const auto before = forward.collective_time();
  const auto start = std::chrono::steady_clock::now();
  run_sequence(*model, forward, ids, prompt, /*all_rows=*/false);
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto after = forward.collective_time();
  std::printf(
      "  world rank %d (EP=%d): prefill+%d decode steps %.3f s, collectives %.3f s "
      "(%lld calls)\n",
      mpi.rank().value, place.size, steps, total, after.seconds - before.seconds,
      static_cast<long long>(after.calls - before.calls));
}

int run(int argc, char** argv) {
  MpiRuntime mpi;
  DUET_REQUIRE(mpi.world_size() == kWorldSize, "run under mpirun -np {} (got {})", kWorldSize,
               mpi.world_size());
  const Instance place = instance_of(mpi.rank().value);
  if (argc > 1) {
    measure(mpi, place, argv[1], argc > 2 ? std::stoi(argv[2]) : 16);
    return 0;
  }
  const std::vector<std::string> failures = check_fixtures(mpi, place);
  if (mpi.rank().value != 0) return 0;
  for (const std::string& f : failures) std::fprintf(stderr, "FAIL: %s\n", f.c_str());
  std::printf("mpi_ep_forward_test: %s\n", failures.empty() ? "passed" : "FAILED");
  return failures.empty() ? 0 : 1;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) {
  try {
    return duet::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_ep_forward_test: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}
