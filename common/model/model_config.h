// Hyper-parameters of a Llama-family model, read from GGUF metadata.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace duet {

class GgufFile;

// general.architecture values Duet runs: `llama` (also Llama 3/3.1 and Mistral without sliding
// windows), `qwen2` (Q/K/V biases, NeoX RoPE) and `qwen3` (RMS norm of Q and K per head, NeoX
// RoPE, a head size of its own).
inline constexpr std::array<std::string_view, 3> kSupportedArchitectures = {"llama", "qwen2",
                                                                            "qwen3"};

struct ModelConfig {
  std::string architecture;  // GGUF general.architecture
  std::string name;          // general.name, for logs
  int64_t n_vocab = 0;
  int64_t n_embd = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;  // attention.key_length, else n_embd / n_heads
  int64_t n_ff = 0;
  int64_t n_ctx_train = 0;
  int64_t n_rot = 0;       // rotated dims per head
  bool rope_neox = false;  // rotate halves (NeoX) instead of adjacent pairs
  bool qk_norm = false;    // RMS norm of each Q and K head before RoPE (qwen3)
  float rope_freq_base = 10000.0f;
  float rope_freq_scale = 1.0f;  // linear position scaling: 1 / rope.scaling.factor
  float rms_eps = 1e-5f;
  bool tied_embeddings = false;  // no output.weight: the head reuses token_embd

  // Reads and validates the metadata; throws kUnsupported for an architecture
  // or feature Duet does not implement (naming the key: sliding windows, YaRN,
  // mixture of experts) and kCorruptFile for contradictions.
  static ModelConfig from_gguf(const GgufFile& file);

  // Query heads per KV head.
  int64_t group_size() const { return n_heads / n_kv_heads; }
};

}  // namespace duet
