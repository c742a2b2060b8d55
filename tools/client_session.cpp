#include "tools/client_session.h"

#include <csignal>
#include <optional>
#include <span>
#include <utility>

#include "common/net/admin_proof.h"

namespace duet::client {
namespace {

// Gathers a generation's text for its outcome, passing each chunk on, and
// fulfils the outcome at the finish; if the stream is dropped first, the
// outcome fails as DISCONNECTED, so a broken connection cannot hang us.
class OutcomeReceiver final : public StreamReceiver {
 public:
  OutcomeReceiver(std::function<void(std::string_view)> on_text,
                  kj::Own<kj::PromiseFulfiller<kj::Own<GenerateOutcome>>> done)
      : on_text_(std::move(on_text)), done_(kj::mv(done)) {}
  ~OutcomeReceiver() noexcept override {}  // kj members would make it noexcept(false)

  void on_text(std::string_view text) override {
    text_ += text;
    on_text_(text);
  }
  void on_finish(const Finish& finish) override {
    // On the heap: the promise carries a pointer.
    auto outcome = kj::heap<GenerateOutcome>();
    outcome->finish = finish;
    outcome->text = std::move(text_);
    if (done_->isWaiting()) done_->fulfill(kj::mv(outcome));
  }
  void on_dropped() override {
    if (done_->isWaiting()) {
      done_->reject(KJ_EXCEPTION(DISCONNECTED, "the server dropped the request"));
    }
  }

 private:
  std::function<void(std::string_view)> on_text_;
  kj::Own<kj::PromiseFulfiller<kj::Own<GenerateOutcome>>> done_;
  std::string text_;
};

}  // namespace

template <typename T>
T Session::wait(kj::Promise<T>&& promise) {
  try {
    return promise.wait(io_.waitScope);
  } catch (const kj::Exception& e) {
    throw rpc_error(e);
  }
}

GenerateOutcome Session::generate(const Prompt& prompt, const GenerateOptions& options,
                                  const std::function<void(std::string_view)>& on_text) {
  auto done = kj::newPromiseAndFulfiller<kj::Own<GenerateOutcome>>();
  GenerateCall call(connection_.inference(), prompt, options,
                    std::make_unique<OutcomeReceiver>(on_text, kj::mv(done.fulfiller)));
  GenerateStart start = wait(call.send());
  if (start.refused) throw RpcError(start.refused->kind, start.refused->message);
  // Held until done(): dropping it would cancel the request.
  rpc::RequestHandle::Client handle = kj::mv(start.handle);

  // The first Ctrl-C cancels on the server, whose done() then ends the wait;
  // a second one gives up waiting.
  bool interrupted = false;
  bool gave_up = false;
  kj::Promise<kj::Own<GenerateOutcome>> interrupt =
      io_.unixEventPort.onSignal(SIGINT)
          .then([&](siginfo_t) {
            interrupted = true;
            return handle.cancelRequest().send().ignoreResult();
          })
          .then([this]() { return io_.unixEventPort.onSignal(SIGINT); })
          .then([&](siginfo_t) {
            gave_up = true;
            return kj::heap<GenerateOutcome>();
          });
  kj::Own<GenerateOutcome> outcome = wait(done.promise.exclusiveJoin(kj::mv(interrupt)));
  if (gave_up) throw ClientError(kExitInterrupted, "interrupted", "stopped waiting for the server");
  outcome->interrupted = interrupted;
  return kj::mv(*outcome);
}

capnp::Response<rpc::Inference::StatsResults> Session::stats() {
  return wait(connection_.inference().statsRequest().send());
}

capnp::Response<rpc::Inference::ModelInfoResults> Session::model_info() {
  return wait(connection_.inference().modelInfoRequest().send());
}

rpc::HealthStatus Session::health() {
  return wait(connection_.inference().healthRequest().send()).getStatus();
}

std::string Session::set_role(const std::string& key_file, int instance, const std::string& role) {
  std::optional<ClusterKey> key;
  try {
    key = ClusterKey::from_file(key_file);
  } catch (const std::exception& e) {
    throw ClientError(kExitRefused, "invalid_argument", e.what());
  }
  rpc::Gateway::Client& gateway = connection_.gateway();
  auto challenge = wait(gateway.adminChallengeRequest().send());
  const auto nonce = challenge.getNonce();
  const AdminProof proof = admin_proof(*key, std::as_bytes(std::span(nonce.begin(), nonce.size())));
  auto open = gateway.adminRequest();
  open.setProof(kj::arrayPtr(reinterpret_cast<const kj::byte*>(proof.data()), proof.size()));
  auto opened = wait(open.send());
  const auto door = opened.getResult();
  if (door.isError()) {
    throw RpcError(std::string(error_kind_name(door.getError().getKind())),
                   door.getError().getMessage().cStr());
  }
  auto call = door.getAdmin().setRoleRequest();
  call.setInstance(instance);
  call.setRole(role);
  auto reply = wait(call.send());
  const auto result = reply.getResult();
  if (result.isError()) {
    throw RpcError(std::string(error_kind_name(result.getError().getKind())),
                   result.getError().getMessage().cStr());
  }
  return result.getDone().cStr();
}

}  // namespace duet::client
