#include "worker/kv/kv_cache.h"

#include "common/error.h"

namespace duet {

KvLayout make_kv_layout(const ModelConfig& config, int64_t n_blocks, int64_t block_size) {
  DUET_REQUIRE(block_size > 0 && n_blocks > 0, "KV cache needs a positive block size and count");
  KvLayout layout;
  layout.n_layers = config.n_layers;
  layout.n_kv_heads = config.n_kv_heads;
  layout.head_dim = config.head_dim;
  layout.block_size = block_size;
  layout.n_blocks = n_blocks;
  return layout;
}

KvCache::KvCache(const KvLayout& layout, KvMemory memory) : layout_(layout) {
  if (memory == KvMemory::kHost)
    storage_ = HugePageMemory(static_cast<size_t>(layout.total_elems()) * sizeof(KvElement));
}

}  // namespace duet
