#include "coordinator/http/health_routes.h"

#include <fmt/format.h>

namespace duet::http_health {

bool is_health_route(std::string_view path) {
  return path == "/health" || path == "/health/live" || path == "/health/ready";
}

Answer answer(std::string_view path, const Service::Health& health) {
  const bool ready = Service::ready(health.state);
  const int status = path == "/health/live" || ready ? 200 : 503;
  if (health.state == Service::HealthState::kOk) return {status, R"({"status":"ok"})"};
  return {status, fmt::format(R"({{"status":"{}","lost_instances":{},"instances":{}}})",
                              Service::health_state_name(health.state), health.instances.n_lost,
                              health.instances.n_instances)};
}

}  // namespace duet::http_health
