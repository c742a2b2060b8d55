// The mapping between the Cap'n Proto schema (common/duet.capnp) and the
// service's plain types (coordinator/service.h). Pure functions, any thread;
// used by the RPC front only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/duet.capnp.h"
#include "common/error.h"
#include "coordinator/service.h"

namespace duet::rpc_convert {

// Saturates to [0, 2^32 - 1] (counters and sizes on the wire are UInt32).
uint32_t clamp_u32(int64_t value);

std::string to_string(capnp::Text::Reader text);
std::vector<int32_t> to_vector(capnp::List<int32_t>::Reader list);
// `out` has values.size() elements.
void fill_list(capnp::List<int32_t>::Builder out, const std::vector<int32_t>& values);

rpc::ErrorKind to_rpc(ServeErrorKind kind);
rpc::FinishReason to_rpc(ServeFinish finish);
// The protocol's kind for an exception that escaped a handler.
ServeErrorKind serve_error_kind_of(ErrorKind kind);

void fill_error(rpc::Error::Builder out, ServeErrorKind kind, const std::string& message);
// Timings go on the wire in milliseconds.
void fill_finish(rpc::Finish::Builder out, ServeFinish finish, const RequestTimings& timings,
                 const std::optional<ServeError>& error);
void fill_model_info(rpc::ModelInfo::Builder out, const ModelSummary& model);
void fill_stats(rpc::Stats::Builder out, const ServiceStats& stats);

// The service's form of a wire request (the model name is the caller's to
// check). An unknown prompt form is kInvalidArgument; readers throw
// kj::Exception on a malformed message.
Result<ServeRequest> to_serve_request(rpc::GenerateRequest::Reader in);

}  // namespace duet::rpc_convert
