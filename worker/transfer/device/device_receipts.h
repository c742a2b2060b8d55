// The receiving side's book of payloads in flight on a DeviceKvLink:
// which import each receipt writes into and how many rows it carries, and
// the outcomes (complete, failed, released) that must wait until an import
// has no receipt pending, because after them nothing may write its blocks.
//
// A pure state machine (no GPU, no wire): the transfer feeds it receipts
// as it starts them and as they finish, and ends imports through it.
// `Outcome` is the transfer's own record of how an import ended. Not
// thread-safe: the transfer's communication thread owns it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "common/serving.h"

namespace duet {

template <typename Outcome>
class DeviceReceipts {
 public:
  // A finished receipt of a live import: its rows to count.
  struct Rows {
    RequestId id;
    int source = 0;  // the sending rank
    int64_t n = 0;   // positions of one layer
    bool ok = true;  // false: the payload did not arrive (the connection broke)
  };

  // Receipt `receipt` writes `n` rows from `source` into import `id`.
  void add(uint64_t receipt, RequestId id, int source, int64_t n) {
    receipts_[receipt] = Rows{id, source, n, true};
    ++pending_[id];
  }

  // Receipt `receipt` finished (`ok`: its rows are in place). Returns the
  // rows when its import is still live; an ended import whose last receipt
  // this was releases its held outcome into `released`.
  std::optional<Rows> finish(uint64_t receipt, bool ok, std::vector<Outcome>& released) {
    auto it = receipts_.find(receipt);
    if (it == receipts_.end()) return std::nullopt;  // a drained payload: nobody's
    Rows rows = it->second;
    rows.ok = ok;
    receipts_.erase(it);
    auto pending = pending_.find(rows.id);
    if (--pending->second == 0) pending_.erase(pending);
    auto held = held_.find(rows.id);
    if (held != held_.end()) {
      if (!pending_.contains(rows.id)) {
        for (Outcome& outcome : held->second) released.push_back(std::move(outcome));
        held_.erase(held);
      }
      return std::nullopt;  // the import is over: its rows no longer count
    }
    return rows;
  }

  // Import `id` is over with `outcome`: delivered into `ready` now when no
  // receipt of it is pending, else held until the last one finishes. An
  // import may end twice (it failed, then its owner cancelled it): both
  // outcomes come, in order, as they would without device payloads.
  void end(RequestId id, Outcome outcome, std::vector<Outcome>& ready) {
    if (!pending_.contains(id)) {
      ready.push_back(std::move(outcome));
      return;
    }
    held_[id].push_back(std::move(outcome));
  }

  // Whether import `id` has payloads in flight (an import that still
  // expects rows cannot complete until they land).
  bool pending(RequestId id) const { return pending_.contains(id); }
  // Ended imports waiting for their receipts.
  bool holding() const { return !held_.empty(); }
  bool empty() const { return receipts_.empty() && held_.empty(); }

 private:
  std::map<uint64_t, Rows> receipts_;
  std::map<RequestId, int64_t> pending_;            // receipts per import
  std::map<RequestId, std::vector<Outcome>> held_;  // ended imports waiting for their receipts
};

}  // namespace duet
