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

// A gather's column parts of the widths `widths`, as assemble_parts takes them.
cuda::ColumnParts column_parts(std::span<const int64_t> widths) {
  cuda::ColumnParts parts;
  parts.n_parts = static_cast<int>(widths.size());
  for (size_t p = 0; p < widths.size(); ++p) parts.begin[p + 1] = parts.begin[p] + widths[p];
  return parts;
}

}  // namespace

// The plan's ops (worker/model/forward_plan.h) with kernels/cuda/: each
// queues its kernels (or collectives) on the backend's stream and returns;
// the step's tokens and positions are the staged inputs, the sequences the
// uploaded batch_.
class CudaForward::Ops {
 public:
  explicit Ops(CudaForward& forward) : f_(forward), b_(*forward.backend_) {}

  const Layer& layer(int64_t il) const { return f_.layers_[static_cast<size_t>(il)]; }
  const cuda::DeviceBuffer& output_norm() const { return f_.output_norm_; }
  const cuda::DeviceWeight& output() const { return f_.output_; }
  float* tensor(ForwardTensor t) const { return floats_mut(f_.tensors_[t]); }
  const int32_t* tokens() const { return f_.inputs_.as<int32_t>(); }
  const int32_t* positions() const { return tokens() + f_.capacity_; }
  const float* rope_freqs() const {
    return f_.rope_freqs_.bytes() == 0 ? nullptr : floats(f_.rope_freqs_);
  }
  float* logits() const { return floats_mut(f_.logits_); }

  void embed(const int32_t* tokens, int64_t n, float* x) {
    cuda::embed_rows(f_.token_embd_, tokens, n, x, b_, f_.model_.shard().vocab_begin);
  }

  void rms_norm(const float* x, const cuda::DeviceBuffer& weight, float* out, int64_t n_rows,
                int64_t dim, float eps) {
    cuda::rms_norm(x, floats(weight), out, n_rows, dim, eps, b_);
  }

  template <typename... Products>
  void matmul(const float* x, int64_t n_rows, const Products&... products) {
    (cuda::matmul(products.weight, x, n_rows, products.out, products.ldy, b_), ...);
  }

  // The GPU has one order for every row (the CPU follows llama.cpp's two).
  template <typename Weight>
  void router_logits(const float* x, int64_t n_rows, const Weight& w, float* out,
                     int64_t n_experts) {
    matmul(x, n_rows, WeightProduct{w, out, n_experts});
  }

  void add_bias(float* x, const cuda::DeviceBuffer& bias, int64_t n_rows, int64_t dim) {
    if (bias.bytes() != 0) cuda::add_bias(x, floats(bias), n_rows, dim, b_);
  }

  void head_norm(float* x, const cuda::DeviceBuffer& weight, int64_t n_heads, int64_t head_dim,
                 float eps) {
    if (weight.bytes() != 0) cuda::rms_norm(x, floats(weight), x, n_heads, head_dim, eps, b_);
  }

  void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            const RopeParams& params) {
    cuda::rope(x, n_rows, n_heads, head_dim, positions, params, b_);
  }

  void store_kv(int64_t layer, const float* k, const float* v) {
    cuda::kv_cache_store_batch(f_.layout_, f_.kv_.as<KvElement>(), layer, f_.batch_, k, v, b_);
  }

  void synchronize() { b_.synchronize(); }

  // One reduction order on the GPU: the sequences' one_token_from is not read.
  void attention(int64_t layer, const AttentionShape& shape, const float* q, float* out) {
    cuda::attention_batch(f_.layout_, f_.kv_.as<KvElement>(), layer, f_.batch_, shape, q, out, b_);
  }

  void add_in_place(float* x, const float* y, int64_t n) { cuda::add_in_place(x, y, n, b_); }

  void scale(float* x, int64_t n, float factor) { cuda::scale(x, n, factor, b_); }

  void gelu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width) {
    cuda::gelu_mul(gate, up, out, n_rows * width, b_);
  }

  // One kernel over every row.
  void silu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width) {
    cuda::silu_mul(gate, up, out, n_rows * width, b_);
  }

  // The picks come to the host (the plan groups the rows by expert there).
  std::span<const int32_t> route(const float* logits, int64_t n_rows, const RouterShape& shape,
                                 float* weights) {
    const auto n_picks = static_cast<size_t>(n_rows * shape.n_used);
    cuda::route_experts(logits, n_rows, shape, f_.picked_.as<int32_t>(), weights, b_);
    f_.picked_host_.resize(n_picks);
    b_.download(f_.picked_host_.data(), f_.picked_.data(), n_picks * sizeof(int32_t));
    b_.synchronize();
    return f_.picked_host_;
  }

  // The index list goes up first, in stream order before the kernel that reads it (and after
  // the one that read the last list).
  void gather_rows(const float* x, int64_t width, std::span<const int32_t> rows, float* out) {
    cuda::gather_rows(x, width, upload_index(rows), static_cast<int64_t>(rows.size()), out, b_);
  }

  void scatter_weighted(const float* y, int64_t width, std::span<const int32_t> slots,
                        const float* weights, float* out) {
    cuda::scatter_weighted(y, width, upload_index(slots), static_cast<int64_t>(slots.size()),
                           weights, out, b_);
  }

  void zero(float* x, int64_t n) { cuda::zero(x, n, b_); }

  void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out) {
    cuda::sum_picks(picks, n_rows, n_used, width, out, b_);
  }

  void all_reduce(float* data, int64_t n) { f_.collective_->all_reduce_sum(data, n, b_.stream()); }

  // `mine` is read for all n_per_rank floats, past this rank's own part too
  // (the plan sizes the tensors so).
  void all_gather(const float* mine, int64_t n_per_rank, float* all) {
    f_.collective_->all_gather(mine, all, n_per_rank, b_.stream());
  }

  void assemble_columns(const float* gathered, int64_t slot, std::span<const int64_t> parts,
                        int64_t n_rows, float* all) {
    cuda::assemble_parts(gathered, slot, column_parts(parts), n_rows, all, b_);
  }

  void assemble_logits(const float* slices, int64_t n_slices, int64_t n_rows, int64_t stride,
                       int64_t n_cols, float* out) {
    cuda::assemble_slices(slices, n_slices, n_rows, stride, n_cols, out, b_);
  }

 private:
  const int32_t* upload_index(std::span<const int32_t> index) {
    b_.upload(f_.expert_index_.data(), index.data(), index.size_bytes());
    b_.synchronize();  // `index` is the plan's, gone when it moves on
    return f_.expert_index_.as<int32_t>();
  }

  CudaForward& f_;
  cuda::CudaBackend& b_;
};

CudaForward::CudaForward(const LlamaModel& model, int device, DeviceCollective* collective)
    : model_(model),
      collective_(model.shard().whole() ? nullptr : collective),
      backend_(std::make_unique<cuda::CudaBackend>(device)),
      plan_(model) {
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
  DUET_REQUIRE(shard.size <= cuda::kMaxParts,
               "the CUDA forward splits a model over at most {} GPUs", cuda::kMaxParts);
  cuda::CudaBackend& b = *backend_;
  auto weight = [&](const cpu::WeightMatrix& w) {
    cuda::DeviceWeight d = cuda::upload_weight(w, b);
    weight_bytes_ += d.bytes();
    return d;
  };
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
    l.q_norm = upload_vector(w.q_norm, b);
    l.k_norm = upload_vector(w.k_norm, b);
    l.attn_post_norm = upload_vector(w.attn_post_norm, b);
    l.ffn_post_norm = upload_vector(w.ffn_post_norm, b);
    l.wq = weight(w.wq);
    l.wk = weight(w.wk);
    l.wv = weight(w.wv);
    l.wo = weight(w.wo);
    if (model.config().is_moe()) {
      l.router = weight(w.router);
      for (const ExpertWeights& e : w.experts) {
        l.experts.push_back({weight(e.gate), weight(e.up), weight(e.down)});
      }
    } else {
      l.w_gate = weight(w.w_gate);
      l.w_up = weight(w.w_up);
      l.w_down = weight(w.w_down);
    }
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
  for (int i = 0; i < kForwardTensors; ++i) {
    const auto t = static_cast<ForwardTensor>(i);
    const auto floats = static_cast<size_t>(plan_.floats(t, capacity_, out_capacity_));
    tensors_[t] = cuda::DeviceBuffer(floats * sizeof(float));  // none for 0 floats
  }
  logits_ = cuda::DeviceBuffer(static_cast<size_t>(out_capacity_ * c.n_vocab) * sizeof(float));
  if (!model_.shard().whole()) {
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
  const auto picks = static_cast<size_t>(capacity_ * c.n_experts_used);
  picked_ = cuda::DeviceBuffer(picks * sizeof(int32_t));
  expert_index_ = cuda::DeviceBuffer(picks * sizeof(int32_t));
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
  const ForwardStep& step = plan_.stage(tokens, sequences, logit_rows);
  const int64_t n = step.n_rows;
  const int64_t n_out = step.n_out;
  if (n == 0) return;
  cuda::CudaBackend& b = *backend_;
  b.bind();
  b.synchronize();             // the pinned staging buffers are reused
  use_layout(cache.layout());  // the KV itself lives on the device
  reserve(n, n_out);

  // Upload the step's inputs: tokens, positions, logit rows.
  auto* staged = inputs_host_.as<int32_t>();
  std::copy(tokens.begin(), tokens.end(), staged);
  std::copy(step.positions.begin(), step.positions.end(), staged + capacity_);
  for (int64_t i = 0; i < n_out; ++i) {
    staged[2 * capacity_ + i] = static_cast<int32_t>(logit_rows[static_cast<size_t>(i)]);
  }
  b.upload(inputs_.data(), staged, static_cast<size_t>(2 * capacity_ + n_out) * sizeof(int32_t));
  batch_.set(step.sequences, b);

  // A mixture of experts synchronizes inside the step (the picks): never captured.
  const bool decode = step.one_row_per_sequence && step.logit_rows_are_all && !layer_stored &&
                      !model_.config().is_moe();
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
        compute({});
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
      compute({});
    }
  } else {
    compute(layer_stored);
  }
  last_n_out_ = n_out;
  if (logits != nullptr && n_out > 0) {
    const int64_t n_vocab = model_.config().n_vocab;
    b.download(logits, logits_.data(), static_cast<size_t>(n_out * n_vocab) * sizeof(float));
  }
  b.synchronize();
}

void CudaForward::compute(const LayerStored& layer_stored) {
  Ops ops(*this);
  plan_.run(ops, layer_stored);
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
