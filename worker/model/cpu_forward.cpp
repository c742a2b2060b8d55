#include "worker/model/cpu_forward.h"

#include <algorithm>
#include <chrono>
#include <tuple>

#include "common/error.h"
#include "common/model/token_order.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/experts.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quantize.h"

namespace duet {

// The plan's ops (worker/model/forward_plan.h) with kernels/cpu/, for one run:
// the step's tokens and positions are the plan's, the KV goes into `cache`
// and the logits into the caller's `logits`. Every op has run when it returns.
class CpuForward::Ops {
 public:
  Ops(CpuForward& forward, KvCache& cache, float* logits)
      : f_(forward), cache_(cache), logits_(logits) {}

  const LlamaLayerWeights& layer(int64_t il) const { return f_.model_.layer(il); }
  const std::vector<float>& output_norm() const { return f_.model_.output_norm(); }
  cpu::WeightMatrix output() const { return f_.model_.output(); }
  float* tensor(ForwardTensor t) const { return f_.tensors_[t].data(); }
  const int32_t* tokens() const { return f_.plan_.step().tokens.data(); }
  const int32_t* positions() const { return f_.plan_.step().positions.data(); }
  const float* rope_freqs() const {
    const std::vector<float>& freqs = f_.model_.rope_freqs();
    return freqs.empty() ? nullptr : freqs.data();
  }
  float* logits() const { return logits_; }

  void embed(const int32_t* tokens, int64_t n, float* x) {
    const int64_t n_embd = f_.model_.config().n_embd;
    const TpShard& shard = f_.model_.shard();
    const cpu::WeightMatrix table = f_.model_.token_embd();
    for (int64_t r = 0; r < n; ++r) {
      const int32_t id = tokens[r];
      float* row = x + r * n_embd;
      if (id < shard.vocab_begin || id >= shard.vocab_end) {
        std::fill(row, row + n_embd, 0.0f);  // another rank's row: the all-reduce brings it
        continue;
      }
      const auto index = static_cast<size_t>(id - shard.vocab_begin);
      cpu::dequantize_weight_row(table, static_cast<int64_t>(index), row);
    }
  }

  void rms_norm(const float* x, const std::vector<float>& weight, float* out, int64_t n_rows,
                int64_t dim, float eps) {
    cpu::rms_norm(x, weight.data(), out, n_rows, dim, eps, f_.pool_);
  }

  // The input is converted once for every product's weight type (Q, K and
  // V share it; gate and up), then each product is one matmul.
  template <typename... Products>
  void matmul(const float* x, int64_t n_rows, const Products&... products) {
    const int64_t k = std::get<0>(std::tie(products...)).weight.k;
    f_.packed_.pack(f_.kernels_, x, n_rows, k, {products.weight.type...}, f_.pool_);
    (cpu::matmul(f_.kernels_, products.weight, f_.packed_, products.out, products.ldy, f_.pool_),
     ...);
  }

  // The router's logits, each row in llama.cpp's order for its token
  // (cpu::router_logits); a router in another type or layout is a matmul.
  void router_logits(const float* x, int64_t n_rows, const cpu::WeightMatrix& w, float* out,
                     int64_t n_experts) {
    if (w.type != DType::kF32 || w.layout != cpu::WeightLayout::kRows) {
      matmul(x, n_rows, WeightProduct{w, out, n_experts});
      return;
    }
    f_.one_token_.assign(static_cast<size_t>(n_rows), 0);
    for (const AttentionSequence& s : f_.plan_.step().sequences) {  // a sequence's last rows
      const int64_t n_one = n_one_token(s.pos0, s.n_q, s.one_token_from);
      std::fill_n(f_.one_token_.begin() + s.row + s.n_q - n_one, n_one, 1);
    }
    cpu::router_logits(f_.kernels_, x, n_rows, reinterpret_cast<const float*>(w.data), n_experts,
                       w.k, f_.one_token_, out, f_.pool_);
  }

  // As llama.cpp's ggml_add after the projection.
  void add_bias(float* x, const std::vector<float>& bias, int64_t n_rows, int64_t dim) {
    if (bias.empty()) return;
    for (int64_t r = 0; r < n_rows; ++r) cpu::add_in_place(x + r * dim, bias.data(), dim);
  }

  // As llama.cpp's RMS norm of a (head_dim, n_heads, n_tokens) view.
  void head_norm(float* x, const std::vector<float>& weight, int64_t n_heads, int64_t head_dim,
                 float eps) {
    if (!weight.empty()) cpu::rms_norm(x, weight.data(), x, n_heads, head_dim, eps, f_.pool_);
  }

  void rope(float* x, int64_t n_rows, int64_t n_heads, int64_t head_dim, const int32_t* positions,
            const RopeParams& params) {
    cpu::rope(x, n_rows, n_heads, head_dim, positions, params, f_.pool_);
  }

  void store_kv(int64_t layer, const float* k, const float* v) {
    cpu::kv_cache_store_batch(f_.kernels_, cache_.layout(), cache_.data(), layer,
                              f_.plan_.step().sequences, k, v, f_.pool_);
  }

  void synchronize() {}

  // Every sequence's attention in one parallel pass.
  void attention(int64_t layer, const AttentionShape& shape, const float* q, float* out) {
    cpu::attention_batch(f_.kernels_, cache_.layout(), cache_.data(), layer,
                         f_.plan_.step().sequences, shape, q, out, f_.pool_);
  }

  void add_in_place(float* x, const float* y, int64_t n) { cpu::add_in_place(x, y, n); }

  std::span<const int32_t> route(const float* logits, int64_t n_rows, const RouterShape& shape,
                                 float* weights) {
    f_.picked_.resize(static_cast<size_t>(n_rows * shape.n_used));
    cpu::route_experts(f_.kernels_, logits, n_rows, shape, f_.picked_.data(), weights);
    return f_.picked_;
  }

  void gather_rows(const float* x, int64_t width, std::span<const int32_t> rows, float* out) {
    cpu::gather_rows(x, width, rows, out);
  }

  void scatter_weighted(const float* y, int64_t width, std::span<const int32_t> slots,
                        const float* weights, float* out) {
    cpu::scatter_weighted(y, width, slots, weights, out);
  }

  void zero(float* x, int64_t n) { std::fill(x, x + n, 0.0f); }

  void sum_picks(const float* picks, int64_t n_rows, int64_t n_used, int64_t width, float* out) {
    cpu::sum_picks(picks, n_rows, n_used, width, out);
  }

  void scale(float* x, int64_t n, float factor) { cpu::scale(x, n, factor); }

  void gelu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width) {
    cpu::gelu_mul(gate, up, out, n_rows, width, f_.pool_);
  }

  void silu_mul(const float* gate, const float* up, float* out, int64_t n_rows, int64_t width) {
    f_.pool_.parallel_for(n_rows, [&](int64_t r, int) {
      f_.kernels_.silu_mul(gate + r * width, up + r * width, out + r * width, width);
    });
  }

  void all_reduce(float* data, int64_t n) {
    const double seconds = timed(
        [&] { f_.collective_->all_reduce_sum(std::span<float>(data, static_cast<size_t>(n))); });
    ++f_.collective_time_.all_reduce_calls;
    f_.collective_time_.all_reduce_seconds += seconds;
  }

  void all_gather(const float* mine, int64_t n_per_rank, float* all) {
    const auto count = static_cast<size_t>(n_per_rank);
    const auto n_ranks = static_cast<size_t>(f_.collective_->size());
    timed([&] {
      f_.collective_->all_gather(std::span<const float>(mine, count),
                                 std::span<float>(all, count * n_ranks));
    });
  }

  void assemble_columns(const float* gathered, int64_t slot, std::span<const int64_t> parts,
                        int64_t n_rows, float* all) {
    assemble_slices(gathered, slot, parts, n_rows, all);
  }

  void assemble_logits(const float* slices, int64_t n_slices, int64_t n_rows, int64_t stride,
                       int64_t n_cols, float* out) {
    for (int64_t s = 0; s < n_slices; ++s) {
      const int64_t begin = s * stride;
      const int64_t count = std::min(stride, n_cols - begin);
      const float* from = slices + s * n_rows * stride;
      for (int64_t i = 0; i < n_rows; ++i) {
        std::copy_n(from + i * stride, count, out + i * n_cols + begin);
      }
    }
  }

 private:
  // Runs a collective and counts its time in collective_time(); returns the time.
  template <typename Collect>
  double timed(Collect&& collect) {
    const auto start = std::chrono::steady_clock::now();
    collect();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ++f_.collective_time_.calls;
    f_.collective_time_.seconds += seconds;
    return seconds;
  }

  CpuForward& f_;
  KvCache& cache_;
  float* const logits_;
};

CpuForward::CpuForward(const LlamaModel& model, const cpu::KernelTable& kernels,
                       cpu::ThreadPool& pool, Collective* collective)
    : model_(model), kernels_(kernels), pool_(pool), collective_(collective), plan_(model) {
  const TpShard& shard = model.shard();
  DUET_REQUIRE(shard.whole() || (collective != nullptr && collective->size() == shard.size &&
                                 collective->rank() == shard.rank),
               "a shard {} of {} needs its instance's collective of {} ranks", shard.rank,
               shard.size, shard.size);
}

void CpuForward::reserve(int64_t n_rows, int64_t n_out) {
  for (int i = 0; i < kForwardTensors; ++i) {
    const auto t = static_cast<ForwardTensor>(i);
    const auto floats = static_cast<size_t>(plan_.floats(t, n_rows, n_out));
    if (tensors_[t].size() < floats) tensors_[t].resize(floats);
  }
}

void CpuForward::run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
                     KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
                     const LayerStored& layer_stored) {
  const ForwardStep& step = plan_.stage(tokens, sequences, logit_rows);
  if (step.n_rows == 0) return;
  reserve(step.n_rows, step.n_out);
  Ops ops(*this, cache, logits);
  plan_.run(ops, layer_stored);
}

}  // namespace duet
