#include "coordinator/http/http_server_impl.h"

namespace duet {

// --- Connection ---------------------------------------------------------------------------

void HttpServer::Impl::Connection::read_header() {
  parser_.emplace();
  parser_->body_limit(server_.max_body_bytes());
  parser_->header_limit(kHeaderLimit);
  stream_.expires_after(server_.idle_timeout());
  http::async_read_header(stream_, buffer_, *parser_,
                          guard([this](beast::error_code ec, size_t) { on_header(ec); }));
}

void HttpServer::Impl::Connection::refuse(const openai::ApiError& error) {
  keep_alive_ = false;
  // Lingers after the reply: closing with the client's unread request in the
  // socket would reset the connection before the client read the 503.
  send(response_bytes(static_cast<http::status>(error.status), openai::error_body(error),
                      "application/json",
                      {{http::field::retry_after, std::to_string(error.retry_after_s)}}),
       AfterWrite::kLingerClose);
}

void HttpServer::Impl::Connection::on_header(beast::error_code ec) {
  if (ec) return on_read_error(ec);
  keep_alive_ = parser_->get().keep_alive() && !server_.stopping();
  version_ = parser_->get().version() >= 11 ? 11 : 10;
  const std::string_view target = to_std(parser_->get().target());
  if (auto refusal = server_.refuse_header(target.substr(0, target.find('?')), parser_->get())) {
    // Refused before a byte of the body is read: a client with a wrong key,
    // or one the server has no room for, cannot make it read (or parse) a
    // body. The unread body means the connection cannot carry another request.
    const bool body_pending = !parser_->is_done();
    if (body_pending) keep_alive_ = false;
    Headers headers;
    if (refusal->retry_after_s > 0)
      headers.emplace_back(http::field::retry_after, std::to_string(refusal->retry_after_s));
    return send(response_bytes(static_cast<http::status>(refusal->status),
                               openai::error_body(*refusal), "application/json", headers),
                body_pending  ? AfterWrite::kLingerClose
                : keep_alive_ ? AfterWrite::kNextRequest
                              : AfterWrite::kClose);
  }
  if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
    // The client waits for this before sending the body (curl does for large ones).
    return send("HTTP/1.1 100 Continue\r\n\r\n", AfterWrite::kReadBody);
  }
  read_body();
}

void HttpServer::Impl::Connection::read_body() {
  stream_.expires_after(server_.idle_timeout());
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

}  // namespace duet
