// Measuring a profile (sim/profile.h) on the machine at hand: the real engine
// (worker/engine.h), configured as `duet serve` configures it, runs a plan of
// workloads in the shapes a server's steps take (measure_steps), every step is
// timed, and the cluster simulator's step cost is fitted to the samples.
// Requests ignore end-of-generation, so their lengths are the plan's.
//
// Every step that ran a forward pass is one sample (its shape as the forward
// saw it, and the wall-clock seconds of the whole engine.step(): scheduling,
// forward and sampling), every repetition kept: the fit sees the noise and
// the profile's residuals show it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "sim/profile.h"
#include "worker/engine.h"
#include "worker/model/llama_model.h"

namespace duet::sim {

struct MeasureOptions {
  // The engine as `duet serve` configures it (KV blocks, max_running, step
  // budget); end_of_generation is ignored (requests run to their length).
  EngineConfig engine;
  // Wall-clock budget of the whole plan, warm-up included, in seconds. The
  // plan is scaled down (fewer repetitions, then the largest contexts and
  // batches dropped) to fit an estimate made after the warm-up, and no
  // workload starts once it is spent.
  double budget_s = 60;
  int reps = 3;  // repetitions of the plan, each with fresh random prompts
  // Contexts of prefill chunks and decode steps are capped here (and by the
  // model's context and the KV cache).
  int64_t max_context = 4096;
  uint64_t seed = 1;
  // Rounds of the neighbour measurement (measure_neighbour); 0: not measured.
  int neighbour_rounds = 9;
};

// The steps of the plan, in the order they ran. The plan covers:
//   - prefill chunks of T tokens at context C: a random prefix of C tokens is
//     computed first (its own steps are samples too: chunks of the step
//     budget from context 0), then the prefix plus T new tokens, of which the
//     prefix cache holds the C, so the measured step computes T rows at C;
//   - decode steps of B sequences at context L: B prompts of L tokens, each
//     with KV blocks of its own as in serving, decode a few tokens. They
//     come in through the engine's import path (their blocks reserved,
//     nothing computing their rows, whose values do not change a step's
//     time), so 64 sequences at 2048 tokens need no 64 prefills;
//   - mixed steps: a prompt's chunk arriving while B sequences decode, which
//     the scheduler batches with the decodes (chunked prefill).
// Throws duet::Error
// (kInvalidArgument) for options the plan cannot run with (budget <= 0,
// reps < 1, a KV cache too small for one step budget of tokens).
std::vector<StepSample> measure_steps(const LlamaModel& model, const cpu::KernelTable& kernels,
                                      cpu::ThreadPool& pool, const MeasureOptions& options);

// The token knots of a measured step cost: 1, 2, 4, ..., 512, those up to
// max_step_tokens, and max_step_tokens itself.
std::vector<int64_t> measure_knots(int64_t max_step_tokens);

// What the processor is, for Profile::device: "cpu: <model name from
// /proc/cpuinfo>, N thread(s)" ("cpu: unknown, ..." where it cannot be read).
std::string cpu_device(int n_threads);

// How much longer this engine's steps take while a second instance like it
// (its own engine and KV cache, a thread pool of the same size) computes
// beside it: the host sharing a CPU cluster on one machine has, beyond the
// cores. Each round times the same workload (a prefill chunk of up to 512
// tokens, then a batch of 8 sequences decoding at 256 tokens) alone and
// with the neighbour looping over that workload too, in alternating order;
// a round's sample is the ratio of the two, the figure their median. Needs
// twice the threads in cores to mean what it says (`duet profile` on a
// 2-core machine: --threads 1). A profile without it (rounds 0) says 1.
HostSharing measure_neighbour(const LlamaModel& model, const cpu::KernelTable& kernels,
                              cpu::ThreadPool& pool, const MeasureOptions& options);

// measure_steps fitted into a profile of one instance (tp 1): the step cost
// with measure_knots, every sample's residual and the fit's quality, the KV
// the engine holds (n_kv_blocks * 16 tokens), the model's shape. source
// "measured"; transfers and collectives are left empty (the caller adds what
// sim/link_measure.h measures and says in `note` what is missing);
// `host` from measure_neighbour.
Profile measure_profile(const LlamaModel& model, const cpu::KernelTable& kernels,
                        cpu::ThreadPool& pool, const MeasureOptions& options);

}  // namespace duet::sim
