// Storage of a paged KV cache laid out by KvLayout (common/kv_layout.h).
// It owns the memory only; which blocks a sequence uses is its block table,
// kept by whoever allocates blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_layout.h"
#include "common/model_config.h"

namespace duet {

KvLayout make_kv_layout(const ModelConfig& config, int64_t n_blocks,
                        int64_t block_size = KvLayout::kDefaultBlockSize);

class KvCache final {
 public:
  explicit KvCache(const KvLayout& layout);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvLayout& layout() const { return layout_; }
  KvElement* data() { return storage_.data(); }
  const KvElement* data() const { return storage_.data(); }

 private:
  KvLayout layout_;
  std::vector<KvElement> storage_;
};

}  // namespace duet
