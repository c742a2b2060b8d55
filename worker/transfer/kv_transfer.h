// How KV moves from a prefill instance to a decode instance: MpiKvTransfer
// (worker/transfer/mpi_kv_transfer.h), TcpKvTransfer (worker/transfer/tcp_kv_transfer.h).
// For one request (ids are the coordinator's RequestIds), the decode side reserves
// the prompt's blocks and calls start_import, which sends the PrefillOrder; the
// prefill side, on_order, computes the prompt, calls send_rows after each layer of
// each chunk and send_handoff at the end (the first token, or an error); the decode
// side's transfer writes the rows into the reserved blocks as they come, then calls
// on_complete after the handoff, or on_failed (an error, the deadline, a bad
// checksum). Rows travel packed (worker/kv/kv_rows.h), one message per layer per
// chunk; messages between two peers arrive in the order sent, so a handoff is
// behind every row its sender sent. Tensor parallelism: each prefill rank sends the
// heads it shares with each decode rank straight to it (worker/model/tp_shard.h);
// only the leaders exchange orders and handoffs.
//
// Threads: start_import, abort_import, send_rows and send_handoff from the
// instance's engine thread; handlers run on the transfer's thread and must be
// quick (they queue work for the engine thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/cluster/cluster_spec.h"
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

  struct Counters {
    int64_t messages_sent = 0;
    int64_t bytes_sent = 0;  // headers and payloads
    int64_t messages_received = 0;
    int64_t bytes_received = 0;
    int64_t rows_dropped = 0;  // rows messages for no live import (aborted or failed)
    int64_t imports_completed = 0;
    int64_t imports_failed = 0;
    int64_t imports_quarantined = 0;  // failed with rows from a lost rank half-received
    int64_t device_bytes_sent = 0;    // rows payloads through the device transfer
    int64_t device_bytes_received = 0;
    int64_t cma_bytes_sent = 0;  // rows payloads read out of this rank's CMA staging
    int64_t cma_bytes_received = 0;

    Counters& operator+=(const Counters& o) {
      messages_sent += o.messages_sent;
      bytes_sent += o.bytes_sent;
      messages_received += o.messages_received;
      bytes_received += o.bytes_received;
      rows_dropped += o.rows_dropped;
      imports_completed += o.imports_completed;
      imports_failed += o.imports_failed;
      imports_quarantined += o.imports_quarantined;
      device_bytes_sent += o.device_bytes_sent;
      device_bytes_received += o.device_bytes_received;
      cma_bytes_sent += o.cma_bytes_sent;
      cma_bytes_received += o.cma_bytes_received;
      return *this;
    }
  };

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
  // Decode side: the prefill side is told (on_cancel), the transfer stops
  // writing, then on_released: only now may the blocks be reused. Rows that
  // still arrive for `id` are dropped.
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

  // `ranks` are lost (the coordinator's word): nothing from them is waited
  // on any more. Any thread.
  virtual void peers_lost(std::span<const Rank> ranks) = 0;
  // Any thread.
  virtual Counters counters() const = 0;
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
