// The Cap'n Proto front's admin door (common/duet.capnp, Gateway.adminChallenge
// and Gateway.admin): one per connection. A client asks for a nonce, answers
// it with the cluster key's proof (common/net/admin_proof.h), and gets the
// `Admin` capability, whose calls go to the cluster (coordinator/cluster_admin.h).
// Each nonce is good for one answer; a wrong one is refused as
// unauthenticated, and so is every answer on a server that has no cluster key
// or is no cluster (single-process `duet serve`), with the reason.
//
// Loop thread only, as every capnp object of the front.
#pragma once

#include <optional>

#include "common/duet.capnp.h"
#include "common/net/admin_proof.h"
#include "coordinator/cluster_admin.h"

namespace duet {

class AdminDoor final {
 public:
  // Either may be null: then every answer is refused, saying which is missing.
  // Both outlive the door.
  AdminDoor(ClusterAdmin* admin, const ClusterKey* key) : admin_(admin), key_(key) {}

  // A fresh nonce, replacing any this connection was given before.
  void challenge(rpc::Gateway::AdminChallengeResults::Builder results);
  // Checks `proof` against the outstanding nonce (which it consumes), then
  // fills `result` with the Admin capability or a typed error.
  void open(capnp::Data::Reader proof, rpc::AdminResult::Builder result);

 private:
  ClusterAdmin* admin_;
  const ClusterKey* key_;
  std::optional<AdminNonce> nonce_;
};

}  // namespace duet
