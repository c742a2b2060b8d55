// The order in which a process hands its messages to MPI. The control
// channel's communication thread posts every message of the process, its
// own and those of the endpoints attached to it (the KV transfer), through
// one SendQueue (common/control_plane/control_channel.h).
//
// Two lanes:
// - control: the control plane's messages and the KV transfer's headers,
//   orders, cancels and handoffs (later, heartbeats). They leave in the order
//   they were queued, each ahead of every bulk message still queued: a
//   cancel or a handoff never waits behind KV payloads.
// - bulk: KV payloads. They leave per destination in the order queued, with
//   at most `bulk_window` bytes of them in flight to one destination at a
//   time (a larger message goes alone): a slow or dead destination holds up
//   its own payloads only, and MPI never has more payload than that queued
//   to a destination ahead of a control message.
//
// Pure bookkeeping, no MPI: not thread-safe (the channel guards it).
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "common/error.h"

namespace duet {

enum class SendLane { kControl, kBulk };

// `Message` has the members `int destination`, `SendLane lane` and
// `std::vector<std::byte> bytes`.
template <typename Message>
class SendQueue {
 public:
  explicit SendQueue(size_t bulk_window) : bulk_window_(bulk_window) {
    DUET_REQUIRE(bulk_window > 0, "send queue: the bulk window must be positive");
  }

  void push(Message message) {
    if (message.lane == SendLane::kControl) {
      control_.push_back(std::move(message));
    } else {
      bulk_[message.destination].push_back(std::move(message));
    }
  }

  // Moves the messages to post now to the end of `out`, in posting order:
  // every queued control message, then the bulk messages that each
  // destination's window admits. Those count as in flight until sent().
  void take(std::vector<Message>& out) {
    for (Message& message : control_) out.push_back(std::move(message));
    control_.clear();
    for (auto it = bulk_.begin(); it != bulk_.end();) {
      std::deque<Message>& queued = it->second;
      size_t& in_flight = in_flight_bytes_[it->first];
      while (!queued.empty() &&
             (in_flight == 0 || in_flight + queued.front().bytes.size() <= bulk_window_)) {
        in_flight += queued.front().bytes.size();
        out.push_back(std::move(queued.front()));
        queued.pop_front();
      }
      if (in_flight == 0) in_flight_bytes_.erase(it->first);
      it = queued.empty() ? bulk_.erase(it) : std::next(it);
    }
  }

  // A bulk message of `bytes` bytes to `destination`, taken earlier, is done
  // (sent, or abandoned): its destination's window has room again.
  void sent(int destination, size_t bytes) {
    auto it = in_flight_bytes_.find(destination);
    if (it == in_flight_bytes_.end()) return;  // an empty message
    DUET_ASSERT(it->second >= bytes, "send queue: {} bytes done to rank {}, {} in flight", bytes,
                destination, it->second);
    it->second -= bytes;
    if (it->second == 0) in_flight_bytes_.erase(it);
  }

  // Drops the queued messages `drop` selects; returns how many.
  template <typename Predicate>
  size_t erase_if(Predicate drop) {
    size_t n = std::erase_if(control_, drop);
    for (auto it = bulk_.begin(); it != bulk_.end();) {
      n += std::erase_if(it->second, drop);
      it = it->second.empty() ? bulk_.erase(it) : std::next(it);
    }
    return n;
  }

  // How many queued messages `match` selects.
  template <typename Predicate>
  size_t count_if(Predicate match) const {
    size_t n = 0;
    for (const Message& message : control_) n += match(message) ? 1 : 0;
    for (const auto& [destination, queued] : bulk_) {
      for (const Message& message : queued) n += match(message) ? 1 : 0;
    }
    return n;
  }

  // Whether bulk bytes are in flight to any destination.
  bool bulk_in_flight() const { return !in_flight_bytes_.empty(); }

 private:
  const size_t bulk_window_;
  std::deque<Message> control_;
  std::map<int, std::deque<Message>> bulk_;  // by destination
  std::map<int, size_t> in_flight_bytes_;    // bulk bytes taken and not yet sent(), by destination
};

}  // namespace duet
