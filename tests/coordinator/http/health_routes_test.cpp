// The HTTP front's health routes without a socket: every state on every
// route, the status a load balancer or a probe acts on and the body's words.
#include "coordinator/http/health_routes.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace duet {
namespace {

Service::Health health(Service::HealthState state, int n_lost = 0) {
  Service::Health h;
  h.state = state;
  h.instances.n_instances = 3;
  h.instances.n_lost = n_lost;
  return h;
}

TEST(HealthRoutes, OnlyTheThreeRoutesAreHealthRoutes) {
  EXPECT_TRUE(http_health::is_health_route("/health"));
  EXPECT_TRUE(http_health::is_health_route("/health/live"));
  EXPECT_TRUE(http_health::is_health_route("/health/ready"));
  EXPECT_FALSE(http_health::is_health_route("/health/"));
  EXPECT_FALSE(http_health::is_health_route("/healthz"));
  EXPECT_FALSE(http_health::is_health_route("/metrics"));
}

TEST(HealthRoutes, EachStateOnEachRoute) {
  using State = Service::HealthState;
  struct Case {
    State state;
    int health, live, ready;
  };
  for (const Case& c :
       {Case{State::kOk, 200, 200, 200}, Case{State::kDegraded, 200, 200, 200},
        Case{State::kDraining, 503, 200, 503}, Case{State::kUnavailable, 503, 200, 503}}) {
    const std::string_view name = Service::health_state_name(c.state);
    const Service::Health h = health(c.state, c.state == State::kDegraded ? 1 : 0);
    EXPECT_EQ(http_health::answer("/health", h).status, c.health) << name;
    EXPECT_EQ(http_health::answer("/health/live", h).status, c.live) << name;
    EXPECT_EQ(http_health::answer("/health/ready", h).status, c.ready) << name;
    EXPECT_NE(http_health::answer("/health/live", h).body.find(fmt::format("\"{}\"", name)),
              std::string::npos)
        << name;
  }
}

TEST(HealthRoutes, BodiesCountJoinsAndLeavesOnceTheMembershipChanged) {
  Service::Health h = health(Service::HealthState::kOk);
  h.instances.joins = 2;
  h.instances.leaves = 1;
  EXPECT_EQ(http_health::answer("/health", h).body,
            R"({"status":"ok","lost_instances":0,"instances":3,"joined":2,"left":1})");
  h.state = Service::HealthState::kDegraded;
  h.instances.n_lost = 1;
  EXPECT_EQ(http_health::answer("/health", h).body,
            R"({"status":"degraded","lost_instances":1,"instances":3,"joined":2,"left":1})");
}

TEST(HealthRoutes, BodiesNameTheStateAndTheLostInstances) {
  EXPECT_EQ(http_health::answer("/health", health(Service::HealthState::kOk)).body,
            R"({"status":"ok"})");
  EXPECT_EQ(http_health::answer("/health", health(Service::HealthState::kDegraded, 1)).body,
            R"({"status":"degraded","lost_instances":1,"instances":3})");
  EXPECT_EQ(http_health::answer("/health/ready", health(Service::HealthState::kDraining)).body,
            R"({"status":"draining","lost_instances":0,"instances":3})");
}

}  // namespace
}  // namespace duet
