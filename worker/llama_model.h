// A loaded Llama-family model: its configuration and views of its weights.
//
// The weights stay in the read-only mapping of the GGUF file (no copy); the
// model owns the file. Immutable after load, so any number of forward passes
// may read it.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/gguf.h"
#include "common/model_config.h"
#include "kernels/cpu/matmul.h"

namespace duet {

struct LlamaLayerWeights {
  std::vector<float> attn_norm;  // (n_embd)
  cpu::WeightMatrix wq;          // (n_heads * head_dim) rows of n_embd
  cpu::WeightMatrix wk;          // (n_kv_heads * head_dim) rows of n_embd
  cpu::WeightMatrix wv;          // (n_kv_heads * head_dim) rows of n_embd
  // Projection biases, added after the product (qwen2 has them; llama may): (n_heads * head_dim)
  // for bq, (n_kv_heads * head_dim) for bk and bv; empty when the file has none.
  std::vector<float> bq, bk, bv;
  cpu::WeightMatrix wo;         // n_embd rows of (n_heads * head_dim)
  std::vector<float> ffn_norm;  // (n_embd)
  cpu::WeightMatrix w_gate;     // n_ff rows of n_embd
  cpu::WeightMatrix w_up;       // n_ff rows of n_embd
  cpu::WeightMatrix w_down;     // n_embd rows of n_ff
};

class LlamaModel final {
 public:
  // Opens, validates and maps a GGUF model of a supported architecture
  // (kSupportedArchitectures). Throws duet::Error naming the file and the
  // offending tensor or key for anything unsupported or inconsistent, including
  // a tensor the forward pass would not use (a feature Duet lacks is refused,
  // never silently skipped).
  static std::unique_ptr<LlamaModel> load(const std::filesystem::path& path);

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const GgufFile& file() const { return file_; }

  cpu::WeightMatrix token_embd() const { return token_embd_; }  // n_vocab rows of n_embd
  const LlamaLayerWeights& layer(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  cpu::WeightMatrix output() const { return output_; }  // n_vocab rows (token_embd when tied)
  // RoPE frequency divisors, (n_rot / 2), from `rope_freqs.weight` (Llama 3.1 bakes its
  // "llama3" scaling into it); empty when the file has none.
  const std::vector<float>& rope_freqs() const { return rope_freqs_; }

  // Bytes of weight data the model reads (file tensors it uses).
  size_t weight_bytes() const { return weight_bytes_; }

 private:
  explicit LlamaModel(GgufFile file);
  cpu::WeightMatrix matrix(const std::string& name, int64_t k, int64_t n_out);
  std::vector<float> vector(const std::string& name, int64_t n);
  // vector(name, n) when the file has the tensor, else empty.
  std::vector<float> optional_vector(const std::string& name, int64_t n);
  void refuse_unused_tensors() const;

  GgufFile file_;
  ModelConfig config_;
  cpu::WeightMatrix token_embd_;
  std::vector<LlamaLayerWeights> layers_;
  std::vector<float> output_norm_;
  cpu::WeightMatrix output_;
  std::vector<float> rope_freqs_;
  size_t weight_bytes_ = 0;
  std::unordered_set<std::string> used_tensors_;  // tensors read, during load only (then cleared)
};

}  // namespace duet
