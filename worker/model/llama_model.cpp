#include "worker/model/llama_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/format.h"
#include "kernels/cpu/quantize.h"
#include "worker/kv/kv_cache.h"

namespace duet {

std::unique_ptr<LlamaModel> LlamaModel::load(const std::filesystem::path& path,
                                             TpPlacement placement,
                                             const cpu::KernelTable* kernels) {
  return std::unique_ptr<LlamaModel>(new LlamaModel(GgufFile::open(path), placement, kernels));
}

LlamaModel::LlamaModel(GgufFile file, TpPlacement placement, const cpu::KernelTable* kernels)
    : file_(std::move(file)), config_(ModelConfig::from_gguf(file_)), kernels_(kernels) {
  const ModelConfig& c = config_;
  shard_ = make_tp_shard(c, placement.rank, placement.size);
  const TpShard& s = shard_;
  const int64_t hd = c.head_dim;
  // Looked up a row at a time, unless it is also the output head.
  token_embd_ =
      rows("token_embd.weight", c.n_embd, c.n_vocab, s.vocab_begin, s.vocab_end, c.tied_embeddings);
  layers_.resize(static_cast<size_t>(c.n_layers));
  const int64_t q_dim = c.n_heads * hd;
  const int64_t kv_dim = c.n_kv_heads * hd;
  const int64_t q0 = s.head_begin * hd, q1 = s.head_end * hd;
  const int64_t kv0 = s.kv_head_begin * hd, kv1 = s.kv_head_end * hd;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string p = duet::format("blk.{}.", i);
    LlamaLayerWeights& l = layers_[static_cast<size_t>(i)];
    l.attn_norm = vector(p + "attn_norm.weight", c.n_embd);
    l.wq = rows(p + "attn_q.weight", c.n_embd, q_dim, q0, q1);
    l.wk = rows(p + "attn_k.weight", c.n_embd, kv_dim, kv0, kv1);
    l.wv = rows(p + "attn_v.weight", c.n_embd, kv_dim, kv0, kv1);
    l.wo = rows(p + "attn_output.weight", q_dim, c.n_embd, s.embd_begin, s.embd_end);
    l.ffn_norm = vector(p + "ffn_norm.weight", c.n_embd);
    if (c.is_moe()) {
      l.router = matrix(p + "ffn_gate_inp.weight", c.n_embd, c.n_experts);
      for (int64_t e = s.expert_begin; e < s.expert_end; ++e) {
        l.experts.push_back({expert(p + "ffn_gate_exps.weight", c.n_embd, c.n_ff_exp, e),
                             expert(p + "ffn_up_exps.weight", c.n_embd, c.n_ff_exp, e),
                             expert(p + "ffn_down_exps.weight", c.n_ff_exp, c.n_embd, e)});
      }
    } else {
      l.w_gate = rows(p + "ffn_gate.weight", c.n_embd, c.n_ff, s.ff_begin, s.ff_end);
      l.w_up = rows(p + "ffn_up.weight", c.n_embd, c.n_ff, s.ff_begin, s.ff_end);
      l.w_down = rows(p + "ffn_down.weight", c.n_ff, c.n_embd, s.embd_begin, s.embd_end);
    }
    // Optional for both architectures, as in llama.cpp (Qwen2 files have them); absent means zero.
    l.bq = slice(optional_vector(p + "attn_q.bias", q_dim), q0, q1);
    l.bk = slice(optional_vector(p + "attn_k.bias", kv_dim), kv0, kv1);
    l.bv = slice(optional_vector(p + "attn_v.bias", kv_dim), kv0, kv1);
    if (c.qk_norm) {  // one weight for every head: the same on every rank
      l.q_norm = vector(p + "attn_q_norm.weight", hd);
      l.k_norm = vector(p + "attn_k_norm.weight", hd);
    }
    if (c.post_norms) {  // whole rows on every rank
      l.attn_post_norm = vector(p + "post_attention_norm.weight", c.n_embd);
      l.ffn_post_norm = vector(p + "post_ffw_norm.weight", c.n_embd);
    }
  }
  output_norm_ = vector("output_norm.weight", c.n_embd);
  output_ = c.tied_embeddings
                ? token_embd_
                : rows("output.weight", c.n_embd, c.n_vocab, s.vocab_begin, s.vocab_end);
  if (c.architecture == "llama") {  // llama.cpp reads rope_freqs for `llama` only
    rope_freqs_ = optional_vector("rope_freqs.weight", c.n_rot / 2);
    for (float factor : rope_freqs_) {
      if (!(factor > 0.0f) || !std::isfinite(factor)) {
        throw Error(
            ErrorKind::kCorruptFile,
            duet::format("{}: tensor rope_freqs.weight holds {}; RoPE frequency divisors must be "
                         "positive and finite",
                         file_.name(), factor));
      }
    }
  }
  refuse_unused_tensors();
  used_tensors_.clear();
  copied_tensors_.clear();
  kernels_ = nullptr;
}

void LlamaModel::refuse_unused_tensors() const {
  for (const GgufTensorInfo& t : file_.tensors()) {
    if (used_tensors_.count(t.name) == 0) {
      throw Error(
          ErrorKind::kUnsupported,
          duet::format("{}: tensor {} is not part of Duet's '{}' forward pass (a feature Duet does "
                       "not implement); refusing the model rather than ignoring it",
                       file_.name(), t.name, config_.architecture));
    }
  }
}

KvLayout LlamaModel::kv_layout(int64_t n_blocks, int64_t block_size) const {
  KvLayout layout = make_kv_layout(config_, n_blocks, block_size);
  layout.n_kv_heads = shard_.n_kv_heads();
  return layout;
}

std::vector<float> LlamaModel::slice(std::vector<float> whole, int64_t begin, int64_t end) {
  if (whole.empty() || (begin == 0 && end == static_cast<int64_t>(whole.size()))) return whole;
  return std::vector<float>(whole.begin() + begin, whole.begin() + end);
}

void LlamaModel::require_weight_type(const GgufTensorInfo& t) const {
  if (dtype_is_supported_weight(t.type)) return;
  throw Error(ErrorKind::kUnsupported,
              duet::format("{}: tensor {} has weight type {}, which is not supported "
                           "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K)",
                           file_.name(), t.name, dtype_name(t.type)));
}

cpu::WeightMatrix LlamaModel::matrix(const std::string& name, int64_t k, int64_t n_out,
                                     int64_t row0, int64_t row1, int64_t col0, int64_t col1,
                                     bool for_kernels) {
  const cpu::KernelTable* kernels = for_kernels ? kernels_ : nullptr;
  const GgufTensorInfo& t = file_.tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != k || t.ne[1] != n_out) {
    throw Error(ErrorKind::kCorruptFile,
                duet::format("{}: tensor {} has shape [{}], expected [{}, {}]", file_.name(), name,
                             duet::join(t.ne, ", "), k, n_out));
  }
  require_weight_type(t);
  used_tensors_.insert(name);
  if (row0 == 0 && row1 == n_out && col0 == 0 && col1 == k) {
    weight_bytes_ += t.n_bytes;
    const cpu::WeightMatrix view = cpu::make_weight_matrix(t.type, t.data, k, n_out);
    if (kernels == nullptr) return view;
    const cpu::WeightLayout layout = cpu::preferred_layout(*kernels, view);
    if (layout == cpu::WeightLayout::kRows) return view;
    return interleaved(view, layout, &file_);
  }
  const int64_t block = dtype_traits(t.type).block_size;
  DUET_ASSERT(col0 % block == 0 && col1 % block == 0 && row0 < row1 && col0 < col1,
              "{}: shard rows [{}, {}) columns [{}, {}) of {}-element blocks", name, row0, row1,
              col0, col1, block);
  const size_t row_bytes = dtype_row_bytes(t.type, k);
  const size_t skip = dtype_row_bytes(t.type, col0);
  const size_t shard_row_bytes = dtype_row_bytes(t.type, col1 - col0);
  const size_t bytes = shard_row_bytes * static_cast<size_t>(row1 - row0);
  auto owned = std::make_unique<uint8_t[]>(bytes);
  const auto* source = static_cast<const uint8_t*>(t.data);
  for (int64_t r = row0; r < row1; ++r) {
    std::memcpy(owned.get() + static_cast<size_t>(r - row0) * shard_row_bytes,
                source + static_cast<size_t>(r) * row_bytes + skip, shard_row_bytes);
  }
  if (!shard_.whole()) weight_bytes_ += bytes;  // a whole model counts the file's tensor
  owned_weight_bytes_ += bytes;
  if (copied_tensors_.insert(name).second) split_tensor_bytes_ += t.n_bytes;
  const cpu::WeightMatrix w =
      cpu::make_weight_matrix(t.type, owned.get(), col1 - col0, row1 - row0);
  const cpu::WeightLayout layout =
      kernels == nullptr ? cpu::WeightLayout::kRows : cpu::preferred_layout(*kernels, w);
  if (layout == cpu::WeightLayout::kRows) {
    owned_.push_back(std::move(owned));
    return w;
  }
  return interleaved(w, layout, nullptr);  // the shard's copy goes when `owned` does
}

cpu::WeightMatrix LlamaModel::expert(const std::string& name, int64_t k, int64_t n_out, int64_t e) {
  const GgufTensorInfo& t = file_.tensor(name);
  const int64_t n_experts = config_.n_experts;
  if (t.ne.size() != 3 || t.ne[0] != k || t.ne[1] != n_out || t.ne[2] != n_experts) {
    throw Error(ErrorKind::kCorruptFile,
                duet::format("{}: tensor {} has shape [{}], expected [{}, {}, {}]", file_.name(),
                             name, duet::join(t.ne, ", "), k, n_out, n_experts));
  }
  require_weight_type(t);
  used_tensors_.insert(name);
  // An expert is whole rows, so a shard views the mapping as a whole model does.
  const size_t bytes = dtype_row_bytes(t.type, k) * static_cast<size_t>(n_out);
  weight_bytes_ += bytes;
  const cpu::WeightMatrix view = cpu::make_weight_matrix(
      t.type, static_cast<const uint8_t*>(t.data) + bytes * static_cast<size_t>(e), k, n_out);
  if (kernels_ == nullptr) return view;
  const cpu::WeightLayout layout = cpu::preferred_layout(*kernels_, view);
  if (layout == cpu::WeightLayout::kRows) return view;
  return interleaved(view, layout, &file_);
}

cpu::WeightMatrix LlamaModel::interleaved(const cpu::WeightMatrix& w, cpu::WeightLayout layout,
                                          const GgufFile* source) {
  // On huge pages: decode streams every matrix once per token, and a 4 KiB
  // page per 28 blocks of a row group would be a TLB miss each (and making
  // them at load costs a fault each).
  const size_t bytes = w.row_bytes * static_cast<size_t>(w.n_out);
  HugePageMemory& memory = interleaved_.emplace_back(bytes);
  interleaved_weight_bytes_ += bytes;
  // Each piece's file pages are dropped once copied, so that the file's
  // pages and the copy are never both in memory for long.
  return cpu::interleave(w, layout, reinterpret_cast<uint8_t*>(memory.data()),
                         [&](const uint8_t* read, size_t n) {
                           if (source != nullptr) source->drop_pages(read, n);
                         });
}

std::vector<float> LlamaModel::vector(const std::string& name, int64_t n) {
  const GgufTensorInfo& t = file_.tensor(name);
  if (t.n_elements() != n) {
    throw Error(ErrorKind::kCorruptFile, duet::format("{}: tensor {} has {} elements, expected {}",
                                                      file_.name(), name, t.n_elements(), n));
  }
  if (t.type != DType::kF32 && t.type != DType::kF16 && t.type != DType::kBF16) {
    throw Error(
        ErrorKind::kUnsupported,
        duet::format("{}: tensor {} has type {}; vectors (norm weights, biases, rope_freqs) must "
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
