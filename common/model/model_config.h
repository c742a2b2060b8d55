// Hyper-parameters of a Llama-family model, read from GGUF metadata.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

class GgufFile;

// general.architecture values Duet runs: `llama` (also Llama 3/3.1, Mistral, and Mixtral's
// mixture of experts with expert_count), `qwen2` (Q/K/V biases, NeoX RoPE), `qwen3` (RMS norm of
// Q and K per head, NeoX RoPE, a head size of its own), `qwen3moe` (qwen3's attention and a
// mixture of experts) and `gemma3` (qwen3's head norms, gated GELU, a scaled embedding, norms
// after each block and sliding-window layers with a RoPE of their own).
inline constexpr std::array<std::string_view, 5> kSupportedArchitectures = {
    "llama", "qwen2", "qwen3", "qwen3moe", "gemma3"};

// The most experts llama.cpp takes (LLAMA_MAX_EXPERTS).
inline constexpr int64_t kMaxExperts = 512;

// The feed-forward block's gated activation: act(gate) * up.
enum class FfnActivation {
  kSilu,      // SwiGLU (llama, qwen2, qwen3)
  kGeluTanh,  // GELU's tanh approximation (gemma3)
};

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
  FfnActivation ffn_activation = FfnActivation::kSilu;
  // The token embedding's rows are multiplied by this (gemma3: sqrt(n_embd)).
  float embed_scale = 1.0f;
  // Each Q element is multiplied by this after RoPE and attention's scores are then taken unscaled
  // (gemma3, as its graph does); 0: the scores are scaled by 1 / sqrt(head_dim) instead.
  float q_scale = 0.0f;
  // An RMS norm of the attention's and the feed-forward's outputs before each joins the residual
  // stream (gemma3: attn_post_norm, ffn_post_norm).
  bool post_norms = false;
  // Sliding-window attention (gemma3): a windowed layer's query at position p attends to the
  // positions p - sliding_window + 1 .. p only, and rotates with its own RoPE base and scale.
  // 0: no layer is windowed. swa_layers holds n_layers flags when sliding_window > 0.
  int64_t sliding_window = 0;
  std::vector<bool> swa_layers;
  float rope_freq_base_swa = 10000.0f;
  float rope_freq_scale_swa = 1.0f;
  // Mixture of experts (qwen3moe; llama with expert_count, Mixtral): every layer's feed-forward
  // is n_experts gated experts of n_ff_exp hidden units each, of which a router (ffn_gate_inp)
  // picks n_experts_used per token: a softmax over the experts, the top n_experts_used, their
  // probabilities divided by their sum (both architectures hard-code these in llama.cpp), and
  // the weighted expert outputs summed in the order picked. 0: a dense feed-forward of n_ff.
  int64_t n_experts = 0;
  int64_t n_experts_used = 0;
  int64_t n_ff_exp = 0;

  // Reads and validates the metadata; throws kUnsupported for an architecture
  // or feature Duet does not implement (naming the key: YaRN, expert groups,
  // logit soft-capping) and kCorruptFile for contradictions.
  static ModelConfig from_gguf(const GgufFile& file);

  // Query heads per KV head.
  int64_t group_size() const { return n_heads / n_kv_heads; }
  bool is_moe() const { return n_experts > 0; }
  // Whether layer il attends through the sliding window.
  bool is_swa(int64_t il) const {
    return sliding_window > 0 && swa_layers[static_cast<size_t>(il)];
  }
};

}  // namespace duet
