#include "loadgen/http_client.h"

// <utility> before any Boost.Asio header: with GCC 12, asio/awaitable.hpp
// needs std::exchange declared first.
#include <utility>

// GCC 12 warns (falsely) about a boost::optional inside Beast's parser.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>
#pragma GCC diagnostic pop

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include "common/error.h"

namespace duet::loadgen {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

constexpr size_t kTokenizeChunkBytes = 32 * 1024;  // under every server's body limit
constexpr auto kSetupTimeout = std::chrono::seconds(60);

struct Url {
  std::string host;
  std::string port;
  std::string prefix;  // path before the routes, without a trailing '/'
};

Url parse_url(const std::string& text) {
  constexpr std::string_view kScheme = "http://";
  DUET_REQUIRE(text.starts_with(kScheme), "--http {}: expected http://HOST:PORT[/PREFIX]", text);
  std::string_view rest = std::string_view(text).substr(kScheme.size());
  const size_t slash = rest.find('/');
  const std::string_view authority = rest.substr(0, slash);
  Url url;
  url.prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
  while (url.prefix.ends_with('/')) url.prefix.pop_back();
  if (url.prefix.ends_with("/v1")) url.prefix.resize(url.prefix.size() - 3);
  const size_t colon = authority.rfind(':');
  const bool has_port =
      colon != std::string_view::npos && authority.find(']', colon) == authority.npos;
  url.host = std::string(authority.substr(0, has_port ? colon : authority.npos));
  url.port = has_port ? std::string(authority.substr(colon + 1)) : "80";
  if (url.host.size() >= 2 && url.host.front() == '[')
    url.host = url.host.substr(1, url.host.size() - 2);
  DUET_REQUIRE(!url.host.empty() && !url.port.empty(), "--http {}: no host or port", text);
  return url;
}

// The message of an error body: OpenAI's {"error": {"message"}}, llama-server's
// too, or the start of whatever else came.
std::string error_message(const std::string& body) {
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object()) {
    const auto error = parsed.find("error");
    if (error != parsed.end() && error->is_object() && error->contains("message") &&
        (*error)["message"].is_string())
      return (*error)["message"].get<std::string>();
    if (error != parsed.end() && error->is_string()) return error->get<std::string>();
  }
  return body.substr(0, 200);
}

// Fills a record's token count and the server's timings from one completion
// object (a streamed chunk or a whole response).
void read_counts(const json& object, RequestRecord& record, std::optional<int64_t>& usage_tokens) {
  if (const auto usage = object.find("usage"); usage != object.end() && usage->is_object()) {
    const auto n = usage->find("completion_tokens");
    if (n != usage->end() && n->is_number_integer()) usage_tokens = n->get<int64_t>();
  }
  // llama-server's own timings, when it gave no usage.
  if (const auto timings = object.find("timings");
      timings != object.end() && timings->is_object()) {
    const auto n = timings->find("predicted_n");
    if (!usage_tokens && n != timings->end() && n->is_number_integer())
      usage_tokens = n->get<int64_t>();
  }
  if (const auto duet = object.find("duet"); duet != object.end() && duet->is_object()) {
    const auto seconds = [&](const char* key) -> std::optional<double> {
      const auto it = duet->find(key);
      if (it == duet->end() || !it->is_number()) return std::nullopt;
      return it->get<double>() / 1e3;
    };
    record.server_ttft = seconds("ttft_ms");
    record.server_tpot = seconds("tpot_ms");
    record.server_e2e = seconds("e2e_ms");
  }
}

// The text of choices[0] (completions' "text" or chat's "delta.content").
std::string_view choice_text(const json& object) {
  const auto choices = object.find("choices");
  if (choices == object.end() || !choices->is_array() || choices->empty()) return {};
  const json& choice = choices->front();
  if (const auto text = choice.find("text"); text != choice.end() && text->is_string())
    return text->get_ref<const std::string&>();
  if (const auto delta = choice.find("delta"); delta != choice.end() && delta->is_object()) {
    const auto content = delta->find("content");
    if (content != delta->end() && content->is_string())
      return content->get_ref<const std::string&>();
  }
  return {};
}

// One HTTP exchange on a pooled connection. Lives on the client's thread.
class Exchange {
 public:
  virtual ~Exchange() = default;
  http::request<http::string_body> request;
  // The request is about to be written (again, after a stale keep-alive connection).
  virtual void on_sent() {}
  // The 200 response's body has grown; `body` is all of it so far.
  virtual void on_body(const std::string& /*body*/) {}
  // The whole response arrived.
  virtual void on_response(unsigned status, const std::string& body) = 0;
  // No response: `kind` is "connection" or "timeout".
  virtual void on_failure(std::string kind, std::string message) = 0;
};

// A generation request: turns the response into a RequestRecord.
class Generation final : public Exchange {
 public:
  Generation(RequestRecord record, bool stream, const RunClock& clock, RecordDone done)
      : record_(std::move(record)), stream_(stream), clock_(clock), done_(std::move(done)) {}

  void on_sent() override { record_.sent = clock_.now(); }

  // Scans the complete lines added since the last call for `data:` events.
  void on_body(const std::string& body) override {
    const double now = clock_.now();
    if (!stream_) return;
    for (;;) {
      const size_t end = body.find('\n', scanned_);
      if (end == std::string::npos) return;
      std::string_view line(body.data() + scanned_, end - scanned_);
      scanned_ = end + 1;
      if (line.ends_with('\r')) line.remove_suffix(1);
      if (!line.starts_with("data:")) continue;  // blank lines, comments, other fields
      line.remove_prefix(5);
      if (line.starts_with(' ')) line.remove_prefix(1);
      on_event(line, now);
    }
  }

  void on_response(unsigned status, const std::string& body) override {
    if (stream_ && status == 200) {
      on_body(body);
      if (scanned_ < body.size()) on_body(body + "\n");  // a last line without its newline
    }
    record_.finished = clock_.now();
    if (status != 200) return fail(fmt::format("http_{}", status), error_message(body));
    if (!stream_) {
      const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
      if (!parsed.is_object()) return fail("bad_response", "the response is not a JSON object");
      read_counts(parsed, record_, usage_tokens_);
      if (!choice_text(parsed).empty()) n_chunks_ = 1;
    }
    if (!stream_error_.empty()) return fail("stream_error", stream_error_);
    record_.ok = true;
    record_.received_tokens = usage_tokens_.value_or(n_chunks_);
    finish();
  }

  void on_failure(std::string kind, std::string message) override {
    record_.finished = clock_.now();
    fail(std::move(kind), std::move(message));
  }

 private:
  void on_event(std::string_view payload, double now) {
    if (payload == "[DONE]") return;
    const json event = json::parse(payload, nullptr, /*allow_exceptions=*/false);
    if (!event.is_object()) return;
    if (event.contains("error")) {
      stream_error_ = error_message(std::string(payload));
      return;
    }
    if (!choice_text(event).empty()) {
      if (!record_.first_token) record_.first_token = now;
      record_.token_times.push_back(now);
      ++n_chunks_;
    }
    read_counts(event, record_, usage_tokens_);
  }

  void fail(std::string kind, std::string message) {
    record_.ok = false;
    record_.error_kind = std::move(kind);
    record_.error_message = std::move(message);
    record_.received_tokens = usage_tokens_.value_or(n_chunks_);
    finish();
  }

  void finish() {
    if (done_) std::exchange(done_, nullptr)(std::move(record_));
  }

  RequestRecord record_;
  const bool stream_;
  const RunClock clock_;
  RecordDone done_;
  size_t scanned_ = 0;  // body bytes already split into lines
  int64_t n_chunks_ = 0;
  std::optional<int64_t> usage_tokens_;
  std::string stream_error_;
};

// A set-up request (tokenize, models) whose answer a caller thread waits for.
class Fetch final : public Exchange {
 public:
  std::promise<std::pair<unsigned, std::string>> answer;
  void on_response(unsigned status, const std::string& body) override {
    answer.set_value({status, body});
  }
  void on_failure(std::string kind, std::string message) override {
    answer.set_exception(std::make_exception_ptr(
        Error(ErrorKind::kInvalidArgument, fmt::format("{}: {}", kind, message))));
  }
};

class HttpClient final : public Client {
 public:
  explicit HttpClient(const HttpClientOptions& options);
  ~HttpClient() override;
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  std::vector<int32_t> tokenize(const std::string& text) override;
  void send(ClientRequest request, RequestRecord record, const RunClock& clock,
            RecordDone done) override;
  std::string describe() const override { return options_.url; }
  // Asks GET /v1/models for the model field when none was given.
  void learn_model() {
    if (options_.model.empty()) options_.model = first_model();
  }

 private:
  struct Connection {
    explicit Connection(asio::io_context& io) : stream(io) {}
    beast::tcp_stream stream;
    beast::flat_buffer buffer;
    bool reused = false;  // served a response before: the server may have closed it meanwhile
  };
  // One exchange in flight with its connection; owned by flights_.
  struct Flight {
    std::unique_ptr<Exchange> exchange;
    std::unique_ptr<Connection> connection;
    std::optional<http::response_parser<http::string_body>> parser;
    bool retried = false;
  };

  http::request<http::string_body> make_request(http::verb method, const std::string& route,
                                                std::string body) const;
  // Blocking, from a thread other than the client's.
  std::pair<unsigned, std::string> fetch(http::request<http::string_body> request);
  std::string first_model();

  // The client's thread.
  void start(std::unique_ptr<Exchange> exchange);
  void begin(Flight* flight);
  void write(Flight* flight);
  void read(Flight* flight);
  void on_read(Flight* flight, beast::error_code ec);
  void fail(Flight* flight, beast::error_code ec);
  void end(Flight* flight, bool keep_connection);

  HttpClientOptions options_;
  Url url_;
  const std::chrono::nanoseconds timeout_;
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_{io_.get_executor()};
  tcp::resolver::results_type endpoints_;
  // The client's thread owns these two.
  std::vector<std::unique_ptr<Connection>> idle_;
  std::map<Flight*, std::unique_ptr<Flight>> flights_;
  std::thread thread_;
};

HttpClient::HttpClient(const HttpClientOptions& options)
    : options_(options),
      url_(parse_url(options.url)),
      timeout_(std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::duration<double>(options.request_timeout_s))) {
  beast::error_code ec;
  tcp::resolver resolver(io_);
  endpoints_ = resolver.resolve(url_.host, url_.port, ec);
  DUET_REQUIRE(!ec && !endpoints_.empty(), "--http {}: cannot resolve '{}': {}", options.url,
               url_.host, ec.message());
  thread_ = std::thread([this] { io_.run(); });
}

HttpClient::~HttpClient() {
  work_.reset();
  io_.stop();
  thread_.join();
  flights_.clear();  // sockets before the io_context they belong to
  idle_.clear();
}

http::request<http::string_body> HttpClient::make_request(http::verb method,
                                                          const std::string& route,
                                                          std::string body) const {
  http::request<http::string_body> request{method, url_.prefix + route, 11};
  request.set(http::field::host, url_.host + ":" + url_.port);
  request.set(http::field::user_agent, "duet-bench");
  if (!options_.api_key.empty())
    request.set(http::field::authorization, "Bearer " + options_.api_key);
  if (method == http::verb::post) request.set(http::field::content_type, "application/json");
  request.keep_alive(true);
  request.body() = std::move(body);
  request.prepare_payload();
  return request;
}

std::pair<unsigned, std::string> HttpClient::fetch(http::request<http::string_body> request) {
  auto exchange = std::make_unique<Fetch>();
  exchange->request = std::move(request);
  std::future<std::pair<unsigned, std::string>> answer = exchange->answer.get_future();
  asio::post(io_, [this, exchange = std::move(exchange)]() mutable { start(std::move(exchange)); });
  if (answer.wait_for(kSetupTimeout) != std::future_status::ready)
    throw Error(ErrorKind::kInvalidArgument, fmt::format("{} did not answer", options_.url));
  return answer.get();
}

std::string HttpClient::first_model() {
  const auto [status, body] = fetch(make_request(http::verb::get, "/v1/models", ""));
  if (status != 200) return "";
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_object() || !parsed.contains("data") || !parsed["data"].is_array() ||
      parsed["data"].empty() || !parsed["data"][0].contains("id") ||
      !parsed["data"][0]["id"].is_string())
    return "";
  return parsed["data"][0]["id"].get<std::string>();
}

std::vector<int32_t> HttpClient::tokenize(const std::string& text) {
  // In pieces that end at a line break: a body under every server's limit.
  // Token windows may cross a piece's boundary; they stay exact in length.
  std::vector<int32_t> tokens;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = std::min(text.size(), begin + kTokenizeChunkBytes);
    if (end < text.size()) {
      const size_t newline = text.rfind('\n', end);
      if (newline != std::string::npos && newline > begin) end = newline + 1;
    }
    const json body = {{"content", text.substr(begin, end - begin)}, {"add_special", false}};
    const auto [status, reply] = fetch(make_request(
        http::verb::post, "/tokenize", body.dump(-1, ' ', false, json::error_handler_t::replace)));
    if (status != 200)
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("{} cannot tokenize (POST /tokenize answered {}: {})", options_.url,
                              status, error_message(reply)));
    const json parsed = json::parse(reply, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_object() || !parsed.contains("tokens") || !parsed["tokens"].is_array())
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("{}: POST /tokenize answered no token list", options_.url));
    for (const json& id : parsed["tokens"]) {
      // llama-server answers [{"id", "piece"}] when asked for pieces; ids otherwise.
      tokens.push_back(id.is_object() ? id.at("id").get<int32_t>() : id.get<int32_t>());
    }
    begin = end;
  }
  return tokens;
}

void HttpClient::send(ClientRequest request, RequestRecord record, const RunClock& clock,
                      RecordDone done) {
  json body = {{"prompt", std::move(request.prompt)},
               {"max_tokens", request.max_tokens},
               {"ignore_eos", true},
               {"temperature", 0},
               {"stream", request.stream}};
  if (!options_.model.empty()) body["model"] = options_.model;
  if (request.stream) body["stream_options"] = {{"include_usage", true}};
  auto exchange =
      std::make_unique<Generation>(std::move(record), request.stream, clock, std::move(done));
  exchange->request = make_request(http::verb::post, "/v1/completions", body.dump());
  asio::post(io_, [this, exchange = std::move(exchange)]() mutable { start(std::move(exchange)); });
}

void HttpClient::start(std::unique_ptr<Exchange> exchange) {
  auto flight = std::make_unique<Flight>();
  flight->exchange = std::move(exchange);
  Flight* raw = flight.get();
  flights_.emplace(raw, std::move(flight));
  begin(raw);
}

// Takes the most recently idle connection (the likeliest to be still open)
// or opens one; a retry always opens one (the other idle ones are as stale).
void HttpClient::begin(Flight* flight) {
  flight->exchange->on_sent();
  if (!idle_.empty() && !flight->retried) {
    flight->connection = std::move(idle_.back());
    idle_.pop_back();
    return write(flight);
  }
  flight->connection = std::make_unique<Connection>(io_);
  flight->connection->stream.expires_after(timeout_);
  flight->connection->stream.async_connect(
      endpoints_, [this, flight](beast::error_code ec, const tcp::endpoint&) {
        if (ec) return fail(flight, ec);
        beast::error_code ignored;
        flight->connection->stream.socket().set_option(tcp::no_delay(true), ignored);
        write(flight);
      });
}

void HttpClient::write(Flight* flight) {
  flight->connection->stream.expires_after(timeout_);  // the whole exchange's deadline
  http::async_write(flight->connection->stream, flight->exchange->request,
                    [this, flight](beast::error_code ec, size_t) {
                      if (ec) return fail(flight, ec);
                      flight->parser.emplace();
                      // Not boost::none: Boost 1.74 then refuses every Content-Length body.
                      flight->parser->body_limit(std::numeric_limits<std::uint64_t>::max());
                      read(flight);
                    });
}

void HttpClient::read(Flight* flight) {
  http::async_read_some(flight->connection->stream, flight->connection->buffer, *flight->parser,
                        [this, flight](beast::error_code ec, size_t) { on_read(flight, ec); });
}

void HttpClient::on_read(Flight* flight, beast::error_code ec) {
  if (ec) return fail(flight, ec);
  auto& parser = *flight->parser;
  const bool ok_status = parser.is_header_done() && parser.get().result_int() == 200;
  if (!parser.is_done()) {
    if (ok_status) flight->exchange->on_body(parser.get().body());
    return read(flight);
  }
  const bool keep = parser.get().keep_alive();
  flight->exchange->on_response(parser.get().result_int(), parser.get().body());
  end(flight, keep);
}

void HttpClient::fail(Flight* flight, beast::error_code ec) {
  Connection& connection = *flight->connection;
  const bool nothing_read = !flight->parser || !flight->parser->got_some();
  if (connection.reused && nothing_read && !flight->retried && ec != beast::error::timeout) {
    // The server closed the idle keep-alive connection: once more on a new one.
    flight->retried = true;
    flight->connection.reset();
    flight->parser.reset();
    return begin(flight);
  }
  const bool timeout = ec == beast::error::timeout;
  flight->exchange->on_failure(
      timeout ? "timeout" : "connection",
      timeout ? "no complete response within the request timeout" : ec.message());
  end(flight, /*keep_connection=*/false);
}

void HttpClient::end(Flight* flight, bool keep_connection) {
  if (keep_connection && flight->connection) {
    flight->connection->reused = true;
    flight->connection->stream.expires_never();
    idle_.push_back(std::move(flight->connection));
  }
  flights_.erase(flight);
}

}  // namespace

std::unique_ptr<Client> make_http_client(const HttpClientOptions& options) {
  auto client = std::make_unique<HttpClient>(options);
  client->learn_model();
  return client;
}

}  // namespace duet::loadgen
