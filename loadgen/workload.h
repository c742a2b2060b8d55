// What duet-bench sends and when: arrival times, prompt and output lengths.
//
// Open loop: arrivals are a Poisson process at `rate` requests/s, or a gamma
// renewal process with the same mean rate whose shape is `burstiness` (1 is
// Poisson; under 1 burstier, over 1 more regular), as in vLLM's benchmark.
// Lengths come from a distribution (fixed, uniform, normal; clamped to >= 1)
// or from a trace file whose rows carry their own timestamps and lengths.
// Everything draws from one seeded generator: same seed, same workload.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace duet::loadgen {

struct PlannedRequest {
  double at = 0;  // seconds from the start (open loop); ignored by closed-loop runs
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  // The prompt itself, when the trace carries it (its TokenIds column):
  // prompt_tokens ids. Empty: the sender makes a prompt of that length.
  std::vector<int32_t> prompt_ids;
};

// Inter-arrival gaps: exponential (burstiness 1) or gamma(shape = burstiness,
// scale = 1 / (rate * burstiness)). rate > 0, burstiness > 0.
std::vector<double> arrival_times(int64_t n, double rate, double burstiness, std::mt19937_64& rng);

struct LengthSpec {
  enum class Kind { kFixed, kUniform, kNormal } kind = Kind::kFixed;
  double a = 128;  // fixed value; uniform min; normal mean
  double b = 0;    // uniform max; normal standard deviation
};
// "128", "uniform:64:512", "normal:256:64". Throws duet::Error on anything else.
LengthSpec parse_length_spec(const std::string& text);
int64_t draw_length(const LengthSpec& spec, std::mt19937_64& rng);

// A trace file: CSV with a header naming the columns TIMESTAMP,
// ContextTokens, GeneratedTokens (the public Azure LLM inference traces);
// TIMESTAMP is seconds (a number) or an ISO date-time ("2023-11-16
// 18:15:46.6805900"), relative to the first row. Throws duet::Error naming
// the line on a malformed row. An optional TokenIds column holds each
// prompt's ids separated by spaces (then ContextTokens must count them), so
// that prompts sharing a prefix share it in a replay or a simulation.
std::vector<PlannedRequest> read_trace(const std::filesystem::path& path);
void write_trace(const std::filesystem::path& path, const std::vector<PlannedRequest>& requests);

// Replays a trace `time_scale` times faster (2: twice the rate).
std::vector<PlannedRequest> scale_trace(std::vector<PlannedRequest> trace, double time_scale);

// Named synthetic mixes for `duet-bench make-trace`:
//   chat   short prompts (~normal 200±100), short answers (~normal 150±80), Poisson
//   long   long documents (uniform 1500..3500), short answers (uniform 50..200), Poisson
//   mixed  80% chat, 20% long, with bursts (gamma arrivals, burstiness 0.3)
//   pages  a page or two to read (uniform 600..1400), brief answers (uniform 8..32), Poisson
// Throws duet::Error for an unknown name.
std::vector<PlannedRequest> make_trace(const std::string& mix, int64_t n, double rate,
                                       uint64_t seed);

// One stretch of a shifting load: `mix` at `rate` requests/s for `seconds`.
struct TracePhase {
  std::string mix;
  double seconds = 0;
  double rate = 0;
};
// "MIX:SECONDS:RATE[,MIX:SECONDS:RATE...]", e.g. "chat:60:0.75,pages:90:0.4,chat:60:0.75".
// Throws duet::Error (kInvalidArgument) naming the bad part.
std::vector<TracePhase> parse_trace_phases(std::string_view text);
// The phases one after another: phase i is make_trace(mix, ..., rate, seed + i)
// cut at its `seconds` and shifted to start where the one before ended.
std::vector<PlannedRequest> make_phased_trace(std::span<const TracePhase> phases, uint64_t seed);

}  // namespace duet::loadgen
