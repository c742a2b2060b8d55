#include "worker/llama_forward.h"

#include <cmath>

#include "common/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quantize.h"

namespace duet {
namespace {

// x (n_rows, bias.size()) += bias on every row, as llama.cpp's ggml_add after the projection;
// nothing when bias is empty.
void add_bias(float* x, const std::vector<float>& bias, int64_t n_rows) {
  const int64_t dim = static_cast<int64_t>(bias.size());
  for (int64_t r = 0; r < n_rows; ++r) cpu::add_in_place(x + r * dim, bias.data(), dim);
}

}  // namespace

LlamaForward::LlamaForward(const LlamaModel& model, const cpu::KernelTable& kernels,
                           cpu::ThreadPool& pool, cpu::AttentionOrder attention_order)
    : model_(model), kernels_(kernels), pool_(pool), attention_order_(attention_order) {}

void LlamaForward::resize(int64_t n, int64_t n_logit_rows) {
  const ModelConfig& c = model_.config();
  auto fit = [](std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  };
  fit(x_, n * c.n_embd);
  fit(norm_, n * c.n_embd);
  fit(q_, n * c.n_heads * c.head_dim);
  fit(k_, n * c.n_kv_heads * c.head_dim);
  fit(v_, n * c.n_kv_heads * c.head_dim);
  fit(attn_, n * c.n_heads * c.head_dim);
  fit(attn_out_, n * c.n_embd);
  fit(gate_, n * c.n_ff);
  fit(up_, n * c.n_ff);
  fit(ffn_out_, n * c.n_embd);
  fit(head_in_, n_logit_rows * c.n_embd);
  positions_.resize(static_cast<size_t>(n));
}

void LlamaForward::run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
                       KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
                       const LayerStored& layer_stored) {
  const ModelConfig& c = model_.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  int64_t rows_in_sequences = 0;
  for (const ForwardSequence& s : sequences) rows_in_sequences += s.n_tokens;
  DUET_ASSERT(rows_in_sequences == n, "sequences cover {} rows of a {}-row batch",
              rows_in_sequences, n);
  if (n == 0) return;
  resize(n, static_cast<int64_t>(logit_rows.size()));

  // Embeddings and positions.
  const cpu::WeightMatrix embd = model_.token_embd();
  for (int64_t r = 0; r < n; ++r) {
    const int32_t id = tokens[static_cast<size_t>(r)];
    DUET_REQUIRE(id >= 0 && id < c.n_vocab, "token id {} is outside the vocabulary (0..{})", id,
                 c.n_vocab - 1);
    cpu::dequantize_row(embd.type, embd.data + static_cast<size_t>(id) * embd.row_bytes,
                        x_.data() + r * c.n_embd, c.n_embd);
  }
  {
    int64_t r = 0;
    for (const ForwardSequence& s : sequences) {
      for (int64_t t = 0; t < s.n_tokens; ++t)
        positions_[static_cast<size_t>(r++)] = static_cast<int32_t>(s.pos0 + t);
    }
  }

  const int64_t q_dim = c.n_heads * c.head_dim;
  const int64_t kv_dim = c.n_kv_heads * c.head_dim;
  cpu::RopeParams rope;
  rope.style = c.rope_neox ? cpu::RopeStyle::kHalves : cpu::RopeStyle::kAdjacentPairs;
  rope.n_rot = c.n_rot;
  rope.freq_base = c.rope_freq_base;
  rope.freq_scale = c.rope_freq_scale;
  rope.freq_factors = model_.rope_freqs().empty() ? nullptr : model_.rope_freqs().data();
  cpu::AttentionShape shape;
  shape.n_heads = c.n_heads;
  shape.n_kv_heads = c.n_kv_heads;
  shape.head_dim = c.head_dim;
  shape.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  shape.order = attention_order_;

  // Each sequence's rows of the batch, for the cache stores and the attention.
  attention_sequences_.clear();
  {
    int64_t row = 0;
    for (const ForwardSequence& s : sequences) {
      attention_sequences_.push_back({s.block_table, s.pos0, s.n_tokens, row});
      row += s.n_tokens;
    }
  }

  for (int64_t il = 0; il < c.n_layers; ++il) {
    const LlamaLayerWeights& w = model_.layer(il);

    // Attention block.
    cpu::rms_norm(x_.data(), w.attn_norm.data(), norm_.data(), n, c.n_embd, c.rms_eps, pool_);
    packed_.pack(kernels_, norm_.data(), n, c.n_embd, {w.wq.type, w.wk.type, w.wv.type}, pool_);
    cpu::matmul(kernels_, w.wq, packed_, q_.data(), q_dim, pool_);
    cpu::matmul(kernels_, w.wk, packed_, k_.data(), kv_dim, pool_);
    cpu::matmul(kernels_, w.wv, packed_, v_.data(), kv_dim, pool_);
    add_bias(q_.data(), w.bq, n);
    add_bias(k_.data(), w.bk, n);
    add_bias(v_.data(), w.bv, n);
    cpu::rope(q_.data(), n, c.n_heads, c.head_dim, positions_.data(), rope, pool_);
    cpu::rope(k_.data(), n, c.n_kv_heads, c.head_dim, positions_.data(), rope, pool_);
    cpu::kv_cache_store_batch(kernels_, cache.layout(), cache.data(), il, attention_sequences_,
                              k_.data(), v_.data(), pool_);
    if (layer_stored) layer_stored(il);
    // Every sequence's attention in one parallel pass.
    cpu::attention_batch(kernels_, cache.layout(), cache.data(), il, attention_sequences_, shape,
                         q_.data(), attn_.data(), pool_);
    packed_.pack(kernels_, attn_.data(), n, q_dim, {w.wo.type}, pool_);
    cpu::matmul(kernels_, w.wo, packed_, attn_out_.data(), c.n_embd, pool_);
    cpu::add_in_place(x_.data(), attn_out_.data(), n * c.n_embd);

    // Feed-forward block (SwiGLU).
    cpu::rms_norm(x_.data(), w.ffn_norm.data(), norm_.data(), n, c.n_embd, c.rms_eps, pool_);
    packed_.pack(kernels_, norm_.data(), n, c.n_embd, {w.w_gate.type, w.w_up.type}, pool_);
    cpu::matmul(kernels_, w.w_gate, packed_, gate_.data(), c.n_ff, pool_);
    cpu::matmul(kernels_, w.w_up, packed_, up_.data(), c.n_ff, pool_);
    pool_.parallel_for(n, [&](int64_t r, int) {
      float* gate = gate_.data() + r * c.n_ff;
      kernels_.silu_mul(gate, up_.data() + r * c.n_ff, gate, c.n_ff);
    });
    packed_.pack(kernels_, gate_.data(), n, c.n_ff, {w.w_down.type}, pool_);
    cpu::matmul(kernels_, w.w_down, packed_, ffn_out_.data(), c.n_embd, pool_);
    cpu::add_in_place(x_.data(), ffn_out_.data(), n * c.n_embd);
  }

  // Output head, only for the rows whose logits are wanted.
  const int64_t n_out = static_cast<int64_t>(logit_rows.size());
  if (n_out == 0) return;
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t r = logit_rows[static_cast<size_t>(i)];
    DUET_ASSERT(r >= 0 && r < n, "logit row {} outside the batch of {}", r, n);
    cpu::rms_norm(x_.data() + r * c.n_embd, model_.output_norm().data(),
                  head_in_.data() + i * c.n_embd, 1, c.n_embd, c.rms_eps);
  }
  const cpu::WeightMatrix head = model_.output();
  packed_.pack(kernels_, head_in_.data(), n_out, c.n_embd, {head.type}, pool_);
  cpu::matmul(kernels_, head, packed_, logits, c.n_vocab, pool_);
}

}  // namespace duet
