// The HTTP front's health routes, as answers without I/O:
//   GET /health        the state: 200 while ok or degraded, 503 while draining
//                      or unavailable (load balancers stop sending)
//   GET /health/live   200 while the process answers, draining included
//                      (a liveness probe must not kill a server finishing its work)
//   GET /health/ready  200 only while new requests are taken (ok, degraded);
//                      503 while draining or unavailable
// Every body is {"status": STATE, "lost_instances": N, "instances": N}, STATE
// being Service::health_state_name ({"status":"ok"} alone when ok). None
// needs the API key.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "coordinator/service.h"

namespace duet::http_health {

struct Answer {
  int status = 200;  // 200 or 503
  std::string body;  // JSON
};

// Whether `path` is one of the routes above.
bool is_health_route(std::string_view path);
// The answer to GET `path` (a health route) for a service in `health`.
Answer answer(std::string_view path, const Service::Health& health);

}  // namespace duet::http_health
