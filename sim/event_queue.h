// The simulator's clock and its pending events.
//
// A discrete-event simulation: actions are scheduled at simulated times and
// run in time order; actions at the same time run in the order they were
// scheduled, so a run is deterministic. One thread.
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

#include "common/error.h"

namespace duet::sim {

class EventQueue {
 public:
  using Action = std::function<void()>;

  double now() const { return now_; }

  // Runs `action` at simulated time `at` (>= now()).
  void at(double at, Action action) {
    DUET_ASSERT(at >= now_, "an event scheduled in the past ({} < {})", at, now_);
    events_.push({at, next_seq_++, std::move(action)});
  }
  void after(double seconds, Action action) { at(now_ + seconds, std::move(action)); }

  // Runs the earliest pending event; false when there is none.
  bool run_one() {
    if (events_.empty()) return false;
    Event event = std::move(const_cast<Event&>(events_.top()));
    events_.pop();
    now_ = event.at;
    ++n_run_;
    event.action();
    return true;
  }
  void run() {
    while (run_one()) {
    }
  }

  bool empty() const { return events_.empty(); }
  int64_t n_run() const { return n_run_; }

 private:
  struct Event {
    double at = 0;
    uint64_t seq = 0;
    Action action;
  };
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.at != b.at ? a.at > b.at : a.seq > b.seq;
    }
  };

  double now_ = 0;
  uint64_t next_seq_ = 0;
  int64_t n_run_ = 0;
  std::priority_queue<Event, std::vector<Event>, Later> events_;
};

}  // namespace duet::sim
