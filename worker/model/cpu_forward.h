// The Llama forward pass on the CPU: the forward plan (worker/model/forward_plan.h)
// run with kernels/cpu/'s ops, the weights read from the model's mapping and
// the KV in the engine's host cache.
//
// Reduction orders: every weight product is one pass of llama.cpp's order
// (the same for any number of rows), and each row's attention reduces in the
// order its sequence names for its position (ForwardSequence::one_token_from),
// so a token's result depends on neither the batch nor the step it is in.
// With tensor parallelism no element is a sum over ranks (the plan's
// gathers), so x and the logits are the same bits on every rank of an
// instance and for every TP size (worker/model/tp_shard.h).
// Not thread-safe: one forward at a time per object (the engine thread's).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/kv/kv_cache.h"
#include "worker/model/forward_plan.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"
#include "worker/parallel/collective.h"

namespace duet {

class CpuForward final : public ModelForward {
 public:
  // `collective`: the instance's ranks when the model is a shard (outlives
  // this object; required then), else null.
  CpuForward(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
             Collective* collective = nullptr);

  // Time spent in the collectives since construction (tensor parallelism), and the part of
  // it in all-reduces (the embedding's, one a step, and a mixture of experts', one a layer).
  struct CollectiveTime {
    int64_t calls = 0;
    double seconds = 0;
    int64_t all_reduce_calls = 0;
    double all_reduce_seconds = 0;
  };
  CollectiveTime collective_time() const { return collective_time_; }

  // Writes K/V of every row into `cache` and the logits of `logit_rows`
  // into `logits` (never null here); layer_stored is where a prefill
  // instance ships each layer (see ModelForward).
  void run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
           KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
           const LayerStored& layer_stored = {}) override;

 private:
  class Ops;  // the plan's ops on the CPU, for one run (cpu_forward.cpp)

  // Grows the named tensors to a step of n_rows rows and n_out logit rows.
  void reserve(int64_t n_rows, int64_t n_out);

  const LlamaModel& model_;
  const cpu::KernelTable& kernels_;
  cpu::ThreadPool& pool_;
  Collective* const collective_;
  ForwardPlan plan_;
  CollectiveTime collective_time_;
  cpu::PackedActivations packed_;
  ForwardTensors<std::vector<float>> tensors_;
  std::vector<int32_t> picked_;     // the router's picks of the step's rows (mixture of experts)
  std::vector<uint8_t> one_token_;  // which of the step's rows are in the one-token order
};

}  // namespace duet
