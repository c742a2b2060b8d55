// The admin call's proof (common/net/admin_proof.h): HMAC(key, "duet admin" ||
// nonce) as documented, checked in constant time, and refused for another
// key, another nonce, a truncated proof; nonces differ from call to call.
#include "common/net/admin_proof.h"

#include <gtest/gtest.h>

#include <set>
#include <string_view>
#include <vector>

namespace duet {
namespace {

const ClusterKey kKey = ClusterKey::from_bytes("an-admin-test-key-of-at-least-32-bytes-0123");
const ClusterKey kOtherKey = ClusterKey::from_bytes("another-admin-test-key-of-32-bytes-or-more!");

TEST(AdminProof, IsTheHmacOfTheLabelAndNonce) {
  const AdminNonce nonce = fresh_admin_nonce();
  std::vector<std::byte> message;
  for (char c : std::string_view("duet admin")) message.push_back(static_cast<std::byte>(c));
  message.insert(message.end(), nonce.begin(), nonce.end());
  EXPECT_EQ(admin_proof(kKey, nonce), kKey.sign(message));
  EXPECT_TRUE(admin_proof_matches(kKey, nonce, admin_proof(kKey, nonce)));
}

TEST(AdminProof, AnotherKeyNonceOrLengthIsRefused) {
  const AdminNonce nonce = fresh_admin_nonce();
  const AdminProof proof = admin_proof(kKey, nonce);
  EXPECT_FALSE(admin_proof_matches(kKey, nonce, admin_proof(kOtherKey, nonce)));
  EXPECT_FALSE(admin_proof_matches(kOtherKey, nonce, proof));
  AdminNonce other = nonce;
  other[31] ^= std::byte{1};
  EXPECT_FALSE(admin_proof_matches(kKey, other, proof));
  EXPECT_FALSE(admin_proof_matches(kKey, nonce, std::span(proof).first(31)));
  EXPECT_FALSE(admin_proof_matches(kKey, nonce, {}));
  AdminProof flipped = proof;
  flipped[0] ^= std::byte{0x80};
  EXPECT_FALSE(admin_proof_matches(kKey, nonce, flipped));
}

TEST(AdminProof, NoncesAreFresh) {
  std::set<AdminNonce> seen;
  for (int i = 0; i < 64; ++i) EXPECT_TRUE(seen.insert(fresh_admin_nonce()).second);
}

}  // namespace
}  // namespace duet
