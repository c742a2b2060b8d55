#include "client/connection.h"

#include <utility>

namespace duet::client {
namespace {

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

// kj, like a URL, reads a host with colons as IPv6 only in brackets.
std::string bracketed(const std::string& host) {
  return host.find(':') != std::string::npos ? "[" + host + "]" : host;
}

// Waits for `promise` on `io`'s loop; a kj exception becomes an RpcError.
template <typename T>
T wait(kj::AsyncIoContext& io, kj::Promise<T>&& promise) {
  try {
    return promise.wait(io.waitScope);
  } catch (const kj::Exception& e) {
    throw rpc_error(e);
  }
}

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

RpcError rpc_error(const kj::Exception& exception) {
  const bool disconnected = exception.getType() == kj::Exception::Type::DISCONNECTED;
  return RpcError(disconnected ? "connection" : "internal", exception.getDescription().cStr());
}

std::string Endpoint::describe() const { return bracketed(host) + ":" + std::to_string(port); }

Endpoint parse_endpoint(std::string_view text) {
  const auto bad = [&](const char* why) {
    return RpcError("invalid_argument",
                    "server address " + std::string(text) + ": " + why + " (expected HOST:PORT)");
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

Connection::Connection(kj::AsyncIoContext& io, const Endpoint& endpoint,
                       const std::string& api_key) {
  const std::string address = endpoint.describe();
  try {
    auto network_address = io.provider->getNetwork()
                               .parseAddress(bracketed(endpoint.host), endpoint.port)
                               .wait(io.waitScope);
    stream_ = network_address->connect().wait(io.waitScope);
  } catch (const kj::Exception& e) {
    throw RpcError("connection", "cannot connect to " + address + ": " + e.getDescription().cStr());
  }
  rpc_ = kj::heap<capnp::TwoPartyClient>(*stream_);
  gateway_ = rpc_->bootstrap().castAs<rpc::Gateway>();
  rpc::Gateway::Client& gateway = gateway_;

  auto version = wait(io, gateway.versionRequest().send());
  if (version.getProtocolVersion() != rpc::PROTOCOL_VERSION) {
    throw RpcError("protocol", address + " speaks protocol " +
                                   std::to_string(version.getProtocolVersion()) + ", this client " +
                                   std::to_string(rpc::PROTOCOL_VERSION));
  }
  auto login = gateway.loginRequest();
  login.setApiKey(api_key);
  auto response = wait(io, login.send());
  const auto result = response.getResult();
  if (result.isError()) {
    throw RpcError(std::string(error_kind_name(result.getError().getKind())),
                   to_string(result.getError().getMessage()));
  }
  inference_ = result.getInference();
}

}  // namespace duet::client
