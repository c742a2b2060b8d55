// Proof of the cluster key for an admin call over the Cap'n Proto front
// (common/duet.capnp, Gateway.adminChallenge and Gateway.admin): the server
// hands out a fresh nonce, the client answers HMAC-SHA256(key, "duet admin" ||
// nonce), and the key itself never travels. Each nonce is good for one answer:
// the server forgets it as soon as an answer comes, right or wrong, so a proof
// overheard once opens nothing.
//
// Values only, any thread.
#pragma once

#include <array>
#include <cstddef>
#include <span>

#include "common/net/cluster_auth.h"

namespace duet {

using AdminNonce = std::array<std::byte, 32>;
using AdminProof = std::array<std::byte, 32>;

// 32 bytes from OpenSSL's generator; throws duet::Error (kInternal) when it has none.
AdminNonce fresh_admin_nonce();
// HMAC-SHA256(key, "duet admin" || nonce).
AdminProof admin_proof(const ClusterKey& key, std::span<const std::byte> nonce);
// Whether `proof` is admin_proof(key, nonce), compared in constant time; false
// for a proof of another length.
bool admin_proof_matches(const ClusterKey& key, std::span<const std::byte> nonce,
                         std::span<const std::byte> proof);

}  // namespace duet
