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
// 128-token prefill then that many decode steps on each instance in turn,
// reporting the decode step time and the share of it each EP rank spends in
// its collectives (the attention's and the head's gathers, and the
// all-reduces: one per layer completes the experts' outputs, one per step the
// embedding):
//   mpirun -np 3 ep_forward_test MODEL.gguf [STEPS]
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
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
                                std::span<const int32_t> ids, std::span<const int64_t> chunks) {
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
    std::vector<int64_t> rows(static_cast<size_t>(size));
    std::iota(rows.begin(), rows.end(), 0);
    const ForwardSequence seq{table, pos, size, pos + size - 1};
    forward.run(ids.subspan(static_cast<size_t>(pos), static_cast<size_t>(size)), {&seq, 1}, cache,
                rows, logits.data() + pos * n_vocab);
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

// MPI_Ibarrier on the world, waited for sleeping, so that a waiting rank
// leaves the cores to the instance being measured.
void sleeping_barrier() {
  MPI_Request request;
  DUET_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &request));
  for (int done = 0; !done;) {
    DUET_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The measurement mode: the whole model, then the EP instance (the other
// ranks asleep), each a 128-token prefill then `steps` decode steps.
void measure(const MpiRuntime& mpi, const Instance& place, const std::filesystem::path& path,
             int steps) {
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  const auto model = LlamaModel::load(path, TpPlacement{place.rank, place.size}, &kernels);
  std::vector<Rank> ranks;
  for (int r = 0; r < place.size; ++r) ranks.push_back(Rank{place.first + r});
  MpiCollective collective(mpi, ranks, place.first);
  cpu::ThreadPool pool(1);
  CpuForward forward(*model, kernels, pool, place.size == 1 ? nullptr : &collective);
  const int64_t n_prompt = 128;
  const int64_t n = n_prompt + steps;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(model->config().n_vocab));
  }
  const int64_t n_blocks = (n + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize;
  KvCache cache(model->kv_layout(n_blocks));
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::vector<float> logits(static_cast<size_t>(model->config().n_vocab));
  auto step = [&](int64_t pos, int64_t size) {
    const int64_t last = size - 1;
    const ForwardSequence seq{table, pos, size, pos + last};
    forward.run(
        std::span<const int32_t>(ids).subspan(static_cast<size_t>(pos), static_cast<size_t>(size)),
        {&seq, 1}, cache, {&last, 1}, logits.data());
  };
  using Clock = std::chrono::steady_clock;
  for (int turn = 0; turn < 2; ++turn) {
    sleeping_barrier();
    if ((turn == 0) != (place.size == 1)) continue;
    const auto start = Clock::now();
    step(0, n_prompt);
    const auto decode_start = Clock::now();
    const CpuForward::CollectiveTime before = forward.collective_time();
    for (int64_t pos = n_prompt; pos < n; ++pos) step(pos, 1);
    const double decode = std::chrono::duration<double>(Clock::now() - decode_start).count();
    const CpuForward::CollectiveTime after = forward.collective_time();
    const double collective = after.seconds - before.seconds;
    const double reduce = after.all_reduce_seconds - before.all_reduce_seconds;
    std::printf(
        "  world rank %d (EP=%d): prefill of %lld %.3f s; decode %.2f ms/step, of it "
        "collectives %.2f ms (%.1f%%, %.0f calls/step), all-reduces %.2f ms (%.1f%%, "
        "%.0f calls/step)\n",
        mpi.rank().value, place.size, static_cast<long long>(n_prompt),
        std::chrono::duration<double>(decode_start - start).count(), 1e3 * decode / steps,
        1e3 * collective / steps, 100.0 * collective / decode,
        static_cast<double>(after.calls - before.calls) / steps, 1e3 * reduce / steps,
        100.0 * reduce / decode,
        static_cast<double>(after.all_reduce_calls - before.all_reduce_calls) / steps);
    std::fflush(stdout);
  }
  sleeping_barrier();
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
