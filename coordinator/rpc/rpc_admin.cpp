#include "coordinator/rpc/rpc_admin.h"

#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include <span>
#include <string>

#include "common/error.h"
#include "coordinator/rpc/rpc_convert.h"

namespace duet {
namespace {

// Admin calls, for a client that proved the cluster key.
class AdminImpl final : public rpc::Admin::Server {
 public:
  explicit AdminImpl(ClusterAdmin& admin) : admin_(admin) {}

 protected:
  kj::Promise<void> setRole(SetRoleContext context) override {
    const auto params = context.getParams();
    auto result = context.getResults().initResult();
    try {
      const InstanceRole role =
          parse_instance_role(std::string(params.getRole().cStr(), params.getRole().size()));
      const std::string done = admin_.change_role(params.getInstance(), role);
      spdlog::info("admin: {}", done);
      result.setDone(done);
    } catch (const Error& e) {
      spdlog::warn("admin: refused: {}", e.what());
      rpc_convert::fill_error(result.initError(), rpc_convert::serve_error_kind_of(e.kind()),
                              e.what());
    } catch (const std::exception& e) {
      rpc_convert::fill_error(result.initError(), ServeErrorKind::kInternal, e.what());
    }
    return kj::READY_NOW;
  }

 private:
  ClusterAdmin& admin_;
};

}  // namespace

void AdminDoor::challenge(rpc::Gateway::AdminChallengeResults::Builder results) {
  nonce_ = fresh_admin_nonce();
  results.setNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce_->data()), nonce_->size()));
}

void AdminDoor::open(capnp::Data::Reader proof, rpc::AdminResult::Builder result) {
  const std::optional<AdminNonce> nonce = nonce_;
  nonce_.reset();  // one answer per nonce, right or wrong
  auto refuse = [&](ServeErrorKind kind, const std::string& why) {
    spdlog::warn("admin: refused a client: {}", why);
    rpc_convert::fill_error(result.initError(), kind, why);
  };
  if (key_ == nullptr)
    return refuse(ServeErrorKind::kUnauthenticated,
                  "this server takes no admin calls: it was started without --cluster-key FILE");
  if (!nonce)
    return refuse(ServeErrorKind::kUnauthenticated,
                  "no challenge to answer: call adminChallenge first, once per admin call");
  const auto given = std::as_bytes(std::span(proof.begin(), proof.size()));
  if (!admin_proof_matches(*key_, *nonce, given))
    return refuse(ServeErrorKind::kUnauthenticated, "the cluster key does not match");
  if (admin_ == nullptr)
    return refuse(ServeErrorKind::kInvalidArgument,
                  "this server is a single instance: roles exist in a cluster only");
  result.setAdmin(kj::heap<AdminImpl>(*admin_));
}

}  // namespace duet
