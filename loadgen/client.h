// What the runner needs of a protocol: tokenize the corpus, send a request
// and fill in its record. Implemented over Cap'n Proto (rpc_client.h) and
// over OpenAI-compatible HTTP (http_client.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loadgen/record.h"

namespace duet::loadgen {

using Clock = std::chrono::steady_clock;

// The run's one time origin: every RequestRecord time is seconds since it.
struct RunClock {
  Clock::time_point origin = Clock::now();
  double now() const { return std::chrono::duration<double>(Clock::now() - origin).count(); }
};

// One request as the runner hands it to a client.
struct ClientRequest {
  std::vector<int32_t> prompt;  // token ids, sent as is
  int64_t max_tokens = 0;       // generated exactly (ignore EOS), greedy
  bool stream = true;           // false: one whole response (no per-token times)
};

// Called exactly once per request with its completed record, on the client's
// own thread; it must return quickly (hand the record over and go).
using RecordDone = std::function<void(RequestRecord)>;

// A connection (or pool of them) to one server. Non-copyable; owns a thread.
class Client {
 public:
  virtual ~Client() = default;

  // The server's tokens for `text`, no special tokens added. Blocking; for
  // the set-up before a run. Throws duet::Error when the server cannot.
  virtual std::vector<int32_t> tokenize(const std::string& text) = 0;

  // Sends `request` as soon as possible; callable from any thread. `record`
  // arrives with index, scheduled and the requested lengths filled in; the
  // client stamps `sent` (on its thread, as the request leaves), the token
  // times, `finished`, the outcome and the server's timings, all on `clock`.
  // Failures (refusals, HTTP errors, broken connections, timeouts) are
  // outcomes in the record, never exceptions.
  virtual void send(ClientRequest request, RequestRecord record, const RunClock& clock,
                    RecordDone done) = 0;

  // What to name the server in reports ("duet rpc 127.0.0.1:7433", a URL).
  virtual std::string describe() const = 0;
};

}  // namespace duet::loadgen
