// How KV moves between a prefill instance and a decode instance
// (disaggregated serving). The MPI implementation is
// worker/mpi_kv_transport.h; a GPU one (NCCL) fits the same interface.
//
// The protocol, for one request (ids are the coordinator's RequestIds):
//   decode:  reserves the prompt's blocks, then start_import(prefill peer,
//            order, blocks): the transport records where the rows go and
//            sends the PrefillOrder.
//   prefill: on_order -> computes the prompt; after each layer of each chunk
//            send_rows (the rows are copied out at once, so the prefill side
//            may reuse its blocks right away); at the end send_handoff (the
//            first token), or send_handoff with an error.
//   decode:  the transport writes each layer's rows into the reserved blocks
//            as they come; after the handoff, on_complete. Or on_failed (the
//            prefill side failed, the deadline passed, a checksum did not
//            match): nothing more is written.
//   cancel:  abort_import; the transport tells the prefill side (on_cancel),
//            stops writing, then on_released: only now may the blocks be
//            reused. Rows that still arrive for it are dropped.
//
// Rows travel in the packed layout of worker/kv_rows.h, one message per layer
// per chunk. Messages between two peers arrive in the order they were sent,
// so a handoff is behind every row of its request.
//
// Threads: start_import, abort_import, send_rows and send_handoff from the
// instance's engine thread; handlers run on the transport's thread and must
// be quick (they queue work for the engine thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>

#include "common/serving.h"
#include "worker/kv_cache.h"

namespace duet {

class KvTransport {
 public:
  using Clock = std::chrono::steady_clock;

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
  };

  virtual ~KvTransport() = default;

  // Before the first transfer.
  virtual void set_handlers(Handlers handlers) = 0;

  // Decode side. The rows of positions [order.send_from, prompt length) will
  // be written into `cache`, blocks `block_table` (copied), until on_complete,
  // on_failed or on_released. Past `deadline` the import fails.
  virtual void start_import(int prefill_peer, const PrefillOrder& order, KvCache& cache,
                            std::span<const int32_t> block_table, Clock::time_point deadline) = 0;
  virtual void abort_import(RequestId id) = 0;
  // Ends every import that writes into `cache` at once, without handlers
  // (the cache's owner is going away); when it returns nothing writes into
  // `cache` any more. Any thread.
  virtual void forget_imports(const KvCache& cache) = 0;

  // Prefill side. Copies rows [pos0, pos0 + n) of `layer` out of `cache` now
  // and queues them for `decode_peer`.
  virtual void send_rows(int decode_peer, RequestId id, int64_t layer, int64_t pos0, int64_t n,
                         const KvCache& cache, std::span<const int32_t> block_table) = 0;
  virtual void send_handoff(int decode_peer, const KvHandoff& handoff) = 0;
};

}  // namespace duet
