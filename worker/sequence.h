// The engine's vocabulary for one sequence: its id, where it is in its life,
// and how it ended. A leaf header: every folder of worker/ may include it.
#pragma once

#include <cstdint>
#include <functional>

namespace duet {

// An engine's name for one sequence (a request's prompt and its tokens).
struct SequenceId {
  int64_t value = -1;

  friend bool operator==(SequenceId, SequenceId) = default;
  friend auto operator<=>(SequenceId, SequenceId) = default;
};

// Where a sequence is. The scheduler (worker/scheduler.h) sets it and nothing
// else does; the engine and the instance read it.
enum class SequenceState {
  kQueued,      // waiting for its first admission
  kAwaitingKv,  // an import: its prompt's KV is computed elsewhere
  kRunning,     // holds KV and computes in every step
  kPreempted,   // lost its KV to a sequence before it; waits to be recomputed
  kFinished,    // over (or never known)
};

enum class FinishReason {
  kEndOfGeneration,  // sampled an end-of-generation token
  kLength,           // reached its max_tokens
  kCancelled,        // ended by its caller
};

constexpr const char* sequence_state_name(SequenceState state) {
  switch (state) {
    case SequenceState::kQueued:
      return "queued";
    case SequenceState::kAwaitingKv:
      return "awaiting KV";
    case SequenceState::kRunning:
      return "running";
    case SequenceState::kPreempted:
      return "preempted";
    case SequenceState::kFinished:
      return "finished";
  }
  return "?";
}

}  // namespace duet

template <>
struct std::hash<duet::SequenceId> {
  size_t operator()(duet::SequenceId id) const noexcept { return std::hash<int64_t>{}(id.value); }
};
