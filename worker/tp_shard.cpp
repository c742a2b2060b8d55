#include "worker/tp_shard.h"

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

namespace {

// How many column groups down's `n_blocks` blocks form: a divisor of
// n_blocks that as many TP sizes up to `max_tp` divide as can (they split
// it evenly), the smallest such (fewest partials to exchange), at most
// 2 * max_tp. 6 for the default model's 48 blocks and 3 KV heads.
int64_t ff_groups(int64_t n_blocks, int64_t max_tp) {
  int64_t best = 1;
  int64_t best_sizes = 1;
  for (int64_t groups = 2; groups <= std::min(n_blocks, 2 * max_tp); ++groups) {
    if (n_blocks % groups != 0) continue;
    int64_t sizes = 0;
    for (int64_t t = 1; t <= max_tp; ++t) sizes += groups % t == 0 ? 1 : 0;
    if (sizes > best_sizes) {
      best = groups;
      best_sizes = sizes;
    }
  }
  return best;
}

}  // namespace

TpShard make_tp_shard(const ModelConfig& c, int rank, int size, int64_t o_block,
                      int64_t down_block) {
  DUET_REQUIRE(size >= 1 && rank >= 0 && rank < size, "tensor-parallel rank {} of {}", rank, size);
  if (size > c.n_kv_heads) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("tensor parallelism splits attention by KV heads: tp {} is more than "
                             "the model's {} KV heads",
                             size, c.n_kv_heads));
  }
  TpShard s;
  s.rank = rank;
  s.size = size;
  std::tie(s.kv_head_begin, s.kv_head_end) = split_evenly(c.n_kv_heads, rank, size);
  s.head_begin = s.kv_head_begin * c.group_size();
  s.head_end = s.kv_head_end * c.group_size();
  // O's columns of this rank are its heads' dims: they must be whole blocks.
  for (int64_t column : {s.head_begin * c.head_dim, s.head_end * c.head_dim}) {
    if (column % o_block != 0) {
      throw Error(ErrorKind::kUnsupported,
                  duet::format("tp {} splits attn_output at column {}, inside one of its "
                               "{}-element quantization blocks; choose a tp whose KV-head "
                               "groups end on block boundaries",
                               size, column, o_block));
    }
  }
  // O's column groups: one per KV head when those are whole blocks (then
  // every TP size sums alike), else one (and the model cannot be split).
  if ((c.group_size() * c.head_dim) % o_block == 0) {
    s.n_o_groups = c.n_kv_heads;
    s.o_group_begin = s.kv_head_begin;
    s.o_group_end = s.kv_head_end;
  } else if (size > 1) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("attn_output's {}-element quantization blocks span KV heads; tensor "
                             "parallelism needs each head group's columns whole",
                             o_block));
  }
  if (c.n_ff % down_block != 0) {
    throw Error(
        ErrorKind::kCorruptFile,
        duet::format("ffn_down has {} columns, not whole {}-element blocks", c.n_ff, down_block));
  }
  s.n_ff_groups = ff_groups(c.n_ff / down_block, c.n_kv_heads);
  std::tie(s.ff_group_begin, s.ff_group_end) = split_evenly(s.n_ff_groups, rank, size);
  if (s.ff_group_begin == s.ff_group_end) {
    throw Error(ErrorKind::kUnsupported,
                duet::format("tp {} leaves rank {} none of ffn_down's {} column groups", size, rank,
                             s.n_ff_groups));
  }
  const int64_t group_columns = c.n_ff / s.n_ff_groups;
  s.ff_begin = s.ff_group_begin * group_columns;
  s.ff_end = s.ff_group_end * group_columns;
  s.vocab_stride = (c.n_vocab + size - 1) / size;
  s.vocab_begin = std::min(c.n_vocab, rank * s.vocab_stride);
  s.vocab_end = std::min(c.n_vocab, (rank + 1) * s.vocab_stride);
  return s;
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
