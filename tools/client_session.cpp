#include "tools/client_session.h"

#include <kj/debug.h>

#include <csignal>
#include <utility>

namespace duet::client {
namespace {

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

// The client's side of a request's TokenSink: hands each chunk's text to the
// caller and fulfils the outcome on done(). Owned by the RPC system (the
// server holds it); if the server drops it without done(), the outcome fails
// as DISCONNECTED, so a broken connection cannot hang us.
class StreamingSink final : public rpc::TokenSink::Server {
 public:
  StreamingSink(std::function<void(std::string_view)> on_text,
                kj::Own<kj::PromiseFulfiller<kj::Own<GenerateOutcome>>> done)
      : on_text_(std::move(on_text)), done_(kj::mv(done)) {}
  ~StreamingSink() noexcept(false) {
    // Dropped without done(): the connection went away.
    if (done_->isWaiting()) {
      done_->reject(KJ_EXCEPTION(DISCONNECTED, "the server dropped the request"));
    }
  }

 protected:
  kj::Promise<void> write(WriteContext context) override {
    const auto text = context.getParams().getChunk().getText();
    const std::string_view piece(text.cStr(), text.size());
    text_ += piece;
    on_text_(piece);
    return kj::READY_NOW;
  }

  kj::Promise<void> done(DoneContext context) override {
    const auto finish = context.getParams().getFinish();
    // On the heap: the promise carries a pointer.
    auto outcome = kj::heap<GenerateOutcome>();
    outcome->reason = finish.getReason();
    const auto t = finish.getTimings();
    outcome->timings = {t.getQueueMs(),     t.getTtftMs(),       t.getTpotMs(),
                        t.getE2eMs(),       t.getPromptTokens(), t.getCompletionTokens(),
                        t.getCachedTokens()};
    if (outcome->reason == rpc::FinishReason::ERROR) {
      outcome->error_kind = std::string(error_kind_name(finish.getError().getKind()));
      outcome->error_message = to_string(finish.getError().getMessage());
    }
    outcome->text = std::move(text_);
    if (done_->isWaiting()) done_->fulfill(kj::mv(outcome));
    return kj::READY_NOW;
  }

 private:
  std::function<void(std::string_view)> on_text_;
  kj::Own<kj::PromiseFulfiller<kj::Own<GenerateOutcome>>> done_;
  std::string text_;
};

}  // namespace

std::string_view error_kind_name(rpc::ErrorKind kind) {
  switch (kind) {
    case rpc::ErrorKind::INVALID_ARGUMENT:
      return "invalid_argument";
    case rpc::ErrorKind::TOO_LONG:
      return "too_long";
    case rpc::ErrorKind::OVERLOADED:
      return "overloaded";
    case rpc::ErrorKind::UNAVAILABLE:
      return "unavailable";
    case rpc::ErrorKind::INTERNAL:
      return "internal";
    case rpc::ErrorKind::UNAUTHENTICATED:
      return "unauthenticated";
    case rpc::ErrorKind::NOT_FOUND:
      return "not_found";
  }
  return "unknown_error";
}

std::string_view finish_reason_name(rpc::FinishReason reason) {
  switch (reason) {
    case rpc::FinishReason::STOP:
      return "stop";
    case rpc::FinishReason::LENGTH:
      return "length";
    case rpc::FinishReason::CANCELLED:
      return "cancelled";
    case rpc::FinishReason::ERROR:
      return "error";
  }
  return "unknown";
}

Endpoint parse_endpoint(std::string_view text) {
  const auto bad = [&](const char* why) {
    return ClientError(kExitRefused, "invalid_argument",
                       "--connect " + std::string(text) + ": " + why + " (expected HOST:PORT)");
  };
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) throw bad("no port");
  Endpoint endpoint;
  endpoint.host = std::string(text.substr(0, colon));
  if (endpoint.host.size() >= 2 && endpoint.host.front() == '[' && endpoint.host.back() == ']') {
    endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);
  }
  if (endpoint.host.empty()) throw bad("no host");
  const std::string_view port = text.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string_view::npos) {
    throw bad("bad port");
  }
  const int value = std::stoi(std::string(port));
  if (value < 1 || value > 65535) throw bad("port out of range");
  endpoint.port = static_cast<uint16_t>(value);
  return endpoint;
}

template <typename T>
T Session::wait(kj::Promise<T>&& promise) {
  try {
    return promise.wait(io_.waitScope);
  } catch (const kj::Exception& e) {
    if (e.getType() == kj::Exception::Type::DISCONNECTED) {
      throw ClientError(kExitConnection, "connection", e.getDescription().cStr());
    }
    throw ClientError(kExitRefused, "internal", e.getDescription().cStr());
  }
}

Session::Session(kj::AsyncIoContext& io, const Endpoint& endpoint, const std::string& api_key)
    : io_(io) {
  // kj reads a host with colons as IPv6 only in brackets.
  const std::string host =
      endpoint.host.find(':') != std::string::npos ? "[" + endpoint.host + "]" : endpoint.host;
  try {
    auto address = io_.provider->getNetwork().parseAddress(host, endpoint.port).wait(io_.waitScope);
    stream_ = address->connect().wait(io_.waitScope);
  } catch (const kj::Exception& e) {
    throw ClientError(kExitConnection, "connection",
                      "cannot connect to " + host + ":" + std::to_string(endpoint.port) + ": " +
                          e.getDescription().cStr());
  }
  rpc_ = kj::heap<capnp::TwoPartyClient>(*stream_);
  auto gateway = rpc_->bootstrap().castAs<rpc::Gateway>();

  auto version = wait(gateway.versionRequest().send());
  if (version.getProtocolVersion() != rpc::PROTOCOL_VERSION) {
    throw ClientError(kExitConnection, "protocol",
                      "server speaks protocol " + std::to_string(version.getProtocolVersion()) +
                          ", this client " + std::to_string(rpc::PROTOCOL_VERSION));
  }
  auto login = gateway.loginRequest();
  login.setApiKey(api_key);
  auto response = wait(login.send());
  const auto result = response.getResult();
  if (result.isError()) {
    throw ClientError(kExitRefused, std::string(error_kind_name(result.getError().getKind())),
                      to_string(result.getError().getMessage()));
  }
  inference_ = result.getInference();
}

GenerateOutcome Session::generate(const std::function<void(rpc::GenerateRequest::Builder)>& fill,
                                  const std::function<void(std::string_view)>& on_text) {
  auto done = kj::newPromiseAndFulfiller<kj::Own<GenerateOutcome>>();
  auto request = inference_.generateRequest();
  fill(request.initRequest());
  request.setSink(kj::heap<StreamingSink>(on_text, kj::mv(done.fulfiller)));
  auto response = wait(request.send());
  const auto result = response.getResult();
  if (result.isError()) {
    throw ClientError(kExitRefused, std::string(error_kind_name(result.getError().getKind())),
                      to_string(result.getError().getMessage()));
  }
  // Held until done(): dropping it would cancel the request.
  rpc::RequestHandle::Client handle = result.getStarted().getHandle();

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
  return wait(inference_.statsRequest().send());
}

capnp::Response<rpc::Inference::ModelInfoResults> Session::model_info() {
  return wait(inference_.modelInfoRequest().send());
}

}  // namespace duet::client
