// A profile: what one model's engine steps, KV transfers and collectives cost
// on one kind of hardware, the input of the cluster simulator (duet-sim).
//
// It is measured on the machine at hand (`duet profile`, sim/profile_measure.h)
// or derived from a stated hardware description and a model shape
// (`duet profile --roofline`, sim/roofline.h) for hardware not at hand;
// `source` says which, and a measured profile keeps every sample with what
// the fitted cost says of it, so its error is in the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "worker/model/step_time_forward.h"

namespace duet::sim {

// A step's cost, a function of the shape the engine hands its forward pass
// (worker/model/step_time_forward.h StepShape):
//
//   weights(n_tokens) + per_sequence * n_sequences
//     + per_decode_attention * n_decode_attention
//     + per_prefill_attention * (n_attention - n_decode_attention)
//     + per_logit_row * n_logit_rows
//
// weights() is piecewise linear through the knots (token_knots[i],
// knot_seconds[i]): below the first knot it is the first knot's value, past
// the last it goes on with the last segment's slope. Piecewise linear in the
// row count is what a roofline looks like at small batches (a flat,
// memory-bound stretch while the weights are read once for every row, then a
// compute-bound slope), and the whole cost stays linear in its parameters, so
// a measured profile is one least-squares fit.
struct StepCost {
  std::vector<int64_t> token_knots;  // increasing, >= 1
  std::vector<double> knot_seconds;  // same length
  double per_sequence = 0;
  double per_decode_attention = 0;   // per (row, key) pair of a one-row sequence
  double per_prefill_attention = 0;  // per pair of a sequence with several rows
  double per_logit_row = 0;

  // No knots: 0. Throws duet::Error (kInvalidArgument) when the two vectors
  // differ in length.
  double weights(int64_t n_tokens) const;
  double operator()(const StepShape& shape) const;  // seconds
};

// The interpolation weights of the knots at n_tokens: weights(n) is
// sum_i knot_weights(knots, n)[i] * knot_seconds[i]. Past the last knot the
// last two weights are 1 + s and -s (the last segment's slope carried on).
// `token_knots` as in StepCost (not checked here).
std::vector<double> knot_weights(std::span<const int64_t> token_knots, int64_t n_tokens);

// One measured step.
struct StepSample {
  StepShape shape;
  double seconds = 0;
};

// A sample beside what the fitted cost says of it.
struct FitResidual {
  StepShape shape;
  double measured_s = 0;
  double fitted_s = 0;
};

// Relative errors |fitted - measured| / measured over the samples.
struct FitQuality {
  int64_t n_samples = 0;
  double median_rel_error = 0;
  double p90_rel_error = 0;
  double max_rel_error = 0;
};

// The StepCost with these knots that fits the samples best in relative terms
// (least squares of (fitted - measured) / measured), every coefficient >= 0.
// A term no sample exercises (no prefill attention among the samples, say)
// is 0; terms the samples cannot tell apart share the cost the least-norm way
// (sim/nnls.h), so vary the shapes to pin every term down.
// Throws duet::Error (kInvalidArgument) with no samples, knots that are not
// increasing from >= 1, or a sample with seconds <= 0 or a negative count.
StepCost fit_step_cost(std::span<const StepSample> samples, std::vector<int64_t> token_knots);
std::vector<FitResidual> fit_residuals(const StepCost& cost, std::span<const StepSample> samples);
FitQuality fit_quality(std::span<const FitResidual> residuals);

// Moving `bytes` over a link (a KV transfer path, or a collective over its
// ranks) takes latency_s + bytes / bytes_per_s.
struct LinkCost {
  double latency_s = 0;
  double bytes_per_s = 0;  // > 0; +infinity when the time does not grow with bytes
  // Throws duet::Error (kInvalidArgument) unless bytes_per_s > 0.
  double seconds(double bytes) const;
};

struct LinkSample {
  double bytes = 0;
  double seconds = 0;
};

// The least-squares line through the samples (latency and inverse bandwidth
// kept >= 0). Throws duet::Error (kInvalidArgument) with fewer than one sample.
LinkCost fit_link_cost(std::span<const LinkSample> samples);

// A KV transfer path between a prefill and a decode instance: "mpi-shm"
// (MPI over shared memory), "tcp" (the TCP transfer, loopback when
// measured), "nccl", "rdma", ... as the profile names them.
struct TransferProfile {
  std::string path;
  LinkCost cost;
  std::vector<LinkSample> samples;  // measured ones; empty for a roofline
};

// A collective of a tensor-parallel instance ("all_reduce") over `ranks`.
struct CollectiveProfile {
  std::string op;
  int ranks = 2;
  LinkCost cost;
  std::vector<LinkSample> samples;
};

// An instance of `tp` ranks: the cost of its whole step (collectives
// included) and the KV it can hold.
struct InstanceProfile {
  int tp = 1;
  StepCost step;
  int64_t kv_capacity_tokens = 0;
  std::vector<FitResidual> residuals;  // measured: every sample; roofline: none
  FitQuality quality;
};

// The model as a cost model sees it.
struct ModelShape {
  std::string name;
  int64_t n_layers = 0;
  int64_t n_embd = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t n_ff = 0;
  int64_t n_vocab = 0;
  int64_t n_ctx = 0;
  double n_params = 0;            // weights, as a count
  double weight_bytes = 0;        // weights as stored (quantized or not)
  double kv_bytes_per_token = 0;  // K and V of every layer, one position
  // A mixture of experts (0: dense): n_experts experts of n_ff_exp hidden units in every
  // layer, n_experts_used of them per token; expert_bytes, the part of weight_bytes they hold.
  int64_t n_experts = 0;
  int64_t n_experts_used = 0;
  int64_t n_ff_exp = 0;
  double expert_bytes = 0;

  // The share of the experts' weights a step of n_tokens reads: each expert is
  // read when some token picks it, n_tokens picking n_experts_used each,
  // uniformly: 1 - (1 - used / experts)^n_tokens. 1 for a dense model.
  double experts_read(int64_t n_tokens) const;
};

// A stated accelerator (or CPU) for a roofline profile.
struct HardwareSpec {
  std::string name;
  double memory_bytes = 0;        // per device
  double memory_bytes_per_s = 0;  // per device
  double flops_per_s = 0;         // dense, in the weights' compute type, per device
  double link_bytes_per_s = 0;    // between devices (collectives, KV transfer), per direction
  double link_latency_s = 0;
  double step_overhead_s = 0;       // fixed per step (launches, scheduling)
  double memory_efficiency = 0.8;   // share of memory_bytes_per_s reached
  double compute_efficiency = 0.6;  // share of flops_per_s reached
  double kv_memory_fraction = 0.9;  // of memory left after the weights, given to KV
};

// Instances that share one host (a CPU cluster on one machine): how much
// longer a step takes while another instance like it computes beside it, on
// cores of its own but the same memory and caches. Measured by `duet
// profile` (sim/profile_measure.h); 1 when not measured.
struct HostSharing {
  double neighbour_slowdown = 1;
  std::vector<double> samples;  // the ratio of each measured round
};

struct Profile {
  std::string source;  // "measured" or "roofline"
  std::string device;  // what it describes: "cpu: <model name>, 1 thread", "roofline: h200"
  int threads = 0;     // measured: compute threads per rank
  std::string note;    // caveats: what is not measured, calibration
  ModelShape model;
  std::vector<InstanceProfile> instances;  // ascending tp, each tp once
  std::vector<TransferProfile> transfers;
  std::vector<CollectiveProfile> collectives;
  HostSharing host;
  std::optional<HardwareSpec> hardware;  // a roofline's description

  // Throw duet::Error (kInvalidArgument) naming what the profile has.
  const InstanceProfile& instance(int tp) const;
  const TransferProfile& transfer(std::string_view path) const;
};

// The JSON form: {"format": "duet-profile", "version": 1, ...} and every
// field of every struct above under its own name ("hardware": null for a
// measured profile; an infinite bytes_per_s as "inf"; "host" may be absent,
// as in files written before it was measured). Doubles read back exactly.
nlohmann::json profile_json(const Profile& profile);
// Throws duet::Error (kInvalidArgument) naming the missing, malformed or
// unknown field ("instances[1].step.knot_seconds[3]: expected a number"), or
// a format or version this build does not read.
Profile profile_from_json(const nlohmann::json& json);
// Throws duet::Error: kInvalidArgument when the file cannot be written.
void write_profile(const std::filesystem::path& path, const Profile& profile);
// Throws duet::Error: kNotFound when the file cannot be opened,
// kInvalidArgument (prefixed with the path) when it is not a profile.
Profile read_profile(const std::filesystem::path& path);

}  // namespace duet::sim
