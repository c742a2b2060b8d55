// GPU twins of worker/kv/kv_rows.h's pack_kv_rows / unpack_kv_rows: a sequence's KV
// rows out of (and into) the paged cache on the device, in that file's packed layout
// (KV heads [head_first, head_first + head_count), F16, packed_kv_elems(layout, n,
// {head_first, head_count}) elements), bit for bit the CPU's. Plain C++ (no CUDA
// headers), so the KV transfer can call them without knowing CUDA.
//
// Every pointer is a device pointer: the cache (layout.total_elems() elements), the
// packed rows, and block_table, which covers positions [0, pos0 + n) as the CPU's
// does (the caller uploads it). `stream` is a cudaStream_t. Each call validates its
// arguments on the host (they throw duet::Error), then queues one kernel on `stream`
// and returns: no allocation, no synchronization, so the calls are legal inside a
// CUDA graph capture. n == 0 (or head_count == 0) queues nothing. Not checked on the
// device: each block table entry must name a block of the cache (the CPU asserts it),
// and for unpack_kv_rows no block may appear twice. The packed rows and the cache
// must not overlap; the source must not be written until the kernel has run. Copies
// use the widest vector, up to 16 bytes, that head_dim and the pointers allow.
#pragma once

#include <cstdint>

#include "common/model/kv_layout.h"

namespace duet::cuda {

// out = the packed rows of positions [pos0, pos0 + n) of `layer` (of KV heads
// [head_first, head_first + head_count)) of `cache`.
void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  const int32_t* block_table, int64_t pos0, int64_t n, int64_t head_first,
                  int64_t head_count, KvElement* out, void* stream);

// The inverse: writes the packed rows `in` into the blocks of `block_table`;
// every other element of the cache is left as it was.
void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    const int32_t* block_table, int64_t pos0, int64_t n, int64_t head_first,
                    int64_t head_count, const KvElement* in, void* stream);

}  // namespace duet::cuda
