// What an administrator may change in a running cluster: reached over the
// Cap'n Proto front's Admin capability, which only a client proving the
// cluster key gets (common/net/admin_proof.h; `duet-client set-role`).
#pragma once

#include <cstdint>
#include <string>

#include "common/cluster/cluster_spec.h"

namespace duet {

class ClusterAdmin {
 public:
  virtual ~ClusterAdmin() = default;
  // Instance `instance` (its index in stats, /health and /metrics) takes
  // `role`: it gets no new work of its old role, finishes what it runs, then
  // takes work of the new one; nothing it runs is moved or lost. Returns one
  // line saying what happens. Throws duet::Error (kInvalidArgument) with a
  // one-line reason when it cannot (see the implementation's rules).
  // Any thread.
  virtual std::string change_role(int64_t instance, InstanceRole role) = 0;
};

}  // namespace duet
