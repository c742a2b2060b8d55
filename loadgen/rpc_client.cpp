#include "loadgen/rpc_client.h"

#include <fmt/format.h>
#include <kj/async-io.h>
#include <kj/debug.h>

#include <future>
#include <map>
#include <memory>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "client/connection.h"
#include "client/generation.h"
#include "common/error.h"

namespace duet::loadgen {
namespace {

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

// A request between send() and its record's delivery. Owned by Session::pending_.
struct Pending {
  RequestRecord record;
  RunClock clock;
  RecordDone done;
  rpc::RequestHandle::Client handle = nullptr;  // held until the end: dropping it cancels
  kj::Promise<void> deadline = nullptr;
};

// Everything on the event-loop thread: the connection, the Inference
// capability and the requests in flight. Lives on that thread's stack.
class Session final : private kj::TaskSet::ErrorHandler {
 public:
  Session(kj::AsyncIoContext& io, const RpcClientOptions& options);
  ~Session() noexcept(false);

  void start(ClientRequest request, RequestRecord record, const RunClock& clock, RecordDone done);
  kj::Promise<std::vector<int32_t>> tokenize(const std::string& text);

  // From a request's stream (BenchReceiver).
  void on_chunk(uint64_t id, bool has_text);
  void on_done(uint64_t id, const client::Finish& finish);
  void on_sink_dropped(uint64_t id);

 private:
  void taskFailed(kj::Exception&& exception) override {
    KJ_LOG(ERROR, "duet-bench rpc task failed", exception);
  }
  Pending* find(uint64_t id);
  // Delivers request `id`'s record (ok when `kind` is empty) and forgets it.
  void complete(uint64_t id, std::string kind = {}, std::string message = {});

  kj::AsyncIoContext& io_;
  const double timeout_s_;
  // Set first thing in the destructor; outlives connection_, whose teardown
  // drops the sinks.
  bool closing_ = false;
  client::Connection connection_;
  std::map<uint64_t, kj::Own<Pending>> pending_;
  uint64_t next_id_ = 1;
  kj::TaskSet tasks_{*this};  // declared last: destroyed first
};

// One request's stream, handed to the session by request id. Owned by the
// RPC system.
class BenchReceiver final : public client::StreamReceiver {
 public:
  BenchReceiver(Session& session, uint64_t id) : session_(session), id_(id) {}

  void on_text(std::string_view text) override { session_.on_chunk(id_, !text.empty()); }
  void on_finish(const client::Finish& finish) override { session_.on_done(id_, finish); }
  void on_dropped() override { session_.on_sink_dropped(id_); }

 private:
  Session& session_;
  const uint64_t id_;
};

// Connects and logs in; throws client::RpcError.
Session::Session(kj::AsyncIoContext& io, const RpcClientOptions& options)
    : io_(io),
      timeout_s_(options.request_timeout_s),
      connection_(io, client::parse_endpoint(options.endpoint), options.api_key) {}

Session::~Session() noexcept(false) {
  closing_ = true;
  pending_.clear();  // drops the handles: the server cancels what still runs
}

kj::Promise<std::vector<int32_t>> Session::tokenize(const std::string& text) {
  auto request = connection_.inference().tokenizeRequest();
  request.setText(text);
  request.setAddSpecial(false);
  return request.send().then([](capnp::Response<rpc::Inference::TokenizeResults> response) {
    const auto result = response.getResult();
    if (result.isError()) {
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("the server cannot tokenize: {}", to_string(result.getError().getMessage())));
    }
    std::vector<int32_t> tokens;
    for (int32_t id : result.getTokens()) tokens.push_back(id);
    return tokens;
  });
}

void Session::start(ClientRequest request, RequestRecord record, const RunClock& clock,
                    RecordDone done) {
  const uint64_t id = next_id_++;
  auto owned = kj::heap<Pending>();
  Pending& pending = *owned;
  pending.record = std::move(record);
  pending.clock = clock;
  pending.done = std::move(done);
  pending_.emplace(id, kj::mv(owned));

  client::GenerateOptions options;  // greedy
  options.max_tokens = static_cast<uint32_t>(request.max_tokens);
  options.ignore_eos = true;
  client::GenerateCall call(connection_.inference(), client::Prompt(std::move(request.prompt)),
                            options, std::make_unique<BenchReceiver>(*this, id));

  pending.deadline =
      io_.provider->getTimer()
          .afterDelay(static_cast<int64_t>(timeout_s_ * 1e3) * kj::MILLISECONDS)
          .then([this, id] { complete(id, "timeout", "no done() within the request timeout"); })
          .eagerlyEvaluate(nullptr);
  pending.record.sent = clock.now();
  tasks_.add(call.send().then(
      [this, id](client::GenerateStart start) {
        if (start.refused) return complete(id, start.refused->kind, start.refused->message);
        if (Pending* p = find(id)) p->handle = kj::mv(start.handle);
      },
      [this, id](kj::Exception&& e) { complete(id, "connection", e.getDescription().cStr()); }));
}

Pending* Session::find(uint64_t id) {
  if (closing_) return nullptr;
  const auto it = pending_.find(id);
  return it == pending_.end() ? nullptr : it->second.get();
}

void Session::on_chunk(uint64_t id, bool has_text) {
  Pending* p = find(id);
  if (p == nullptr || !has_text) return;
  const double now = p->clock.now();
  if (!p->record.first_token) p->record.first_token = now;
  p->record.token_times.push_back(now);
}

void Session::on_done(uint64_t id, const client::Finish& finish) {
  Pending* p = find(id);
  if (p == nullptr) return;
  const client::Timings& timings = finish.timings;
  p->record.received_tokens = timings.completion_tokens;
  p->record.server_ttft = timings.ttft_ms / 1e3;
  p->record.server_tpot = timings.tpot_ms / 1e3;
  p->record.server_e2e = timings.e2e_ms / 1e3;
  switch (finish.reason) {
    case rpc::FinishReason::STOP:
    case rpc::FinishReason::LENGTH:
      return complete(id);
    case rpc::FinishReason::CANCELLED:
      return complete(id, "cancelled", "the server cancelled the request");
    case rpc::FinishReason::ERROR:
      return complete(id, finish.error_kind, finish.error_message);
  }
  complete(id, "error", "unknown finish reason");
}

void Session::on_sink_dropped(uint64_t id) {
  if (find(id) != nullptr) complete(id, "connection", "the server dropped the request's sink");
}

void Session::complete(uint64_t id, std::string kind, std::string message) {
  const auto it = pending_.find(id);
  if (closing_ || it == pending_.end()) return;
  kj::Own<Pending> pending = kj::mv(it->second);
  pending_.erase(it);
  RequestRecord& record = pending->record;
  record.finished = pending->clock.now();
  record.ok = kind.empty();
  record.error_kind = std::move(kind);
  record.error_message = std::move(message);
  if (!record.ok && record.received_tokens == 0)
    record.received_tokens = static_cast<int64_t>(record.token_times.size());
  pending->done(std::move(record));
  // Destroyed on a later turn: complete() may run inside the deadline's own callback.
  tasks_.add(kj::evalLater([pending = kj::mv(pending)]() mutable { pending = nullptr; }));
}

class RpcClient final : public Client {
 public:
  explicit RpcClient(const RpcClientOptions& options);
  ~RpcClient() noexcept override;  // kj members would make it noexcept(false)
  RpcClient(const RpcClient&) = delete;
  RpcClient& operator=(const RpcClient&) = delete;

  std::vector<int32_t> tokenize(const std::string& text) override;
  void send(ClientRequest request, RequestRecord record, const RunClock& clock,
            RecordDone done) override;
  std::string describe() const override { return "duet rpc " + options_.endpoint; }

 private:
  void run(std::promise<void>& ready);

  const RpcClientOptions options_;
  // Set by the loop thread before `ready`; used from other threads only
  // through executor_, and only between `ready` and the end of the destructor.
  kj::Own<const kj::Executor> executor_;
  Session* session_ = nullptr;
  kj::Own<kj::PromiseFulfiller<void>> stop_;  // the loop thread's
  std::thread thread_;
};

RpcClient::RpcClient(const RpcClientOptions& options) : options_(options) {
  std::promise<void> ready;
  std::future<void> started = ready.get_future();
  thread_ = std::thread([this, &ready] { run(ready); });
  try {
    started.get();
  } catch (const client::RpcError& e) {
    // Cannot reach, another protocol, or a refused login: duet::Error, as
    // make_rpc_client promises.
    thread_.join();
    throw Error(ErrorKind::kInvalidArgument, fmt::format("{}: {}", e.kind(), e.what()));
  } catch (...) {
    thread_.join();
    throw;
  }
}

void RpcClient::run(std::promise<void>& ready) {
  bool is_ready = false;
  try {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    Session session(io, options_);
    auto stop = kj::newPromiseAndFulfiller<void>();
    stop_ = kj::mv(stop.fulfiller);
    session_ = &session;
    executor_ = kj::getCurrentThreadExecutor().addRef();
    is_ready = true;
    ready.set_value();
    stop.promise.wait(io.waitScope);
    session_ = nullptr;
    stop_ = nullptr;
  } catch (...) {
    if (!is_ready) return ready.set_exception(std::current_exception());
    throw;  // a bug of ours after start-up
  }
}

RpcClient::~RpcClient() noexcept {
  executor_->executeSync([this] { stop_->fulfill(); });
  thread_.join();
}

std::vector<int32_t> RpcClient::tokenize(const std::string& text) {
  try {
    return executor_->executeSync([this, &text] { return session_->tokenize(text); });
  } catch (const kj::Exception& e) {
    throw Error(
        ErrorKind::kInvalidArgument,
        fmt::format("{}: tokenize failed: {}", options_.endpoint, e.getDescription().cStr()));
  }
}

void RpcClient::send(ClientRequest request, RequestRecord record, const RunClock& clock,
                     RecordDone done) {
  executor_->executeSync(
      [&] { session_->start(std::move(request), std::move(record), clock, std::move(done)); });
}

}  // namespace

std::unique_ptr<Client> make_rpc_client(const RpcClientOptions& options) {
  return std::make_unique<RpcClient>(options);
}

}  // namespace duet::loadgen
