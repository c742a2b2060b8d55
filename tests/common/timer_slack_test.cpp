// common/timer_slack.h: the slack is the calling thread's own, as the
// kernel reports it back, and other threads keep theirs.
#include "common/timer_slack.h"

#include <gtest/gtest.h>
#include <sys/prctl.h>

#include <thread>

namespace duet {
namespace {

long own_slack_ns() { return prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0); }

TEST(TimerSlack, SetsTheCallingThreadsSlack) {
  long mine = 0;
  long other = 0;
  const long before = own_slack_ns();
  std::thread worker([&] {
    ASSERT_TRUE(set_thread_timer_slack());
    mine = own_slack_ns();
    ASSERT_TRUE(set_thread_timer_slack(std::chrono::microseconds(7)));
    other = own_slack_ns();
  });
  worker.join();
  EXPECT_EQ(mine, kPollTimerSlack.count());
  EXPECT_EQ(other, 7000);
  EXPECT_EQ(own_slack_ns(), before);  // this thread's slack is untouched
}

TEST(TimerSlack, ZeroMeansTheSmallestNotTheDefault) {
  std::thread worker([] {
    ASSERT_TRUE(set_thread_timer_slack(std::chrono::nanoseconds(0)));
    EXPECT_EQ(own_slack_ns(), 1);
  });
  worker.join();
}

}  // namespace
}  // namespace duet
