// The HTTP front's machinery, shared by its two source files: the server
// (http_server.cpp: listening socket, routing, request bookkeeping) and the
// client connection (http_connection.cpp: reading requests, writing whole and
// streamed responses, watching for the client's going away). Internal to
// duet_http_front; nothing else includes it.
#pragma once

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
#include <boost/asio/thread_pool.hpp>
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
#include "common/text/unicode.h"
#include "coordinator/http/http_server.h"
#include "coordinator/http/openai_api.h"

namespace duet {
namespace http_front {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Request = http::request<http::string_body>;

constexpr auto kWriteTimeout = std::chrono::seconds(60);  // one write to a client
constexpr auto kLingerTimeout = std::chrono::seconds(2);  // draining an unread body before closing
constexpr auto kStopGrace = std::chrono::seconds(5);      // final updates after stop()
constexpr auto kAcceptRetry = std::chrono::milliseconds(100);
constexpr size_t kHeaderLimit = 16 * 1024;
// Connections past max_connections that get their 503 at once (each lingers
// up to kLingerTimeout); more than that are closed without a reply.
constexpr size_t kMaxRefusing = 64;

// Boost 1.74's Beast speaks boost::string_view.
inline std::string_view to_std(beast::string_view text) { return {text.data(), text.size()}; }
inline beast::string_view to_beast(std::string_view text) { return {text.data(), text.size()}; }

inline int64_t unix_now() { return static_cast<int64_t>(std::time(nullptr)); }

inline bool is_http_parse_error(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_target).category();
}

// Appends `data` as one chunk of the chunked transfer coding (RFC 9112 §7.1).
inline void append_chunk(std::string& out, std::string_view data) {
  if (data.empty()) return;  // an empty chunk would end the body
  out += fmt::format("{:x}\r\n", data.size());
  out += data;
  out += "\r\n";
}

constexpr std::string_view kLastChunk = "0\r\n\r\n";

}  // namespace http_front

using namespace http_front;  // NOLINT: the front's own names, in its own files only

// Routing, request bookkeeping and the listening socket. Everything but
// stop(), the forwarder's deliver() and the work handed to the worker threads
// (Connection::offload: JSON parsing, validation, tokenization, which touch
// only the request they were given and the thread-safe Service) runs on the
// server's thread.
class HttpServer::Impl {
 public:
  Impl(Service& service, HttpServerOptions options);
  ~Impl();

  uint16_t port() const { return port_; }
  void stop();

  // For connections (the server's thread).
  asio::io_context& io() { return io_; }
  asio::thread_pool& workers() { return *workers_; }
  bool stopping() const { return stopping_; }
  size_t max_body_bytes() const { return options_.max_body_bytes; }
  std::chrono::milliseconds idle_timeout() const { return options_.idle_timeout; }
  // Checked from the header fields, before the body is read: the refusal of a
  // request for `path` (a missing or wrong API key; a completion while the
  // service's waiting queue is full), counted; nullopt to go on.
  std::optional<openai::ApiError> refuse_header(std::string_view path, const Request& header);
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
  struct PreparedCompletion;
  // Parses and prepares on a worker thread; admits on the server's thread.
  openai::ApiError too_many_connections() const;
  void start_completion(Connection& connection, openai::Endpoint endpoint, Request request);
  PreparedCompletion prepare_completion(openai::Endpoint endpoint, const Request& request,
                                        uint64_t seed, uint64_t id_bits);  // a worker thread
  // llama-server's POST /tokenize {"content", "add_special"} -> {"tokens"}
  // and POST /detokenize {"tokens"} -> {"content"}, for clients (duet-bench)
  // that need exact token counts. Both run on a worker thread.
  void tokenize(Connection& connection, Request request);
  void detokenize(Connection& connection, Request request);
  static void respond_json(Connection& connection,
                           const std::variant<std::string, openai::ApiError>& reply);
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
  size_t n_serving_ = 0;  // connections_ that serve requests (the others get a 503)
  // Requests started and not yet finished, with the connection they answer;
  // nullptr for those whose connection went away (cancelled, final update due).
  std::map<RequestId, Connection*> requests_;
  std::mt19937_64 random_{std::random_device{}()};  // default seeds, response ids
  bool stopping_ = false;
  std::promise<void> drained_;  // set once stopping and no request or connection is left
  bool drained_set_ = false;

  std::thread thread_;
  std::once_flag stop_once_;
  // Last: joined (in stop()) before anything their work posts back to goes.
  std::unique_ptr<asio::thread_pool> workers_;
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
  // Answers `error` without reading a request and closes (a refused connection).
  void refuse(const openai::ApiError& error);
  // Counts against max_connections (set once, at accept).
  void set_serving() { serving_ = true; }
  bool serving() const { return serving_; }
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

  // Runs `work()` on the server's worker threads, then `done(*this, result)`
  // back on the server's thread, unless the connection closed meanwhile (it
  // then waits for the result before it is destroyed). The connection reads
  // nothing more until done() responds.
  template <typename Work, typename Done>
  void offload(Work work, Done done) {
    auto finish =
        guard([this, done = std::move(done)](auto& result) mutable { done(*this, result); });
    asio::post(server_.workers(),
               [io = &server_.io(), work = std::move(work), finish = std::move(finish)]() mutable {
                 auto result = work();
                 asio::post(*io, [finish = std::move(finish),
                                  result = std::move(result)]() mutable { finish(result); });
               });
  }

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
    return [this, handler = std::move(handler)](auto&&... args) mutable {
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
  bool serving_ = false;
  bool closed_ = false;
  bool released_ = false;
};

}  // namespace duet
