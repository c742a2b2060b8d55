#include "common/timer_slack.h"

#if defined(__linux__)
#include <sys/prctl.h>
#endif

namespace duet {

bool set_thread_timer_slack(std::chrono::nanoseconds slack) {
#if defined(__linux__)
  // PR_SET_TIMERSLACK with 0 would mean "the default" again: at least 1 ns.
  const auto ns = static_cast<unsigned long>(slack.count() > 0 ? slack.count() : 1);
  return prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0;
#else
  (void)slack;
  return false;
#endif
}

}  // namespace duet
