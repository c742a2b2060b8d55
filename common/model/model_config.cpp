#include "common/model/model_config.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/format.h"
#include "common/model/gguf.h"

namespace duet {
namespace {

[[noreturn]] void fail(const GgufFile& file, ErrorKind kind, const std::string& what) {
  throw Error(kind, duet::format("{}: {}", file.name(), what));
}

int64_t require_count(const GgufFile& file, const std::string& key) {
  const std::optional<uint64_t> value = file.get_u64(key);
  if (!value) fail(file, ErrorKind::kCorruptFile, duet::format("missing metadata key {}", key));
  if (*value == 0 || *value > (1ull << 31)) {
    fail(file, ErrorKind::kCorruptFile, duet::format("{} = {} is out of range", key, *value));
  }
  return static_cast<int64_t>(*value);
}

// RoPE frequency scaling as llama.cpp derives it (llama_model::load_hparams and the context
// parameters): the type defaults to "linear"; the factor comes from rope.scaling.factor (or the
// older rope.scale_linear), 0 or absent meaning none; type "none" never scales. YaRN and LongRoPE
// change more than the frequencies and are refused; Llama 3.1's "llama3" scaling needs no key,
// its converter bakes it into the rope_freqs tensor.
float read_rope_freq_scale(const GgufFile& file, const std::string& p) {
  const std::string type = file.get_string(p + "rope.scaling.type").value_or("linear");
  if (type != "linear" && type != "none") {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{}rope.scaling.type = '{}': only 'linear' RoPE scaling is supported "
                      "(YaRN and LongRoPE are not)",
                      p, type));
  }
  std::optional<float> factor = file.get_f32(p + "rope.scaling.factor");
  if (!factor) factor = file.get_f32(p + "rope.scale_linear");
  if (const std::optional<float> attn_factor = file.get_f32(p + "rope.scaling.attn_factor");
      attn_factor && *attn_factor != 1.0f) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{}rope.scaling.attn_factor = {} is not supported", p, *attn_factor));
  }
  if (!factor || *factor == 0.0f || type == "none") return 1.0f;
  if (!(*factor > 0.0f) || !std::isfinite(*factor)) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("{}rope.scaling.factor = {} must be positive", p, *factor));
  }
  return 1.0f / *factor;
}

// Which layers attend through the window, as llama.cpp's load_swa_pattern reads them: an array of
// one flag per layer, else a period n (every layer but each n-th is windowed; 0: all of them),
// else llama.cpp's default for the architecture.
std::vector<bool> read_swa_layers(const GgufFile& file, const std::string& p, int64_t n_layers,
                                  uint32_t default_period) {
  const std::string key = p + "attention.sliding_window_pattern";
  std::vector<bool> layers(static_cast<size_t>(n_layers));
  const GgufValue* value = file.find(key);
  if (value != nullptr && value->is_array()) {
    if (static_cast<int64_t>(value->size()) != n_layers) {
      fail(file, ErrorKind::kCorruptFile,
           duet::format("{} holds {} flags for {} layers", key, value->size(), n_layers));
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      const GgufValue flag = value->element(i);
      if (flag.type() == GgufType::kBool) {
        layers[i] = flag.as_bool();
      } else if (flag.is_integer()) {
        layers[i] = flag.integer_as<int64_t>().value_or(1) != 0;
      } else {
        fail(file, ErrorKind::kCorruptFile,
             duet::format("{} holds {} values, not flags", key, gguf_type_name(flag.type())));
      }
    }
    return layers;
  }
  uint32_t period = default_period;
  if (value != nullptr) {
    const std::optional<uint32_t> n = value->integer_as<uint32_t>();
    if (!n) fail(file, ErrorKind::kCorruptFile, duet::format("{} is not a layer period", key));
    period = *n;
  }
  for (int64_t il = 0; il < n_layers; ++il) {
    layers[static_cast<size_t>(il)] =
        period == 0 || static_cast<uint32_t>(il) % period < period - 1;
  }
  return layers;
}

// gemma3 as llama.cpp's loader and graph take it (src/models/gemma3.cpp): head norms, NeoX RoPE,
// gated GELU, the embedding times sqrt(n_embd), Q times 1/sqrt(head size) (the 62-layer 27B:
// 1/sqrt(n_embd / n_heads)) before unscaled scores, norms after both blocks; with a window, one
// layer in six global and the others windowed at RoPE base rope.freq_base_swa (10000 unless the
// file says), unscaled.
void read_gemma3(const GgufFile& file, const std::string& p, ModelConfig& c) {
  c.ffn_activation = FfnActivation::kGeluTanh;
  c.embed_scale = std::sqrt(static_cast<float>(c.n_embd));
  c.q_scale = c.n_layers == 62 ? 1.0f / std::sqrt(static_cast<float>(c.n_embd / c.n_heads))
                               : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  c.post_norms = true;
  if (const std::optional<float> cap = file.get_f32(p + "final_logit_softcapping");
      cap && *cap != 0.0f) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{}final_logit_softcapping = {}: logit soft-capping is not supported", p,
                      *cap));
  }
  const std::optional<uint64_t> window = file.get_u64(p + "attention.sliding_window");
  if (!window || *window == 0) return;  // llama.cpp: no layer windowed
  if (*window > (1ull << 31)) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("{}attention.sliding_window = {} is out of range", p, *window));
  }
  c.sliding_window = static_cast<int64_t>(*window);
  c.swa_layers = read_swa_layers(file, p, c.n_layers, 6);
  c.rope_freq_base_swa = file.get_f32(p + "rope.freq_base_swa").value_or(10000.0f);
  if (!(c.rope_freq_base_swa > 0.0f)) {
    fail(file, ErrorKind::kCorruptFile, "rope.freq_base_swa must be positive");
  }
}

// A mixture of experts as llama.cpp's `llama` (expert_count > 0: every layer; experts of
// feed_forward_length units) and `qwen3moe` (experts of expert_feed_forward_length units, else
// feed_forward_length / expert_used_count) loaders read it. Per-layer expert counts, expert
// groups and shared experts belong to other architectures and are refused.
void read_experts(const GgufFile& file, const std::string& p, ModelConfig& c) {
  const std::string used_key = p + "expert_used_count";
  if (const GgufValue* used = file.find(used_key); used != nullptr && used->is_array()) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{} is an array: per-layer expert counts are not supported", used_key));
  }
  c.n_experts = require_count(file, p + "expert_count");
  c.n_experts_used = require_count(file, used_key);
  if (c.n_experts > kMaxExperts || c.n_experts_used > c.n_experts) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("{} experts, {} used per token: at most {} experts, and no more used than "
                      "there are",
                      c.n_experts, c.n_experts_used, kMaxExperts));
  }
  if (const uint64_t groups = file.get_u64(p + "expert_group_count").value_or(0); groups > 1) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{}expert_group_count = {}: expert groups are not supported", p, groups));
  }
  if (const uint64_t shared = file.get_u64(p + "expert_shared_count").value_or(0); shared > 0) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("{}expert_shared_count = {}: shared experts are not supported", p, shared));
  }
  c.n_ff_exp = c.n_ff;
  if (c.architecture == "qwen3moe") {
    c.n_ff_exp = file.get_u64(p + "expert_feed_forward_length")
                     ? require_count(file, p + "expert_feed_forward_length")
                     : c.n_ff / c.n_experts_used;
  }
}

}  // namespace

ModelConfig ModelConfig::from_gguf(const GgufFile& file) {
  ModelConfig c;
  const std::optional<std::string> arch = file.get_string("general.architecture");
  if (!arch) fail(file, ErrorKind::kCorruptFile, "missing general.architecture");
  c.architecture = *arch;
  if (std::find(kSupportedArchitectures.begin(), kSupportedArchitectures.end(), c.architecture) ==
      kSupportedArchitectures.end()) {
    fail(file, ErrorKind::kUnsupported,
         duet::format("architecture '{}' is not supported (supported: {})", c.architecture,
                      duet::join(kSupportedArchitectures, ", ")));
  }
  c.name = file.get_string("general.name").value_or(c.architecture);
  const std::string p = c.architecture + ".";

  c.n_layers = require_count(file, p + "block_count");
  c.n_embd = require_count(file, p + "embedding_length");
  c.n_ff = require_count(file, p + "feed_forward_length");
  c.n_heads = require_count(file, p + "attention.head_count");
  c.n_kv_heads = file.get_u64(p + "attention.head_count_kv")
                     ? require_count(file, p + "attention.head_count_kv")
                     : c.n_heads;
  c.n_ctx_train =
      file.get_u64(p + "context_length") ? require_count(file, p + "context_length") : 2048;
  // The head size: attention.key_length when the file has it (Qwen3's heads
  // are wider than n_embd / n_heads), else n_embd / n_heads, as in llama.cpp.
  if (file.get_u64(p + "attention.key_length")) {
    c.head_dim = require_count(file, p + "attention.key_length");
    const int64_t value_length = file.get_u64(p + "attention.value_length")
                                     ? require_count(file, p + "attention.value_length")
                                     : c.head_dim;
    if (value_length != c.head_dim) {
      fail(file, ErrorKind::kUnsupported,
           duet::format("attention.value_length {} differs from attention.key_length {}: "
                        "heads whose values and keys differ in size are not supported",
                        value_length, c.head_dim));
    }
  } else {
    if (c.n_embd % c.n_heads != 0) {
      fail(file, ErrorKind::kCorruptFile,
           duet::format("embedding_length {} is not a multiple of head_count {}", c.n_embd,
                        c.n_heads));
    }
    c.head_dim = c.n_embd / c.n_heads;
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("head_count {} is not a multiple of head_count_kv {}", c.n_heads,
                      c.n_kv_heads));
  }
  c.n_rot = file.get_u64(p + "rope.dimension_count")
                ? require_count(file, p + "rope.dimension_count")
                : c.head_dim;
  if (c.n_rot > c.head_dim || c.n_rot % 2 != 0 || c.n_rot > 1024) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("rope.dimension_count {} does not fit head size {}", c.n_rot, c.head_dim));
  }
  // The RoPE style follows the architecture, not a key: `llama` GGUFs hold Q/K permuted for
  // adjacent-pair rotation, the others as trained (NeoX halves).
  c.rope_neox = c.architecture != "llama";
  c.qk_norm =
      c.architecture == "qwen3" || c.architecture == "qwen3moe" || c.architecture == "gemma3";
  if ((c.architecture == "qwen3" || c.architecture == "qwen3moe") &&
      c.n_rot != c.head_dim) {  // as llama.cpp's graph asserts
    fail(file, ErrorKind::kUnsupported,
         duet::format("rope.dimension_count {} differs from the head size {}: {} rotates whole "
                      "heads",
                      c.n_rot, c.head_dim, c.architecture));
  }
  c.rope_freq_base = file.get_f32(p + "rope.freq_base").value_or(10000.0f);
  const std::optional<float> rms_eps = file.get_f32(p + "attention.layer_norm_rms_epsilon");
  if (!rms_eps && (c.architecture == "gemma3" || c.architecture == "qwen3moe")) {
    // llama.cpp requires it there
    fail(file, ErrorKind::kCorruptFile,
         duet::format("missing metadata key {}attention.layer_norm_rms_epsilon", p));
  }
  c.rms_eps = rms_eps.value_or(1e-5f);
  if (!(c.rope_freq_base > 0.0f) || !(c.rms_eps > 0.0f)) {
    fail(file, ErrorKind::kCorruptFile,
         "rope.freq_base and layer_norm_rms_epsilon must be positive");
  }
  c.rope_freq_scale = read_rope_freq_scale(file, p);
  if (c.architecture == "gemma3") {
    read_gemma3(file, p, c);
  } else if (const GgufValue* window = file.find(p + "attention.sliding_window")) {
    // llama.cpp's graphs for these architectures ignore the key; attending to the whole context
    // would answer unlike the model as trained, attending through the window unlike llama.cpp.
    const std::optional<uint64_t> size = window->integer_as<uint64_t>();
    fail(file, ErrorKind::kUnsupported,
         duet::format(
             "{}attention.sliding_window = {}: sliding-window attention is not supported for "
             "'{}' (llama.cpp ignores the key for it; Duet windows gemma3 only)",
             p, size ? std::to_string(*size) : std::string(gguf_type_name(window->type())),
             c.architecture));
  }
  const bool moe_architecture = c.architecture == "qwen3moe" || c.architecture == "llama";
  if (file.get_u64(p + "expert_count").value_or(0) > 0 || c.architecture == "qwen3moe") {
    if (!moe_architecture) {
      fail(file, ErrorKind::kUnsupported,
           duet::format("{}expert_count: '{}' has no mixture of experts in llama.cpp", p,
                        c.architecture));
    }
    read_experts(file, p, c);
  }

  const GgufTensorInfo& embd = file.tensor("token_embd.weight");
  if (embd.ne.size() != 2 || embd.ne[0] != c.n_embd) {
    fail(file, ErrorKind::kCorruptFile,
         duet::format("token_embd.weight has shape {} but embedding_length is {}",
                      duet::join(embd.ne, "x"), c.n_embd));
  }
  c.n_vocab = embd.ne[1];
  c.tied_embeddings = file.find_tensor("output.weight") == nullptr;
  return c;
}

}  // namespace duet
