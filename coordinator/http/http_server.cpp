#include "coordinator/http/http_server.h"

#include "coordinator/http/health_routes.h"
#include "coordinator/http/http_server_impl.h"

namespace duet {

// --- HttpServer::Impl ---------------------------------------------------------------------

void HttpServer::Impl::Forwarder::deliver(std::vector<RequestUpdate> updates) {
  std::lock_guard lock(mutex_);
  if (server_ == nullptr) return;
  asio::post(server_->io_, [server = server_, updates = std::move(updates)]() mutable {
    server->on_updates(std::move(updates));
  });
}

void HttpServer::Impl::Forwarder::close() {
  std::lock_guard lock(mutex_);
  server_ = nullptr;
}

HttpServer::Impl::Impl(Service& service, HttpServerOptions options)
    : service_(service),
      options_(std::move(options)),
      workers_(std::make_unique<asio::thread_pool>(
          static_cast<size_t>(std::max(1, options_.worker_threads)))) {
  beast::error_code ec;
  tcp::resolver resolver(io_);
  const auto endpoints =
      resolver.resolve(options_.host, std::to_string(options_.port), tcp::resolver::passive, ec);
  if (ec || endpoints.empty()) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("http: cannot resolve host '{}': {}", options_.host, ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("http: cannot listen on {}:{}: {}", options_.host, options_.port,
                            ec.message()));
  }
  port_ = acceptor_.local_endpoint().port();
  accept();
  thread_ = std::thread([this] {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {  // a bug of ours; keep serving the others
        spdlog::error("http: unexpected exception on the server thread: {}", e.what());
      }
    }
  });
}

HttpServer::Impl::~Impl() {
  stop();
  connections_.clear();  // sockets before the io_context they belong to
}

void HttpServer::Impl::stop() {
  std::call_once(stop_once_, [this] {
    DUET_ASSERT(std::this_thread::get_id() != thread_.get_id(),
                "HttpServer::stop() must not run on the server's own thread");
    std::future<void> drained = drained_.get_future();
    asio::post(io_, [this] { begin_stop(); });
    const bool in_time = drained.wait_for(kStopGrace) == std::future_status::ready;
    if (!in_time) io_.stop();
    thread_.join();
    // Work still queued is dropped; what runs finishes and posts to a stopped loop.
    workers_->stop();
    workers_->join();
    forwarder_->close();
    if (!requests_.empty()) {
      spdlog::warn("http: {} requests got no final update within {} s of stopping",
                   requests_.size(), kStopGrace.count());
      // The service may still deliver to the forwarder (closed: it drops
      // them); it must outlive those calls, so it is deliberately leaked.
      static_cast<void>(forwarder_.release());
    }
  });
}

void HttpServer::Impl::accept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (stopping_) return;
    if (ec) {
      // Out of descriptors, say: retry a little later rather than spin.
      spdlog::warn("http: accept failed: {}", ec.message());
      accept_retry_.expires_after(kAcceptRetry);
      accept_retry_.async_wait([this](beast::error_code timer_ec) {
        if (!timer_ec && !stopping_) accept();
      });
      return;
    }
    // Small writes (SSE events) must leave at once, not wait for the peer's
    // delayed ACK of the previous one (Nagle).
    beast::error_code nodelay_ec;
    socket.set_option(tcp::no_delay(true), nodelay_ec);
    if (n_serving_ >= options_.max_connections) {
      service_.record_connection_refused("http");
      // A few refusals at a time get their 503; past that they just close.
      if (connections_.size() - n_serving_ < kMaxRefusing) {
        auto connection = std::make_unique<Connection>(*this, std::move(socket));
        Connection& ref = *connection;
        connections_.emplace(&ref, std::move(connection));
        ref.refuse(too_many_connections());
      }
      return accept();
    }
    auto connection = std::make_unique<Connection>(*this, std::move(socket));
    Connection& ref = *connection;
    connections_.emplace(&ref, std::move(connection));
    ref.set_serving();
    ++n_serving_;
    ref.start();
    accept();
  });
}

openai::ApiError HttpServer::Impl::too_many_connections() const {
  return openai::ApiError{
      .status = 503,
      .message = fmt::format("the server has its {} connections open; retry later",
                             options_.max_connections),
      .type = "overloaded",
      .code = "too_many_connections",
      .retry_after_s = 1};
}

std::optional<openai::ApiError> HttpServer::Impl::refuse_header(std::string_view path,
                                                                const Request& header) {
  // Probes (the /health routes) need no key.
  const bool probe = path == "/health" || path.starts_with("/health/");
  if (!probe && !authorized(header)) {
    service_.record_refused(ServeErrorKind::kUnauthenticated);
    return openai::api_error(
        ServeError{ServeErrorKind::kUnauthenticated,
                   "missing or wrong API key: send the header 'Authorization: Bearer KEY'"});
  }
  // Shed load before the body is read and parsed: with the waiting queue
  // full, admit() would refuse it anyway.
  if ((path == "/v1/completions" || path == "/v1/chat/completions") &&
      header.method() == http::verb::post && service_.waiting_full()) {
    service_.record_refused(ServeErrorKind::kOverloaded);
    return openai::api_error(
        ServeError{ServeErrorKind::kOverloaded, "the waiting queue is full; retry later"});
  }
  return std::nullopt;
}

void HttpServer::Impl::release(Connection* connection) {
  if (connection->serving()) --n_serving_;
  connections_.erase(connection);
  drained_if_idle();
}

void HttpServer::Impl::begin_stop() {
  stopping_ = true;
  beast::error_code ignored;
  acceptor_.close(ignored);
  accept_retry_.cancel();
  std::vector<Connection*> open;
  for (const auto& [connection, owned] : connections_) open.push_back(connection);
  for (Connection* connection : open) connection->shut_down();
  drained_if_idle();
}

void HttpServer::Impl::drained_if_idle() {
  if (!stopping_ || !requests_.empty() || !connections_.empty() || drained_set_) return;
  drained_set_ = true;
  work_.reset();  // run() returns once the connections' last handlers are done
  drained_.set_value();
}

void HttpServer::Impl::abandon(RequestId id) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) return;
  it->second = nullptr;
  service_.cancel(id);
}

void HttpServer::Impl::on_updates(std::vector<RequestUpdate> updates) {
  for (const RequestUpdate& update : updates) {
    const auto it = requests_.find(update.id);
    if (it == requests_.end()) continue;  // not ours: the service broke its contract
    Connection* connection = it->second;
    if (update.finished) requests_.erase(it);
    if (connection != nullptr) connection->on_update(update);
  }
  drained_if_idle();
}

bool HttpServer::Impl::authorized(const Request& request) const {
  if (options_.api_key.empty()) return true;
  const std::string_view header = to_std(request[http::field::authorization]);
  constexpr std::string_view kBearer = "Bearer ";
  if (header.size() < kBearer.size() ||
      !beast::iequals(to_beast(header.substr(0, kBearer.size())), to_beast(kBearer)))
    return false;
  const std::string_view key = header.substr(kBearer.size());
  // Compared in time independent of where the first difference is.
  unsigned char difference = key.size() == options_.api_key.size() ? 0 : 1;
  for (size_t i = 0; i < key.size(); ++i)
    difference |=
        static_cast<unsigned char>(key[i] ^ options_.api_key[i % options_.api_key.size()]);
  return difference == 0;
}

void HttpServer::Impl::on_request(Connection& connection, Request request) {
  const std::string_view target = to_std(request.target());
  const std::string_view path = target.substr(0, target.find('?'));
  const http::verb method = request.method();
  // For the log, should a route throw after the request has moved on.
  const std::string route = fmt::format("{} {}", to_std(request.method_string()), path);
  try {
    if (!http_health::is_health_route(path) && !authorized(request)) {
      service_.record_refused(ServeErrorKind::kUnauthenticated);
      return connection.respond_error(openai::api_error(
          ServeError{ServeErrorKind::kUnauthenticated,
                     "missing or wrong API key: send the header 'Authorization: Bearer KEY'"}));
    }
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      if (method != http::verb::post) return method_not_allowed(connection, "POST");
      const auto endpoint = path == "/v1/completions" ? openai::Endpoint::kCompletions
                                                      : openai::Endpoint::kChatCompletions;
      return start_completion(connection, endpoint, std::move(request));
    }
    if (path == "/tokenize" || path == "/detokenize") {
      if (method != http::verb::post) return method_not_allowed(connection, "POST");
      return path == "/tokenize" ? tokenize(connection, std::move(request))
                                 : detokenize(connection, std::move(request));
    }
    constexpr std::string_view kModelPrefix = "/v1/models/";
    const bool is_model = path.starts_with(kModelPrefix);
    if (path == "/v1/models" || is_model || http_health::is_health_route(path) ||
        path == "/metrics") {
      if (method != http::verb::get) return method_not_allowed(connection, "GET");
    }
    if (path == "/v1/models") {
      return connection.respond(http::status::ok, openai::models_body(service_.model(), started_),
                                "application/json");
    }
    if (is_model) {
      const std::string_view name = path.substr(kModelPrefix.size());
      if (name != service_.model().name) {
        openai::ApiError error = openai::api_error(ServeError{
            ServeErrorKind::kNotFound, fmt::format("the model '{}' does not exist", name)});
        error.code = "model_not_found";
        return connection.respond_error(error);
      }
      return connection.respond(http::status::ok, openai::model_body(service_.model(), started_),
                                "application/json");
    }
    if (http_health::is_health_route(path)) {
      const http_health::Answer answer = http_health::answer(path, service_.health());
      if (answer.status == 200)
        return connection.respond(http::status::ok, answer.body, "application/json");
      return connection.respond(http::status::service_unavailable, answer.body, "application/json",
                                {{http::field::retry_after, "5"}});
    }
    if (path == "/metrics") {
      return connection.respond(http::status::ok, service_.metrics_text(),
                                "text/plain; version=0.0.4; charset=utf-8");
    }
    connection.respond_error(openai::api_error(
        ServeError{ServeErrorKind::kNotFound,
                   fmt::format("no route {} {}", to_std(request.method_string()), path)}));
  } catch (const std::exception& e) {
    spdlog::error("http: {} failed: {}", route, e.what());
    connection.respond_error(
        openai::api_error(ServeError{ServeErrorKind::kInternal, "internal error"}));
  }
}

void HttpServer::Impl::method_not_allowed(Connection& connection, std::string_view allowed) {
  openai::ApiError error = openai::invalid_request(
      "method_not_allowed", "", fmt::format("this route only answers {}", allowed));
  error.status = 405;
  connection.respond_error(error, {{http::field::allow, std::string(allowed)}});
}

void HttpServer::Impl::tokenize(Connection& connection, Request request) {
  connection.offload(
      [this, request = std::move(request)]() -> std::variant<std::string, openai::ApiError> {
        auto parsed = openai::parse_tokenize_request(request.body());
        if (auto* error = std::get_if<openai::ApiError>(&parsed)) return std::move(*error);
        const auto& [content, add_special] = std::get<openai::TokenizeRequest>(parsed);
        Result<std::vector<int32_t>> tokens = service_.tokenize(content, add_special);
        if (const auto* error = std::get_if<ServeError>(&tokens)) return openai::api_error(*error);
        return openai::tokenize_body(std::get<std::vector<int32_t>>(tokens));
      },
      [](Connection& connection, std::variant<std::string, openai::ApiError>& reply) {
        respond_json(connection, reply);
      });
}

void HttpServer::Impl::detokenize(Connection& connection, Request request) {
  connection.offload(
      [this, request = std::move(request)]() -> std::variant<std::string, openai::ApiError> {
        auto parsed = openai::parse_detokenize_request(request.body());
        if (auto* error = std::get_if<openai::ApiError>(&parsed)) return std::move(*error);
        Result<std::string> text = service_.detokenize(std::get<std::vector<int32_t>>(parsed));
        if (const auto* error = std::get_if<ServeError>(&text)) return openai::api_error(*error);
        return openai::detokenize_body(std::get<std::string>(text));
      },
      [](Connection& connection, std::variant<std::string, openai::ApiError>& reply) {
        respond_json(connection, reply);
      });
}

void HttpServer::Impl::respond_json(Connection& connection,
                                    const std::variant<std::string, openai::ApiError>& reply) {
  if (const auto* error = std::get_if<openai::ApiError>(&reply))
    return connection.respond_error(*error);
  connection.respond(http::status::ok, std::get<std::string>(reply), "application/json");
}

// A completion request on its way from a worker thread (parsed, validated,
// tokenized) to admission on the server's thread.
struct HttpServer::Impl::PreparedCompletion {
  std::optional<openai::ApiError> refusal;
  std::optional<PreparedRequest> request;
  std::optional<openai::ResponseWriter> writer;
  bool stream = false;
};

HttpServer::Impl::PreparedCompletion HttpServer::Impl::prepare_completion(openai::Endpoint endpoint,
                                                                          const Request& request,
                                                                          uint64_t seed,
                                                                          uint64_t id_bits) {
  PreparedCompletion out;
  auto parsed = openai::parse_completion_request(endpoint, request.body(), seed);
  if (auto* error = std::get_if<openai::ApiError>(&parsed)) {
    service_.record_refused(ServeErrorKind::kInvalidArgument);
    out.refusal = std::move(*error);
    return out;
  }
  openai::CompletionRequest& completion = std::get<openai::CompletionRequest>(parsed);
  if (!service_.serves_model(completion.model)) {
    openai::ApiError error = openai::api_error(
        ServeError{ServeErrorKind::kNotFound,
                   fmt::format("the model '{}' does not exist; this server serves '{}'",
                               completion.model, service_.model().name)});
    error.code = "model_not_found";
    error.param = "model";
    service_.record_refused(ServeErrorKind::kNotFound);
    out.refusal = std::move(error);
    return out;
  }
  const std::string_view prefix =
      endpoint == openai::Endpoint::kChatCompletions ? "chatcmpl" : "cmpl";
  out.writer.emplace(completion, fmt::format("{}-{:016x}", prefix, id_bits), unix_now(),
                     service_.model().name, options_.split_reasoning);
  out.stream = completion.stream;
  Result<PreparedRequest> prepared = service_.prepare(std::move(completion.serve));
  if (const auto* error = std::get_if<ServeError>(&prepared)) {
    out.refusal = openai::api_error(*error);
    return out;
  }
  out.request = std::move(std::get<PreparedRequest>(prepared));
  return out;
}

void HttpServer::Impl::start_completion(Connection& connection, openai::Endpoint endpoint,
                                        Request request) {
  // The generator is the server thread's; the worker gets its draws.
  const uint64_t seed = random_();
  const uint64_t id_bits = random_();
  connection.offload(
      [this, endpoint, request = std::move(request), seed, id_bits] {
        try {
          return prepare_completion(endpoint, request, seed, id_bits);
        } catch (const std::exception& e) {
          spdlog::error("http: preparing a completion failed: {}", e.what());
          PreparedCompletion out;
          out.refusal = openai::api_error(ServeError{ServeErrorKind::kInternal, "internal error"});
          return out;
        }
      },
      [this](Connection& connection, PreparedCompletion& prepared) {
        if (prepared.refusal) return connection.respond_error(*prepared.refusal);
        Result<Admitted> admitted = service_.admit(std::move(*prepared.request), *forwarder_);
        if (const auto* error = std::get_if<ServeError>(&admitted))
          return connection.respond_error(openai::api_error(*error));
        const RequestId id = std::get<Admitted>(admitted).id;
        requests_.emplace(id, &connection);
        connection.begin_generation(id, prepared.stream, std::move(*prepared.writer));
      });
}

// --- HttpServer ---------------------------------------------------------------------------

HttpServer::HttpServer(Service& service, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(service, std::move(options))) {}

HttpServer::~HttpServer() = default;

uint16_t HttpServer::port() const { return impl_->port(); }

void HttpServer::stop() { impl_->stop(); }

}  // namespace duet
