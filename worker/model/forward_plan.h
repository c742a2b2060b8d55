// The Llama forward pass written once, for every device: the batch's
// staging, the layer loop, the tensor-parallel gathers and the output head,
// over a small set of twin ops (listed at ForwardPlan::run) that each device
// implements with its kernels (CpuForward with kernels/cpu/, CudaForward with
// kernels/cuda/). Every architecture LlamaModel loads runs through it: `llama`
// (adjacent-pair RoPE, optional rope_freqs divisors), `qwen2` (Q/K/V
// biases, NeoX RoPE), `qwen3` (NeoX RoPE, each Q and K head RMS-normed
// before it), `gemma3` (qwen3's heads, a scaled embedding, Q scaled
// before unscaled scores, norms after each block, gated GELU, and
// sliding-window layers with their own RoPE) and the mixtures of experts
// (`qwen3moe`, Mixtral's `llama`: a router and gated experts in place of the
// feed-forward).
//
// All rows of the batch go through each weight matrix together (one product
// per weight); attention runs per sequence over its blocks of the paged cache.
// Tensor parallelism: shapes are the shard's (LlamaModel::shard), every rank
// runs the same batch through its own heads and hidden units, and no element
// is ever a sum over ranks (the split: worker/model/tp_shard.h).
//
// Not thread-safe: one step at a time (the engine thread's).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/op_params.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"

namespace duet {

// What every device sets up alike from the model: its RoPE (the frequency
// divisors `freq_factors`, or null; host or device memory, as the device's
// kernels read them) and the attention of the shard's heads, for the global
// layers or (`windowed`) the sliding-window ones.
RopeParams rope_params(const ModelConfig& config, const float* freq_factors, bool windowed = false);
AttentionShape attention_shape(const ModelConfig& config, const TpShard& shard,
                               bool windowed = false);

// The intermediate tensors a device keeps for the plan, by name, overwritten
// layer by layer:
//   x (n, n_embd) residual stream, norm (n, n_embd) attn_norm's then ffn_norm's,
//   q (n, n_heads*head_dim), k/v (n, n_kv_heads*head_dim), attn (n, n_heads*head_dim),
//   attn_out/ffn_out (n, n_embd), gate/up (n, n_ff; an expert's rows: n_ff_exp),
//   head_in (n_out, n_embd).
// A mixture of experts': router_logits (n, n_experts), route_weights (n, n_used),
// expert_in/expert_out (n, n_embd) an expert's rows, picks (n, n_used, n_embd) every
// (row, pick)'s weighted expert output.
// The last five are tensor parallelism's: this rank's logit slice (n_out,
// vocab_stride) and every rank's, in rank order; the gathered whole input of O
// or down (n, k); this rank's rows of its output; an all-gather's result
// (every rank's slot).
enum class ForwardTensor {
  kX,
  kNorm,
  kQ,
  kK,
  kV,
  kAttn,
  kAttnOut,
  kGate,
  kUp,
  kFfnOut,
  kHeadIn,
  kLogitSlice,
  kLogitSlices,
  kWholeIn,
  kOutRows,
  kGathered,
  kRouterLogits,
  kRouteWeights,
  kExpertIn,
  kExpertOut,
  kPicks,
};
inline constexpr int kForwardTensors = static_cast<int>(ForwardTensor::kPicks) + 1;

// Storage of every named tensor, indexed by ForwardTensor.
template <typename Buffer>
struct ForwardTensors {
  std::array<Buffer, kForwardTensors> buffers;

  Buffer& operator[](ForwardTensor t) { return buffers[static_cast<size_t>(t)]; }
};

// out (n_rows, ldy): a product of the activations x (n_rows, weight's k)
// with `weight` transposed, one of those a matmul op takes for one input.
template <typename Weight>
struct WeightProduct {
  const Weight& weight;
  float* out;
  int64_t ldy;
};
template <typename Weight>
WeightProduct(const Weight&, float*, int64_t) -> WeightProduct<Weight>;

// A batch as stage() lays it out, on the host.
struct ForwardStep {
  std::span<const int32_t> tokens;      // (n_rows), each in the vocabulary
  std::span<const int64_t> logit_rows;  // (n_out), each in [0, n_rows)
  int64_t n_rows = 0;
  int64_t n_out = 0;
  std::vector<int32_t> positions;            // (n_rows)
  std::vector<AttentionSequence> sequences;  // each sequence's rows of the batch
  bool one_row_per_sequence = true;          // a decode step's shape
  bool logit_rows_are_all = true;            // logit_rows is 0, 1, ..., n_rows - 1
};

class ForwardPlan {
 public:
  // `model` outlives the plan.
  explicit ForwardPlan(const LlamaModel& model);

  // Checks a batch and lays it out (kept until the next stage()): throws
  // duet::Error (kInvalidArgument) for a token outside the vocabulary.
  // `tokens` and `logit_rows` must stay valid until run() returns.
  const ForwardStep& stage(std::span<const int32_t> tokens,
                           std::span<const ForwardSequence> sequences,
                           std::span<const int64_t> logit_rows);
  const ForwardStep& step() const { return step_; }

  // Floats of tensor `t` for a step of up to n_rows rows and n_out logit
  // rows; 0 for tensor parallelism's when the model is whole.
  int64_t floats(ForwardTensor t, int64_t n_rows, int64_t n_out) const;

  // The staged step (n_rows > 0) on `ops`: stores K/V of every row and leaves
  // the logits of the logit rows in ops.logits(). layer_stored, when set, is
  // called with each layer once its K/V are stored and the host sees them.
  //
  // The ops (an `Ops` object, one per device; its pointers are into that
  // device's memory):
  //   layer(il)             the layer's weights: attn_norm, ffn_norm (norm
  //                         vectors), bq, bk, bv (bias vectors, empty when the
  //                         model has none), wq, wk, wv, wo, w_gate, w_up, w_down
  //   output_norm(), output()   the final norm and the head's weight
  //   tensor(t)             the named tensor t, sized by floats()
  //   tokens(), positions() the staged step's (n_rows) each
  //   rope_freqs()          the RoPE divisors, or null
  //   logits()              (n_out, n_vocab), where run() leaves the logits
  //   embed(tokens, n, x)   x (n, n_embd): the rows of this rank's vocabulary
  //                         slice, zeros for the others
  //   rms_norm(x, weight, out, n_rows, dim, eps)
  //   matmul(x, n_rows, WeightProduct...)  every product of the one input x
  //   add_bias(x, bias, n_rows, dim)       nothing for an empty bias
  //   head_norm(x, weight, n_heads, head_dim, eps)   rms_norm of each of x's n_heads rows of
  //                         head_dim in place; nothing for an empty weight
  //   scale(x, n, factor)   x[i] *= factor for i < n
  //   rope(x, n_rows, n_heads, head_dim, positions, params)
  //   store_kv(layer, k, v), attention(layer, shape, q, out)
  //                         over the staged step's sequences
  //   synchronize()         the host sees every op queued so far
  //   add_in_place(x, y, n), silu_mul(gate, up, out, n_rows, width),
  //   gelu_mul(gate, up, out, n_rows, width)   llama.cpp's GEGLU (ggml_vec_geglu_f32)
  //   route(logits, n_rows, RouterShape, weights)   each row's picks (RouterShape),
  //                         their weights into weights (n_rows, n_used); returns
  //                         the picked experts (n_rows * n_used) in host memory
  //   gather_rows(x, width, rows, out)   out[i] = x[rows[i]], rows of width
  //   scatter_weighted(y, width, slots, weights, out)   out[slots[i]] = y[i] * weights[slots[i]]
  //   zero(x, n), sum_picks(picks, n_rows, n_used, width, out)   out[r] = the sum of
  //                         r's n_used rows of picks, left to right
  //   all_reduce(data, n), all_gather(mine, n_per_rank, all)
  //                         over the instance's ranks (tensor parallelism
  //                         only); a gather sends n_per_rank floats of `mine`,
  //                         past a narrower rank's own part (floats() sizes
  //                         the tensors so)
  //   assemble_columns(gathered, slot, parts, n_rows, all)   duet::assemble_slices
  //   assemble_logits(slices, n_slices, n_rows, stride, n_cols, out)
  //                         vocabulary slices (n_rows, stride) each, padded,
  //                         into out (n_rows, n_cols)
  template <typename Ops>
  void run(Ops& ops, const ModelForward::LayerStored& layer_stored) const;

 private:
  template <typename Ops>
  void head(Ops& ops, const float* x) const;
  // gate (n_rows, width) = act(gate) * up, the model's gated activation.
  template <typename Ops>
  void gated_activation(Ops& ops, float* gate, const float* up, int64_t n_rows,
                        int64_t width) const;
  // out (n, n_embd) = the mixture of experts of layer weights `w` on `in` (n, n_embd).
  template <typename Ops, typename Layer>
  void mixture_of_experts(Ops& ops, const Layer& w, const float* in, float* out) const;
  // out (n, n_embd) = O or down of the input `mine` (n, this rank's part of
  // `parts`); the whole input and the output rows are gathered over the
  // ranks when the model is a shard.
  template <typename Ops, typename Weight>
  void split_product(Ops& ops, const Weight& w, const float* mine, std::span<const int64_t> parts,
                     float* out) const;
  // all (n, sum of parts) = every rank's `mine` (n, its part), side by side.
  template <typename Ops>
  void gather_columns(Ops& ops, const float* mine, std::span<const int64_t> parts,
                      float* all) const;

  const LlamaModel& model_;
  // Every rank's share, in rank order, of the split dimensions: query dims
  // (n_heads * head_dim), hidden units, output rows of O and down.
  std::vector<int64_t> q_parts_, ff_parts_, embd_parts_;
  ForwardStep step_;
};

// The widest of `parts`: a gather's slot, per row.
int64_t widest_part(std::span<const int64_t> parts);

template <typename Ops>
void ForwardPlan::run(Ops& ops, const ModelForward::LayerStored& layer_stored) const {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  const int64_t n = step_.n_rows;
  // This rank's heads and hidden units (all of them when the model is whole).
  const int64_t n_heads = shard.n_heads();
  const int64_t n_kv_heads = shard.n_kv_heads();
  const int64_t n_ff = shard.n_ff();
  const int64_t q_dim = n_heads * c.head_dim;
  const int64_t kv_dim = n_kv_heads * c.head_dim;
  const RopeParams global_rope = rope_params(c, ops.rope_freqs());
  const RopeParams window_rope = rope_params(c, ops.rope_freqs(), true);
  const AttentionShape global_shape = attention_shape(c, shard);
  const AttentionShape window_shape = attention_shape(c, shard, true);
  const int32_t* positions = ops.positions();
  float* x = ops.tensor(ForwardTensor::kX);
  float* norm = ops.tensor(ForwardTensor::kNorm);
  float* q = ops.tensor(ForwardTensor::kQ);
  float* k = ops.tensor(ForwardTensor::kK);
  float* v = ops.tensor(ForwardTensor::kV);
  float* attn = ops.tensor(ForwardTensor::kAttn);
  float* attn_out = ops.tensor(ForwardTensor::kAttnOut);
  float* gate = ops.tensor(ForwardTensor::kGate);
  float* up = ops.tensor(ForwardTensor::kUp);
  float* ffn_out = ops.tensor(ForwardTensor::kFfnOut);

  ops.embed(ops.tokens(), n, x);
  if (!shard.whole()) ops.all_reduce(x, n * c.n_embd);  // adds zeros to each row but one: exact
  if (c.embed_scale != 1.0f) ops.scale(x, n * c.n_embd, c.embed_scale);
  for (int64_t il = 0; il < c.n_layers; ++il) {
    const auto& w = ops.layer(il);
    const bool windowed = c.is_swa(il);
    const RopeParams& rope = windowed ? window_rope : global_rope;

    // Attention block.
    ops.rms_norm(x, w.attn_norm, norm, n, c.n_embd, c.rms_eps);
    ops.matmul(norm, n, WeightProduct{w.wq, q, q_dim}, WeightProduct{w.wk, k, kv_dim},
               WeightProduct{w.wv, v, kv_dim});
    ops.add_bias(q, w.bq, n, q_dim);
    ops.add_bias(k, w.bk, n, kv_dim);
    ops.add_bias(v, w.bv, n, kv_dim);
    ops.head_norm(q, w.q_norm, n * n_heads, c.head_dim, c.rms_eps);
    ops.head_norm(k, w.k_norm, n * n_kv_heads, c.head_dim, c.rms_eps);
    ops.rope(q, n, n_heads, c.head_dim, positions, rope);
    ops.rope(k, n, n_kv_heads, c.head_dim, positions, rope);
    if (c.q_scale != 0.0f) ops.scale(q, n * q_dim, c.q_scale);
    ops.store_kv(il, k, v);
    if (layer_stored) {
      ops.synchronize();
      layer_stored(il);
    }
    ops.attention(il, windowed ? window_shape : global_shape, q, attn);
    split_product(ops, w.wo, attn, q_parts_, attn_out);
    if (c.post_norms) {
      ops.rms_norm(attn_out, w.attn_post_norm, attn_out, n, c.n_embd, c.rms_eps);
    }
    ops.add_in_place(x, attn_out, n * c.n_embd);

    // Feed-forward block (gated: SwiGLU or GEGLU), or a mixture of such experts.
    ops.rms_norm(x, w.ffn_norm, norm, n, c.n_embd, c.rms_eps);
    if (c.is_moe()) {
      mixture_of_experts(ops, w, norm, ffn_out);
    } else {
      ops.matmul(norm, n, WeightProduct{w.w_gate, gate, n_ff}, WeightProduct{w.w_up, up, n_ff});
      gated_activation(ops, gate, up, n, n_ff);
      split_product(ops, w.w_down, gate, ff_parts_, ffn_out);
    }
    if (c.post_norms) ops.rms_norm(ffn_out, w.ffn_post_norm, ffn_out, n, c.n_embd, c.rms_eps);
    ops.add_in_place(x, ffn_out, n * c.n_embd);
  }
  head(ops, x);
}

template <typename Ops, typename Layer>
void ForwardPlan::mixture_of_experts(Ops& ops, const Layer& w, const float* in, float* out) const {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  const int64_t n = step_.n_rows;
  const int64_t n_used = c.n_experts_used;
  float* logits = ops.tensor(ForwardTensor::kRouterLogits);
  float* weights = ops.tensor(ForwardTensor::kRouteWeights);
  ops.router_logits(in, n, w.router, logits, c.n_experts);
  const std::span<const int32_t> picked =
      ops.route(logits, n, RouterShape{c.n_experts, n_used}, weights);

  // This rank's experts' picks, expert by expert, each in row order: the rows an expert reads
  // and the (row, pick) slots it writes.
  const int64_t n_mine = shard.n_experts();
  std::vector<int32_t> starts(static_cast<size_t>(n_mine) + 1, 0);
  for (const int32_t e : picked) {
    if (e >= shard.expert_begin && e < shard.expert_end) ++starts[e - shard.expert_begin + 1];
  }
  for (int64_t e = 0; e < n_mine; ++e) starts[e + 1] += starts[e];
  std::vector<int32_t> rows(static_cast<size_t>(starts.back()));
  std::vector<int32_t> slots(rows.size());
  std::vector<int32_t> next(starts.begin(), starts.end() - 1);
  for (int64_t slot = 0; slot < n * n_used; ++slot) {
    const int32_t e = picked[static_cast<size_t>(slot)];
    if (e < shard.expert_begin || e >= shard.expert_end) continue;
    const auto at = static_cast<size_t>(next[e - shard.expert_begin]++);
    rows[at] = static_cast<int32_t>(slot / n_used);
    slots[at] = static_cast<int32_t>(slot);
  }

  // Each (row, pick) is computed whole by the rank holding the expert; the others hold zeros
  // there, so the all-reduce completes every slot exactly.
  float* picks = ops.tensor(ForwardTensor::kPicks);
  const int64_t n_picks = n * n_used * c.n_embd;
  if (!shard.whole()) ops.zero(picks, n_picks);
  float* expert_in = ops.tensor(ForwardTensor::kExpertIn);
  float* expert_out = ops.tensor(ForwardTensor::kExpertOut);
  float* gate = ops.tensor(ForwardTensor::kGate);
  float* up = ops.tensor(ForwardTensor::kUp);
  for (int64_t e = 0; e < n_mine; ++e) {
    const int32_t begin = starts[e];
    const int64_t m = starts[e + 1] - begin;
    if (m == 0) continue;
    const auto& expert = w.experts[static_cast<size_t>(e)];
    const std::span<const int32_t> expert_rows(rows.data() + begin, static_cast<size_t>(m));
    ops.gather_rows(in, c.n_embd, expert_rows, expert_in);
    ops.matmul(expert_in, m, WeightProduct{expert.gate, gate, c.n_ff_exp},
               WeightProduct{expert.up, up, c.n_ff_exp});
    gated_activation(ops, gate, up, m, c.n_ff_exp);
    ops.matmul(gate, m, WeightProduct{expert.down, expert_out, c.n_embd});
    ops.scatter_weighted(expert_out, c.n_embd,
                         std::span<const int32_t>(slots.data() + begin, static_cast<size_t>(m)),
                         weights, picks);
  }
  if (!shard.whole()) ops.all_reduce(picks, n_picks);
  ops.sum_picks(picks, n, n_used, c.n_embd, out);
}

template <typename Ops>
void ForwardPlan::gated_activation(Ops& ops, float* gate, const float* up, int64_t n_rows,
                                   int64_t width) const {
  if (model_.config().ffn_activation == FfnActivation::kGeluTanh) {
    ops.gelu_mul(gate, up, gate, n_rows, width);
  } else {
    ops.silu_mul(gate, up, gate, n_rows, width);
  }
}

template <typename Ops>
void ForwardPlan::head(Ops& ops, const float* x) const {
  const ModelConfig& c = model_.config();
  const TpShard& shard = model_.shard();
  const int64_t n_out = step_.n_out;
  if (n_out == 0) return;
  // Only the rows whose logits are wanted.
  float* head_in = ops.tensor(ForwardTensor::kHeadIn);
  if (step_.logit_rows_are_all) {
    ops.rms_norm(x, ops.output_norm(), head_in, n_out, c.n_embd, c.rms_eps);
  } else {
    for (int64_t i = 0; i < n_out; ++i) {
      const int64_t r = step_.logit_rows[static_cast<size_t>(i)];
      ops.rms_norm(x + r * c.n_embd, ops.output_norm(), head_in + i * c.n_embd, 1, c.n_embd,
                   c.rms_eps);
    }
  }
  const auto& output = ops.output();
  if (shard.whole()) {
    ops.matmul(head_in, n_out, WeightProduct{output, ops.logits(), c.n_vocab});
    return;
  }
  // Vocabulary-parallel: this rank's columns of the logits, gathered rank by
  // rank, then laid out row by row on every rank.
  const int64_t stride = shard.vocab_stride;
  float* slice = ops.tensor(ForwardTensor::kLogitSlice);
  float* slices = ops.tensor(ForwardTensor::kLogitSlices);
  ops.matmul(head_in, n_out, WeightProduct{output, slice, stride});
  ops.all_gather(slice, n_out * stride, slices);
  ops.assemble_logits(slices, shard.size, n_out, stride, c.n_vocab, ops.logits());
}

template <typename Ops, typename Weight>
void ForwardPlan::split_product(Ops& ops, const Weight& w, const float* mine,
                                std::span<const int64_t> parts, float* out) const {
  const int64_t n = step_.n_rows;
  if (model_.shard().whole()) {
    ops.matmul(mine, n, WeightProduct{w, out, model_.config().n_embd});
    return;
  }
  // (n, k): every rank multiplies the same whole rows, as one rank would.
  float* whole = ops.tensor(ForwardTensor::kWholeIn);
  gather_columns(ops, mine, parts, whole);
  float* rows = ops.tensor(ForwardTensor::kOutRows);
  ops.matmul(whole, n, WeightProduct{w, rows, model_.shard().n_embd()});
  gather_columns(ops, rows, embd_parts_, out);
}

template <typename Ops>
void ForwardPlan::gather_columns(Ops& ops, const float* mine, std::span<const int64_t> parts,
                                 float* all) const {
  const int64_t slot =
      widest_part(parts) * step_.n_rows;  // a narrower part sends padding past its rows
  float* gathered = ops.tensor(ForwardTensor::kGathered);
  ops.all_gather(mine, slot, gathered);
  ops.assemble_columns(gathered, slot, parts, step_.n_rows, all);
}

}  // namespace duet
