#include "worker/tp_shard.h"

#include <algorithm>

#include "common/error.h"

namespace duet {

std::pair<int64_t, int64_t> split_evenly(int64_t n, int rank, int size) {
  DUET_ASSERT(size >= 1 && rank >= 0 && rank < size, "part {} of {}", rank, size);
  const int64_t base = n / size;
  const int64_t extra = n % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

TpShard whole_model_shard(const ModelConfig& config) { return make_tp_shard(config, 0, 1, 1, 1); }

TpShard make_tp_shard(const ModelConfig& c, int rank, int size, int64_t o_block,
                      int64_t down_block) {
  DUET_REQUIRE(size >= 1 && rank >= 0 && rank < size, "tensor-parallel rank {} of {}", rank, size);
  if (size > c.n_kv_heads) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("tensor parallelism splits attention by KV heads: tp {} is more than "
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
                  fmt::format("tp {} splits attn_output at column {}, inside one of its "
                              "{}-element quantization blocks; choose a tp whose KV-head "
                              "groups end on block boundaries",
                              size, column, o_block));
    }
  }
  if (c.n_ff % down_block != 0) {
    throw Error(
        ErrorKind::kCorruptFile,
        fmt::format("ffn_down has {} columns, not whole {}-element blocks", c.n_ff, down_block));
  }
  const auto [ff0, ff1] = split_evenly(c.n_ff / down_block, rank, size);
  if (ff0 == ff1) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("tp {} leaves rank {} no {}-element block of ffn_down's {} columns",
                            size, rank, down_block, c.n_ff));
  }
  s.ff_begin = ff0 * down_block;
  s.ff_end = ff1 * down_block;
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
