// How KV moves between a prefill instance and a decode instance
// (disaggregated serving). The MPI implementation is
// worker/transfer/mpi_kv_transfer.h; a GPU one (NCCL) fits the same interface.
//
// The protocol, for one request (ids are the coordinator's RequestIds):
//   decode:  reserves the prompt's blocks, then start_import(prefill peer,
//            order, blocks): the transfer records where the rows go and
//            sends the PrefillOrder.
//   prefill: on_order -> computes the prompt; after each layer of each chunk
//            send_rows (the rows are copied out at once, so the prefill side
//            may reuse its blocks right away); at the end send_handoff (the
//            first token), or send_handoff with an error.
//   decode:  the transfer writes each layer's rows into the reserved blocks
//            as they come; after the handoff, on_complete. Or on_failed (the
//            prefill side failed, the deadline passed, a checksum did not
//            match): nothing more is written.
//   cancel:  abort_import; the transfer tells the prefill side (on_cancel),
//            stops writing, then on_released: only now may the blocks be
//            reused. Rows that still arrive for it are dropped.
//
// Rows travel in the packed layout of worker/kv/kv_rows.h, one message per layer
// per chunk. Messages between two peers arrive in the order they were sent,
// so a handoff is behind every row its sender sent.
//
// Tensor parallelism: each instance's KV heads are split over its ranks
// (worker/model/tp_shard.h). Every prefill rank sends the heads it shares with
// each decode rank straight to that rank (kv_peers), nothing goes through
// one rank. The leaders speak the protocol above; a decode follower is told
// by its leader to expect_import, and completes when every row of its heads
// is in (no handoff comes to it).
//
// Threads: start_import, abort_import, send_rows and send_handoff from the
// instance's engine thread; handlers run on the transfer's thread and must
// be quick (they queue work for the engine thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/serving.h"
#include "worker/kv/kv_cache.h"

namespace duet {

// A rank on the other side of a transfer and the KV heads the two share,
// [head_begin, head_end) in the model's (global) head indices.
struct KvSource {
  int rank = 0;
  int64_t head_begin = 0;
  int64_t head_end = 0;
};

class KvTransfer {
 public:
  using Clock = std::chrono::steady_clock;

  // Where an import's rows go and where they come from.
  struct ImportPlan {
    RequestId id;
    int64_t send_from = 0;  // rows [send_from, n_prompt) come
    int64_t n_prompt = 0;
    std::vector<KvSource> sources;  // every prefill rank that shares KV heads with `cache`
    int64_t head_offset = 0;        // the global index of `cache`'s first KV head
    KvCache* cache = nullptr;
    std::vector<int32_t> block_table;
    Clock::time_point deadline;  // past it the import fails
  };

  struct Handlers {
    // Prefill side: a decode peer asks for a prompt.
    std::function<void(int peer, PrefillOrder order)> on_order;
    // Prefill side: the decode peer withdrew an order.
    std::function<void(int peer, RequestId id)> on_cancel;
    // Decode side: every row is written; decoding goes on from the handoff.
    std::function<void(RequestId id, const KvHandoff& handoff)> on_complete;
    // Decode side: the transfer is over without its KV; nothing more is written.
    std::function<void(RequestId id, const ServeError& error)> on_failed;
    // Decode side: after abort_import, nothing more is written.
    std::function<void(RequestId id)> on_released;
    // Decode side: the transfer is over without its KV, and rows from a lost
    // rank may still be written into its blocks at any time: never free them.
    std::function<void(RequestId id)> on_quarantined;
  };

  virtual ~KvTransfer() = default;

  // Before the first transfer.
  virtual void set_handlers(Handlers handlers) = 0;

  // Decode leader. The rows of positions [send_from, n_prompt) of the plan's
  // heads will be written into its cache and blocks until on_complete (the
  // handoff from `prefill_leader` and every row from every source are in),
  // on_failed or on_released. Sends `order` to the prefill leader.
  virtual void start_import(int prefill_leader, const PrefillOrder& order, ImportPlan plan) = 0;
  // Decode follower: the same without an order or a handoff; on_complete
  // (with a handoff that carries only the id) once every row is in.
  virtual void expect_import(ImportPlan plan) = 0;
  virtual void abort_import(RequestId id) = 0;
  // Ends every import that writes into `cache` at once, without handlers
  // (the cache's owner is going away); when it returns nothing writes into
  // `cache` any more. Any thread.
  virtual void forget_imports(const KvCache& cache) = 0;

  // Prefill side. Copies rows [pos0, pos0 + n) of `layer` out of `cache` now
  // and queues them for `decode_rank`: the global KV heads
  // [heads.head_begin, heads.head_end) of a cache whose first head is
  // `head_offset` (heads.rank is ignored).
  virtual void send_rows(int decode_rank, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                         const KvCache& cache, std::span<const int32_t> block_table,
                         int64_t head_offset, const KvSource& heads) = 0;
  virtual void send_handoff(int decode_peer, const KvHandoff& handoff) = 0;

  // Whether rows to or from world rank `peer` move device to device (a GPU
  // engine then neither copies exported rows to its host cache nor uploads
  // imported ones from it): GPU pairs with a device transfer.
  virtual bool device_transfer(int /*peer*/) const { return false; }
};

// The plan of an import of every KV head of `cache` from one prefill rank
// (both instances unsplit).
inline KvTransfer::ImportPlan whole_import_plan(int prefill_rank, const PrefillOrder& order,
                                                KvCache& cache,
                                                std::span<const int32_t> block_table,
                                                KvTransfer::Clock::time_point deadline) {
  return {order.request.id,
          order.send_from,
          static_cast<int64_t>(order.request.prompt.size()),
          {{prefill_rank, 0, cache.layout().n_kv_heads}},
          0,
          &cache,
          {block_table.begin(), block_table.end()},
          deadline};
}

// Every KV head of an unsplit cache, for send_rows.
inline KvSource all_kv_heads_of(const KvCache& cache) { return {0, 0, cache.layout().n_kv_heads}; }

}  // namespace duet
