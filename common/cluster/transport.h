// How bytes move between the ranks of a cluster, in the word of the flags
// that choose it (--kv-transport, --control-transport): MPI, over the job's
// own communicator, or TCP, over sockets of Duet's own that a dead peer
// cannot wedge (docs/FAILURES.md).
#pragma once

#include <string_view>

#include "common/error.h"

namespace duet {

enum class Transport { kMpi, kTcp };

constexpr std::string_view transport_name(Transport transport) {
  return transport == Transport::kTcp ? "tcp" : "mpi";
}

// A flag's value: "mpi", "tcp", or "auto" (which gives `automatic`). Throws
// kInvalidArgument for anything else.
inline Transport parse_transport(std::string_view flag, Transport automatic) {
  if (flag == "mpi") return Transport::kMpi;
  if (flag == "tcp") return Transport::kTcp;
  if (flag == "auto") return automatic;
  throw Error(ErrorKind::kInvalidArgument,
              format("unknown transport '{}' (mpi, tcp or auto)", flag));
}

}  // namespace duet
