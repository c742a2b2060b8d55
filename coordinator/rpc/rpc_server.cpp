#include "coordinator/rpc/rpc_server.h"

#include <capnp/rpc-twoparty.h>
#include <fmt/format.h>
#include <kj/async-io.h>
#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <future>
#include <thread>
#include <utility>

#include "common/duet.capnp.h"
#include "common/error.h"
#include "common/text/unicode.h"
#include "coordinator/rpc/rpc_admin.h"
#include "coordinator/rpc/rpc_convert.h"
#include "coordinator/rpc/rpc_streams.h"

namespace duet {
namespace {

using rpc_convert::clamp_u32;
using rpc_convert::fill_error;
using rpc_convert::fill_list;
using rpc_convert::fill_model_info;
using rpc_convert::fill_stats;
using rpc_convert::serve_error_kind_of;
using rpc_convert::to_serve_request;
using rpc_convert::to_string;
using rpc_convert::to_vector;

// ------------------------------------------------------------ capabilities

// Cancels its request on cancel() or when dropped before the request ended.
class RequestHandleImpl final : public rpc::RequestHandle::Server {
 public:
  RequestHandleImpl(kj::Own<StreamTable> table, RequestId id) : table_(kj::mv(table)), id_(id) {}
  ~RequestHandleImpl() noexcept {
    try {
      table_->cancel(id_);
    } catch (const std::exception& e) {
      spdlog::error("rpc: cancelling a dropped request failed: {}", e.what());
    }
  }

 protected:
  kj::Promise<void> cancel(CancelContext) override {
    table_->cancel(id_);
    return kj::READY_NOW;
  }

 private:
  kj::Own<StreamTable> table_;
  RequestId id_;
};

// What the capabilities of one server share. Loop thread only; the table
// is refcounted so that no capability outlives it, however capnp orders
// their destruction.
struct Front {
  Service& service;
  UpdateRelay& relay;
  kj::Own<StreamTable> table;
  kj::Own<ConnectionActivity> connection;  // the client connection these capabilities serve

  Front share() { return {service, relay, kj::addRef(*table), kj::addRef(*connection)}; }
};

class InferenceImpl final : public rpc::Inference::Server {
 public:
  explicit InferenceImpl(Front front) : front_(kj::mv(front)) {}

 protected:
  kj::Promise<void> generate(GenerateContext context) override {
    front_.connection->touch();
    auto params = context.getParams();
    auto result = context.getResults().initResult();
    guard_errors(result, [&] {
      const auto request = params.getRequest();
      if (front_.table->closed()) {
        front_.service.record_refused(ServeErrorKind::kUnavailable);
        fill_error(result.initError(), ServeErrorKind::kUnavailable, "the server is shutting down");
        return;
      }
      const std::string model = to_string(request.getModel());
      if (!front_.service.serves_model(model)) {
        front_.service.record_refused(ServeErrorKind::kNotFound);
        fill_error(result.initError(), ServeErrorKind::kNotFound,
                   "model '" + utf8_sanitize(model) + "' is not served here");
        return;
      }
      Result<ServeRequest> converted = to_serve_request(request);
      if (auto* error = std::get_if<ServeError>(&converted)) {
        front_.service.record_refused(error->kind);
        fill_error(result.initError(), error->kind, error->message);
        return;
      }
      ServeRequest& serve = std::get<ServeRequest>(converted);
      const bool include_token_ids = serve.include_token_ids;
      auto sink = params.getSink();  // before start(): nothing may throw once it runs
      Result<Admitted> admitted = front_.service.start(std::move(serve), front_.relay);
      if (auto* error = std::get_if<ServeError>(&admitted)) {
        fill_error(result.initError(), error->kind, error->message);
        return;
      }
      const Admitted& ok = std::get<Admitted>(admitted);
      // Registered before this turn ends: the request's first update reaches
      // the loop in a later turn.
      front_.relay.started();
      try {
        front_.table->add(ok.id, kj::mv(sink), include_token_ids, kj::addRef(*front_.connection));
        auto started = result.initStarted();
        started.setHandle(kj::heap<RequestHandleImpl>(kj::addRef(*front_.table), ok.id));
        started.setPromptTokens(clamp_u32(ok.prompt_tokens));
      } catch (...) {
        front_.service.cancel(ok.id);  // nobody could cancel it otherwise
        throw;
      }
    });
    return kj::READY_NOW;
  }

  kj::Promise<void> tokenize(TokenizeContext context) override {
    front_.connection->touch();
    auto params = context.getParams();
    auto result = context.getResults().initResult();
    guard_errors(result, [&] {
      const auto text = params.getText();
      Result<std::vector<int32_t>> tokens = front_.service.tokenize(
          std::string_view(text.cStr(), text.size()), params.getAddSpecial());
      if (auto* error = std::get_if<ServeError>(&tokens)) {
        fill_error(result.initError(), error->kind, error->message);
        return;
      }
      const auto& ids = std::get<std::vector<int32_t>>(tokens);
      fill_list(result.initTokens(static_cast<unsigned>(ids.size())), ids);
    });
    return kj::READY_NOW;
  }

  kj::Promise<void> detokenize(DetokenizeContext context) override {
    front_.connection->touch();
    auto params = context.getParams();
    auto result = context.getResults().initResult();
    guard_errors(result, [&] {
      Result<std::string> text = front_.service.detokenize(to_vector(params.getTokens()));
      if (auto* error = std::get_if<ServeError>(&text)) {
        fill_error(result.initError(), error->kind, error->message);
        return;
      }
      result.setText(std::get<std::string>(text));
    });
    return kj::READY_NOW;
  }

  kj::Promise<void> modelInfo(ModelInfoContext context) override {
    front_.connection->touch();
    rethrow_as_kj(
        [&] { fill_model_info(context.getResults().initInfo(), front_.service.model()); });
    return kj::READY_NOW;
  }

  kj::Promise<void> stats(StatsContext context) override {
    front_.connection->touch();
    rethrow_as_kj([&] { fill_stats(context.getResults().initStats(), front_.service.stats()); });
    return kj::READY_NOW;
  }

  kj::Promise<void> health(HealthContext context) override {
    front_.connection->touch();
    rethrow_as_kj([&] {
      const Service::Health health = front_.service.health();
      rpc::HealthStatus status = rpc::HealthStatus::SERVING;
      if (health.state == Service::HealthState::kUnavailable || front_.table->closed()) {
        status = rpc::HealthStatus::SHUTTING_DOWN;
      } else if (health.state == Service::HealthState::kDraining) {
        status = rpc::HealthStatus::DRAINING;
      } else if (health.state == Service::HealthState::kDegraded) {
        status = rpc::HealthStatus::DEGRADED;
      }
      context.getResults().setStatus(status);
    });
    return kj::READY_NOW;
  }

 private:
  // Runs `body`; an exception becomes the result's typed error (the
  // connection and the server keep serving).
  template <typename ResultBuilder, typename Body>
  static void guard_errors(ResultBuilder result, Body&& body) {
    try {
      body();
    } catch (const Error& e) {
      fill_error(result.initError(), serve_error_kind_of(e.kind()), e.what());
    } catch (const kj::Exception& e) {
      // A reader's complaint about the client's message.
      fill_error(result.initError(), ServeErrorKind::kInvalidArgument,
                 std::string("malformed request: ") + e.getDescription().cStr());
    } catch (const std::exception& e) {
      fill_error(result.initError(), ServeErrorKind::kInternal, e.what());
    }
  }

  // For methods whose results have no error member: an exception fails the
  // call (the client sees an RPC exception), not the connection.
  template <typename Body>
  static void rethrow_as_kj(Body&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      KJ_FAIL_REQUIRE("duet: request failed", e.what());
    }
  }

  Front front_;
};

class GatewayImpl final : public rpc::Gateway::Server {
 public:
  GatewayImpl(Front front, std::string api_key, AdminDoor admin)
      : front_(kj::mv(front)), api_key_(std::move(api_key)), admin_(admin) {}

 protected:
  kj::Promise<void> version(VersionContext context) override {
    front_.connection->touch();
    auto results = context.getResults();
    results.setProtocolVersion(rpc::PROTOCOL_VERSION);
    results.setServer("duet");
    return kj::READY_NOW;
  }

  kj::Promise<void> login(LoginContext context) override {
    front_.connection->touch();
    const auto key = context.getParams().getApiKey();
    auto result = context.getResults().initResult();
    if (!api_key_.empty() && !keys_equal(std::string_view(key.cStr(), key.size()), api_key_)) {
      front_.service.record_refused(ServeErrorKind::kUnauthenticated);
      fill_error(result.initError(), ServeErrorKind::kUnauthenticated, "wrong API key");
      return kj::READY_NOW;
    }
    result.setInference(kj::heap<InferenceImpl>(front_.share()));
    return kj::READY_NOW;
  }

  kj::Promise<void> adminChallenge(AdminChallengeContext context) override {
    front_.connection->touch();
    admin_.challenge(context.getResults());
    return kj::READY_NOW;
  }

  kj::Promise<void> admin(AdminContext context) override {
    front_.connection->touch();
    admin_.open(context.getParams().getProof(), context.getResults().initResult());
    return kj::READY_NOW;
  }

 private:
  // Compares in time independent of where the keys differ.
  static bool keys_equal(std::string_view given, std::string_view expected) {
    unsigned char diff = given.size() == expected.size() ? 0 : 1;
    for (size_t i = 0; i < expected.size(); ++i) {
      diff |= static_cast<unsigned char>(expected[i] ^ (i < given.size() ? given[i] : 0));
    }
    return diff == 0;
  }

  Front front_;
  std::string api_key_;
  AdminDoor admin_;
};

}  // namespace

// ------------------------------------------------------------------ server

// How long stopping waits for the cancelled requests' done() to reach their
// clients before it closes the connections regardless.
constexpr kj::Duration kDrainTimeout = 3 * kj::SECONDS;

// The largest legitimate request is a generate() whose prompt is the longest
// text that can still fit max_prompt_tokens: max_prompt_bytes(), that is
// max_prompt_tokens times the longest token of the vocabulary (as token ids
// it is 4 bytes a token, less; as chat messages the same content bytes plus
// at most 64 bytes of structure a message, and every message is at least one
// token of the template), with up to as many bytes again of stop strings, and
// 64 KiB for every other field and Cap'n Proto's framing. The traversal limit
// is twice that, since a reader that looks at a field twice counts it twice.
// The deepest legitimate nesting is nine levels (the RPC message, its call and
// payload, the params, the request, the chat list, a message, its text);
// sixteen leaves room. A tokenize() text is bounded by the same limit.
RpcReaderLimits rpc_reader_limits(const Service& service) {
  const auto prompt_bytes = static_cast<uint64_t>(service.max_prompt_bytes());
  const auto prompt_tokens = static_cast<uint64_t>(service.model().max_prompt_tokens);
  const uint64_t largest_request = 2 * prompt_bytes + 64 * prompt_tokens + (64 << 10);
  return {.traversal_limit_words = 2 * largest_request / sizeof(capnp::word), .nesting_limit = 16};
}

// One client connection: its socket, its two-party RPC system, and what it
// is doing (for the idle timeout). Loop thread only.
struct RpcConnection {
  RpcConnection(kj::Own<kj::AsyncIoStream> socket_in, capnp::Capability::Client bootstrap,
                capnp::ReaderOptions reader, kj::Own<ConnectionActivity> activity_in)
      : activity(kj::mv(activity_in)),
        socket(kj::mv(socket_in)),
        network(*socket, capnp::rpc::twoparty::Side::SERVER, reader),
        rpc(capnp::makeRpcServer(network, kj::mv(bootstrap))) {}

  kj::Own<ConnectionActivity> activity;
  kj::Own<kj::AsyncIoStream> socket;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

struct RpcServer::Impl {
  Impl(Service& service_in, RpcServerOptions options_in)
      : service(service_in), options(std::move(options_in)) {}

  // The loop thread's body: serves until stop(), then cancels what runs.
  // Fulfils `ready` with the bound port, or fails it with a duet::Error.
  void run(std::promise<uint16_t>& ready);
  // Accepts connections for as long as the listener lives; each runs in
  // `connections` until its client leaves or it is idle too long.
  kj::Promise<void> accept(kj::ConnectionReceiver& listener, kj::Timer& timer,
                           kj::TaskSet& connections);
  // Resolves once `activity`'s connection has been idle for idle_timeout.
  kj::Promise<void> idle(kj::Own<ConnectionActivity> activity, kj::Timer& timer);

  Service& service;
  const RpcServerOptions options;
  UpdateRelay relay;
  std::thread thread;
  // Written by the loop thread before `ready` is fulfilled; read-only after.
  uint16_t port = 0;
  kj::Own<const kj::Executor> executor;
  std::atomic<bool> stop_requested{false};
  // Loop thread only.
  kj::Own<kj::PromiseFulfiller<void>> stop_fulfiller;
  StreamTable* table = nullptr;  // while the loop serves
  size_t n_connections = 0;
  capnp::ReaderOptions reader;
};

// Logs a connection's failure; the others go on.
class ConnectionErrors final : public kj::TaskSet::ErrorHandler {
 public:
  void taskFailed(kj::Exception&& exception) override {
    spdlog::debug("rpc: a connection ended: {}", exception.getDescription().cStr());
  }
};

kj::Promise<void> RpcServer::Impl::accept(kj::ConnectionReceiver& listener, kj::Timer& timer,
                                          kj::TaskSet& connections) {
  return listener.accept().then(
      [this, &listener, &timer, &connections](kj::Own<kj::AsyncIoStream>&& socket) {
        if (n_connections >= options.max_connections || table == nullptr) {
          service.record_connection_refused("rpc");
          socket = nullptr;  // closed at once
          return accept(listener, timer, connections);
        }
        ++n_connections;
        auto activity = kj::refcounted<ConnectionActivity>(timer);
        auto gateway = kj::heap<GatewayImpl>(
            Front{service, relay, kj::addRef(*table), kj::addRef(*activity)}, options.api_key,
            AdminDoor(options.admin, options.admin_key ? &*options.admin_key : nullptr));
        auto connection =
            kj::heap<RpcConnection>(kj::mv(socket), kj::mv(gateway), reader, kj::addRef(*activity));
        kj::Promise<void> ends = connection->network.onDisconnect();
        if (options.idle_timeout.count() > 0)
          ends = ends.exclusiveJoin(idle(kj::mv(activity), timer));
        connections.add(ends.attach(kj::mv(connection), kj::defer([this] { --n_connections; })));
        return accept(listener, timer, connections);
      });
}

kj::Promise<void> RpcServer::Impl::idle(kj::Own<ConnectionActivity> activity, kj::Timer& timer) {
  const kj::Duration timeout = options.idle_timeout.count() * kj::MILLISECONDS;
  // A streaming connection is looked at again a whole timeout later.
  const kj::TimePoint check =
      activity->streaming() ? timer.now() + timeout : activity->last() + timeout;
  return timer.atTime(check).then(
      [this, &timer, timeout, activity = kj::mv(activity)]() mutable -> kj::Promise<void> {
        if (!activity->streaming() && timer.now() - activity->last() >= timeout) {
          spdlog::debug("rpc: closing a connection idle for {} ms", options.idle_timeout.count());
          return kj::READY_NOW;
        }
        return idle(kj::mv(activity), timer);
      });
}

void RpcServer::Impl::run(std::promise<uint16_t>& ready) {
  bool listening = false;
  try {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    executor = kj::getCurrentThreadExecutor().addRef();
    kj::Own<StreamTable> streams = kj::refcounted<StreamTable>(service);
    table = streams.get();
    relay.attach([this](std::vector<RequestUpdate>& updates) {
      if (table != nullptr) table->on_updates(updates);
    });
    // Declared before tear_down: destroyed after it, so that detach() finds
    // the promise its fulfiller fulfils alive.
    kj::Promise<void> relaying = relay.run().eagerlyEvaluate([](kj::Exception&& e) {
      spdlog::error("rpc: relaying updates failed: {}", e.getDescription().cStr());
    });
    // Idempotent. Runs before the connections close (their handles' cancels
    // then find nothing left) and however the loop ends.
    auto tear_down = [this] {
      relay.detach();  // later updates are only counted
      if (table != nullptr) table->shut_down();
      table = nullptr;
      stop_fulfiller = nullptr;
    };
    KJ_DEFER(tear_down());

    ConnectionErrors connection_errors;
    // Destroyed when the loop ends, closing every connection.
    kj::TaskSet connections(connection_errors);
    kj::Own<kj::NetworkAddress> address =
        io.provider->getNetwork().parseAddress(options.host, options.port).wait(io.waitScope);
    kj::Own<kj::ConnectionReceiver> listener = address->listen();
    port = static_cast<uint16_t>(listener->getPort());

    auto stop = kj::newPromiseAndFulfiller<void>();
    stop_fulfiller = kj::mv(stop.fulfiller);
    kj::Promise<void> accepting =
        accept(*listener, io.provider->getTimer(), connections)
            .catch_([](kj::Exception&& e) -> kj::Promise<void> {
              spdlog::error("rpc: accepting connections failed: {}", e.getDescription().cStr());
              return kj::NEVER_DONE;  // the open connections keep being served
            });
    listening = true;
    ready.set_value(port);
    stop.promise.exclusiveJoin(kj::mv(accepting)).wait(io.waitScope);

    // Stopping: no new connections or requests; what runs is cancelled and
    // its clients get done(cancelled), for as long as kDrainTimeout allows.
    listener = nullptr;
    streams->close();
    streams->drained()
        .exclusiveJoin(io.provider->getTimer().afterDelay(kDrainTimeout))
        .wait(io.waitScope);
    tear_down();
    // Leaving the scope closes every connection, then the event loop;
    // deliver() now only counts final updates.
  } catch (const kj::Exception& e) {
    if (!listening) {
      ready.set_exception(std::make_exception_ptr(Error(
          ErrorKind::kInvalidArgument, fmt::format("rpc: cannot listen on {}:{}: {}", options.host,
                                                   options.port, e.getDescription().cStr()))));
    } else {
      spdlog::error("rpc: the event loop failed: {}", e.getDescription().cStr());
    }
  } catch (const std::exception& e) {
    if (!listening) {
      ready.set_exception(std::make_exception_ptr(
          Error(ErrorKind::kInternal, fmt::format("rpc: cannot start: {}", e.what()))));
    } else {
      spdlog::error("rpc: the event loop failed: {}", e.what());
    }
  }
}

RpcServer::RpcServer(Service& service, RpcServerOptions options)
    : impl_(std::make_unique<Impl>(service, std::move(options))) {
  const RpcReaderLimits limits = rpc_reader_limits(service);
  impl_->reader.traversalLimitInWords = limits.traversal_limit_words;
  impl_->reader.nestingLimit = limits.nesting_limit;
  spdlog::info("rpc: messages of up to {} KiB, {} connections, idle timeout {} s",
               limits.traversal_limit_words * sizeof(capnp::word) / 1024,
               impl_->options.max_connections, impl_->options.idle_timeout.count() / 1000.0);
  std::promise<uint16_t> ready;
  std::future<uint16_t> listening = ready.get_future();
  impl_->thread =
      std::thread([impl = impl_.get(), ready = std::move(ready)]() mutable { impl->run(ready); });
  try {
    listening.get();
  } catch (...) {
    impl_->thread.join();
    throw;
  }
}

RpcServer::~RpcServer() {
  stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->relay.wait_finished();
}

uint16_t RpcServer::port() const { return impl_->port; }

void RpcServer::stop() {
  if (impl_->stop_requested.exchange(true)) return;
  Impl* impl = impl_.get();
  auto fulfil = [impl] {
    if (impl->stop_fulfiller) impl->stop_fulfiller->fulfill();
  };
  if (std::this_thread::get_id() == impl->thread.get_id()) {
    fulfil();
    return;
  }
  try {
    impl->executor->executeSync(fulfil);
  } catch (const kj::Exception& e) {
    // DISCONNECTED: the loop has exited already.
    if (e.getType() != kj::Exception::Type::DISCONNECTED) {
      spdlog::error("rpc: stopping the server failed: {}", e.getDescription().cStr());
    }
  }
}

}  // namespace duet
