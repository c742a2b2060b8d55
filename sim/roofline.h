// A profile derived, not measured: a model's steps, KV transfers and
// collectives costed from a stated hardware description by the roofline
// (each step takes the longer of reading the weights and computing with
// them, plus what is stated as fixed), for hardware not at hand.
//
// A roofline profile is uncalibrated: its figures are what the hardware's
// data sheet allows at the stated efficiencies, not what any GPU was seen
// doing; its note says so.
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>

#include "common/model/model_config.h"
#include "sim/profile.h"

namespace duet::sim {

// The weights of a Llama-family model of `config`, as a count: the token
// embedding; per layer the attention's q, k, v, o (and qwen2's q/k/v biases),
// the FFN's gate, up and down, the two norms; the final norm; the output head
// unless tied to the embedding.
double parameter_count(const ModelConfig& config);

// The shape of `config` with its weights stored in `weight_bytes`, the KV per
// token as the engine stores it (make_kv_layout: F16). Throws duet::Error
// (kInvalidArgument) for a config with a non-positive dimension.
ModelShape model_shape(const ModelConfig& config, double weight_bytes, std::string name);

// Built-in shapes, BF16 weights (2 bytes per parameter): "llama-3-8b",
// "llama-3-70b". Throws duet::Error (kInvalidArgument) listing the known
// names for any other.
ModelShape named_model_shape(std::string_view name);

// Built-in hardware, from the vendors' data sheets (SXM parts): "h200",
// "h100", "a100". Throws duet::Error (kInvalidArgument) listing the known
// names for any other.
HardwareSpec named_hardware(std::string_view name);

// A hardware description as JSON, every field under its HardwareSpec name.
// Reading: "name", "memory_bytes", "memory_bytes_per_s", "flops_per_s",
// "link_bytes_per_s", "link_latency_s" and "step_overhead_s" are required;
// "memory_efficiency", "compute_efficiency" and "kv_memory_fraction" default
// as in HardwareSpec. Throws duet::Error (kInvalidArgument) naming a missing,
// malformed, out-of-range or unknown field (`path` prefixes the names).
nlohmann::json hardware_json(const HardwareSpec& hardware);
HardwareSpec hardware_from_json(const nlohmann::json& json, const std::string& path = "");

// The roofline profile of `model` on instances of each tp in `tps` (each >= 1,
// at most the model's KV heads, listed once) of `hardware`'s devices.
// Throws duet::Error (kInvalidArgument) for a bad tp or hardware figure, or
// when the weights do not fit in an instance's memory.
Profile roofline_profile(const HardwareSpec& hardware, const ModelShape& model,
                         std::span<const int> tps);

// What the roofline puts in a profile, exposed for its tests and for the
// simulator's reports. A step of n_tokens rows: the fixed overhead, the
// longer of the weights' read and their compute, the all-reduces.
double roofline_weights_seconds(const HardwareSpec& hardware, const ModelShape& model, int tp,
                                int64_t n_tokens);
// A ring all-reduce over `ranks` devices of `hardware`'s link:
// latency + 2 (ranks - 1) / ranks * bytes / link bandwidth.
LinkCost ring_all_reduce_cost(const HardwareSpec& hardware, int ranks);

}  // namespace duet::sim
