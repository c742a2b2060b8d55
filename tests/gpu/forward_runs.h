// Runs of a GPU forward that the model-level GPU checks share: block tables,
// teacher-forced logits in one prefill, greedy decode with on-device
// sampling, and how two paths compare.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "worker/model/model_forward.h"

namespace duet::gpu_check {

inline constexpr float kNearTie = 0.1f;  // top-two logit margin under which argmaxes may differ

inline int32_t argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// The block table of `n_blocks` consecutive blocks from `first` on.
inline std::vector<int32_t> blocks_from(int32_t first, int64_t n_blocks) {
  std::vector<int32_t> table(static_cast<size_t>(n_blocks));
  std::iota(table.begin(), table.end(), first);
  return table;
}

// How many tokens two paths share from the start.
inline size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// Every position's logits of `tokens` (n_vocab each) in one prefill.
inline std::vector<float> teacher_forced(ModelForward& forward, KvCache& cache,
                                         std::span<const int32_t> table,
                                         const std::vector<int32_t>& tokens, int64_t n_vocab) {
  const auto n = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> logits(static_cast<size_t>(n * n_vocab));
  const ForwardSequence whole{table, 0, n};
  forward.run(tokens, {&whole, 1}, cache, rows, logits.data());
  return logits;
}

// Greedy decode of every sequence together, sampled on the device: with
// `prefill`, each prompt is prefilled alone first and its first token
// sampled (else the KV of all but each sequence's last token is there
// already); then `steps` steps of one row per sequence. Returns every
// sequence's tokens.
inline std::vector<std::vector<int32_t>> greedy_decode(ModelForward& forward, KvCache& cache,
                                                       std::span<const std::vector<int32_t>> tables,
                                                       std::vector<std::vector<int32_t>> tokens,
                                                       int64_t steps, bool prefill) {
  const auto n_seq = static_cast<int64_t>(tables.size());
  std::vector<DeviceSampling> greedy(static_cast<size_t>(n_seq));
  std::vector<int32_t> next(static_cast<size_t>(n_seq));
  if (prefill) {
    for (int64_t s = 0; s < n_seq; ++s) {
      const auto n = static_cast<int64_t>(tokens[s].size());
      const ForwardSequence seq{tables[s], 0, n};
      const int64_t last = n - 1;
      forward.run(tokens[s], {&seq, 1}, cache, {&last, 1}, nullptr);
      forward.sample({&greedy[0], 1}, {&next[s], 1});
      tokens[s].push_back(next[s]);
    }
  }
  std::vector<int64_t> all(static_cast<size_t>(n_seq));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<ForwardSequence> seqs;
    std::vector<int32_t> batch;
    for (int64_t s = 0; s < n_seq; ++s) {
      seqs.push_back({tables[s], static_cast<int64_t>(tokens[s].size()) - 1, 1});
      batch.push_back(tokens[s].back());
    }
    forward.run(batch, seqs, cache, all, nullptr);
    forward.sample(greedy, next);
    for (int64_t s = 0; s < n_seq; ++s) tokens[s].push_back(next[s]);
  }
  return tokens;
}

}  // namespace duet::gpu_check
