#include "coordinator/http_server.h"

// <utility> before any Boost.Asio header: with GCC 12, asio/awaitable.hpp
// needs std::exchange declared first.
#include <utility>

// GCC 12 with sanitizers warns (falsely) about a boost::optional inside
// Beast's parser; the warning is Beast's, so it is silenced for its headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>
#pragma GCC diagnostic pop

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "common/error.h"
#include "common/unicode.h"
#include "coordinator/openai_api.h"

namespace duet {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Request = http::request<http::string_body>;

constexpr auto kReadTimeout = std::chrono::seconds(60);   // one request's bytes; an idle keep-alive
constexpr auto kWriteTimeout = std::chrono::seconds(60);  // one write to a client
constexpr auto kLingerTimeout = std::chrono::seconds(2);  // draining an unread body before closing
constexpr auto kStopGrace = std::chrono::seconds(5);      // final updates after stop()
constexpr auto kAcceptRetry = std::chrono::milliseconds(100);
constexpr size_t kHeaderLimit = 16 * 1024;

// Boost 1.74's Beast speaks boost::string_view.
std::string_view to_std(beast::string_view text) { return {text.data(), text.size()}; }
beast::string_view to_beast(std::string_view text) { return {text.data(), text.size()}; }

int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

bool is_http_parse_error(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_target).category();
}

// Appends `data` as one chunk of the chunked transfer coding (RFC 9112 §7.1).
void append_chunk(std::string& out, std::string_view data) {
  if (data.empty()) return;  // an empty chunk would end the body
  out += fmt::format("{:x}\r\n", data.size());
  out += data;
  out += "\r\n";
}

constexpr std::string_view kLastChunk = "0\r\n\r\n";

}  // namespace

// Routing, request bookkeeping and the listening socket. Everything but
// stop() and the forwarder's deliver() runs on the server's thread.
class HttpServer::Impl {
 public:
  Impl(Service& service, HttpServerOptions options);
  ~Impl();

  uint16_t port() const { return port_; }
  void stop();

  // For connections (the server's thread).
  asio::io_context& io() { return io_; }
  bool stopping() const { return stopping_; }
  size_t max_body_bytes() const { return options_.max_body_bytes; }
  class Connection;
  void on_request(Connection& connection, Request request);
  // The connection went away while `id` generated: cancel it and drop its updates.
  void abandon(RequestId id);
  // Cancels `id`; its final update still goes to its connection.
  void cancel(RequestId id) { service_.cancel(id); }
  // Destroys a closed connection with no operation pending.
  void release(Connection* connection);

 private:
  // Receives the service's updates on the instance's event thread and posts
  // them to the server's thread; after close(), drops them.
  class Forwarder final : public UpdateSink {
   public:
    explicit Forwarder(Impl& server) : server_(&server) {}
    void deliver(std::vector<RequestUpdate> updates) override;
    void close();

   private:
    std::mutex mutex_;  // guards server_ against close()
    Impl* server_;      // nullptr once closed
  };

  void accept();
  void on_updates(std::vector<RequestUpdate> updates);
  void begin_stop();
  void drained_if_idle();
  bool authorized(const Request& request) const;
  void start_completion(Connection& connection, openai::Endpoint endpoint, const Request& request);
  // llama-server's POST /tokenize {"content", "add_special"} -> {"tokens"}
  // and POST /detokenize {"tokens"} -> {"content"}, for clients (duet-bench)
  // that need exact token counts.
  void tokenize(Connection& connection, const Request& request);
  void detokenize(Connection& connection, const Request& request);
  static void method_not_allowed(Connection& connection, std::string_view allowed);

  Service& service_;
  const HttpServerOptions options_;
  const int64_t started_ = unix_now();
  uint16_t port_ = 0;

  // The server's thread owns everything below (construction and ~Impl aside).
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  tcp::acceptor acceptor_{io_};
  asio::steady_timer accept_retry_{io_};
  std::unique_ptr<Forwarder> forwarder_ = std::make_unique<Forwarder>(*this);
  std::map<Connection*, std::unique_ptr<Connection>> connections_;
  // Requests started and not yet finished, with the connection they answer;
  // nullptr for those whose connection went away (cancelled, final update due).
  std::map<RequestId, Connection*> requests_;
  std::mt19937_64 random_{std::random_device{}()};  // default seeds, response ids
  bool stopping_ = false;
  std::promise<void> drained_;  // set once stopping and no request or connection is left
  bool drained_set_ = false;

  std::thread thread_;
  std::once_flag stop_once_;
};

// One client connection: reads requests one at a time, writes responses
// (whole, or as a stream of server-sent events), and watches the socket for
// the client's going away while a request generates.
//
// Owned by the server's connection table and destroyed only once closed with
// no operation pending, so its completion handlers may hold `this`. Lives on
// the server's thread.
class HttpServer::Impl::Connection {
 public:
  using Headers = std::vector<std::pair<http::field, std::string>>;

  Connection(Impl& server, tcp::socket socket) : server_(server), stream_(std::move(socket)) {}

  void start() { read_header(); }
  // Closes the socket and cancels the request generating, if any. Idempotent.
  void close();
  // The server stops: closes now when idle, else once the response under way
  // is written; a request generating is cancelled, and its client gets the
  // final (error) response.
  void shut_down();

  // Whole responses, for the server's routing. The connection then reads the
  // next request or, when the request asked not to keep it alive, closes.
  void respond(http::status status, std::string body, std::string_view content_type,
               const Headers& headers = {});
  void respond_error(const openai::ApiError& error, Headers headers = {});
  // Starts answering request `id` with `writer` (streamed or whole).
  void begin_generation(RequestId id, bool stream, openai::ResponseWriter writer);
  // An update of the request generating (the server's routing guarantees it is ours).
  void on_update(const RequestUpdate& update);

 private:
  enum class AfterWrite {
    kNothing,      // more output follows (a stream in progress)
    kReadBody,     // after "100 Continue"
    kNextRequest,  // the response is complete: read the next request
    kClose,        // the response is complete: close
    kLingerClose,  // close once the unread request body has drained
  };
  struct Generation {
    RequestId id;
    bool stream = false;
    openai::ResponseWriter writer;  // streams the events, or collects the whole response
  };

  // Counts an operation as pending until its handler runs; the handler is
  // skipped once the connection is closed.
  template <typename Handler>
  auto guard(Handler handler) {
    ++n_pending_;
    return [this, handler = std::move(handler)](auto... args) mutable {
      --n_pending_;
      if (closed_) return release_if_idle();
      handler(args...);
    };
  }

  void read_header();
  void on_header(beast::error_code ec);
  void read_body();
  void on_body(beast::error_code ec);
  void on_read_error(beast::error_code ec);
  std::string response_bytes(http::status status, std::string body, std::string_view content_type,
                             const Headers& headers) const;
  void send(std::string bytes, AfterWrite after);
  void flush();
  void on_write(beast::error_code ec);
  void watch();
  void on_watch(beast::error_code ec);
  void linger();
  void release_if_idle();

  Impl& server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool keep_alive_ = false;  // of the current request
  unsigned version_ = 11;    // of the current request: 10 for HTTP/1.0, 11 for HTTP/1.1
  bool chunked_ = false;     // the current stream uses the chunked coding (HTTP/1.1)

  std::optional<Generation> generation_;
  std::string out_;        // bytes waiting for the write in flight to finish
  std::string in_flight_;  // the bytes of the write in flight
  bool writing_ = false;
  AfterWrite after_write_ = AfterWrite::kNothing;  // once out_ and in_flight_ are written
  bool watching_ = false;
  bool lingering_ = false;
  std::string drain_;  // lingering close's scratch
  size_t n_drained_ = 0;

  int n_pending_ = 0;
  bool closed_ = false;
  bool released_ = false;
};

// --- Connection ---------------------------------------------------------------------------

void HttpServer::Impl::Connection::read_header() {
  parser_.emplace();
  parser_->body_limit(server_.max_body_bytes());
  parser_->header_limit(kHeaderLimit);
  stream_.expires_after(kReadTimeout);
  http::async_read_header(stream_, buffer_, *parser_,
                          guard([this](beast::error_code ec, size_t) { on_header(ec); }));
}

void HttpServer::Impl::Connection::on_header(beast::error_code ec) {
  if (ec) return on_read_error(ec);
  keep_alive_ = parser_->get().keep_alive() && !server_.stopping();
  version_ = parser_->get().version() >= 11 ? 11 : 10;
  if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
    // The client waits for this before sending the body (curl does for large ones).
    return send("HTTP/1.1 100 Continue\r\n\r\n", AfterWrite::kReadBody);
  }
  read_body();
}

void HttpServer::Impl::Connection::read_body() {
  stream_.expires_after(kReadTimeout);
  http::async_read(stream_, buffer_, *parser_,
                   guard([this](beast::error_code ec, size_t) { on_body(ec); }));
}

void HttpServer::Impl::Connection::on_body(beast::error_code ec) {
  if (ec) return on_read_error(ec);
  stream_.expires_never();  // generation may take long; writes set their own deadline
  server_.on_request(*this, parser_->release());
}

void HttpServer::Impl::Connection::on_read_error(beast::error_code ec) {
  keep_alive_ = false;
  if (ec == http::error::body_limit) {
    // Refused before the body is read; the connection closes after a linger.
    openai::ApiError error = openai::invalid_request(
        "request_too_large", "",
        fmt::format("the request body exceeds {} bytes", server_.max_body_bytes()));
    error.status = 413;
    return send(response_bytes(static_cast<http::status>(error.status), openai::error_body(error),
                               "application/json", {}),
                AfterWrite::kLingerClose);
  }
  if (ec == http::error::header_limit) {
    openai::ApiError error = openai::invalid_request("headers_too_large", "",
                                                     "the request's header fields are too large");
    error.status = 431;
    return respond_error(error);
  }
  if (is_http_parse_error(ec) && ec != http::error::end_of_stream &&
      ec != http::error::partial_message) {
    return respond_error(openai::invalid_request(
        "bad_http", "", fmt::format("malformed HTTP request: {}", ec.message())));
  }
  close();  // the client closed or reset the connection, or timed out
}

std::string HttpServer::Impl::Connection::response_bytes(http::status status, std::string body,
                                                         std::string_view content_type,
                                                         const Headers& headers) const {
  http::response<http::string_body> response{status, version_};
  response.set(http::field::server, "duet");
  response.set(http::field::content_type, to_beast(content_type));
  for (const auto& [name, value] : headers) response.set(name, value);
  response.keep_alive(keep_alive_);
  response.body() = std::move(body);
  response.prepare_payload();
  std::ostringstream bytes;
  bytes << response;
  return std::move(bytes).str();
}

void HttpServer::Impl::Connection::respond(http::status status, std::string body,
                                           std::string_view content_type, const Headers& headers) {
  send(response_bytes(status, std::move(body), content_type, headers),
       keep_alive_ ? AfterWrite::kNextRequest : AfterWrite::kClose);
}

void HttpServer::Impl::Connection::respond_error(const openai::ApiError& error, Headers headers) {
  if (error.retry_after_s > 0)
    headers.emplace_back(http::field::retry_after, std::to_string(error.retry_after_s));
  respond(static_cast<http::status>(error.status), openai::error_body(error), "application/json",
          headers);
}

void HttpServer::Impl::Connection::begin_generation(RequestId id, bool stream,
                                                    openai::ResponseWriter writer) {
  generation_.emplace(Generation{id, stream, std::move(writer)});
  watch();
  if (!stream) return;
  chunked_ = version_ >= 11;
  if (!chunked_) keep_alive_ = false;  // HTTP/1.0: the body ends when the connection does
  http::response<http::empty_body> head{http::status::ok, version_};
  head.set(http::field::server, "duet");
  head.set(http::field::content_type, "text/event-stream");
  head.set(http::field::cache_control, "no-cache");
  head.keep_alive(keep_alive_);
  if (chunked_) head.chunked(true);
  std::ostringstream bytes;
  bytes << head.base();  // the status line and fields, through the blank line
  std::string out = std::move(bytes).str();
  const std::string first = generation_->writer.stream_start();
  if (chunked_) {
    append_chunk(out, first);
  } else {
    out += first;
  }
  send(std::move(out), AfterWrite::kNothing);
}

void HttpServer::Impl::Connection::on_update(const RequestUpdate& update) {
  if (!generation_ || closed_) return;
  Generation& generation = *generation_;
  if (generation.stream) {
    std::string events = generation.writer.stream_update(update);
    std::string bytes;
    if (chunked_) {
      append_chunk(bytes, events);
      if (update.finished) bytes += kLastChunk;
    } else {
      bytes = std::move(events);
    }
    if (update.finished) generation_.reset();
    return send(std::move(bytes), !update.finished ? AfterWrite::kNothing
                                  : keep_alive_    ? AfterWrite::kNextRequest
                                                   : AfterWrite::kClose);
  }
  generation.writer.collect(update);
  if (!update.finished) return;
  std::optional<openai::ApiError> failure = openai::failure(update);
  std::string body = failure ? std::string() : generation.writer.full_response(update);
  generation_.reset();
  if (failure) return respond_error(*failure);
  respond(http::status::ok, std::move(body), "application/json");
}

void HttpServer::Impl::Connection::send(std::string bytes, AfterWrite after) {
  out_ += bytes;
  after_write_ = after;
  flush();
}

// Keeps at most one write in flight; what arrives meanwhile waits in out_ and
// goes out with the next write, coalesced.
void HttpServer::Impl::Connection::flush() {
  if (writing_ || closed_) return;
  if (out_.empty()) {
    switch (after_write_) {
      case AfterWrite::kNothing:
        return;
      case AfterWrite::kReadBody:
        after_write_ = AfterWrite::kNothing;
        return read_body();
      case AfterWrite::kNextRequest:
        after_write_ = AfterWrite::kNothing;
        return read_header();
      case AfterWrite::kClose:
        return close();
      case AfterWrite::kLingerClose:
        return linger();
    }
  }
  writing_ = true;
  in_flight_.swap(out_);
  out_.clear();
  stream_.expires_after(kWriteTimeout);
  asio::async_write(stream_, asio::buffer(in_flight_),
                    guard([this](beast::error_code ec, size_t) { on_write(ec); }));
}

void HttpServer::Impl::Connection::on_write(beast::error_code ec) {
  writing_ = false;
  in_flight_.clear();
  if (ec) {
    spdlog::debug("http: a client went away ({}); closing its connection", ec.message());
    return close();  // cancels the request generating
  }
  flush();
}

// Waits for the socket to become readable while a request generates, then
// peeks: end-of-file (or an error) means the client has gone away. Bytes mean
// a pipelined request, and the watch ends (a later write notices a
// departure); nothing to read means the readiness was stale (bytes the reader
// consumed meanwhile), and the watch goes on.
void HttpServer::Impl::Connection::watch() {
  if (watching_ || closed_) return;
  watching_ = true;
  stream_.socket().async_wait(tcp::socket::wait_read,
                              guard([this](beast::error_code ec) { on_watch(ec); }));
}

void HttpServer::Impl::Connection::on_watch(beast::error_code ec) {
  watching_ = false;
  if (ec || !generation_) return;
  char byte = 0;
  beast::error_code peek_ec;
  stream_.socket().non_blocking(true);  // only this peek is synchronous
  const size_t n =
      stream_.socket().receive(asio::buffer(&byte, 1), tcp::socket::message_peek, peek_ec);
  if (peek_ec == asio::error::would_block || peek_ec == asio::error::try_again) return watch();
  if (peek_ec || n == 0) {
    spdlog::debug("http: a client went away while its request generated; cancelling it");
    close();
  }
}

// After refusing a body unread (413), stops sending and reads what the client
// still sends, for a while, so that closing does not reset the connection
// before the client has read the response.
void HttpServer::Impl::Connection::linger() {
  if (!lingering_) {
    lingering_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    drain_.resize(16 * 1024);
  }
  stream_.expires_after(kLingerTimeout);
  stream_.async_read_some(asio::buffer(drain_), guard([this](beast::error_code ec, size_t n) {
                            n_drained_ += n;
                            if (ec || n_drained_ > 4 * server_.max_body_bytes()) return close();
                            linger();
                          }));
}

void HttpServer::Impl::Connection::close() {
  if (closed_) return;
  closed_ = true;
  if (generation_) server_.abandon(generation_->id);
  generation_.reset();
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
  stream_.close();
  release_if_idle();
}

void HttpServer::Impl::Connection::shut_down() {
  keep_alive_ = false;
  if (generation_) return server_.cancel(generation_->id);
  if (writing_ || !out_.empty()) {
    if (after_write_ == AfterWrite::kNextRequest) after_write_ = AfterWrite::kClose;
    return;
  }
  close();
}

void HttpServer::Impl::Connection::release_if_idle() {
  if (!closed_ || n_pending_ > 0 || released_) return;
  released_ = true;
  // Posted: the caller may still be inside one of this connection's functions.
  asio::post(server_.io(), [server = &server_, self = this] { server->release(self); });
}

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
    : service_(service), options_(std::move(options)) {
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
    auto connection = std::make_unique<Connection>(*this, std::move(socket));
    Connection& ref = *connection;
    connections_.emplace(&ref, std::move(connection));
    ref.start();
    accept();
  });
}

void HttpServer::Impl::release(Connection* connection) {
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
  try {
    if (path != "/health" && !authorized(request)) {
      service_.record_refused(ServeErrorKind::kUnauthenticated);
      return connection.respond_error(openai::api_error(
          ServeError{ServeErrorKind::kUnauthenticated,
                     "missing or wrong API key: send the header 'Authorization: Bearer KEY'"}));
    }
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      if (method != http::verb::post) return method_not_allowed(connection, "POST");
      const auto endpoint = path == "/v1/completions" ? openai::Endpoint::kCompletions
                                                      : openai::Endpoint::kChatCompletions;
      return start_completion(connection, endpoint, request);
    }
    if (path == "/tokenize" || path == "/detokenize") {
      if (method != http::verb::post) return method_not_allowed(connection, "POST");
      return path == "/tokenize" ? tokenize(connection, request) : detokenize(connection, request);
    }
    constexpr std::string_view kModelPrefix = "/v1/models/";
    const bool is_model = path.starts_with(kModelPrefix);
    if (path == "/v1/models" || is_model || path == "/health" || path == "/metrics") {
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
    if (path == "/health") {
      if (service_.healthy())
        return connection.respond(http::status::ok, R"({"status":"ok"})", "application/json");
      return connection.respond(http::status::service_unavailable, R"({"status":"unavailable"})",
                                "application/json", {{http::field::retry_after, "5"}});
    }
    if (path == "/metrics") {
      return connection.respond(http::status::ok, service_.metrics_text(),
                                "text/plain; version=0.0.4; charset=utf-8");
    }
    connection.respond_error(openai::api_error(
        ServeError{ServeErrorKind::kNotFound,
                   fmt::format("no route {} {}", to_std(request.method_string()), path)}));
  } catch (const std::exception& e) {
    spdlog::error("http: {} {} failed: {}", to_std(request.method_string()), path, e.what());
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

void HttpServer::Impl::tokenize(Connection& connection, const Request& request) {
  auto parsed = openai::parse_tokenize_request(request.body());
  if (const auto* error = std::get_if<openai::ApiError>(&parsed))
    return connection.respond_error(*error);
  const auto& [content, add_special] = std::get<openai::TokenizeRequest>(parsed);
  Result<std::vector<int32_t>> tokens = service_.tokenize(content, add_special);
  if (const auto* error = std::get_if<ServeError>(&tokens))
    return connection.respond_error(openai::api_error(*error));
  connection.respond(http::status::ok,
                     openai::tokenize_body(std::get<std::vector<int32_t>>(tokens)),
                     "application/json");
}

void HttpServer::Impl::detokenize(Connection& connection, const Request& request) {
  auto parsed = openai::parse_detokenize_request(request.body());
  if (const auto* error = std::get_if<openai::ApiError>(&parsed))
    return connection.respond_error(*error);
  Result<std::string> text = service_.detokenize(std::get<std::vector<int32_t>>(parsed));
  if (const auto* error = std::get_if<ServeError>(&text))
    return connection.respond_error(openai::api_error(*error));
  connection.respond(http::status::ok, openai::detokenize_body(std::get<std::string>(text)),
                     "application/json");
}

void HttpServer::Impl::start_completion(Connection& connection, openai::Endpoint endpoint,
                                        const Request& request) {
  auto parsed = openai::parse_completion_request(endpoint, request.body(), random_());
  if (const auto* error = std::get_if<openai::ApiError>(&parsed)) {
    service_.record_refused(ServeErrorKind::kInvalidArgument);
    return connection.respond_error(*error);
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
    return connection.respond_error(error);
  }
  const std::string_view prefix =
      endpoint == openai::Endpoint::kChatCompletions ? "chatcmpl" : "cmpl";
  openai::ResponseWriter writer(completion, fmt::format("{}-{:016x}", prefix, random_()),
                                unix_now(), service_.model().name);
  const bool stream = completion.stream;
  Result<Admitted> admitted = service_.start(std::move(completion.serve), *forwarder_);
  if (const auto* error = std::get_if<ServeError>(&admitted))
    return connection.respond_error(openai::api_error(*error));
  const RequestId id = std::get<Admitted>(admitted).id;
  requests_.emplace(id, &connection);
  connection.begin_generation(id, stream, std::move(writer));
}

// --- HttpServer ---------------------------------------------------------------------------

HttpServer::HttpServer(Service& service, HttpServerOptions options)
    : impl_(std::make_unique<Impl>(service, std::move(options))) {}

HttpServer::~HttpServer() = default;

uint16_t HttpServer::port() const { return impl_->port(); }

void HttpServer::stop() { impl_->stop(); }

}  // namespace duet
