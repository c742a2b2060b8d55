// What the TCP KV transfer's tests share: a recorder of a transfer's handler
// calls (Calls, waited for with a deadline), a connected pair of sockets as
// start-up makes them, and a prompt's rows packed out of a cache.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "common/net/tcp_connect.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/kv_transfer.h"
#include "worker/transfer/tcp_kv_transfer.h"

namespace duet {

// Connected sockets between ranks `a` and `b` over loopback, as start-up
// makes them (connect_tcp_peers): {a's, b's}.
inline std::pair<int, int> connected_tcp_pair(int a, int b) {
  TcpListener a_listener, b_listener;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto a_side = std::async(std::launch::async, [&] {
    const TcpPeer peer{b, b_listener.address(), true, a < b};
    return connect_tcp_peers(a, &a_listener, std::span(&peer, 1), kKvPurpose, deadline);
  });
  const TcpPeer peer{a, a_listener.address(), true, b < a};
  std::map<int, int> b_side =
      connect_tcp_peers(b, &b_listener, std::span(&peer, 1), kKvPurpose, deadline);
  return {a_side.get().at(b), b_side.at(a)};
}

// A decode leader's import of a whole prompt of `n_prompt` tokens, every KV
// head of `cache` from `prefill`, into `blocks`, due `patience` from now.
inline void start_whole_import(KvTransfer& decode, int prefill, RequestId id, int64_t n_prompt,
                               KvCache& cache, std::vector<int32_t> blocks,
                               std::chrono::milliseconds patience) {
  PrefillOrder order;
  order.request.id = id;
  order.request.prompt.assign(static_cast<size_t>(n_prompt), 1);
  decode.start_import(prefill, order,
                      {id,
                       0,
                       n_prompt,
                       {{prefill, 0, cache.layout().n_kv_heads}},
                       0,
                       &cache,
                       std::move(blocks),
                       KvTransfer::Clock::now() + patience});
}

// Rows [0, n) of every KV head of `layer`, packed out of `cache`'s `blocks`.
inline std::vector<KvElement> packed_rows(const KvCache& cache, const std::vector<int32_t>& blocks,
                                          int64_t layer, int64_t n) {
  std::vector<KvElement> rows(
      static_cast<size_t>(packed_kv_elems(cache.layout(), n, all_kv_heads(cache.layout()))));
  pack_kv_rows(cache.layout(), cache.data(), layer, blocks, 0, n, all_kv_heads(cache.layout()),
               rows.data());
  return rows;
}

class Calls {
 public:
  KvTransfer::Handlers handlers() {
    KvTransfer::Handlers h;
    h.on_order = [this](int peer, PrefillOrder order) {
      note([&] { orders.push_back({peer, order}); });
    };
    h.on_cancel = [this](int, RequestId id) { note([&] { cancels.push_back(id); }); };
    h.on_complete = [this](RequestId id, const KvHandoff& handoff) {
      note([&] { completed.push_back({id, handoff}); });
    };
    h.on_failed = [this](RequestId id, const ServeError& error) {
      note([&] { failed.push_back({id, error}); });
    };
    h.on_released = [this](RequestId id) { note([&] { released.push_back(id); }); };
    h.on_quarantined = [this](RequestId id) { note([&] { quarantined.push_back(id); }); };
    return h;
  }
  bool wait(const std::function<bool()>& done) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, std::chrono::seconds(10), done);
  }

  std::vector<std::pair<int, PrefillOrder>> orders;
  std::vector<RequestId> cancels;
  std::vector<std::pair<RequestId, KvHandoff>> completed;
  std::vector<std::pair<RequestId, ServeError>> failed;
  std::vector<RequestId> released;
  std::vector<RequestId> quarantined;

 private:
  void note(const std::function<void()>& change) {
    {
      std::lock_guard lock(mutex_);
      change();
    }
    changed_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable changed_;
};

}  // namespace duet
