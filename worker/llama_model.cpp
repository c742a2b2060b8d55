#include "worker/llama_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "common/error.h"
#include "kernels/cpu/quantize.h"

namespace duet {

std::unique_ptr<LlamaModel> LlamaModel::load(const std::filesystem::path& path) {
  return std::unique_ptr<LlamaModel>(new LlamaModel(GgufFile::open(path)));
}

LlamaModel::LlamaModel(GgufFile file)
    : file_(std::move(file)), config_(ModelConfig::from_gguf(file_)) {
  const ModelConfig& c = config_;
  token_embd_ = matrix("token_embd.weight", c.n_embd, c.n_vocab);
  layers_.resize(static_cast<size_t>(c.n_layers));
  const int64_t q_dim = c.n_heads * c.head_dim;
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = fmt::format("blk.{}.", i);
    LlamaLayerWeights& l = layers_[static_cast<size_t>(i)];
    l.attn_norm = vector(p + "attn_norm.weight", c.n_embd);
    l.wq = matrix(p + "attn_q.weight", c.n_embd, q_dim);
    l.wk = matrix(p + "attn_k.weight", c.n_embd, kv_dim);
    l.wv = matrix(p + "attn_v.weight", c.n_embd, kv_dim);
    l.wo = matrix(p + "attn_output.weight", q_dim, c.n_embd);
    l.ffn_norm = vector(p + "ffn_norm.weight", c.n_embd);
    l.w_gate = matrix(p + "ffn_gate.weight", c.n_embd, c.n_ff);
    l.w_up = matrix(p + "ffn_up.weight", c.n_embd, c.n_ff);
    l.w_down = matrix(p + "ffn_down.weight", c.n_ff, c.n_embd);
    // Optional for both architectures, as in llama.cpp (Qwen2 files have them); absent means zero.
    l.bq = optional_vector(p + "attn_q.bias", q_dim);
    l.bk = optional_vector(p + "attn_k.bias", kv_dim);
    l.bv = optional_vector(p + "attn_v.bias", kv_dim);
  }
  output_norm_ = vector("output_norm.weight", c.n_embd);
  output_ = c.tied_embeddings ? token_embd_ : matrix("output.weight", c.n_embd, c.n_vocab);
  if (c.architecture == "llama") {  // llama.cpp reads rope_freqs for `llama` only
    rope_freqs_ = optional_vector("rope_freqs.weight", c.n_rot / 2);
    for (float factor : rope_freqs_) {
      if (!(factor > 0.0f) || !std::isfinite(factor)) {
        throw Error(
            ErrorKind::kCorruptFile,
            fmt::format("{}: tensor rope_freqs.weight holds {}; RoPE frequency divisors must be "
                        "positive and finite",
                        file_.name(), factor));
      }
    }
  }
  refuse_unused_tensors();
  used_tensors_.clear();
}

void LlamaModel::refuse_unused_tensors() const {
  for (const GgufTensorInfo& t : file_.tensors()) {
    if (used_tensors_.count(t.name) == 0) {
      throw Error(
          ErrorKind::kUnsupported,
          fmt::format("{}: tensor {} is not part of Duet's '{}' forward pass (a feature Duet does "
                      "not implement); refusing the model rather than ignoring it",
                      file_.name(), t.name, config_.architecture));
    }
  }
}

cpu::WeightMatrix LlamaModel::matrix(const std::string& name, int64_t k, int64_t n_out) {
  const GgufTensorInfo& t = file_.tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != k || t.ne[1] != n_out) {
    throw Error(ErrorKind::kCorruptFile,
                fmt::format("{}: tensor {} has shape [{}], expected [{}, {}]", file_.name(), name,
                            fmt::join(t.ne, ", "), k, n_out));
  }
  if (!dtype_is_supported_weight(t.type)) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("{}: tensor {} has weight type {}, which is not supported "
                            "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)",
                            file_.name(), name, dtype_name(t.type)));
  }
  weight_bytes_ += t.n_bytes;
  used_tensors_.insert(name);
  return cpu::make_weight_matrix(t.type, t.data, k, n_out);
}

std::vector<float> LlamaModel::vector(const std::string& name, int64_t n) {
  const GgufTensorInfo& t = file_.tensor(name);
  if (t.n_elements() != n) {
    throw Error(ErrorKind::kCorruptFile, fmt::format("{}: tensor {} has {} elements, expected {}",
                                                     file_.name(), name, t.n_elements(), n));
  }
  if (t.type != DType::kF32 && t.type != DType::kF16 && t.type != DType::kBF16) {
    throw Error(
        ErrorKind::kUnsupported,
        fmt::format("{}: tensor {} has type {}; vectors (norm weights, biases, rope_freqs) must "
                    "be F32, F16 or BF16",
                    file_.name(), name, dtype_name(t.type)));
  }
  std::vector<float> out(static_cast<size_t>(n));
  cpu::dequantize_row(t.type, t.data, out.data(), n);
  weight_bytes_ += t.n_bytes;
  used_tensors_.insert(name);
  return out;
}

std::vector<float> LlamaModel::optional_vector(const std::string& name, int64_t n) {
  if (file_.find_tensor(name) == nullptr) return {};
  return vector(name, n);
}

}  // namespace duet
