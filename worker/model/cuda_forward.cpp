#include "worker/model/cuda_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/sampling.h"

namespace duet {
namespace {

cuda::DeviceBuffer upload_vector(const std::vector<float>& values, cuda::CudaBackend& backend) {
  if (values.empty()) return {};
  return cuda::upload_floats(values.data(), static_cast<int64_t>(values.size()), backend);
}

const float* floats(const cuda::DeviceBuffer& buffer) { return buffer.as<float>(); }
float* floats_mut(const cuda::DeviceBuffer& buffer) { return buffer.as<float>(); }

// Every rank's share of a dimension split over `size` ranks, as column parts.
template <typename Width>
cuda::ColumnParts column_parts(int size, Width width) {
  DUET_REQUIRE(size <= cuda::kMaxParts, "the CUDA forward splits a model over at most {} GPUs",
               cuda::kMaxParts);
  cuda::ColumnParts parts;
  parts.n_parts = size;
  for (int rank = 0; rank < size; ++rank) parts.begin[rank + 1] = parts.begin[rank] + width(rank);
  return parts;
}

int64_t widest(const cuda::ColumnParts& parts) {
  int64_t w = 0;
  for (int p = 0; p < parts.n_parts; ++p) w = std::max(w, parts.begin[p + 1] - parts.begin[p]);
  return w;
}

}  // namespace

CudaForward::CudaForward(const LlamaModel& model, int device, DeviceCollective* collective)
    : model_(model),
      collective_(model.shard().whole() ? nullptr : collective),
      backend_(std::make_unique<cuda::CudaBackend>(device)) {
  const TpShard& shard = model.shard();
  DUET_REQUIRE(shard.whole() || (collective != nullptr && collective->size() == shard.size &&
                                 collective->rank() == shard.rank),
               "a shard {} of {} needs its instance's device collective of {} ranks", shard.rank,
               shard.size, shard.size);
  const int64_t head_dim = model.config().head_dim;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    throw Error(ErrorKind::kUnsupported,
                format("the CUDA backend's attention runs head_dim 64, 128 and 256; this model's "
                       "heads have {} dimensions (run it with --device cpu)",
                       head_dim));
  }
  cuda::CudaBackend& b = *backend_;
  auto weight = [&](const cpu::WeightMatrix& w) {
    cuda::DeviceWeight d = cuda::upload_weight(w, b);
    weight_bytes_ += d.bytes();
    return d;
  };
  const ModelConfig& c = model.config();
  q_parts_ = column_parts(
      shard.size, [&](int r) { return make_tp_shard(c, r, shard.size).n_heads() * c.head_dim; });
  ff_parts_ =
      column_parts(shard.size, [&](int r) { return make_tp_shard(c, r, shard.size).n_ff(); });
  embd_parts_ =
      column_parts(shard.size, [&](int r) { return make_tp_shard(c, r, shard.size).n_embd(); });
  widest_part_ = std::max({widest(q_parts_), widest(ff_parts_), widest(embd_parts_)});
  token_embd_ = weight(model.token_embd());
  output_ = weight(model.output());
  output_norm_ = upload_vector(model.output_norm(), b);
  rope_freqs_ = upload_vector(model.rope_freqs(), b);
  layers_.resize(static_cast<size_t>(model.config().n_layers));
  for (int64_t il = 0; il < model.config().n_layers; ++il) {
    const LlamaLayerWeights& w = model.layer(il);
    Layer& l = layers_[static_cast<size_t>(il)];
    l.attn_norm = upload_vector(w.attn_norm, b);
    l.ffn_norm = upload_vector(w.ffn_norm, b);
    l.bq = upload_vector(w.bq, b);
    l.bk = upload_vector(w.bk, b);
    l.bv = upload_vector(w.bv, b);
    l.wq = weight(w.wq);
    l.wk = weight(w.wk);
    l.wv = weight(w.wv);
    l.wo = weight(w.wo);
    l.w_gate = weight(w.w_gate);
    l.w_up = weight(w.w_up);
    l.w_down = weight(w.w_down);
  }
}

CudaForward::~CudaForward() = default;

void CudaForward::reserve(int64_t n_rows, int64_t n_out) {
  if (n_rows <= capacity_ && n_out <= out_capacity_) return;
  // New buffers move every address a graph was captured with.
  graphs_.clear();
  capacity_ = std::max(capacity_, n_rows);
  out_capacity_ = std::max(out_capacity_, n_out);
  const ModelConfig& c = model_.config();
  const TpShard& s = model_.shard();
  const auto rows = [&](int64_t width) {
    return cuda::DeviceBuffer(static_cast<size_t>(capacity_ * width) * sizeof(float));
  };
  const auto out_rows = [&](int64_t width) {
    return cuda::DeviceBuffer(static_cast<size_t>(out_capacity_ * width) * sizeof(float));
  };
  x_ = rows(c.n_embd);
  norm_ = rows(c.n_embd);
  q_ = rows(s.n_heads() * c.head_dim);
  k_ = rows(s.n_kv_heads() * c.head_dim);
  v_ = rows(s.n_kv_heads() * c.head_dim);
  // attn_ and gate_ are sent whole by an all-gather: as wide as the widest rank's part.
  attn_ = rows(s.whole() ? s.n_heads() * c.head_dim : widest(q_parts_));
  attn_out_ = rows(c.n_embd);
  gate_ = rows(s.whole() ? s.n_ff() : widest(ff_parts_));
  up_ = rows(s.n_ff());
  ffn_out_ = rows(c.n_embd);
  head_in_ = out_rows(c.n_embd);
  logits_ = out_rows(c.n_vocab);
  if (!s.whole()) {
    logits_slice_ = out_rows(s.vocab_stride);
    logits_gathered_ = out_rows(s.vocab_stride * s.size);
    whole_in_ = rows(std::max(c.n_heads * c.head_dim, c.n_ff));
    out_rows_ = rows(widest(embd_parts_));
    gathered_ = rows(widest_part_ * s.size);
    // Every rank of the instance must capture and replay its decode graphs
    // at the same steps (NCCL's rule for captured collectives). A move of
    // the scratch drops the graphs, and a rank's own shapes would move it at
    // its own times: size it here from the whole model's, the same on every
    // rank, so that it moves only when the batch grows, everywhere at once.
    const int64_t q_dim = c.n_heads * c.head_dim;
    const int64_t widest_dim = std::max({c.n_embd, q_dim, c.n_ff});
    backend_->reserve_scratch(
        std::max(cuda::gemm_scratch_bound(widest_dim, widest_dim, capacity_),
                 cuda::gemm_scratch_bound(c.n_embd, c.n_vocab, out_capacity_)));
  }
  const size_t input_bytes = static_cast<size_t>(2 * capacity_ + out_capacity_) * sizeof(int32_t);
  inputs_host_ = cuda::PinnedBuffer(input_bytes);
  inputs_ = cuda::DeviceBuffer(input_bytes);
  sampling_host_ =
      cuda::PinnedBuffer(static_cast<size_t>(out_capacity_) * sizeof(cuda::RowSampling));
  sampling_ = cuda::DeviceBuffer(sampling_host_.bytes());
  sampled_ = cuda::DeviceBuffer(static_cast<size_t>(out_capacity_) * sizeof(int32_t));
}

void CudaForward::use_layout(const KvLayout& layout) {
  const bool same = layout.n_layers == layout_.n_layers &&
                    layout.n_kv_heads == layout_.n_kv_heads &&
                    layout.head_dim == layout_.head_dim &&
                    layout.block_size == layout_.block_size && layout.n_blocks == layout_.n_blocks;
  if (same) return;
  const ModelConfig& c = model_.config();
  DUET_REQUIRE(layout.n_layers == c.n_layers && layout.n_kv_heads == model_.shard().n_kv_heads() &&
                   layout.head_dim == c.head_dim,
               "a KV cache of {} layers x {} KV heads x {} is not this model's (shard's)",
               layout.n_layers, layout.n_kv_heads, layout.head_dim);
  graphs_.clear();  // captured with the old layout's offsets
  layout_ = layout;
  backend_->synchronize();
  kv_.reserve(layout.total_bytes());
}

void CudaForward::run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
                      KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
                      const LayerStored& layer_stored) {
  const ModelConfig& c = model_.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t n_out = static_cast<int64_t>(logit_rows.size());
  int64_t rows_in_sequences = 0;
  for (const ForwardSequence& s : sequences) rows_in_sequences += s.n_tokens;
  DUET_ASSERT(rows_in_sequences == n, "sequences cover {} rows of a {}-row batch",
              rows_in_sequences, n);
  if (n == 0) return;
  for (int32_t id : tokens) {
    DUET_REQUIRE(id >= 0 && id < c.n_vocab, "token id {} is outside the vocabulary (0..{})", id,
                 c.n_vocab - 1);
  }
  cuda::CudaBackend& b = *backend_;
  b.bind();
  b.synchronize();             // the pinned staging buffers are reused
  use_layout(cache.layout());  // the KV itself lives on the device
  reserve(n, n_out);

  // Stage the step's inputs: tokens, positions, logit rows.
  auto* staged = inputs_host_.as<int32_t>();
  std::copy(tokens.begin(), tokens.end(), staged);
  bool all_rows_sampled = n_out == n;
  bool decode = true;
  std::vector<AttentionSequence> attention;
  attention.reserve(sequences.size());
  {
    int64_t row = 0;
    for (const ForwardSequence& s : sequences) {
      for (int64_t t = 0; t < s.n_tokens; ++t)
        staged[capacity_ + row + t] = static_cast<int32_t>(s.pos0 + t);
      attention.push_back({s.block_table, s.pos0, s.n_tokens, row});
      decode = decode && s.n_tokens == 1;
      row += s.n_tokens;
    }
  }
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t r = logit_rows[static_cast<size_t>(i)];
    DUET_ASSERT(r >= 0 && r < n, "logit row {} outside the batch of {}", r, n);
    staged[2 * capacity_ + i] = static_cast<int32_t>(r);
    all_rows_sampled = all_rows_sampled && r == i;
  }
  b.upload(inputs_.data(), staged, static_cast<size_t>(2 * capacity_ + n_out) * sizeof(int32_t));
  batch_.set(attention, b);

  decode = decode && all_rows_sampled && !layer_stored;
  if (decode && use_graphs_) {
    // A graph replays the addresses it was captured with: the batch arrays'
    // and the scratch's (the GEMM path's, for batches over kGemvMaxRows).
    if (batch_.storage() != graph_batch_storage_ ||
        b.scratch_generation() != graph_scratch_generation_) {
      graphs_.clear();
      graph_batch_storage_ = batch_.storage();
      graph_scratch_generation_ = b.scratch_generation();
    }
    auto graph = graphs_.find(n);
    if (graph == graphs_.end() && seen_[n]++ >= 1) {
      b.begin_capture();
      try {
        compute(n, n_out, logit_rows, true, {});
      } catch (...) {
        b.end_capture();
        throw;
      }
      graph = graphs_.emplace(n, b.end_capture()).first;
    }
    if (graph != graphs_.end()) {
      b.launch(graph->second);
      ++graph_launches_;
    } else {
      compute(n, n_out, logit_rows, true, {});
    }
  } else {
    compute(n, n_out, logit_rows, all_rows_sampled, layer_stored);
  }
  last_n_out_ = n_out;
  if (logits != nullptr && n_out > 0) {
    b.download(logits, logits_.data(), static_cast<size_t>(n_out * c.n_vocab) * sizeof(float));
  }
  b.synchronize();
}

void CudaForward::compute(int64_t n, int64_t n_out, std::span<const int64_t> logit_rows,
                          bool logit_rows_are_all, const LayerStored& layer_stored) {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  cuda::CudaBackend& b = *backend_;
  const int32_t* tokens = inputs_.as<int32_t>();
  const int32_t* positions = tokens + capacity_;
  // This rank's heads and hidden units (all of them when the model is whole).
  const int64_t n_heads = shard.n_heads();
  const int64_t n_kv_heads = shard.n_kv_heads();
  const int64_t n_ff = shard.n_ff();
  const int64_t q_dim = n_heads * c.head_dim;
  const int64_t kv_dim = n_kv_heads * c.head_dim;
  const RopeParams rope = rope_params(c, rope_freqs_.bytes() == 0 ? nullptr : floats(rope_freqs_));
  // One reduction order on the GPU: the sequences' one_token_from is not read.
  const AttentionShape shape = attention_shape(c, shard);
  auto* kv = kv_.as<KvElement>();
  float* x = floats_mut(x_);
  float* norm = floats_mut(norm_);
  float* q = floats_mut(q_);
  float* k = floats_mut(k_);
  float* v = floats_mut(v_);
  float* attn = floats_mut(attn_);
  float* attn_out = floats_mut(attn_out_);
  float* gate = floats_mut(gate_);
  float* up = floats_mut(up_);
  float* ffn_out = floats_mut(ffn_out_);

  cuda::embed_rows(token_embd_, tokens, n, x, b, shard.vocab_begin);
  all_reduce(x, n * c.n_embd);  // one rank holds each row, the others add zeros: exact
  for (int64_t il = 0; il < c.n_layers; ++il) {
    const Layer& w = layers_[static_cast<size_t>(il)];

    // Attention block.
    cuda::rms_norm(x, floats(w.attn_norm), norm, n, c.n_embd, c.rms_eps, b);
    cuda::matmul(w.wq, norm, n, q, q_dim, b);
    cuda::matmul(w.wk, norm, n, k, kv_dim, b);
    cuda::matmul(w.wv, norm, n, v, kv_dim, b);
    if (w.bq.bytes() != 0) cuda::add_bias(q, floats(w.bq), n, q_dim, b);
    if (w.bk.bytes() != 0) cuda::add_bias(k, floats(w.bk), n, kv_dim, b);
    if (w.bv.bytes() != 0) cuda::add_bias(v, floats(w.bv), n, kv_dim, b);
    cuda::rope(q, n, n_heads, c.head_dim, positions, rope, b);
    cuda::rope(k, n, n_kv_heads, c.head_dim, positions, rope, b);
    cuda::kv_cache_store_batch(layout_, kv, il, batch_, k, v, b);
    if (layer_stored) {
      b.synchronize();
      layer_stored(il);
    }
    cuda::attention_batch(layout_, kv, il, batch_, shape, q, attn, b);
    split_product(w.wo, attn, q_parts_, n, attn_out);
    cuda::add_in_place(x, attn_out, n * c.n_embd, b);

    // Feed-forward block (SwiGLU).
    cuda::rms_norm(x, floats(w.ffn_norm), norm, n, c.n_embd, c.rms_eps, b);
    cuda::matmul(w.w_gate, norm, n, gate, n_ff, b);
    cuda::matmul(w.w_up, norm, n, up, n_ff, b);
    cuda::silu_mul(gate, up, gate, n * n_ff, b);
    split_product(w.w_down, gate, ff_parts_, n, ffn_out);
    cuda::add_in_place(x, ffn_out, n * c.n_embd, b);
  }

  // Output head, only for the rows whose logits are wanted.
  if (n_out == 0) return;
  float* head_in = floats_mut(head_in_);
  if (logit_rows_are_all) {
    cuda::rms_norm(x, floats(output_norm_), head_in, n, c.n_embd, c.rms_eps, b);
  } else {
    for (int64_t i = 0; i < n_out; ++i) {
      const int64_t r = logit_rows[static_cast<size_t>(i)];
      cuda::rms_norm(x + r * c.n_embd, floats(output_norm_), head_in + i * c.n_embd, 1, c.n_embd,
                     c.rms_eps, b);
    }
  }
  if (shard.whole()) {
    cuda::matmul(output_, head_in, n_out, floats_mut(logits_), c.n_vocab, b);
    return;
  }
  // Vocabulary-parallel: this rank's columns of the logits, gathered rank by
  // rank, then laid out row by row on every rank.
  const int64_t stride = shard.vocab_stride;
  float* slice = floats_mut(logits_slice_);
  float* gathered = floats_mut(logits_gathered_);
  cuda::matmul(output_, head_in, n_out, slice, stride, b);
  collective_->all_gather(slice, gathered, n_out * stride, b.stream());
  cuda::assemble_slices(gathered, shard.size, n_out, stride, c.n_vocab, floats_mut(logits_), b);
}

void CudaForward::all_reduce(float* data, int64_t n) {
  if (collective_ != nullptr) collective_->all_reduce_sum(data, n, backend_->stream());
}

void CudaForward::gather_columns(const float* mine, const cuda::ColumnParts& parts, int64_t n,
                                 float* all) {
  const int64_t slot = widest(parts) * n;  // a narrower part sends padding past its rows
  float* gathered = floats_mut(gathered_);
  collective_->all_gather(mine, gathered, slot, backend_->stream());
  cuda::assemble_parts(gathered, slot, parts, n, all, *backend_);
}

void CudaForward::split_product(const cuda::DeviceWeight& w, const float* mine,
                                const cuda::ColumnParts& parts, int64_t n, float* out) {
  cuda::CudaBackend& b = *backend_;
  if (collective_ == nullptr) {
    cuda::matmul(w, mine, n, out, model_.config().n_embd, b);
    return;
  }
  float* whole = floats_mut(whole_in_);
  gather_columns(mine, parts, n, whole);
  float* rows = floats_mut(out_rows_);
  cuda::matmul(w, whole, n, rows, w.n_out, b);
  gather_columns(rows, embd_parts_, n, out);
}

void CudaForward::sample(std::span<const DeviceSampling> rows, std::span<int32_t> tokens) {
  const auto n = static_cast<int64_t>(rows.size());
  DUET_ASSERT(n == last_n_out_ && tokens.size() == rows.size(),
              "{} draws for the {} logit rows of the last run", n, last_n_out_);
  if (n == 0) return;
  cuda::CudaBackend& b = *backend_;
  b.bind();
  auto* staged = sampling_host_.as<cuda::RowSampling>();
  for (int64_t i = 0; i < n; ++i) {
    const DeviceSampling& r = rows[static_cast<size_t>(i)];
    staged[i] = {r.temperature, r.top_k, r.top_p, r.uniform};
  }
  b.upload(sampling_.data(), staged, static_cast<size_t>(n) * sizeof(cuda::RowSampling));
  cuda::sample_rows(floats(logits_), n, model_.config().n_vocab, sampling_.as<cuda::RowSampling>(),
                    sampled_.as<int32_t>(), b);
  b.download(tokens.data(), sampled_.data(), static_cast<size_t>(n) * sizeof(int32_t));
  b.synchronize();
}

void CudaForward::copy_blocks(int64_t layer, std::span<const int32_t> block_table, int64_t pos0,
                              int64_t n, KvElement* host, bool to_host) {
  if (n <= 0) return;
  const int64_t bs = layout_.block_size;
  const auto first = static_cast<size_t>(pos0 / bs);
  const auto end = static_cast<size_t>((pos0 + n - 1) / bs + 1);
  DUET_ASSERT(end <= block_table.size(), "rows [{}, +{}) beyond a table of {} blocks", pos0, n,
              block_table.size());
  const int64_t l0 = layer < 0 ? 0 : layer;
  const int64_t l1 = layer < 0 ? layout_.n_layers : layer + 1;
  auto* device = kv_.as<KvElement>();
  cuda::CudaBackend& b = *backend_;
  for (size_t i = first; i < end;) {
    // A run of consecutive block ids is one contiguous range per layer.
    size_t j = i + 1;
    while (j < end && block_table[j] == block_table[j - 1] + 1) ++j;
    const int64_t block = block_table[i];
    const size_t bytes = static_cast<size_t>(j - i) * layout_.bytes_per_block_per_layer();
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t offset = l * layout_.layer_elems() + block * layout_.block_elems();
      if (to_host) {
        b.download(host + offset, device + offset, bytes);
      } else {
        b.upload(device + offset, host + offset, bytes);
      }
    }
    i = j;
  }
  b.synchronize();
}

void CudaForward::kv_to_host(int64_t layer, std::span<const int32_t> block_table, int64_t pos0,
                             int64_t n, KvCache& cache) {
  backend_->bind();
  use_layout(cache.layout());
  copy_blocks(layer, block_table, pos0, n, cache.data(), true);
}

DeviceKv CudaForward::device_kv(const KvLayout& layout) {
  backend_->bind();
  use_layout(layout);
  return {kv_.as<KvElement>(), backend_->device(), backend_->stream()};
}

void CudaForward::kv_from_host(std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                               const KvCache& cache) {
  backend_->bind();
  use_layout(cache.layout());
  copy_blocks(-1, block_table, pos0, n, const_cast<KvElement*>(cache.data()), false);
}

}  // namespace duet
