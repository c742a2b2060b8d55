#include "worker/model/tp_shard.h"

#include <algorithm>
#include <numeric>

#include "common/error.h"
#include "common/format.h"

namespace duet {

std::pair<int64_t, int64_t> split_evenly(int64_t n, int rank, int size) {
  DUET_ASSERT(size >= 1 && rank >= 0 && rank < size, "part {} of {}", rank, size);
  const int64_t base = n / size;
  const int64_t extra = n % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

TpShard make_tp_shard(const ModelConfig& c, int rank, int size) {
  DUET_REQUIRE(size >= 1 && rank >= 0 && rank < size, "tensor-parallel rank {} of {}", rank, size);
  if (size > c.n_kv_heads) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("tensor parallelism splits attention by KV heads: tp {} is more than "
                             "the model's {} KV heads",
                             size, c.n_kv_heads));
  }
  if (c.is_moe() && size > c.n_experts) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("expert parallelism gives each rank whole experts: tp {} is more "
                             "than the model's {} experts",
                             size, c.n_experts));
  }
  TpShard s;
  s.rank = rank;
  s.size = size;
  std::tie(s.kv_head_begin, s.kv_head_end) = split_evenly(c.n_kv_heads, rank, size);
  s.head_begin = s.kv_head_begin * c.group_size();
  s.head_end = s.kv_head_end * c.group_size();
  // Hidden units in runs of kFfRun; the last rank takes the remainder too.
  constexpr int64_t kFfRun = 16;
  const auto [run0, run1] = split_evenly(c.n_ff / kFfRun, rank, size);
  s.ff_begin = run0 * kFfRun;
  s.ff_end = rank + 1 == size ? c.n_ff : run1 * kFfRun;
  if (s.ff_begin == s.ff_end) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("tp {} leaves rank {} none of the model's {} hidden units", size, rank,
                             c.n_ff));
  }
  std::tie(s.embd_begin, s.embd_end) = split_evenly(c.n_embd, rank, size);
  if (c.is_moe()) std::tie(s.expert_begin, s.expert_end) = split_evenly(c.n_experts, rank, size);
  s.vocab_stride = (c.n_vocab + size - 1) / size;
  s.vocab_begin = std::min(c.n_vocab, rank * s.vocab_stride);
  s.vocab_end = std::min(c.n_vocab, (rank + 1) * s.vocab_stride);
  return s;
}

void assemble_slices(const float* gathered, int64_t slot, std::span<const int64_t> parts,
                     int64_t rows, float* all) {
  int64_t width = 0;
  for (int64_t part : parts) width += part;
  int64_t column = 0;
  for (size_t r = 0; r < parts.size(); ++r) {
    const int64_t part = parts[r];
    const float* from = gathered + static_cast<int64_t>(r) * slot;
    for (int64_t i = 0; i < rows; ++i) std::copy_n(from + i * part, part, all + i * width + column);
    column += part;
  }
}

std::vector<KvPeer> kv_peers(int64_t n_kv_heads, int index, int size, int other_size) {
  const auto [mine_begin, mine_end] = kv_heads_of(n_kv_heads, index, size);
  std::vector<KvPeer> peers;
  for (int other = 0; other < other_size; ++other) {
    const auto [begin, end] = kv_heads_of(n_kv_heads, other, other_size);
    const int64_t shared_begin = std::max(mine_begin, begin);
    const int64_t shared_end = std::min(mine_end, end);
    if (shared_begin < shared_end) peers.push_back({other, shared_begin, shared_end});
  }
  return peers;
}

}  // namespace duet
