#include "sim/profile_measure.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>
#include <thread>

#include "common/error.h"
#include "sim/roofline.h"

namespace duet::sim {
namespace {

using Clock = std::chrono::steady_clock;

// The plan's axes (see the header); each is cut to what the model's context,
// the KV cache and the step budget allow.
constexpr int64_t kContexts[] = {0, 64, 256, 1024, 2048, 4096};
constexpr int64_t kPrefillChunks[] = {1, 16, 64, 128, 256, 512};
constexpr int64_t kDecodeBatches[] = {1, 2, 4, 8, 16, 32, 64};
constexpr int64_t kMixedBatches[] = {2, 16};
constexpr int64_t kDecodeSteps = 4;  // decode steps per (batch, context), after the first

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Steps an engine, timing each step that ran a forward pass. Thread: the
// caller's (the engine's).
class TimedEngine {
 public:
  TimedEngine(Engine& engine, std::vector<StepSample>& samples)
      : engine_(engine), samples_(samples) {
    engine_.set_before_forward([this](const ForwardBatch& batch) {
      shape_ = step_shape(batch.sequences, static_cast<int64_t>(batch.logit_rows.size()));
      ran_forward_ = true;
    });
  }
  ~TimedEngine() { engine_.set_before_forward({}); }
  TimedEngine(const TimedEngine&) = delete;
  TimedEngine& operator=(const TimedEngine&) = delete;

  bool step() {
    ran_forward_ = false;
    const auto start = Clock::now();
    const bool did = engine_.step();
    const double seconds = seconds_since(start);
    if (ran_forward_) samples_.push_back({shape_, seconds});
    return did;
  }
  void run_until_idle() {
    while (step()) {
    }
  }
  Engine& engine() { return engine_; }

 private:
  Engine& engine_;
  std::vector<StepSample>& samples_;
  StepShape shape_;
  bool ran_forward_ = false;
};

// The plan, grouped by context: the prefill chunks at a context reuse the
// prefix computed once for it; the decode batches import their contexts.
struct ContextGroup {
  int64_t context = 0;
  std::vector<int64_t> prefill_chunks;
  std::vector<int64_t> decode_batches;
  std::vector<int64_t> mixed_batches;  // each with a chunk of max_step_tokens
};

struct Limits {
  int64_t max_step_tokens = 0;
  int64_t max_running = 0;
  int64_t max_context = 0;  // tokens a request may hold, max_tokens included
  int64_t kv_blocks = 0;
};

int64_t blocks_for(int64_t tokens) {
  return (tokens + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize;
}

std::vector<ContextGroup> make_plan(const Limits& limits) {
  std::vector<ContextGroup> plan;
  const int64_t decode_tokens = 2 + kDecodeSteps;  // a sequence's tokens past its prompt
  for (const int64_t context : kContexts) {
    ContextGroup group{.context = context};
    for (const int64_t chunk : kPrefillChunks) {
      if (chunk <= limits.max_step_tokens && context + chunk + 1 <= limits.max_context &&
          blocks_for(context + chunk + 1) <= limits.kv_blocks)
        group.prefill_chunks.push_back(chunk);
    }
    const auto fits_decode = [&](int64_t batch, int64_t extra_tokens) {
      return context > 0 && batch <= limits.max_running && batch < limits.max_step_tokens &&
             context + decode_tokens + extra_tokens <= limits.max_context &&
             batch * (blocks_for(context + decode_tokens) + 1) + blocks_for(extra_tokens) + 1 <=
                 limits.kv_blocks;
    };
    for (const int64_t batch : kDecodeBatches) {
      if (fits_decode(batch, 0)) group.decode_batches.push_back(batch);
    }
    for (const int64_t batch : kMixedBatches) {
      if (batch + 1 <= limits.max_running && fits_decode(batch, limits.max_step_tokens))
        group.mixed_batches.push_back(batch);
    }
    if (!group.prefill_chunks.empty() || !group.decode_batches.empty()) plan.push_back(group);
  }
  return plan;
}

// Seconds a step of n rows takes, roughly: from the warm-up's one-row and
// full-budget steps (attention ignored, so that estimates are low at long
// contexts; the budget's hard stop covers them).
struct StepEstimate {
  double one_row_s = 0;
  double per_row_s = 0;
  double operator()(int64_t rows) const {
    return one_row_s + per_row_s * static_cast<double>(std::max<int64_t>(rows - 1, 0));
  }
};

double estimate_group(const ContextGroup& group, const Limits& limits, const StepEstimate& step) {
  const int64_t full_chunks = group.context / limits.max_step_tokens;
  double s = static_cast<double>(full_chunks) * step(limits.max_step_tokens) +
             step(group.context % limits.max_step_tokens + 1);
  for (const int64_t chunk : group.prefill_chunks) s += step(chunk) + step(1);
  for (const int64_t batch : group.decode_batches) s += (2 + kDecodeSteps) * step(batch);
  for (const int64_t batch : group.mixed_batches) {
    s += (2 + kDecodeSteps) * step(batch + 1) + step(limits.max_step_tokens);
  }
  return s;
}

double estimate_plan(const std::vector<ContextGroup>& plan, const Limits& limits,
                     const StepEstimate& step) {
  double s = 0;
  for (const ContextGroup& group : plan) s += estimate_group(group, limits, step);
  return s;
}

// Drops the most expensive part of the plan: its largest context, or when a
// single one is left, its largest decode batch (then mixed batch, then chunk).
// False when nothing more can go.
bool shrink(std::vector<ContextGroup>& plan) {
  if (plan.size() > 1) {
    plan.pop_back();
    return true;
  }
  if (plan.empty()) return false;
  ContextGroup& group = plan.back();
  if (group.decode_batches.size() > 1) {
    group.decode_batches.pop_back();
  } else if (!group.mixed_batches.empty()) {
    group.mixed_batches.pop_back();
  } else if (group.prefill_chunks.size() > 1) {
    group.prefill_chunks.pop_back();
  } else {
    return false;
  }
  return true;
}

class Workloads {
 public:
  Workloads(TimedEngine& engine, int64_t n_vocab, uint64_t seed)
      : engine_(engine), rng_(seed), token_(5, static_cast<int32_t>(n_vocab - 1)) {
    DUET_REQUIRE(n_vocab > 6, "the model's vocabulary ({}) is too small to draw prompts from",
                 n_vocab);
  }

  std::vector<int32_t> random_tokens(int64_t n) {
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int32_t& t : tokens) t = token_(rng_);
    return tokens;
  }

  // Computes `prefix` so that the prefix cache holds it.
  void prime(const std::vector<int32_t>& prefix) {
    if (prefix.empty()) return;
    submit(prefix, 1);
    engine_.run_until_idle();
  }

  // The prefix and `chunk` new tokens: one step of `chunk` rows at the prefix's length.
  void prefill(const std::vector<int32_t>& prefix, int64_t chunk) {
    submit(concat(prefix, random_tokens(chunk)), 1);
    engine_.run_until_idle();
  }

  // `batch` sequences of `context` prompt tokens, decoding, each with KV
  // blocks of its own, as in serving (a shared prefix would let later
  // sequences read the first one's KV from cache): they come in through
  // the engine's import path, which reserves their blocks, and nothing
  // computes their rows, whose values do not change a step's time. With
  // `mixed_chunk` > 0 a fresh prompt of that length arrives after their
  // first step and is prefilled beside their decodes.
  void decode(int64_t context, int64_t batch, int64_t mixed_chunk) {
    Engine& engine = engine_.engine();
    const RequestOptions options{.max_tokens = 2 + kDecodeSteps, .ignore_eos = true};
    std::vector<SequenceId> ids;
    for (int64_t i = 0; i < batch; ++i)
      ids.push_back(engine.submit_import(random_tokens(std::max<int64_t>(1, context)), options,
                                         nullptr, ImportHooks{}));
    for (const SequenceId id : ids) {
      DUET_ASSERT(engine.import_reserved(id), "the plan's decode batch does not fit the KV cache");
      engine.complete_import(id, token_(rng_));
    }
    engine_.step();
    if (mixed_chunk > 0) submit(random_tokens(mixed_chunk), 2 + kDecodeSteps);
    engine_.run_until_idle();
  }

 private:
  static std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  void submit(std::vector<int32_t> prompt, int64_t max_tokens) {
    RequestOptions options{.max_tokens = max_tokens, .ignore_eos = true};
    engine_.engine().submit(std::move(prompt), options, nullptr);
  }

  TimedEngine& engine_;
  std::mt19937 rng_;
  std::uniform_int_distribution<int32_t> token_;
};

}  // namespace

std::vector<int64_t> measure_knots(int64_t max_step_tokens) {
  DUET_REQUIRE(max_step_tokens >= 1, "max_step_tokens must be >= 1, got {}", max_step_tokens);
  std::vector<int64_t> knots;
  for (int64_t k = 1; k <= 512 && k < max_step_tokens; k *= 2) knots.push_back(k);
  knots.push_back(max_step_tokens);
  return knots;
}

std::string cpu_device(int n_threads) {
  std::string name = "unknown";
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    name = line.substr(line.find_first_not_of(' ', colon + 1));
    break;
  }
  return "cpu: " + name + ", " + std::to_string(n_threads) +
         (n_threads == 1 ? " thread" : " threads");
}

std::vector<StepSample> measure_steps(const LlamaModel& model, const cpu::KernelTable& kernels,
                                      cpu::ThreadPool& pool, const MeasureOptions& options) {
  DUET_REQUIRE(options.budget_s > 0, "the measuring budget must be positive, got {} s",
               options.budget_s);
  DUET_REQUIRE(options.reps >= 1, "reps must be >= 1, got {}", options.reps);
  const auto start = Clock::now();
  EngineConfig config = options.engine;
  config.end_of_generation.clear();
  Limits limits;
  limits.max_step_tokens = config.scheduler.max_step_tokens;
  limits.max_running = config.scheduler.max_running;
  limits.kv_blocks = config.n_kv_blocks;
  limits.max_context = std::min({model.config().n_ctx_train,
                                 options.max_context + limits.max_step_tokens + kDecodeSteps + 2,
                                 config.n_kv_blocks * KvLayout::kDefaultBlockSize});
  DUET_REQUIRE(limits.max_context > limits.max_step_tokens,
               "the KV cache ({} tokens) and the model's context ({}) must hold more than one "
               "step budget ({} tokens)",
               config.n_kv_blocks * KvLayout::kDefaultBlockSize, model.config().n_ctx_train,
               limits.max_step_tokens);
  DUET_REQUIRE(!config.scheduler.recompute, "measure with the KV cache on");

  Engine engine(model, kernels, pool, config);
  std::vector<StepSample> warm_up;
  std::vector<StepSample> samples;
  StepEstimate estimate;
  {
    // Warm-up (weights paged in, caches and pool threads awake), twice; the
    // second gives the estimate's one-row and full-budget steps.
    TimedEngine timed(engine, warm_up);
    Workloads workloads(timed, model.config().n_vocab, options.seed ^ 0x5eed);
    for (int i = 0; i < 2; ++i) {
      warm_up.clear();
      workloads.decode(limits.max_step_tokens, 1, 0);
    }
    for (const StepSample& s : warm_up) {
      if (s.shape.n_tokens == limits.max_step_tokens) estimate.per_row_s = s.seconds;
      if (s.shape.n_tokens == 1) estimate.one_row_s = s.seconds;  // the last decode
    }
    estimate.per_row_s = std::max(0.0, estimate.per_row_s - estimate.one_row_s) /
                         static_cast<double>(std::max<int64_t>(limits.max_step_tokens - 1, 1));
  }

  std::vector<ContextGroup> plan = make_plan(limits);
  int reps = options.reps;
  const double left = options.budget_s - seconds_since(start);
  while (reps * estimate_plan(plan, limits, estimate) > left) {
    if (reps > 1) {
      --reps;
    } else if (!shrink(plan)) {
      break;
    }
  }
  spdlog::info("measuring {} context(s) up to {} tokens, {} repetition(s), about {:.0f} s",
               plan.size(), plan.empty() ? 0 : plan.back().context, reps,
               reps * estimate_plan(plan, limits, estimate));

  TimedEngine timed(engine, samples);
  Workloads workloads(timed, model.config().n_vocab, options.seed);
  const auto spent = [&] { return seconds_since(start) > options.budget_s; };
  for (int rep = 0; rep < reps && !spent(); ++rep) {
    for (const ContextGroup& group : plan) {
      if (spent()) break;
      const std::vector<int32_t> prefix = workloads.random_tokens(group.context);
      workloads.prime(prefix);
      for (const int64_t chunk : group.prefill_chunks) {
        if (!spent()) workloads.prefill(prefix, chunk);
      }
      for (const int64_t batch : group.decode_batches) {
        if (!spent()) workloads.decode(group.context, batch, 0);
      }
      for (const int64_t batch : group.mixed_batches) {
        if (!spent()) workloads.decode(group.context, batch, limits.max_step_tokens);
      }
    }
  }
  spdlog::info("measured {} steps in {:.1f} s", samples.size(), seconds_since(start));
  return samples;
}

HostSharing measure_neighbour(const LlamaModel& model, const cpu::KernelTable& kernels,
                              cpu::ThreadPool& pool, const MeasureOptions& options) {
  HostSharing host;
  if (options.neighbour_rounds <= 0) return host;
  EngineConfig config = options.engine;
  config.end_of_generation.clear();
  const int64_t chunk = std::min<int64_t>(config.scheduler.max_step_tokens, 512);
  const int64_t batch = std::min<int64_t>(config.scheduler.max_running, 8);
  constexpr int64_t kContext = 256;
  // KV for the workload, no more: two engines share the host's memory.
  const int64_t blocks =
      batch * (blocks_for(kContext + 2 + kDecodeSteps) + 1) + blocks_for(chunk + 1) + 2;
  if (config.n_kv_blocks < blocks || model.config().n_ctx_train < kContext + 2 + kDecodeSteps) {
    spdlog::warn("the KV cache is too small for the neighbour measurement; not measured");
    return host;
  }
  config.n_kv_blocks = blocks;
  const int64_t n_vocab = model.config().n_vocab;

  Engine engine(model, kernels, pool, config);
  std::vector<StepSample> samples;
  TimedEngine timed(engine, samples);
  Workloads workloads(timed, n_vocab, options.seed ^ 0x1a);
  const auto workload_seconds = [&] {
    samples.clear();
    workloads.prefill({}, chunk);
    workloads.decode(kContext, batch, 0);
    double seconds = 0;
    for (const StepSample& s : samples) seconds += s.seconds;
    return seconds;
  };

  cpu::ThreadPool neighbour_pool(pool.size());
  Engine neighbour(model, kernels, neighbour_pool, config);
  std::atomic<bool> stop = false;
  std::atomic<int64_t> neighbour_steps = 0;
  const auto beside = [&] {
    std::vector<StepSample> own;
    TimedEngine t(neighbour, own);
    Workloads w(t, n_vocab, options.seed ^ 0x2b);
    while (!stop) {
      w.prefill({}, chunk);
      ++neighbour_steps;
      if (!stop) w.decode(kContext, batch, 0);
      own.clear();
    }
  };
  const auto with_neighbour = [&] {
    stop = false;
    neighbour_steps = 0;
    std::thread thread(beside);
    while (neighbour_steps == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    double seconds = 0;
    try {
      seconds = workload_seconds();
    } catch (...) {
      stop = true;
      thread.join();
      throw;
    }
    stop = true;
    thread.join();
    return seconds;
  };

  workload_seconds();  // warm-up: weights paged in, caches and pool threads awake
  for (int round = 0; round < options.neighbour_rounds; ++round) {
    double alone = 0, together = 0;
    if (round % 2 == 0) {
      alone = workload_seconds();
      together = with_neighbour();
    } else {
      together = with_neighbour();
      alone = workload_seconds();
    }
    host.samples.push_back(together / alone);
  }
  std::vector<double> sorted = host.samples;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  host.neighbour_slowdown = n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  spdlog::info("a neighbour slows this instance's steps by {:.3f}x (median of {} rounds)",
               host.neighbour_slowdown, n);
  return host;
}

Profile measure_profile(const LlamaModel& model, const cpu::KernelTable& kernels,
                        cpu::ThreadPool& pool, const MeasureOptions& options) {
  const std::vector<StepSample> samples = measure_steps(model, kernels, pool, options);
  Profile profile;
  profile.source = "measured";
  profile.device = cpu_device(pool.size());
  profile.threads = pool.size();
  profile.model =
      model_shape(model.config(), static_cast<double>(model.weight_bytes()), model.config().name);
  InstanceProfile instance;
  instance.tp = 1;
  instance.step = fit_step_cost(samples, measure_knots(options.engine.scheduler.max_step_tokens));
  instance.kv_capacity_tokens = options.engine.n_kv_blocks * KvLayout::kDefaultBlockSize;
  instance.residuals = fit_residuals(instance.step, samples);
  instance.quality = fit_quality(instance.residuals);
  profile.instances.push_back(std::move(instance));
  profile.host = measure_neighbour(model, kernels, pool, options);
  return profile;
}

}  // namespace duet::sim
