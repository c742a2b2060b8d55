#include "common/net/admin_proof.h"

#include <openssl/crypto.h>
#include <openssl/rand.h>

#include <string_view>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

// Apart from the handshake's labels ("duet listener", "duet dialer"), so that
// no proof of one can stand for the other.
constexpr std::string_view kAdminLabel = "duet admin";

}  // namespace

AdminNonce fresh_admin_nonce() {
  AdminNonce nonce;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1)
    throw Error(ErrorKind::kInternal, "admin call: no random bytes from OpenSSL");
  return nonce;
}

AdminProof admin_proof(const ClusterKey& key, std::span<const std::byte> nonce) {
  std::vector<std::byte> message;
  const auto label = std::as_bytes(std::span(kAdminLabel.data(), kAdminLabel.size()));
  message.insert(message.end(), label.begin(), label.end());
  message.insert(message.end(), nonce.begin(), nonce.end());
  return key.sign(message);
}

bool admin_proof_matches(const ClusterKey& key, std::span<const std::byte> nonce,
                         std::span<const std::byte> proof) {
  const AdminProof expected = admin_proof(key, nonce);
  return proof.size() == expected.size() &&
         CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) == 0;
}

}  // namespace duet
