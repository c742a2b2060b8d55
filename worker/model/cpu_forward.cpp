#include "worker/model/cpu_forward.h"

#include <algorithm>
#include <chrono>
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

CpuForward::CpuForward(const LlamaModel& model, const cpu::KernelTable& kernels,
                       cpu::ThreadPool& pool, Collective* collective)
    : model_(model), kernels_(kernels), pool_(pool), collective_(collective) {
  const TpShard& shard = model.shard();
  DUET_REQUIRE(shard.whole() || (collective != nullptr && collective->size() == shard.size &&
                                 collective->rank() == shard.rank),
               "a shard {} of {} needs its instance's collective of {} ranks", shard.rank,
               shard.size, shard.size);
  const ModelConfig& c = model.config();
  for (int rank = 0; rank < shard.size; ++rank) {
    const TpShard s = make_tp_shard(c, rank, shard.size);
    q_parts_.push_back(s.n_heads() * c.head_dim);
    ff_parts_.push_back(s.n_ff());
    embd_parts_.push_back(s.n_embd());
  }
}

void CpuForward::gather_columns(const float* mine, std::span<const int64_t> parts, int64_t n,
                                float* all) {
  const int64_t slot = *std::max_element(parts.begin(), parts.end()) * n;
  const int64_t part = parts[static_cast<size_t>(model_.shard().rank)];
  gather_send_.assign(static_cast<size_t>(slot), 0.0f);  // a shorter part is padded
  std::copy_n(mine, part * n, gather_send_.begin());
  gather_recv_.resize(static_cast<size_t>(slot) * parts.size());
  const auto start = std::chrono::steady_clock::now();
  collective_->all_gather(gather_send_, gather_recv_);
  ++collective_time_.calls;
  collective_time_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  assemble_slices(gather_recv_.data(), slot, parts, n, all);
}

void CpuForward::split_product(const cpu::WeightMatrix& w, const float* mine,
                               std::span<const int64_t> in_parts, int64_t n, float* out) {
  const int64_t n_embd = model_.config().n_embd;
  if (model_.shard().whole()) {
    packed_.pack(kernels_, mine, n, w.k, {w.type}, pool_);
    cpu::matmul(kernels_, w, packed_, out, n_embd, pool_);
    return;
  }
  // (n, k): the rows quantize exactly as one rank's whole rows do.
  whole_in_.resize(static_cast<size_t>(n * w.k));
  gather_columns(mine, in_parts, n, whole_in_.data());
  packed_.pack(kernels_, whole_in_.data(), n, w.k, {w.type}, pool_);
  out_rows_.resize(static_cast<size_t>(n * w.n_out));
  cpu::matmul(kernels_, w, packed_, out_rows_.data(), w.n_out, pool_);
  gather_columns(out_rows_.data(), embd_parts_, n, out);
}

void CpuForward::all_reduce(float* data, int64_t n) {
  if (model_.shard().whole()) return;
  const auto start = std::chrono::steady_clock::now();
  collective_->all_reduce_sum(std::span<float>(data, static_cast<size_t>(n)));
  ++collective_time_.calls;
  collective_time_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void CpuForward::embed(std::span<const int32_t> tokens) {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  const cpu::WeightMatrix embd = model_.token_embd();
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (int64_t r = 0; r < n; ++r) {
    const int32_t id = tokens[static_cast<size_t>(r)];
    DUET_REQUIRE(id >= 0 && id < c.n_vocab, "token id {} is outside the vocabulary (0..{})", id,
                 c.n_vocab - 1);
    float* x = x_.data() + r * c.n_embd;
    if (id < shard.vocab_begin || id >= shard.vocab_end) {
      std::fill(x, x + c.n_embd, 0.0f);  // another rank's row: the all-reduce brings it
      continue;
    }
    const size_t row = static_cast<size_t>(id - shard.vocab_begin);
    cpu::dequantize_row(embd.type, embd.data + row * embd.row_bytes, x, c.n_embd);
  }
  // One rank holds each row, the others add zeros: exact.
  all_reduce(x_.data(), n * c.n_embd);
}

void CpuForward::head(int64_t n_out, float* logits) {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  const cpu::WeightMatrix head = model_.output();
  packed_.pack(kernels_, head_in_.data(), n_out, c.n_embd, {head.type}, pool_);
  if (shard.whole()) {
    cpu::matmul(kernels_, head, packed_, logits, c.n_vocab, pool_);
    return;
  }
  // Vocabulary-parallel: this rank's columns of the logits, gathered rank by
  // rank, then laid out row by row.
  const int64_t stride = shard.vocab_stride;
  const auto size = static_cast<size_t>(n_out * stride);
  logits_slice_.assign(size, 0.0f);
  logits_gathered_.resize(size * static_cast<size_t>(shard.size));
  cpu::matmul(kernels_, head, packed_, logits_slice_.data(), stride, pool_);
  const auto start = std::chrono::steady_clock::now();
  collective_->all_gather(logits_slice_, logits_gathered_);
  ++collective_time_.calls;
  collective_time_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < shard.size; ++rank) {
    const int64_t begin = rank * stride;
    const int64_t count = std::min(stride, c.n_vocab - begin);
    const float* from = logits_gathered_.data() + static_cast<size_t>(rank) * size;
    for (int64_t i = 0; i < n_out; ++i) {
      std::copy_n(from + i * stride, count, logits + i * c.n_vocab + begin);
    }
  }
}

void CpuForward::resize(int64_t n, int64_t n_logit_rows) {
  const ModelConfig& c = model_.config();
  auto fit = [](std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  };
  fit(x_, n * c.n_embd);
  fit(norm_, n * c.n_embd);
  const TpShard& s = model_.shard();
  fit(q_, n * s.n_heads() * c.head_dim);
  fit(k_, n * s.n_kv_heads() * c.head_dim);
  fit(v_, n * s.n_kv_heads() * c.head_dim);
  fit(attn_, n * s.n_heads() * c.head_dim);
  fit(attn_out_, n * c.n_embd);
  fit(gate_, n * s.n_ff());
  fit(up_, n * s.n_ff());
  fit(ffn_out_, n * c.n_embd);
  fit(head_in_, n_logit_rows * c.n_embd);
  positions_.resize(static_cast<size_t>(n));
}

void CpuForward::run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
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
  embed(tokens);
  {
    int64_t r = 0;
    for (const ForwardSequence& s : sequences) {
      for (int64_t t = 0; t < s.n_tokens; ++t)
        positions_[static_cast<size_t>(r++)] = static_cast<int32_t>(s.pos0 + t);
    }
  }

  // This rank's heads and hidden units (all of them when the model is whole).
  const TpShard& shard = model_.shard();
  const int64_t n_heads = shard.n_heads();
  const int64_t n_kv_heads = shard.n_kv_heads();
  const int64_t n_ff = shard.n_ff();
  const int64_t q_dim = n_heads * c.head_dim;
  const int64_t kv_dim = n_kv_heads * c.head_dim;
  const RopeParams rope =
      rope_params(c, model_.rope_freqs().empty() ? nullptr : model_.rope_freqs().data());
  const AttentionShape shape = attention_shape(c, shard);

  // Each sequence's rows of the batch, for the cache stores and the attention.
  attention_sequences_.clear();
  {
    int64_t row = 0;
    for (const ForwardSequence& s : sequences) {
      attention_sequences_.push_back({s.block_table, s.pos0, s.n_tokens, row, s.one_token_from});
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
    cpu::rope(q_.data(), n, n_heads, c.head_dim, positions_.data(), rope, pool_);
    cpu::rope(k_.data(), n, n_kv_heads, c.head_dim, positions_.data(), rope, pool_);
    cpu::kv_cache_store_batch(kernels_, cache.layout(), cache.data(), il, attention_sequences_,
                              k_.data(), v_.data(), pool_);
    if (layer_stored) layer_stored(il);
    // Every sequence's attention in one parallel pass.
    cpu::attention_batch(kernels_, cache.layout(), cache.data(), il, attention_sequences_, shape,
                         q_.data(), attn_.data(), pool_);
    split_product(w.wo, attn_.data(), q_parts_, n, attn_out_.data());
    cpu::add_in_place(x_.data(), attn_out_.data(), n * c.n_embd);

    // Feed-forward block (SwiGLU).
    cpu::rms_norm(x_.data(), w.ffn_norm.data(), norm_.data(), n, c.n_embd, c.rms_eps, pool_);
    packed_.pack(kernels_, norm_.data(), n, c.n_embd, {w.w_gate.type, w.w_up.type}, pool_);
    cpu::matmul(kernels_, w.w_gate, packed_, gate_.data(), n_ff, pool_);
    cpu::matmul(kernels_, w.w_up, packed_, up_.data(), n_ff, pool_);
    pool_.parallel_for(n, [&](int64_t r, int) {
      float* gate = gate_.data() + r * n_ff;
      kernels_.silu_mul(gate, up_.data() + r * n_ff, gate, n_ff);
    });
    split_product(w.w_down, gate_.data(), ff_parts_, n, ffn_out_.data());
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
  head(n_out, logits);
}

}  // namespace duet
