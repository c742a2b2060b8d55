// Short sleeps that last what they ask. Linux lets a thread's timed waits
// (nanosleep, poll, a condition variable's wait_for) end up to the thread's
// timer slack late, 50 us by default, so that wake-ups can be batched: a
// thread that polls every 20 us would poll every 70 us. Communication
// threads that poll a transfer in flight at a fixed interval (the KV
// transfers, the control channel) tighten their own slack; the raw MPI
// baselines in bench/ do the same, so both sides of the comparison sleep
// alike.
#pragma once

#include <chrono>

namespace duet {

// The slack the polling threads use.
inline constexpr std::chrono::nanoseconds kPollTimerSlack{1000};

// Sets the calling thread's timer slack (Linux; elsewhere nothing). Returns
// false when the kernel refused it (the thread then keeps its slack).
bool set_thread_timer_slack(std::chrono::nanoseconds slack = kPollTimerSlack);

}  // namespace duet
