#include "sim/roofline.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "common/error.h"
#include "sim/json_fields.h"
#include "worker/kv/kv_cache.h"

namespace duet::sim {
namespace {

// BF16: the built-in models' weights and the activations a tensor-parallel
// step all-reduces.
constexpr double kBf16Bytes = 2;
// Megatron-style tensor parallelism all-reduces twice a layer: after the
// attention's output projection and after the FFN's down projection.
constexpr int64_t kAllReducesPerLayer = 2;
// The knots of a roofline step cost: 1, 2, 4, ... tokens up to this, enough
// for a long prefill chunk; past it the last segment's slope goes on.
constexpr int64_t kMaxTokenKnot = 8192;
// Host work per sequence in a step (block tables, sampling, detokenizing):
// an assumption, not a measurement.
constexpr double kPerSequenceSeconds = 20e-6;
// A KV transfer between nodes over RDMA: an assumed 400 Gb/s NIC
// (400e9 / 8 bytes/s) at an assumed 10 us a message.
constexpr double kRdmaBytesPerS = 50e9;
constexpr double kRdmaLatencyS = 10e-6;

// Every kernel launch and scheduling pass of a step, assumed 0.5 ms (no CUDA
// graphs); NVLink latency assumed 5 us a collective.
constexpr double kGpuStepOverheadS = 0.5e-3;
constexpr double kNvlinkLatencyS = 5e-6;

// Vendors' data sheets, SXM parts; FLOP/s are dense BF16 (the sheets' larger
// figures assume 2:4 sparsity); link bandwidth is NVLink's per direction
// (half the sheets' bidirectional figure).
HardwareSpec gpu(std::string name, double memory_bytes, double memory_bytes_per_s,
                 double flops_per_s, double link_bytes_per_s) {
  HardwareSpec hw;
  hw.name = std::move(name);
  hw.memory_bytes = memory_bytes;
  hw.memory_bytes_per_s = memory_bytes_per_s;
  hw.flops_per_s = flops_per_s;
  hw.link_bytes_per_s = link_bytes_per_s;
  hw.link_latency_s = kNvlinkLatencyS;
  hw.step_overhead_s = kGpuStepOverheadS;
  return hw;
}

const std::array<HardwareSpec, 3>& known_hardware() {
  static const std::array<HardwareSpec, 3> known = {
      gpu("h200", 141e9, 4.8e12, 989e12, 450e9),   // HBM3e; NVLink 4: 900 GB/s both ways
      gpu("h100", 80e9, 3.35e12, 989e12, 450e9),   // HBM3; NVLink 4
      gpu("a100", 80e9, 2.039e12, 312e12, 300e9),  // 80 GB HBM2e; NVLink 3: 600 GB/s
  };
  return known;
}

ModelConfig llama3(std::string name, int64_t n_layers, int64_t n_embd, int64_t n_heads,
                   int64_t n_ff) {
  ModelConfig c;
  c.architecture = "llama";
  c.name = std::move(name);
  c.n_vocab = 128256;
  c.n_embd = n_embd;
  c.n_layers = n_layers;
  c.n_heads = n_heads;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.n_ff = n_ff;
  c.n_ctx_train = 8192;
  c.n_rot = 128;
  c.rope_freq_base = 500000.0f;
  return c;
}

void require_hardware(const HardwareSpec& hw, const std::string& where) {
  const auto positive = [&](double value, std::string_view field) {
    DUET_REQUIRE(std::isfinite(value) && value > 0, "{}{}: {} must be > 0", where, field, value);
  };
  const auto share = [&](double value, std::string_view field) {
    DUET_REQUIRE(value > 0 && value <= 1, "{}{}: {} must be in (0, 1]", where, field, value);
  };
  positive(hw.memory_bytes, "memory_bytes");
  positive(hw.memory_bytes_per_s, "memory_bytes_per_s");
  positive(hw.flops_per_s, "flops_per_s");
  positive(hw.link_bytes_per_s, "link_bytes_per_s");
  DUET_REQUIRE(hw.link_latency_s >= 0, "{}link_latency_s: {} must be >= 0", where,
               hw.link_latency_s);
  DUET_REQUIRE(hw.step_overhead_s >= 0, "{}step_overhead_s: {} must be >= 0", where,
               hw.step_overhead_s);
  share(hw.memory_efficiency, "memory_efficiency");
  share(hw.compute_efficiency, "compute_efficiency");
  share(hw.kv_memory_fraction, "kv_memory_fraction");
}

// Weights a row multiplies through the layers (the head is per_logit_row's):
// a mixture of experts' router and the experts a token picks.
double layer_matmul_params(const ModelShape& m) {
  const double q_o = 2.0 * m.n_embd * m.n_heads * m.head_dim;
  const double k_v = 2.0 * m.n_embd * m.n_kv_heads * m.head_dim;
  const double ffn = m.n_experts > 0 ? static_cast<double>(m.n_embd) *
                                           (3.0 * m.n_ff_exp * m.n_experts_used + m.n_experts)
                                     : 3.0 * m.n_embd * m.n_ff;
  return m.n_layers * (q_o + k_v + ffn);
}

double memory_rate(const HardwareSpec& hw) { return hw.memory_bytes_per_s * hw.memory_efficiency; }
double compute_rate(const HardwareSpec& hw) { return hw.flops_per_s * hw.compute_efficiency; }

}  // namespace

double ModelShape::experts_read(int64_t n_tokens) const {
  if (n_experts == 0) return 1.0;
  const double miss = 1.0 - static_cast<double>(n_experts_used) / static_cast<double>(n_experts);
  return 1.0 - std::pow(miss, static_cast<double>(n_tokens));
}

double expert_parameter_count(const ModelConfig& c) {
  return static_cast<double>(c.n_layers) * 3.0 * static_cast<double>(c.n_embd) *
         static_cast<double>(c.n_ff_exp) * static_cast<double>(c.n_experts);
}

double parameter_count(const ModelConfig& c) {
  const double e = static_cast<double>(c.n_embd);
  const double q = static_cast<double>(c.n_heads * c.head_dim);
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim);
  const double ffn = c.is_moe() ? e * static_cast<double>(c.n_experts)  // the router
                                : 3 * e * static_cast<double>(c.n_ff);  // gate, up, down
  double layer = e * q + 2 * e * kv + q * e                             // q, k, v, o
                 + ffn + 2 * e;                        // the feed-forward, attention and FFN norms
  if (c.architecture == "qwen2") layer += q + 2 * kv;  // q, k, v biases
  const double embedding = static_cast<double>(c.n_vocab) * e;
  return embedding + static_cast<double>(c.n_layers) * layer + e  // final norm
         + (c.tied_embeddings ? 0.0 : embedding) + expert_parameter_count(c);
}

ModelShape model_shape(const ModelConfig& config, double weight_bytes, std::string name) {
  DUET_REQUIRE(config.n_layers > 0 && config.n_embd > 0 && config.n_heads > 0 &&
                   config.n_kv_heads > 0 && config.head_dim > 0 && config.n_ff > 0 &&
                   config.n_vocab > 0,
               "model {}: every dimension must be > 0 (layers {}, embd {}, heads {}, kv heads {}, "
               "head_dim {}, ff {}, vocab {})",
               name, config.n_layers, config.n_embd, config.n_heads, config.n_kv_heads,
               config.head_dim, config.n_ff, config.n_vocab);
  DUET_REQUIRE(std::isfinite(weight_bytes) && weight_bytes > 0,
               "model {}: weight bytes {} must be > 0", name, weight_bytes);
  ModelShape m;
  m.name = std::move(name);
  m.n_layers = config.n_layers;
  m.n_embd = config.n_embd;
  m.n_heads = config.n_heads;
  m.n_kv_heads = config.n_kv_heads;
  m.head_dim = config.head_dim;
  m.n_ff = config.n_ff;
  m.n_vocab = config.n_vocab;
  m.n_ctx = config.n_ctx_train;
  m.n_params = parameter_count(config);
  m.weight_bytes = weight_bytes;
  m.kv_bytes_per_token = static_cast<double>(make_kv_layout(config, 1).bytes_per_token());
  if (config.is_moe()) {
    m.n_experts = config.n_experts;
    m.n_experts_used = config.n_experts_used;
    m.n_ff_exp = config.n_ff_exp;
    // The experts' share of the bytes, as of the parameters (one weight type throughout).
    m.expert_bytes = weight_bytes * expert_parameter_count(config) / m.n_params;
  }
  return m;
}

// A mixture of experts on a llama3() body (config.json's shapes).
ModelConfig moe(ModelConfig c, int64_t n_kv_heads, int64_t n_vocab, int64_t n_experts,
                int64_t n_used, int64_t n_ff_exp) {
  c.n_kv_heads = n_kv_heads;
  c.n_vocab = n_vocab;
  c.n_experts = n_experts;
  c.n_experts_used = n_used;
  c.n_ff_exp = n_ff_exp;
  return c;
}

ModelShape named_model_shape(std::string_view name) {
  const std::array<ModelConfig, 4> known = {
      llama3("llama-3-8b", 32, 4096, 32, 14336),
      llama3("llama-3-70b", 80, 8192, 64, 28672),
      moe(llama3("qwen3-30b-a3b", 48, 2048, 32, 6144), 4, 151936, 128, 8, 768),
      moe(llama3("mixtral-8x7b", 32, 4096, 32, 14336), 8, 32000, 8, 2, 14336),
  };
  std::vector<std::string> names;
  for (const ModelConfig& config : known) {
    if (config.name == name) {
      return model_shape(config, kBf16Bytes * parameter_count(config), config.name);
    }
    names.push_back(config.name);
  }
  throw Error(ErrorKind::kInvalidArgument,
              duet::format("no built-in model '{}'; known: {}", name, duet::join(names, ", ")));
}

HardwareSpec named_hardware(std::string_view name) {
  std::vector<std::string> names;
  for (const HardwareSpec& hw : known_hardware()) {
    if (hw.name == name) return hw;
    names.push_back(hw.name);
  }
  throw Error(ErrorKind::kInvalidArgument,
              duet::format("no built-in hardware '{}'; known: {}", name, duet::join(names, ", ")));
}

nlohmann::json hardware_json(const HardwareSpec& hw) {
  return {{"name", hw.name},
          {"memory_bytes", json_number(hw.memory_bytes)},
          {"memory_bytes_per_s", json_number(hw.memory_bytes_per_s)},
          {"flops_per_s", json_number(hw.flops_per_s)},
          {"link_bytes_per_s", json_number(hw.link_bytes_per_s)},
          {"link_latency_s", json_number(hw.link_latency_s)},
          {"step_overhead_s", json_number(hw.step_overhead_s)},
          {"memory_efficiency", json_number(hw.memory_efficiency)},
          {"compute_efficiency", json_number(hw.compute_efficiency)},
          {"kv_memory_fraction", json_number(hw.kv_memory_fraction)}};
}

HardwareSpec hardware_from_json(const nlohmann::json& json, const std::string& path) {
  const JsonFields f(json, path);
  f.only({"name", "memory_bytes", "memory_bytes_per_s", "flops_per_s", "link_bytes_per_s",
          "link_latency_s", "step_overhead_s", "memory_efficiency", "compute_efficiency",
          "kv_memory_fraction"});
  HardwareSpec hw;
  hw.name = f.string("name");
  hw.memory_bytes = f.number("memory_bytes");
  hw.memory_bytes_per_s = f.number("memory_bytes_per_s");
  hw.flops_per_s = f.number("flops_per_s");
  hw.link_bytes_per_s = f.number("link_bytes_per_s");
  hw.link_latency_s = f.number("link_latency_s");
  hw.step_overhead_s = f.number("step_overhead_s");
  if (f.has("memory_efficiency")) hw.memory_efficiency = f.number("memory_efficiency");
  if (f.has("compute_efficiency")) hw.compute_efficiency = f.number("compute_efficiency");
  if (f.has("kv_memory_fraction")) hw.kv_memory_fraction = f.number("kv_memory_fraction");
  require_hardware(hw, path.empty() ? std::string() : path + ".");
  return hw;
}

LinkCost ring_all_reduce_cost(const HardwareSpec& hw, int ranks) {
  DUET_REQUIRE(ranks >= 2, "an all-reduce over {} ranks", ranks);
  const double share = 2.0 * (ranks - 1) / ranks;  // of the bytes each rank sends
  return {hw.link_latency_s, hw.link_bytes_per_s / share};
}

double roofline_weights_seconds(const HardwareSpec& hw, const ModelShape& model, int tp,
                                int64_t n_tokens) {
  DUET_REQUIRE(tp >= 1, "tp {}", tp);
  const double n = static_cast<double>(n_tokens);
  // A mixture of experts reads the experts some token picked.
  const double bytes_read =
      model.weight_bytes - model.expert_bytes + model.expert_bytes * model.experts_read(n_tokens);
  const double read = bytes_read / tp / memory_rate(hw);
  const double compute = 2 * layer_matmul_params(model) * n / tp / compute_rate(hw);
  double all_reduce = 0;
  if (tp > 1) {
    const double bytes = n * static_cast<double>(model.n_embd) * kBf16Bytes;
    all_reduce = static_cast<double>(kAllReducesPerLayer * model.n_layers) *
                 ring_all_reduce_cost(hw, tp).seconds(bytes);
    // Expert parallelism: each layer's picks, completed by one more all-reduce.
    if (model.n_experts > 0) {
      all_reduce +=
          static_cast<double>(model.n_layers) *
          ring_all_reduce_cost(hw, tp).seconds(bytes * static_cast<double>(model.n_experts_used));
    }
  }
  return hw.step_overhead_s + std::max(read, compute) + all_reduce;
}

Profile roofline_profile(const HardwareSpec& hw, const ModelShape& model,
                         std::span<const int> tps) {
  require_hardware(hw, "hardware " + hw.name + ": ");
  DUET_REQUIRE(model.weight_bytes > 0 && model.kv_bytes_per_token > 0 && model.n_layers > 0,
               "model {}: weight bytes {}, KV bytes per token {}, layers {} must be > 0",
               model.name, model.weight_bytes, model.kv_bytes_per_token, model.n_layers);
  DUET_REQUIRE(!tps.empty(), "a roofline profile needs at least one tp");
  std::vector<int> sorted(tps.begin(), tps.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    DUET_REQUIRE(sorted[i] >= 1 && sorted[i] <= model.n_kv_heads,
                 "tp {}: must be in [1, {}] (one KV head per rank at least)", sorted[i],
                 model.n_kv_heads);
    DUET_REQUIRE(i == 0 || sorted[i] != sorted[i - 1], "tp {} is listed twice", sorted[i]);
  }

  Profile profile;
  profile.source = "roofline";
  profile.device = "roofline: " + hw.name;
  profile.note =
      "derived from the stated hardware, not measured, and uncalibrated: no GPU figures; "
      "each step is the longer of the weights' read and their compute at the stated "
      "efficiencies, plus a fixed step overhead, ring all-reduces and attention terms, with "
      "nothing overlapped; per-sequence host cost and RDMA figures are assumptions";
  profile.model = model;
  profile.hardware = hw;

  for (int tp : sorted) {
    const double memory = tp * hw.memory_bytes;
    DUET_REQUIRE(model.weight_bytes < memory,
                 "model {} ({} GB of weights) does not fit in tp {} of {} ({} GB)", model.name,
                 model.weight_bytes / 1e9, tp, hw.name, memory / 1e9);
    InstanceProfile instance;
    instance.tp = tp;
    StepCost& step = instance.step;
    for (int64_t knot = 1; knot <= kMaxTokenKnot; knot *= 2) {
      step.token_knots.push_back(knot);
      step.knot_seconds.push_back(roofline_weights_seconds(hw, model, tp, knot));
    }
    step.per_sequence = kPerSequenceSeconds;
    step.per_decode_attention = model.kv_bytes_per_token / tp / memory_rate(hw);
    step.per_prefill_attention =
        4.0 * static_cast<double>(model.n_heads * model.head_dim * model.n_layers) / tp /
        compute_rate(hw);
    step.per_logit_row =
        2.0 * static_cast<double>(model.n_embd * model.n_vocab) / tp / compute_rate(hw);
    instance.kv_capacity_tokens = static_cast<int64_t>(
        (memory - model.weight_bytes) * hw.kv_memory_fraction / model.kv_bytes_per_token);
    profile.instances.push_back(std::move(instance));
    if (tp > 1) profile.collectives.push_back({"all_reduce", tp, ring_all_reduce_cost(hw, tp), {}});
  }
  profile.transfers.push_back({"nvlink", {hw.link_latency_s, hw.link_bytes_per_s}, {}});
  profile.transfers.push_back({"rdma", {kRdmaLatencyS, kRdmaBytesPerS}, {}});
  return profile;
}

}  // namespace duet::sim
