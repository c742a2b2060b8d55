// The engine's one rule for how each token of a sequence is computed.
//
// llama.cpp's CPU build reduces a token's attention in one of two orders,
// chosen by the micro-batch the token is in: ggml_vec_dot_f16's order when
// the micro-batch holds one token, its GEMM order when it holds several
// (kernels/cpu/attention.h). Every other part of the forward pass reduces
// alike for any number of rows. llama-server with one slot (`-np 1`, default
// `-b 2048 -ub 512`, no prompt cache) runs a prompt in micro-batches of 512
// tokens, then every generated token alone.
//
// Duet ties the order to the token's role, never to the step it happens to
// be computed in: prompt tokens take the multi-token order, generated tokens
// the one-token order, and so does the last prompt token when llama-server's
// micro-batches of 512 leave it alone (a prompt of 512k + 1 tokens). A
// sequence carries its prompt length through chunked prefill, preemption and
// recompute, prefix-cache hits and KV import, so a token recomputed in a
// chunk of 300 rows is computed bit for bit as it was alone, and a lone
// sequence gives llama-server's tokens.
#pragma once

#include <cstdint>

namespace duet {

// llama-server's default micro-batch (`-ub`), which the rule follows.
inline constexpr int64_t kLlamaCppMicroBatch = 512;

// The first position of a sequence with an `n_prompt`-token prompt that is
// computed in the one-token order (every later one is too).
constexpr int64_t one_token_from(int64_t n_prompt) {
  return n_prompt >= 1 && (n_prompt - 1) % kLlamaCppMicroBatch == 0 ? n_prompt - 1 : n_prompt;
}

// How many of the `n` positions from `pos0` on are computed in the
// one-token order, for a sequence whose one-token rows start at `from`.
constexpr int64_t n_one_token(int64_t pos0, int64_t n, int64_t from) {
  const int64_t first = pos0 > from ? pos0 : from;
  return pos0 + n > first ? pos0 + n - first : 0;
}

}  // namespace duet
