// duet-engine-bench: prompt processing and generation speed of one model, the
// way llama-bench measures them, so the two can run side by side:
//   pp N: one forward pass over N random tokens from an empty cache (logits of
//         the last one), tokens/s = N / time;
//   tg N: N single-token steps from an empty cache, tokens/s = N / time;
//   either "@ dD" with -d D: after D tokens already in the cache (filled
//         once, untimed), as llama-bench's --n-depth.
// Each test runs once to warm up, then --repetitions times; it prints the
// mean and standard deviation as a Markdown table (or JSON with --json).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/stats.h"
#include "kernels/cpu/isa.h"
#include "worker/engine.h"
#include "worker/model/cpu_forward.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double mean = 0.0;
  double stddev = 0.0;
};

Stats stats(const std::vector<double>& values) {
  Stats s;
  s.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  double sq = 0.0;
  for (double v : values) sq += (v - s.mean) * (v - s.mean);
  s.stddev = values.size() > 1 ? std::sqrt(sq / static_cast<double>(values.size() - 1)) : 0.0;
  return s;
}

// One sequence's cache with room for n_depth + n_more positions, the first
// n_depth holding random tokens' K/V (llama-bench's -d: a test then runs at
// that depth), filled in one untimed pass.
struct Context {
  std::unique_ptr<duet::KvCache> cache;
  std::vector<int32_t> blocks;
  int64_t n_depth = 0;
};

Context make_context(duet::CpuForward& forward, const duet::ModelConfig& config, int64_t n_depth,
                     int64_t n_more, std::mt19937& rng) {
  const int64_t n_total = std::max<int64_t>(n_depth + n_more, 1);
  Context ctx{std::make_unique<duet::KvCache>(duet::make_kv_layout(config, (n_total + 15) / 16)),
              {},
              n_depth};
  ctx.blocks.resize(static_cast<size_t>(ctx.cache->layout().n_blocks));
  std::iota(ctx.blocks.begin(), ctx.blocks.end(), 0);
  if (n_depth > 0) {
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.n_vocab - 1));
    std::vector<int32_t> tokens(static_cast<size_t>(n_depth));
    for (auto& t : tokens) t = token(rng);
    std::vector<float> logits(static_cast<size_t>(config.n_vocab));
    const duet::ForwardSequence seq{ctx.blocks, 0, n_depth};
    const int64_t last = n_depth - 1;
    forward.run(tokens, {&seq, 1}, *ctx.cache, {&last, 1}, logits.data());
  }
  return ctx;
}

// Runs n_prompt tokens in one batch, then n_gen single-token steps, after the
// context's depth (each run writes the same positions again); returns seconds
// of each part.
std::pair<double, double> run_once(duet::CpuForward& forward, const duet::ModelConfig& config,
                                   Context& ctx, int64_t n_prompt, int64_t n_gen,
                                   std::mt19937& rng) {
  const int64_t d = ctx.n_depth;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.n_vocab - 1));
  std::vector<float> logits(static_cast<size_t>(config.n_vocab));
  double prompt_seconds = 0.0, gen_seconds = 0.0;
  if (n_prompt > 0) {
    std::vector<int32_t> tokens(static_cast<size_t>(n_prompt));
    for (auto& t : tokens) t = token(rng);
    const duet::ForwardSequence seq{ctx.blocks, d, n_prompt};
    const int64_t last = n_prompt - 1;
    const auto start = Clock::now();
    forward.run(tokens, {&seq, 1}, *ctx.cache, {&last, 1}, logits.data());
    prompt_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  if (n_gen > 0) {
    const auto start = Clock::now();
    for (int64_t i = 0; i < n_gen; ++i) {
      const int32_t t = token(rng);
      // A generated token: llama.cpp's one-token order, as the engine runs it.
      const duet::ForwardSequence seq{ctx.blocks, d + i, 1, d + i};
      const int64_t last = 0;
      forward.run({&t, 1}, {&seq, 1}, *ctx.cache, {&last, 1}, logits.data());
    }
    gen_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return {prompt_seconds, gen_seconds};
}

// Aggregate decode speed of the batching engine with n_seq sequences of
// n_prompt random tokens generating n_gen tokens each (no end of generation):
// all prompts prefill in the first step, every later step decodes one token
// of every sequence, as llama-batched-bench measures. Returns {prefill t/s, decode t/s}.
std::pair<double, double> run_batch(const duet::LlamaModel& model,
                                    const duet::cpu::KernelTable& kernels,
                                    duet::cpu::ThreadPool& pool, int64_t n_seq, int64_t n_prompt,
                                    int64_t n_gen, std::mt19937& rng) {
  duet::EngineConfig config;
  config.n_kv_blocks = n_seq * ((n_prompt + n_gen + 15) / 16 + 1);
  config.scheduler.max_running = n_seq;
  config.scheduler.max_step_tokens = n_seq * n_prompt + n_seq;
  duet::Engine engine(model, kernels, pool, config);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(model.config().n_vocab - 1));
  duet::RequestOptions options;
  options.max_tokens = n_gen + 1;  // the first token comes from the prefill step
  for (int64_t i = 0; i < n_seq; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(n_prompt));
    for (auto& t : prompt) t = token(rng);
    engine.submit(std::move(prompt), options, nullptr);
  }
  const auto start = Clock::now();
  engine.step();
  const auto decode_start = Clock::now();
  engine.run_until_idle();
  const auto end = Clock::now();
  const double prefill = std::chrono::duration<double>(decode_start - start).count();
  const double decode = std::chrono::duration<double>(end - decode_start).count();
  return {static_cast<double>(n_seq * n_prompt) / prefill,
          static_cast<double>(n_seq * n_gen) / decode};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "duet-engine-bench: prompt and generation tokens/s of one model (llama-bench style)"};
  std::string model_path;
  std::vector<int64_t> prompt_sizes{512};
  std::vector<int64_t> gen_sizes{128};
  std::vector<int64_t> depths{0};
  std::vector<int> threads{1, 2};
  int repetitions = 5;
  bool json = false;
  std::vector<int64_t> batches;
  app.add_option("-m,--model", model_path, "GGUF model")->required();
  app.add_option("-p,--n-prompt", prompt_sizes, "Prompt sizes (pp tests)")->delimiter(',');
  app.add_option("-n,--n-gen", gen_sizes, "Generation lengths (tg tests)")->delimiter(',');
  app.add_option("-d,--n-depth", depths,
                 "Context depths: tokens already in the cache before each test (as llama-bench's)")
      ->delimiter(',');
  app.add_option("-t,--threads", threads, "Thread counts")->delimiter(',');
  app.add_option("-r,--repetitions", repetitions, "Timed runs per test")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--json", json, "Print JSON instead of a Markdown table");
  app.add_option(
         "--batch", batches,
         "Batching engine mode: sequence counts (e.g. 1,2,4,...,64); uses the first -p and -n")
      ->delimiter(',');
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "duet-engine-bench: error: %s\n", e.what());
    return 2;
  }
  try {
    const duet::cpu::Isa isa = duet::cpu::isa_from_environment();
    const auto& kernels = duet::cpu::kernel_table(isa);
    const auto load_start = std::chrono::steady_clock::now();
    const auto model = duet::LlamaModel::load(model_path, {}, &kernels);
    // What loading costs, the weights laid out for the kernels included
    // (the rest stays mapped, read when first used).
    std::fprintf(
        stderr,
        "duet-engine-bench: loaded in %.2f s (%s): %.0f MiB of weights, %.0f MiB laid out for the "
        "kernels\n",
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(),
        std::string(duet::cpu::isa_name(isa)).c_str(),
        static_cast<double>(model->weight_bytes()) / (1 << 20),
        static_cast<double>(model->interleaved_weight_bytes()) / (1 << 20));
    nlohmann::json results = nlohmann::json::array();
    if (!batches.empty()) {
      const int64_t n_prompt = prompt_sizes.at(0), n_gen = gen_sizes.at(0);
      if (!json)
        std::printf(
            "| threads | batch | prefill t/s | decode t/s (aggregate) |\n|---:|---:|---:|---:|\n");
      for (int n_threads : threads) {
        duet::cpu::ThreadPool pool(n_threads);
        std::mt19937 rng(99);
        for (int64_t b : batches) {
          run_batch(*model, kernels, pool, b, n_prompt, std::min<int64_t>(n_gen, 8),
                    rng);  // warm-up
          std::vector<double> prefill, decode;
          for (int r = 0; r < repetitions; ++r) {
            const auto [pp, tg] = run_batch(*model, kernels, pool, b, n_prompt, n_gen, rng);
            prefill.push_back(pp);
            decode.push_back(tg);
          }
          const double pp = duet::median(prefill), tg = duet::median(decode);
          if (json) {
            results.push_back({{"threads", n_threads},
                               {"batch", b},
                               {"n_prompt", n_prompt},
                               {"n_gen", n_gen},
                               {"prefill_tps", pp},
                               {"decode_tps", tg}});
          } else {
            std::printf("| %d | %lld | %.1f | %.1f |\n", n_threads, static_cast<long long>(b), pp,
                        tg);
            std::fflush(stdout);
          }
        }
      }
      if (json) std::printf("%s\n", results.dump(2).c_str());
      return 0;
    }
    if (!json) {
      std::printf("| model | isa | threads | test | t/s |\n|---|---|---:|---:|---:|\n");
    }
    for (int n_threads : threads) {
      duet::cpu::ThreadPool pool(n_threads);
      duet::CpuForward forward(*model, kernels, pool);
      std::mt19937 rng(1234);
      auto measure = [&](std::string test, int64_t n_depth, int64_t n_prompt, int64_t n_gen) {
        if (n_depth > 0) test += " @ d" + std::to_string(n_depth);
        Context ctx = make_context(forward, model->config(), n_depth, n_prompt + n_gen, rng);
        run_once(forward, model->config(), ctx, n_prompt, n_gen, rng);  // warm-up
        std::vector<double> rates;
        for (int r = 0; r < repetitions; ++r) {
          const auto [pp, tg] = run_once(forward, model->config(), ctx, n_prompt, n_gen, rng);
          rates.push_back(n_prompt > 0 ? n_prompt / pp : n_gen / tg);
        }
        const Stats s = stats(rates);
        if (json) {
          results.push_back({{"model", model->config().name},
                             {"isa", duet::cpu::isa_name(isa)},
                             {"threads", n_threads},
                             {"test", test},
                             {"n_depth", n_depth},
                             {"tokens_per_second", rates},
                             {"mean", s.mean},
                             {"stddev", s.stddev}});
        } else {
          std::printf("| %s | %s | %d | %s | %.2f ± %.2f |\n", model->config().name.c_str(),
                      std::string(duet::cpu::isa_name(isa)).c_str(), n_threads, test.c_str(),
                      s.mean, s.stddev);
          std::fflush(stdout);
        }
      };
      for (int64_t d : depths) {
        for (int64_t p : prompt_sizes) {
          if (p > 0) measure("pp" + std::to_string(p), d, p, 0);
        }
        for (int64_t n : gen_sizes) {
          if (n > 0) measure("tg" + std::to_string(n), d, 0, n);
        }
      }
    }
    if (json) std::printf("%s\n", results.dump(2).c_str());
  } catch (const duet::Error& e) {
    std::fprintf(stderr, "duet-engine-bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
