// A loaded Llama-family model, or one rank's shard of it: its configuration
// and its weights.
//
// Whole (tp 1), the weights stay in the read-only mapping of the GGUF file
// (no copy); the model owns the file. A shard (worker/model/tp_shard.h) copies out
// only its own rows of every split tensor (Q/K/V, gate/up, O, down, the
// vocabulary); the mapping's other pages
// are never touched. Immutable after load, so any number of forward passes
// may read it.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/huge_pages.h"
#include "common/model/gguf.h"
#include "common/model/kv_layout.h"
#include "common/model/model_config.h"
#include "kernels/cpu/matmul.h"
#include "worker/model/tp_shard.h"

namespace duet {

// One expert of a mixture: a gated feed-forward of n_ff_exp hidden units.
struct ExpertWeights {
  cpu::WeightMatrix gate;  // n_ff_exp rows of n_embd
  cpu::WeightMatrix up;    // n_ff_exp rows of n_embd
  cpu::WeightMatrix down;  // n_embd rows of n_ff_exp
};

// Shapes are the shard's: n_heads, n_kv_heads and n_ff are the rank's own
// (TpShard), the whole model's when tp is 1.
struct LlamaLayerWeights {
  std::vector<float> attn_norm;  // (n_embd)
  cpu::WeightMatrix wq;          // (n_heads * head_dim) rows of n_embd
  cpu::WeightMatrix wk;          // (n_kv_heads * head_dim) rows of n_embd
  cpu::WeightMatrix wv;          // (n_kv_heads * head_dim) rows of n_embd
  // Projection biases, added after the product (qwen2 has them; llama may): (n_heads * head_dim)
  // for bq, (n_kv_heads * head_dim) for bk and bv; empty when the file has none.
  std::vector<float> bq, bk, bv;
  // RMS norm weights of every Q and K head, (head_dim) each, applied before RoPE (qwen3); empty
  // for the other architectures.
  std::vector<float> q_norm, k_norm;
  // O and down: the shard's output rows [embd_begin, embd_end) of the whole
  // input (every rank's heads, every rank's hidden units).
  cpu::WeightMatrix wo;  // n_embd rows of (n_heads * head_dim), all heads
  // RMS norm weights of the attention's and the feed-forward's outputs (n_embd each; gemma3);
  // empty for the other architectures.
  std::vector<float> attn_post_norm, ffn_post_norm;
  std::vector<float> ffn_norm;  // (n_embd)
  cpu::WeightMatrix w_gate;     // n_ff rows of n_embd
  cpu::WeightMatrix w_up;       // n_ff rows of n_embd
  cpu::WeightMatrix w_down;     // n_embd rows of n_ff, all hidden units
  // A mixture of experts in place of w_gate, w_up and w_down (ModelConfig::is_moe): the router
  // (ffn_gate_inp: n_experts rows of n_embd, every expert's, on every rank) and this rank's
  // experts, [expert_begin, expert_end) of the shard, each a view of its slice of the file's
  // 3-D ffn_{gate,up,down}_exps (or laid out anew for the kernels).
  cpu::WeightMatrix router;
  std::vector<ExpertWeights> experts;
};

// Which rank of how many tensor-parallel ranks loads the model.
struct TpPlacement {
  int rank = 0;
  int size = 1;
};

class LlamaModel final {
 public:
  // Opens, validates and maps a GGUF model of a supported architecture
  // (kSupportedArchitectures). Throws duet::Error naming the file and the
  // offending tensor or key for anything unsupported or inconsistent, including
  // a tensor the forward pass would not use (a feature Duet lacks is refused,
  // never silently skipped).
  // With `placement.size` > 1, loads only the rank's shard (see above);
  // throws kUnsupported when the model cannot be split that way.
  // `kernels`: the CPU path that will run the model; matrices it runs faster
  // in another layout (cpu::preferred_layout) are laid out so at load, in
  // place of the file's pages (which are dropped from memory). Null keeps
  // the file's layout (the CUDA upload reads it).
  static std::unique_ptr<LlamaModel> load(const std::filesystem::path& path,
                                          TpPlacement placement = {},
                                          const cpu::KernelTable* kernels = nullptr);

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  // The whole model's configuration (also for a shard).
  const ModelConfig& config() const { return config_; }
  const GgufFile& file() const { return file_; }
  // The part this model holds; whole_model_shard when tp is 1.
  const TpShard& shard() const { return shard_; }
  // The layout of a KV cache for this shard's KV heads.
  KvLayout kv_layout(int64_t n_blocks, int64_t block_size = KvLayout::kDefaultBlockSize) const;

  // The shard's vocabulary rows [vocab_begin, vocab_end) of n_embd.
  cpu::WeightMatrix token_embd() const { return token_embd_; }
  const LlamaLayerWeights& layer(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  const std::vector<float>& output_norm() const { return output_norm_; }
  // The shard's vocabulary rows of the head (token_embd when tied).
  cpu::WeightMatrix output() const { return output_; }
  // RoPE frequency divisors, (n_rot / 2), from `rope_freqs.weight` (Llama 3.1 bakes its
  // "llama3" scaling into it); empty when the file has none.
  const std::vector<float>& rope_freqs() const { return rope_freqs_; }

  // Bytes of weight data this model reads (its part of the file tensors it uses).
  size_t weight_bytes() const { return weight_bytes_; }
  // Bytes copied out of the file into memory of this model's own: a shard's
  // parts of the tensors it splits (none for a whole model, which reads the
  // mapping).
  size_t owned_weight_bytes() const { return owned_weight_bytes_; }
  // File bytes of the tensors this model copies parts of (whole): what
  // owned_weight_bytes is about 1/tp of.
  size_t split_tensor_bytes() const { return split_tensor_bytes_; }
  // Bytes of matrices laid out anew for the kernels (see load).
  size_t interleaved_weight_bytes() const { return interleaved_weight_bytes_; }

 private:
  LlamaModel(GgufFile file, TpPlacement placement, const cpu::KernelTable* kernels);
  // Rows [row0, row1) and columns [col0, col1) of a [k, n_out] tensor (k
  // columns per row): a view of the mapping when that is all of it, else a
  // copy of just those bytes (columns on block boundaries).
  // `for_kernels`: products read it (else rows are only looked up, and it
  // keeps the file's layout).
  cpu::WeightMatrix matrix(const std::string& name, int64_t k, int64_t n_out, int64_t row0,
                           int64_t row1, int64_t col0, int64_t col1, bool for_kernels = true);
  // `w` laid out in `layout` in memory of this model's own; `source`: the
  // file whose mapping `w` views (its pages are dropped), or null for a copy.
  cpu::WeightMatrix interleaved(const cpu::WeightMatrix& w, cpu::WeightLayout layout,
                                const GgufFile* source);
  // Expert `e` of the 3-D tensor `name` ([k, n_out, n_experts]): its n_out rows of k.
  cpu::WeightMatrix expert(const std::string& name, int64_t k, int64_t n_out, int64_t e);
  cpu::WeightMatrix matrix(const std::string& name, int64_t k, int64_t n_out) {
    return matrix(name, k, n_out, 0, n_out, 0, k);
  }
  // Rows [row0, row1) only (column-parallel).
  cpu::WeightMatrix rows(const std::string& name, int64_t k, int64_t n_out, int64_t row0,
                         int64_t row1, bool for_kernels = true) {
    return matrix(name, k, n_out, row0, row1, 0, k, for_kernels);
  }
  // Elements [begin, end) of vector(name, n).
  std::vector<float> slice(std::vector<float> whole, int64_t begin, int64_t end);
  std::vector<float> vector(const std::string& name, int64_t n);
  // vector(name, n) when the file has the tensor, else empty.
  std::vector<float> optional_vector(const std::string& name, int64_t n);
  void refuse_unused_tensors() const;
  // Throws kUnsupported for a matrix of a type the kernels do not take.
  void require_weight_type(const GgufTensorInfo& t) const;

  GgufFile file_;
  ModelConfig config_;
  TpShard shard_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // the shard's copied tensors
  std::vector<HugePageMemory> interleaved_;        // matrices laid out for the kernels
  cpu::WeightMatrix token_embd_;
  std::vector<LlamaLayerWeights> layers_;
  std::vector<float> output_norm_;
  cpu::WeightMatrix output_;
  std::vector<float> rope_freqs_;
  size_t weight_bytes_ = 0;
  size_t owned_weight_bytes_ = 0;
  size_t split_tensor_bytes_ = 0;
  size_t interleaved_weight_bytes_ = 0;
  const cpu::KernelTable* kernels_ = nullptr;       // during load only
  std::unordered_set<std::string> used_tensors_;    // tensors read, during load only (then cleared)
  std::unordered_set<std::string> copied_tensors_;  // parts copied, during load only
};

}  // namespace duet
