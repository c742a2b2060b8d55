// What the serving fronts cost on top of the engine, per request and per
// streamed token.
//
// One process holds the model twice over the same weights: a bare Engine
// driven on this thread (the in-process baseline), and the serving stack
// (LocalInstance + Service + Cap'n Proto front + HTTP front on loopback
// ports). Each path runs the same greedy requests with ignore_eos: a 1-token
// generation (per-request overhead) and an N-token stream (per-token
// overhead), --reps times each, interleaved; medians are reported.
//
//   duet-serve-overhead --model M [--threads 2] [--reps 20] [--stream-tokens 256]
#include <capnp/ez-rpc.h>
#include <kj/async.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>  // before Asio (GCC 12)

#include "common/duet.capnp.h"
#include "common/stats.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/http/http_server.h"
#include "coordinator/rpc/rpc_server.h"
#include "coordinator/service.h"
#include "kernels/cpu/isa.h"
#include "worker/local_instance.h"

namespace duet {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using boost::asio::ip::tcp;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The bare engine on this thread.
double time_engine(Engine& engine, const std::vector<int32_t>& prompt, int64_t n_tokens) {
  int64_t got = 0;
  const auto t0 = Clock::now();
  engine.submit(prompt, {.max_tokens = n_tokens, .ignore_eos = true},
                [&](const TokenEvent& e) { got += e.token >= 0; });
  engine.run_until_idle();
  const double s = seconds_since(t0);
  if (got != n_tokens) throw std::runtime_error("engine: wrong token count");
  return s;
}

// The service in process: no network, the engine on its own thread.
class WaitingSink final : public UpdateSink {
 public:
  void deliver(std::vector<RequestUpdate> updates) override {
    std::lock_guard lock(mutex_);
    for (const RequestUpdate& u : updates) done_ |= u.finished;
    if (done_)
      cv_.notify_all();  // waking the waiter per token is a front's cost, not the service's
  }
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    done_ = false;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
};

double time_service(Service& service, const std::vector<int32_t>& prompt, int64_t n_tokens) {
  WaitingSink sink;
  const auto t0 = Clock::now();
  auto r = service.start({.prompt = prompt, .max_tokens = n_tokens, .ignore_eos = true}, sink);
  if (std::holds_alternative<ServeError>(r)) throw std::runtime_error("service refused");
  sink.wait();
  return seconds_since(t0);
}

// Cap'n Proto: a client TokenSink that counts chunks and resolves on done().
class CountingSink final : public rpc::TokenSink::Server {
 public:
  explicit CountingSink(kj::Own<kj::PromiseFulfiller<void>> done) : done_(kj::mv(done)) {}
  kj::Promise<void> write(WriteContext) override { return kj::READY_NOW; }
  kj::Promise<void> done(DoneContext) override {
    done_->fulfill();
    return kj::READY_NOW;
  }

 private:
  kj::Own<kj::PromiseFulfiller<void>> done_;
};

double time_rpc(capnp::EzRpcClient& client, rpc::Inference::Client& inference,
                const std::vector<int32_t>& prompt, int64_t n_tokens) {
  auto& ws = client.getWaitScope();
  auto paf = kj::newPromiseAndFulfiller<void>();
  const auto t0 = Clock::now();
  auto req = inference.generateRequest();
  auto g = req.initRequest();
  auto ids = g.getPrompt().initTokens(static_cast<unsigned>(prompt.size()));
  for (size_t i = 0; i < prompt.size(); ++i) ids.set(static_cast<unsigned>(i), prompt[i]);
  g.setMaxTokens(static_cast<uint32_t>(n_tokens));
  g.setIgnoreEos(true);
  req.setSink(kj::heap<CountingSink>(kj::mv(paf.fulfiller)));
  auto response = req.send().wait(ws);
  if (!response.getResult().isStarted()) throw std::runtime_error("rpc refused");
  auto handle = response.getResult().getStarted().getHandle();  // held until done
  paf.promise.wait(ws);
  return seconds_since(t0);
}

// HTTP: one keep-alive connection; the whole response (SSE included) is read.
double time_http(tcp::socket& socket, const std::vector<int32_t>& prompt, int64_t n_tokens,
                 bool stream) {
  nlohmann::json body = {{"prompt", prompt},
                         {"max_tokens", n_tokens},
                         {"temperature", 0},
                         {"ignore_eos", true},
                         {"stream", stream}};
  http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
  req.set(http::field::host, "127.0.0.1");
  req.set(http::field::content_type, "application/json");
  req.body() = body.dump();
  req.prepare_payload();
  const auto t0 = Clock::now();
  http::write(socket, req);
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(64 << 20);
  http::read(socket, buffer, parser);
  const double s = seconds_since(t0);
  if (parser.get().result() != http::status::ok) throw std::runtime_error("http: not 200");
  return s;
}

int run(int argc, char** argv) {
  std::string model_path;
  int threads = 2;
  int reps = 20;
  int64_t stream_tokens = 256;
  CLI::App app{"Serving overhead per request and per streamed token"};
  app.add_option("-m,--model", model_path, "GGUF model")->required();
  app.add_option("-t,--threads", threads, "Compute threads")->capture_default_str();
  app.add_option("--reps", reps, "Repetitions of each measurement")->capture_default_str();
  app.add_option("--stream-tokens", stream_tokens, "Tokens of the streamed generation")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto model = LlamaModel::load(model_path);
  const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  const std::vector<int32_t> prompt = tokenizer.encode("The quick brown fox", true, true);
  EngineConfig config{.n_kv_blocks = 256, .end_of_generation = tokenizer.end_of_generation_ids()};

  cpu::ThreadPool engine_pool(threads);
  Engine engine(*model, kernels, engine_pool, config);
  cpu::ThreadPool serve_pool(threads);
  LocalInstance instance(*model, kernels, serve_pool, config, "model");
  Service service(instance, tokenizer, std::nullopt, "model", {});
  RpcServer rpc_server(service, {});
  HttpServer http_server(service, {});

  capnp::EzRpcClient client("127.0.0.1", rpc_server.port());
  auto login = client.getMain<rpc::Gateway>().loginRequest();
  login.setApiKey("");
  rpc::Inference::Client inference =
      login.send().wait(client.getWaitScope()).getResult().getInference();

  boost::asio::io_context io;
  tcp::socket socket(io);
  socket.connect({boost::asio::ip::make_address("127.0.0.1"), http_server.port()});
  socket.set_option(tcp::no_delay(true));

  struct Path {
    const char* name;
    std::vector<double> one, many;
  };
  std::vector<Path> paths = {{"engine (in process, same thread)", {}, {}},
                             {"service (in process, engine thread)", {}, {}},
                             {"Cap'n Proto RPC (loopback, streamed)", {}, {}},
                             {"HTTP non-stream (loopback)", {}, {}},
                             {"HTTP SSE stream (loopback)", {}, {}}};
  auto measure = [&](size_t path, int64_t n) {
    switch (path) {
      case 0:
        return time_engine(engine, prompt, n);
      case 1:
        return time_service(service, prompt, n);
      case 2:
        return time_rpc(client, inference, prompt, n);
      case 3:
        return time_http(socket, prompt, n, false);
      default:
        return time_http(socket, prompt, n, true);
    }
  };
  for (size_t p = 0; p < paths.size(); ++p) measure(p, 4);  // warm up every path
  for (int r = 0; r < reps; ++r) {
    for (size_t p = 0; p < paths.size(); ++p) {
      paths[p].one.push_back(measure(p, 1));
      paths[p].many.push_back(measure(p, stream_tokens));
    }
  }
  const double base_one = median(paths[0].one);
  const double base_many = median(paths[0].many);
  std::printf("prompt %zu tokens, %d threads, %d reps, medians\n", prompt.size(), threads, reps);
  std::printf(
      "| path | 1-token request (ms) | overhead/request (ms) | %lld-token stream (ms) | "
      "overhead/token (us) |\n|---|---|---|---|---|\n",
      static_cast<long long>(stream_tokens));
  for (const Path& p : paths) {
    const double one = median(p.one), many = median(p.many);
    std::printf("| %s | %.3f | %+.3f | %.1f | %+.1f |\n", p.name, one * 1e3, (one - base_one) * 1e3,
                many * 1e3, (many - base_many) / static_cast<double>(stream_tokens) * 1e6);
  }
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) {
  try {
    return duet::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-serve-overhead: %s\n", e.what());
    return 1;
  }
}
