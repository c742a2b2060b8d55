// Tensor parallelism on GPUs: a model split over 2 (and 3, where the machine
// has the GPUs and the model the KV heads) CudaForward shards, one GPU each,
// their collectives on one NCCL communicator (NcclCollective::on_devices),
// against the whole model on one GPU:
//   - teacher-forced logits of the whole model's greedy path, in one
//     prefill: within normalized error 1e-3 of the whole model's, and the
//     same argmax except at near-ties (the row-parallel sums are NCCL's);
//   - two sequences decoded together, token by token with on-device
//     sampling, replayed from CUDA graphs that captured the NCCL calls: every
//     rank samples the same tokens (the gathered logits are the same bits on
//     every rank), and the first sequence follows the whole model's greedy
//     path up to its first near-tie.
// Every rank runs on its own thread, as each would in its own process.
// NCCL refuses two ranks on one GPU, so a machine with one GPU skips this
// check (and says so).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <numeric>
#include <optional>
#include <thread>

#include "common/error.h"
#include "tests/gpu/forward_runs.h"
#include "tests/gpu/gpu_check.h"
#include "tests/test_paths.h"
#include "worker/model/cuda_forward.h"
#include "worker/parallel/nccl_collective.h"

namespace duet {
namespace {

using gpu_check::argmax;
using gpu_check::blocks_from;
using gpu_check::common_prefix;
using gpu_check::fail;
using gpu_check::greedy_decode;
using gpu_check::kNearTie;
using gpu_check::teacher_forced;

constexpr int64_t kSteps = 24;
constexpr int64_t kBlocks = 32;

std::vector<int32_t> prompt_of(int64_t n_vocab, int32_t seed, int32_t n) {
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < n; ++i)
    prompt.push_back((i * 37 + seed * 101 + 5) % static_cast<int32_t>(n_vocab));
  return prompt;
}

// What one shard's thread produced.
struct RankRun {
  std::vector<float> forced;                  // teacher-forced logits
  std::vector<std::vector<int32_t>> decoded;  // greedy paths of both sequences
  int64_t graph_launches = 0;
  std::string error;
};

void check_split(const std::filesystem::path& path, int tp) {
  const std::unique_ptr<LlamaModel> whole = LlamaModel::load(path);
  const ModelConfig& c = whole->config();
  const int64_t n_vocab = c.n_vocab;
  std::vector<std::unique_ptr<LlamaModel>> shards;
  try {
    for (int r = 0; r < tp; ++r) shards.push_back(LlamaModel::load(path, TpPlacement{r, tp}));
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUnsupported) throw;
    std::printf("    the model cannot be split %d ways (%s): skipped\n", tp, e.what());
    return;
  }
  std::unique_ptr<CudaForward> reference;
  try {
    reference = std::make_unique<CudaForward>(*whole, 0);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUnsupported) throw;
    std::printf("    the GPU refuses it (%s): skipped\n", e.what());
    return;
  }

  // The whole model's greedy path and its logits along it.
  const std::vector<std::vector<int32_t>> tables = {blocks_from(0, kBlocks / 2),
                                                    blocks_from(kBlocks / 2, kBlocks / 2)};
  const std::vector<std::vector<int32_t>> prompts = {prompt_of(n_vocab, 1, 20),
                                                     prompt_of(n_vocab, 2, 13)};
  KvCache whole_staging(whole->kv_layout(kBlocks));
  const std::vector<int32_t> path_tokens =
      greedy_decode(*reference, whole_staging, {&tables[0], 1}, {prompts[0]}, kSteps - 1, true)[0];
  const std::vector<int32_t> forced_input(path_tokens.begin(), path_tokens.end() - 1);
  const std::vector<float> want =
      teacher_forced(*reference, whole_staging, tables[0], forced_input, n_vocab);
  reference.reset();

  std::vector<int> devices(static_cast<size_t>(tp));
  std::iota(devices.begin(), devices.end(), 0);
  std::vector<std::unique_ptr<NcclCollective>> collectives = NcclCollective::on_devices(devices);
  std::vector<RankRun> runs(static_cast<size_t>(tp));
  const auto done = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(tp));
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r) {
      threads.emplace_back([&, r] {
        RankRun& run = runs[static_cast<size_t>(r)];
        try {
          const LlamaModel& shard = *shards[static_cast<size_t>(r)];
          CudaForward gpu(shard, r, collectives[static_cast<size_t>(r)].get());
          KvCache staging(shard.kv_layout(kBlocks));
          run.forced = teacher_forced(gpu, staging, tables[0], forced_input, n_vocab);
          run.decoded = greedy_decode(gpu, staging, tables, prompts, kSteps - 1, true);
          run.graph_launches = gpu.graph_launches();
        } catch (const std::exception& e) {
          run.error = e.what();
        }
        done[static_cast<size_t>(r)] = true;
      });
    }
    // A rank that failed leaves the others waiting on their streams for it:
    // past a grace period their communicators are aborted (from this thread,
    // while their owners wait), which ends those waits with errors.
    std::optional<std::chrono::steady_clock::time_point> failed_at;
    for (;;) {
      bool all_done = true, any_failed = false;
      for (int r = 0; r < tp; ++r) {
        const bool finished = done[static_cast<size_t>(r)];
        all_done = all_done && finished;
        any_failed = any_failed || (finished && !runs[static_cast<size_t>(r)].error.empty());
      }
      if (all_done) break;
      const auto now = std::chrono::steady_clock::now();
      if (any_failed && !failed_at) failed_at = now;
      if (failed_at && now - *failed_at > std::chrono::seconds(20)) {
        for (int r = 0; r < tp; ++r) {
          if (!done[static_cast<size_t>(r)]) collectives[static_cast<size_t>(r)]->abort();
        }
        failed_at = now + std::chrono::hours(1);  // once
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (std::thread& t : threads) t.join();
  }
  for (int r = 0; r < tp; ++r) {
    if (!runs[static_cast<size_t>(r)].error.empty()) {
      fail("rank %d: %s", r, runs[static_cast<size_t>(r)].error.c_str());
      return;
    }
  }

  // Teacher-forced logits against the whole model's.
  const RankRun& leader = runs[0];
  const int64_t n_rows = static_cast<int64_t>(forced_input.size());
  double worst = 0;
  int64_t near_ties = 0, flips = 0;
  for (int64_t row = 0; row < n_rows; ++row) {
    const std::span<const float> w(want.data() + row * n_vocab, static_cast<size_t>(n_vocab));
    const std::span<const float> g(leader.forced.data() + row * n_vocab,
                                   static_cast<size_t>(n_vocab));
    worst = std::max(worst, gpu_check::normalized_error(g, w));
    const int32_t a = argmax(w), b = argmax(g);
    if (a == b) continue;
    ++(w[static_cast<size_t>(a)] - w[static_cast<size_t>(b)] < kNearTie ? near_ties : flips);
  }
  std::printf(
      "    tp %d teacher-forced, %lld rows: max normalized error %.3g; argmax: %lld near-tie "
      "difference(s), %lld other(s)\n",
      tp, static_cast<long long>(n_rows), worst, static_cast<long long>(near_ties),
      static_cast<long long>(flips));
  if (worst > 1e-3) fail("tp %d: normalized error %.3g > 1e-3", tp, worst);
  if (flips > 0) {
    fail("tp %d: %lld argmax difference(s) beyond near-ties", tp, static_cast<long long>(flips));
  }
  for (int r = 1; r < tp; ++r) {
    if (runs[static_cast<size_t>(r)].forced != leader.forced)
      fail("tp %d: rank %d's gathered logits differ from the leader's", tp, r);
  }

  // Decode: every rank the same tokens, from graphs; the leader's path vs the whole model's.
  for (int r = 0; r < tp; ++r) {
    const RankRun& run = runs[static_cast<size_t>(r)];
    if (run.decoded != leader.decoded) fail("tp %d: rank %d sampled other tokens", tp, r);
    if (run.graph_launches == 0) fail("tp %d: rank %d never replayed a decode graph", tp, r);
  }
  const std::vector<int32_t>& got = leader.decoded[0];
  const size_t same = common_prefix(got, path_tokens);
  std::printf("    tp %d decode: %zu of %zu tokens as the whole model, %lld graph replays\n", tp,
              same, path_tokens.size(), static_cast<long long>(leader.graph_launches));
  if (same < path_tokens.size()) {
    // The paths part where the whole model's prediction at `same - 1` was a near-tie.
    const auto row = static_cast<int64_t>(same) - 1;
    const std::span<const float> w(want.data() + row * n_vocab, static_cast<size_t>(n_vocab));
    std::vector<float> sorted(w.begin(), w.end());
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    if (sorted[0] - sorted[1] >= kNearTie)
      fail("tp %d: decode left the whole model's path at token %zu, not a near-tie", tp, same);
  }
}

void check_model(const std::filesystem::path& path, int n_gpus) {
  for (int tp = 2; tp <= std::min(n_gpus, 3); ++tp) check_split(path, tp);
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  if (gpu_check::no_gpu()) return gpu_check::kSkipped;
  const int n_gpus = static_cast<int>(cuda::list_devices().size());
  if (n_gpus < 2) {
    std::printf(
        "one GPU: tensor parallelism needs one GPU per rank (NCCL refuses two ranks on one "
        "GPU): skipped\n");
    return gpu_check::kSkipped;
  }
  if (const auto path = testing::default_model_path()) {
    gpu_check::run_case("default model split over GPUs", [&] { check_model(*path, n_gpus); });
  } else {
    std::printf("the default model is absent (launch/setup.sh fetches it): its case skipped\n");
  }
  for (const auto& entry :
       std::filesystem::directory_iterator(testing::fixture_path("fixtures/tiny_gpu"))) {
    if (entry.path().extension() != ".gguf") continue;
    const std::string name = "tiny model " + entry.path().filename().string() + " split";
    gpu_check::run_case(name.c_str(), [&] { check_model(entry.path(), n_gpus); });
  }
  return gpu_check::finish();
}
