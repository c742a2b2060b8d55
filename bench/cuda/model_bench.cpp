#include "bench/cuda/model_bench.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "worker/kv/kv_cache.h"
#include "worker/model/cuda_forward.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"

namespace duet::cuda_bench {
namespace {

constexpr int64_t kMaxBatch = 64;
constexpr int64_t kTokensPerSequence = 256;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kBlocksPerSequence = kTokensPerSequence / kBlockSize;
constexpr int64_t kPromptTokens = 128;
constexpr int64_t kPrefillGroup = 16;  // sequences per prefill run
constexpr int64_t kWarmupSteps = 2;    // the graph is captured on a batch size's second step
constexpr int64_t kDecodeSteps = 64;
static_assert(kPromptTokens + kWarmupSteps + kDecodeSteps <= kTokensPerSequence);
static_assert(kMaxPrefillTokens == kMaxBatch * kTokensPerSequence);

struct ModelRig {
  const LlamaModel& model;
  CudaForward& forward;
  KvCache& cache;
  std::vector<std::vector<int32_t>> tables;  // sequence s: its own kBlocksPerSequence blocks
};

int32_t prompt_token(int64_t sequence, int64_t position, int64_t n_vocab) {
  return static_cast<int32_t>((sequence * 1009 + position * 7919 + 1) % n_vocab);
}

// FLOPs of one n-token prompt in one run: every layer's 7 matmuls on every
// token, causal attention (QK^T and PV over n(n+1)/2 query-key pairs) and the
// output head on the last row.
double prompt_flops(const ModelConfig& c, int64_t n) {
  const auto d = static_cast<double>(c.n_embd);
  const auto q_dim = static_cast<double>(c.n_heads * c.head_dim);
  const auto kv_dim = static_cast<double>(c.n_kv_heads * c.head_dim);
  const double matmuls = 2.0 * (d * (2 * q_dim + 2 * kv_dim) + 3 * d * static_cast<double>(c.n_ff));
  const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2;
  const double attention = 4.0 * q_dim * pairs;
  return static_cast<double>(c.n_layers) * (matmuls * static_cast<double>(n) + attention) +
         2.0 * d * static_cast<double>(c.n_vocab);
}

// One n_tokens prompt in one run (the last row's logits only), in blocks 0..
// (the decode prompts overwrite them later).
void measure_model_prefill(ModelRig& rig, Reps reps, int64_t n_tokens, double gemm_tflops,
                           JsonWriter& json) {
  std::vector<int32_t> table(static_cast<size_t>((n_tokens + kBlockSize - 1) / kBlockSize));
  std::iota(table.begin(), table.end(), 0);
  std::vector<int32_t> tokens;
  for (int64_t p = 0; p < n_tokens; ++p)
    tokens.push_back(prompt_token(0, p, rig.model.config().n_vocab));
  const ForwardSequence sequence{table, 0, n_tokens};
  const int64_t last_row = n_tokens - 1;
  const double seconds = time_median(rig.forward.backend(), reps, [&] {
    rig.forward.run(tokens, {&sequence, 1}, rig.cache, {&last_row, 1}, nullptr);
  });
  const double tokens_per_s = static_cast<double>(n_tokens) / seconds;
  const double tflops = prompt_flops(rig.model.config(), n_tokens) / seconds / kTera;
  std::printf(
      "  prefill, one %ld-token prompt: %.2f ms, %.0f tokens/s, %.1f TFLOP/s (%.3f of GEMM)\n",
      static_cast<long>(n_tokens), seconds * 1e3, tokens_per_s, tflops, tflops / gemm_tflops);
  json.open("model_prefill", '{');
  json.integer("prompt_tokens", n_tokens);
  json.number("ms", seconds * 1e3);
  json.number("tokens_per_s", tokens_per_s);
  json.number("tflops", tflops);
  json.number("ratio_to_gemm", tflops / gemm_tflops);
  json.close('}');
}

// Prefills sequences [0, batch) with kPromptTokens each (kPrefillGroup at a
// time) and returns each one's greedy next token.
std::vector<int32_t> prefill_prompts(ModelRig& rig, int64_t batch) {
  std::vector<int32_t> next(static_cast<size_t>(batch));
  for (int64_t s0 = 0; s0 < batch; s0 += kPrefillGroup) {
    const int64_t n_seq = std::min(kPrefillGroup, batch - s0);
    std::vector<int32_t> tokens;
    std::vector<ForwardSequence> sequences;
    std::vector<int64_t> last_rows;
    for (int64_t s = s0; s < s0 + n_seq; ++s) {
      for (int64_t p = 0; p < kPromptTokens; ++p)
        tokens.push_back(prompt_token(s, p, rig.model.config().n_vocab));
      sequences.push_back({rig.tables[static_cast<size_t>(s)], 0, kPromptTokens});
      last_rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
    }
    rig.forward.run(tokens, sequences, rig.cache, last_rows, nullptr);
    const std::vector<DeviceSampling> greedy(static_cast<size_t>(n_seq));
    rig.forward.sample(greedy, std::span<int32_t>(next).subspan(static_cast<size_t>(s0),
                                                                static_cast<size_t>(n_seq)));
  }
  return next;
}

// Fresh prompts, kWarmupSteps untimed decode steps, then kDecodeSteps timed
// ones: one row per sequence, every row sampled greedily on the device. One
// row of the table, one object ("graphs" or "no_graphs") in json.
void measure_decode(ModelRig& rig, int64_t batch, bool graphs, double copy_gbps, JsonWriter& json) {
  rig.forward.set_use_graphs(graphs);
  std::vector<int32_t> tokens = prefill_prompts(rig, batch);
  std::vector<ForwardSequence> sequences(static_cast<size_t>(batch));
  std::vector<int64_t> rows(static_cast<size_t>(batch));
  std::iota(rows.begin(), rows.end(), 0);
  const std::vector<DeviceSampling> greedy(static_cast<size_t>(batch));
  auto step = [&](int64_t i) {
    for (size_t s = 0; s < sequences.size(); ++s)
      sequences[s] = {rig.tables[s], kPromptTokens + i, 1};
    rig.forward.run(tokens, sequences, rig.cache, rows, nullptr);
    rig.forward.sample(greedy, tokens);  // run() has already staged the tokens it read
  };
  for (int64_t i = 0; i < kWarmupSteps; ++i) step(i);
  rig.forward.backend().synchronize();
  const int64_t launches_before = rig.forward.graph_launches();
  std::vector<double> step_seconds;
  for (int64_t i = kWarmupSteps; i < kWarmupSteps + kDecodeSteps; ++i) {
    const Clock::time_point t0 = Clock::now();
    step(i);
    rig.forward.backend().synchronize();
    step_seconds.push_back(seconds_between(t0, Clock::now()));
  }
  const int64_t launches = rig.forward.graph_launches() - launches_before;
  const double seconds = std::accumulate(step_seconds.begin(), step_seconds.end(), 0.0);
  const double tokens_per_s = static_cast<double>(batch * kDecodeSteps) / seconds;
  const double step_ms = seconds / static_cast<double>(kDecodeSteps) * 1e3;
  const double median_step_ms = median(step_seconds) * 1e3;
  // The whole model's weights are read once a step, whatever the batch.
  const auto weight_bytes = static_cast<double>(rig.forward.weight_bytes());
  const double weight_gbps = weight_bytes * static_cast<double>(kDecodeSteps) / seconds / kGiga;
  std::printf("  %5ld %7s %10.1f %8.3f %8.3f %12.3f %10.1f %8.3f\n", static_cast<long>(batch),
              graphs ? "on" : "off", tokens_per_s, step_ms, median_step_ms,
              weight_bytes / static_cast<double>(batch) / 1e6, weight_gbps,
              weight_gbps / copy_gbps);
  if (graphs && launches < kDecodeSteps) {
    std::printf("  warning: batch %ld replayed a graph on only %ld of %ld steps\n",
                static_cast<long>(batch), static_cast<long>(launches),
                static_cast<long>(kDecodeSteps));
  }
  std::fflush(stdout);
  json.open(graphs ? "graphs" : "no_graphs", '{');
  json.integer("steps", kDecodeSteps);
  json.number("seconds", seconds);
  json.number("tokens_per_s", tokens_per_s);
  json.number("step_ms", step_ms);
  json.number("median_step_ms", median_step_ms);
  json.number("weight_bytes_per_token", weight_bytes / static_cast<double>(batch));
  json.number("weight_gbps", weight_gbps);
  json.number("ratio_to_copy", weight_gbps / copy_gbps);
  json.integer("graph_launches", launches);
  json.close('}');
}

}  // namespace

void measure_model(const std::string& path, Rooflines rooflines, const Plan& plan,
                   int64_t prefill_tokens, JsonWriter& json) {
  const std::unique_ptr<LlamaModel> model = LlamaModel::load(path);
  CudaForward forward(*model, 0);
  // The device KV cache takes this host cache's layout (the host copy is the
  // KV transfer's staging area, unused here).
  KvCache cache(make_kv_layout(model->config(), kMaxBatch * kBlocksPerSequence, kBlockSize));
  ModelRig rig{*model, forward, cache, {}};
  for (int64_t s = 0; s < kMaxBatch; ++s) {
    std::vector<int32_t> table(static_cast<size_t>(kBlocksPerSequence));
    std::iota(table.begin(), table.end(), static_cast<int32_t>(s * kBlocksPerSequence));
    rig.tables.push_back(std::move(table));
  }
  const std::string name = model->config().name.empty() ? path : model->config().name;
  std::printf("== model %s: %.1f MB of weights on the device ==\n", name.c_str(),
              static_cast<double>(forward.weight_bytes()) / 1e6);
  json.open("model", '{');
  json.string("path", path);
  json.string("name", name);
  json.integer("weight_bytes", static_cast<int64_t>(forward.weight_bytes()));
  json.close('}');

  measure_model_prefill(rig, plan.model_prefill, prefill_tokens, rooflines.gemm_tflops, json);
  std::printf("  decode, %ld steps after %ld-token prompts, greedy sampling on the device:\n",
              static_cast<long>(kDecodeSteps), static_cast<long>(kPromptTokens));
  std::printf("  %5s %7s %10s %8s %8s %12s %10s %8s\n", "batch", "graphs", "tokens/s", "step ms",
              "median", "wt MB/token", "wt GB/s", "vs copy");
  json.open("model_decode", '{');
  static_assert(kMaxBatch == 64, "the JSON keys below");
  for (const auto& [batch, key] : {std::pair<int64_t, const char*>{1, "b1"}, {kMaxBatch, "b64"}}) {
    json.open(key, '{');
    for (const bool graphs : {false, true})
      measure_decode(rig, batch, graphs, rooflines.copy_gbps, json);
    json.close('}');
  }
  json.close('}');
  std::printf(
      "  (weight bytes: CudaForward::weight_bytes(), every uploaded matrix once, the embedding\n"
      "   table too though a step reads only its looked-up rows: GB/s is slightly overstated)\n");
}

}  // namespace duet::cuda_bench
