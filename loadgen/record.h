// What duet-bench records of one request, whatever protocol carried it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace duet::loadgen {

// Times are seconds since the start of the run (steady clock).
struct RequestRecord {
  int64_t index = 0;     // in arrival order
  double scheduled = 0;  // when the arrival process said to send it
  double sent = 0;       // when it was sent (later than scheduled if the client lagged)
  std::optional<double> first_token;  // first streamed token (text chunk) received
  std::vector<double> token_times;    // every streamed chunk, first included
  double finished = 0;                // last byte of the response received
  int64_t prompt_tokens = 0;          // requested
  int64_t output_tokens = 0;          // requested
  int64_t received_tokens = 0;        // as the server counted them (usage / timings)
  bool ok = false;
  std::string error_kind;  // when !ok: "overloaded", "http_429", "connection", ...
  std::string error_message;
  // The server's own timings of the request, when it reports them (Duet does).
  std::optional<double> server_ttft;
  std::optional<double> server_tpot;
  std::optional<double> server_e2e;
};

}  // namespace duet::loadgen
