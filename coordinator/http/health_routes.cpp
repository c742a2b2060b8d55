#include "coordinator/http/health_routes.h"

#include <fmt/format.h>

namespace duet::http_health {

bool is_health_route(std::string_view path) {
  return path == "/health" || path == "/health/live" || path == "/health/ready";
}

Answer answer(std::string_view path, const Service::Health& health) {
  const bool ready = Service::ready(health.state);
  const int status = path == "/health/live" || ready ? 200 : 503;
  const InstanceClient::Health& instances = health.instances;
  // Once the membership changed, how: instances that joined, and that left
  // after draining (their count stays in "instances"); then role changes.
  std::string membership =
      instances.joins > 0 || instances.leaves > 0
          ? fmt::format(R"(,"joined":{},"left":{})", instances.joins, instances.leaves)
          : std::string();
  if (instances.role_changes > 0)
    membership += fmt::format(R"(,"role_changes":{})", instances.role_changes);
  if (health.state == Service::HealthState::kOk) {
    if (membership.empty()) return {status, R"({"status":"ok"})"};
    return {status, fmt::format(R"({{"status":"ok","lost_instances":{},"instances":{}{}}})",
                                instances.n_lost, instances.n_instances, membership)};
  }
  return {status, fmt::format(R"({{"status":"{}","lost_instances":{},"instances":{}{}}})",
                              Service::health_state_name(health.state), instances.n_lost,
                              instances.n_instances, membership)};
}

}  // namespace duet::http_health
