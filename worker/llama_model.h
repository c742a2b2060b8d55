// A loaded Llama-family model: its configuration and views of its weights.
//
// The weights stay in the read-only mapping of the GGUF file (no copy); the
// model owns the file. Immutable after load, so any number of forward passes
// may read it.
#pragma once

#include <filesystem>
#include <memory>
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
  cpu::WeightMatrix wo;          // n_embd rows of (n_heads * head_dim)
  std::vector<float> ffn_norm;   // (n_embd)
  cpu::WeightMatrix w_gate;      // n_ff rows of n_embd
  cpu::WeightMatrix w_up;        // n_ff rows of n_embd
  cpu::WeightMatrix w_down;      // n_embd rows of n_ff
};

class LlamaModel final {
 public:
  // Opens, validates and maps a GGUF model. Throws duet::Error naming the file
  // and the offending tensor or key for anything unsupported or inconsistent.
  static std::unique_ptr<LlamaModel> load(const std::filesystem::path& path);

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  const GgufFile& file() const { return file_; }

  cpu::WeightMatrix token_embd() const { return token_embd_; }  // n_vocab rows of n_embd
  const LlamaLayerWeights& layer(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  cpu::WeightMatrix output() const { return output_; }  // n_vocab rows (token_embd when tied)

  // Bytes of weight data the model reads (file tensors it uses).
  size_t weight_bytes() const { return weight_bytes_; }

 private:
  explicit LlamaModel(GgufFile file);
  cpu::WeightMatrix matrix(const std::string& name, int64_t k, int64_t n_out);
  std::vector<float> vector(const std::string& name, int64_t n);

  GgufFile file_;
  ModelConfig config_;
  cpu::WeightMatrix token_embd_;
  std::vector<LlamaLayerWeights> layers_;
  std::vector<float> output_norm_;
  cpu::WeightMatrix output_;
  size_t weight_bytes_ = 0;
};

}  // namespace duet
