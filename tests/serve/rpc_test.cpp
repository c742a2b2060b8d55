// The Cap'n Proto front end to end, in one process over real loopback
// sockets: a LocalInstance on the default model, the Service, an RpcServer on
// a free port, and a kj client on the test's thread. Greedy text over RPC
// equals the engine's own; cancel(), dropping the handle, disconnecting and
// destroying the server all end the request and free its KV; 64 concurrent
// streams all complete; refusals arrive typed and the server keeps serving.
#include <capnp/rpc-twoparty.h>
#include <gtest/gtest.h>
#include <kj/async-io.h>

#include <memory>
#include <string>
#include <vector>

#include "common/duet.capnp.h"
#include "common/error.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/rpc/rpc_server.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/local_instance.h"

namespace duet {
namespace {

constexpr kj::Duration kCallTimeout = 60 * kj::SECONDS;

// What a stream delivered; shared by the test and its sink, which the RPC
// system may keep a little longer than the test needs it.
struct StreamRecord {
  std::string text;
  std::vector<int32_t> tokens;
  int n_writes = 0;
  bool done = false;
  rpc::FinishReason reason = rpc::FinishReason::ERROR;
  rpc::ErrorKind error_kind = rpc::ErrorKind::INTERNAL;  // with reason ERROR
  uint32_t completion_tokens = 0;
  uint32_t prompt_tokens = 0;
  double ttft_ms = 0, e2e_ms = 0;
};

class RecordingSink final : public rpc::TokenSink::Server {
 public:
  RecordingSink(std::shared_ptr<StreamRecord> record,
                kj::Own<kj::PromiseFulfiller<void>> first_write,
                kj::Own<kj::PromiseFulfiller<void>> done)
      : record_(std::move(record)), first_write_(kj::mv(first_write)), done_(kj::mv(done)) {}

 protected:
  kj::Promise<void> write(WriteContext context) override {
    const auto chunk = context.getParams().getChunk();
    record_->text += chunk.getText().cStr();
    for (int32_t id : chunk.getTokenIds()) record_->tokens.push_back(id);
    ++record_->n_writes;
    if (first_write_->isWaiting()) first_write_->fulfill();
    return kj::READY_NOW;
  }

  kj::Promise<void> done(DoneContext context) override {
    const auto finish = context.getParams().getFinish();
    EXPECT_FALSE(record_->done) << "done() twice";
    record_->done = true;
    record_->reason = finish.getReason();
    if (finish.hasError()) record_->error_kind = finish.getError().getKind();
    record_->completion_tokens = finish.getTimings().getCompletionTokens();
    record_->prompt_tokens = finish.getTimings().getPromptTokens();
    record_->ttft_ms = finish.getTimings().getTtftMs();
    record_->e2e_ms = finish.getTimings().getE2eMs();
    if (first_write_->isWaiting()) first_write_->fulfill();
    done_->fulfill();
    return kj::READY_NOW;
  }

 private:
  std::shared_ptr<StreamRecord> record_;
  kj::Own<kj::PromiseFulfiller<void>> first_write_;
  kj::Own<kj::PromiseFulfiller<void>> done_;
};

// One started (or refused) generation as the client sees it.
struct Stream {
  std::shared_ptr<StreamRecord> record = std::make_shared<StreamRecord>();
  kj::Promise<void> first_write = nullptr;
  kj::Promise<void> done = nullptr;
  rpc::RequestHandle::Client handle = nullptr;
  bool refused = false;
  rpc::ErrorKind error = rpc::ErrorKind::INTERNAL;
};

// A client connection on the test's event loop.
class Client {
 public:
  Client(kj::AsyncIoContext& io, uint16_t port) : io_(io) {
    auto address = io.provider->getNetwork().parseAddress("127.0.0.1", port).wait(io.waitScope);
    stream_ = address->connect().wait(io.waitScope);
    rpc_ = kj::heap<capnp::TwoPartyClient>(*stream_);
    gateway_ = rpc_->bootstrap().castAs<rpc::Gateway>();
  }

  rpc::Gateway::Client& gateway() { return gateway_; }

  // Logs in; a refusal is reported through `error` and returns false.
  bool login(const std::string& key, rpc::ErrorKind* error = nullptr) {
    auto request = gateway_.loginRequest();
    request.setApiKey(key);
    auto response = wait(request.send());
    auto result = response.getResult();
    if (result.isError()) {
      if (error != nullptr) *error = result.getError().getKind();
      EXPECT_GT(result.getError().getMessage().size(), 0u);
      return false;
    }
    inference_ = result.getInference();
    return true;
  }

  rpc::Inference::Client& inference() { return inference_; }

  // Sends a generate request that `fill` writes.
  template <typename Fill>
  Stream generate(Fill&& fill) {
    Stream stream;
    auto first = kj::newPromiseAndFulfiller<void>();
    auto done = kj::newPromiseAndFulfiller<void>();
    stream.first_write = kj::mv(first.promise);
    stream.done = kj::mv(done.promise);
    auto request = inference_.generateRequest();
    fill(request.initRequest());
    request.setSink(
        kj::heap<RecordingSink>(stream.record, kj::mv(first.fulfiller), kj::mv(done.fulfiller)));
    auto response = wait(request.send());
    auto result = response.getResult();
    if (result.isError()) {
      stream.refused = true;
      stream.error = result.getError().getKind();
      EXPECT_GT(result.getError().getMessage().size(), 0u);
    } else {
      stream.handle = result.getStarted().getHandle();
    }
    return stream;
  }

  capnp::Response<rpc::Inference::StatsResults> stats() {
    return wait(inference_.statsRequest().send());
  }

  template <typename T>
  T wait(kj::Promise<T>&& promise) {
    return io_.provider->getTimer().timeoutAfter(kCallTimeout, kj::mv(promise)).wait(io_.waitScope);
  }

 private:
  kj::AsyncIoContext& io_;
  kj::Own<kj::AsyncIoStream> stream_;
  kj::Own<capnp::TwoPartyClient> rpc_;
  rpc::Gateway::Client gateway_ = nullptr;
  rpc::Inference::Client inference_ = nullptr;
};

void set_tokens(rpc::GenerateRequest::Builder request, const std::vector<int32_t>& tokens) {
  auto list = request.initPrompt().initTokens(static_cast<unsigned>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) list.set(static_cast<unsigned>(i), tokens[i]);
}

class RpcTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto path = testing::default_model_path();
    if (!path) return;
    model_ = LlamaModel::load(*path).release();
    tokenizer_ = new Tokenizer(tokenizer_from_gguf(model_->file()));
    pool_ = new cpu::ThreadPool(1);
  }
  static void TearDownTestSuite() {
    delete pool_;
    delete tokenizer_;
    delete model_;
    pool_ = nullptr;
    tokenizer_ = nullptr;
    model_ = nullptr;
  }

  void SetUp() override {
    if (model_ == nullptr)
      GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it";
    io_ = std::make_unique<kj::AsyncIoContext>(kj::setupAsyncIo());
  }

  void start(RpcServerOptions options = {}, int64_t max_running = 64) {
    EngineConfig config;
    config.scheduler.max_running = max_running;
    config.n_kv_blocks = 160;  // 2,560 tokens
    config.end_of_generation = tokenizer_->end_of_generation_ids();
    instance_ = std::make_unique<LocalInstance>(*model_, cpu::kernel_table(cpu::best_isa()), *pool_,
                                                config, "smollm2");
    ServiceLimits limits;
    limits.max_prompt_tokens = 64;
    limits.max_tokens = 1024;
    service_ = std::make_unique<Service>(*instance_, *tokenizer_, ChatTemplateKind::kChatMl,
                                         "smollm2", limits);
    rpc_ = std::make_unique<RpcServer>(*service_, options);
    ASSERT_NE(rpc_->port(), 0);
  }

  void TearDown() override {
    clients_.clear();  // before the loop they live on
    rpc_.reset();      // before the service it serves
    service_.reset();  // before the instance it listens to
    instance_.reset();
    io_.reset();
  }

  Client& connect(const std::string& key = "") {
    clients_.push_back(std::make_unique<Client>(*io_, rpc_->port()));
    if (!clients_.back()->login(key)) ADD_FAILURE() << "login refused";
    return *clients_.back();
  }

  void sleep_ms(int ms) {
    io_->provider->getTimer().afterDelay(ms * kj::MILLISECONDS).wait(io_->waitScope);
  }

  // Polls stats() until nothing runs and every KV block is free.
  void expect_kv_free(Client& client) {
    for (int i = 0; i < 2000; ++i) {
      auto response = client.stats();
      const auto s = response.getStats();
      if (s.getRunningSequences() == 0 && s.getWaitingSequences() == 0 &&
          s.getKvBlocksFree() == s.getKvBlocksTotal() && s.getActiveRequests() == 0) {
        EXPECT_GT(s.getKvBlocksTotal(), 0u);
        return;
      }
      sleep_ms(5);
    }
    auto response = client.stats();
    const auto s = response.getStats();
    ADD_FAILURE() << "KV not freed: running " << s.getRunningSequences() << ", free "
                  << s.getKvBlocksFree() << "/" << s.getKvBlocksTotal();
  }

  // A small request that must succeed: the server still serves.
  void expect_serving(Client& client) {
    Stream s = client.generate([](rpc::GenerateRequest::Builder r) {
      r.initPrompt().setText("Hello");
      r.setMaxTokens(2);
      r.setIgnoreEos(true);
    });
    ASSERT_FALSE(s.refused);
    client.wait(kj::mv(s.done));
    EXPECT_EQ(s.record->reason, rpc::FinishReason::LENGTH);
    EXPECT_EQ(s.record->completion_tokens, 2u);
  }

  // After a request ended early: its KV is freed and the server still serves.
  void expect_recovered(Client& client) {
    expect_kv_free(client);
    expect_serving(client);
  }

  // Once the server is gone: the instance runs nothing and holds no KV.
  void expect_instance_idle() {
    const InstanceStats stats = instance_->stats();
    EXPECT_EQ(stats.running, 0);
    EXPECT_EQ(stats.kv_blocks_free, stats.kv_blocks_total);
  }

  // Sends a request long enough to cancel while it runs into `s`, and waits
  // for its first write.
  static void start_long_request(Client& client, Stream& s) {
    s = client.generate([](rpc::GenerateRequest::Builder r) {
      r.initPrompt().setText("Tell me a very long story about a dragon.");
      r.setMaxTokens(1000);
      r.setIgnoreEos(true);
    });
    ASSERT_FALSE(s.refused);
    client.wait(kj::mv(s.first_write));
  }

  static inline LlamaModel* model_ = nullptr;
  static inline Tokenizer* tokenizer_ = nullptr;
  static inline cpu::ThreadPool* pool_ = nullptr;

  std::unique_ptr<kj::AsyncIoContext> io_;  // the test thread's event loop
  std::unique_ptr<LocalInstance> instance_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<RpcServer> rpc_;
  std::vector<std::unique_ptr<Client>> clients_;
};

TEST_F(RpcTest, GreedyGenerateEqualsTheEnginesOwn) {
  start();
  Client& client = connect();
  const std::vector<int32_t> prompt = tokenizer_->encode("The capital of France is", true, true);
  constexpr int kMaxTokens = 16;

  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_,
                {.end_of_generation = tokenizer_->end_of_generation_ids()});
  std::vector<int32_t> expected;
  engine.submit(prompt, {.max_tokens = kMaxTokens}, [&](const TokenEvent& e) {
    if (e.token >= 0) expected.push_back(e.token);
  });
  engine.run_until_idle();
  ASSERT_FALSE(expected.empty());

  Stream s = client.generate([&](rpc::GenerateRequest::Builder r) {
    set_tokens(r, prompt);
    r.setMaxTokens(kMaxTokens);
    r.setIncludeTokenIds(true);
  });
  ASSERT_FALSE(s.refused);
  client.wait(kj::mv(s.done));
  EXPECT_EQ(s.record->tokens, expected);
  EXPECT_EQ(s.record->text, tokenizer_->decode(expected, /*skip_special=*/true));
  EXPECT_EQ(s.record->reason, static_cast<int>(expected.size()) < kMaxTokens
                                  ? rpc::FinishReason::STOP
                                  : rpc::FinishReason::LENGTH);
  EXPECT_EQ(s.record->completion_tokens, expected.size());
  EXPECT_EQ(s.record->prompt_tokens, prompt.size());
  EXPECT_GT(s.record->ttft_ms, 0.0);
  EXPECT_GE(s.record->e2e_ms, s.record->ttft_ms);
  expect_kv_free(client);
}

TEST_F(RpcTest, QueriesAnswer) {
  start();
  Client& client = connect();
  {
    auto response = client.wait(client.gateway().versionRequest().send());
    EXPECT_EQ(response.getProtocolVersion(), rpc::PROTOCOL_VERSION);
  }
  {
    auto response = client.wait(client.inference().modelInfoRequest().send());
    EXPECT_EQ(std::string(response.getInfo().getName().cStr()), "smollm2");
    EXPECT_EQ(response.getInfo().getVocabSize(), tokenizer_->vocab_size());
    EXPECT_EQ(response.getInfo().getMaxPromptTokens(), 64u);
  }
  {
    auto response = client.wait(client.inference().healthRequest().send());
    EXPECT_EQ(response.getStatus(), rpc::HealthStatus::SERVING);
  }
  const std::string text = "Hello, world! 123";
  std::vector<int32_t> ids;
  {
    auto request = client.inference().tokenizeRequest();
    request.setText(text);
    request.setAddSpecial(false);
    auto response = client.wait(request.send());
    ASSERT_TRUE(response.getResult().isTokens());
    for (int32_t id : response.getResult().getTokens()) ids.push_back(id);
    EXPECT_EQ(ids, tokenizer_->encode(text, false, true));
  }
  {
    auto request = client.inference().detokenizeRequest();
    auto list = request.initTokens(static_cast<unsigned>(ids.size()));
    for (size_t i = 0; i < ids.size(); ++i) list.set(static_cast<unsigned>(i), ids[i]);
    auto response = client.wait(request.send());
    ASSERT_TRUE(response.getResult().isText());
    EXPECT_EQ(std::string(response.getResult().getText().cStr()), text);
  }
  {
    auto request = client.inference().detokenizeRequest();
    request.initTokens(1).set(0, 1 << 30);  // outside the vocabulary
    auto response = client.wait(request.send());
    ASSERT_TRUE(response.getResult().isError());
    EXPECT_EQ(response.getResult().getError().getKind(), rpc::ErrorKind::INVALID_ARGUMENT);
  }
}

// The server started and a long request running on client_, past its first
// write: the tests end it in each way a request can end early.
class RpcRunningTest : public RpcTest {
 protected:
  void SetUp() override {
    RpcTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_NO_FATAL_FAILURE(start());
    client_ = &connect();
    running_ = std::make_unique<Stream>();
    ASSERT_NO_FATAL_FAILURE(start_long_request(*client_, *running_));
  }

  void TearDown() override {
    running_.reset();  // before the loop its promises live on
    RpcTest::TearDown();
  }

  Client* client_ = nullptr;  // owned by clients_
  // Behind a pointer: a fixture's destructor may not throw, and kj's may.
  std::unique_ptr<Stream> running_;
};

TEST_F(RpcRunningTest, CancelEndsTheRequestAndFreesTheKv) {
  client_->wait(running_->handle.cancelRequest().send());
  client_->wait(kj::mv(running_->done));
  EXPECT_EQ(running_->record->reason, rpc::FinishReason::CANCELLED);
  EXPECT_LT(running_->record->completion_tokens, 1000u);
  expect_recovered(*client_);
}

TEST_F(RpcRunningTest, DroppingTheHandleCancels) {
  running_->handle = nullptr;  // the release reaches the server; it cancels
  client_->wait(kj::mv(running_->done));
  EXPECT_EQ(running_->record->reason, rpc::FinishReason::CANCELLED);
  expect_recovered(*client_);
}

TEST_F(RpcTest, DisconnectingCancels) {
  start();
  Client& observer = connect();
  {
    auto leaving = std::make_unique<Client>(*io_, rpc_->port());
    ASSERT_TRUE(leaving->login(""));
    Stream s;
    ASSERT_NO_FATAL_FAILURE(start_long_request(*leaving, s));
  }  // the connection closes with the request running
  expect_recovered(observer);
}

TEST_F(RpcRunningTest, StoppingCancelsWhatRunsAndTellsTheClient) {
  rpc_->stop();
  client_->wait(kj::mv(running_->done));
  EXPECT_EQ(running_->record->reason, rpc::FinishReason::CANCELLED);
  sleep_ms(50);  // the answer to done() goes out; the server's drain ends with it
  rpc_.reset();
  expect_instance_idle();
}

TEST_F(RpcRunningTest, DrainingRefusesNewRequestsUnavailableAndSaysSo) {
  service_->begin_drain();
  {
    auto response = client_->wait(client_->inference().healthRequest().send());
    EXPECT_EQ(response.getStatus(), rpc::HealthStatus::DRAINING);
  }
  EXPECT_TRUE(client_->stats().getStats().getDraining());
  Stream refused = client_->generate([](rpc::GenerateRequest::Builder r) {
    r.initPrompt().setText("Hello");
    r.setMaxTokens(2);
  });
  EXPECT_TRUE(refused.refused);
  EXPECT_EQ(refused.error, rpc::ErrorKind::UNAVAILABLE);
  // What runs goes on until it is cut: then it ends with the typed error.
  service_->cut("the server is shutting down");
  client_->wait(kj::mv(running_->done));
  EXPECT_EQ(running_->record->reason, rpc::FinishReason::ERROR);
  EXPECT_EQ(running_->record->error_kind, rpc::ErrorKind::UNAVAILABLE);
  EXPECT_GT(running_->record->completion_tokens, 0u);
  expect_kv_free(*client_);
}

TEST_F(RpcRunningTest, DestroyingTheServerCancelsWhatRuns) {
  // This thread's client cannot answer done() while it waits here: the
  // destructor gives up on it after its drain timeout, then returns once the
  // request's final update arrived.
  rpc_.reset();
  expect_instance_idle();
}

TEST_F(RpcTest, SixtyFourConcurrentStreamsComplete) {
  start();
  Client& client = connect();
  constexpr int kStreams = 64;
  constexpr uint32_t kTokens = 8;
  std::vector<Stream> streams;
  for (int i = 0; i < kStreams; ++i) {
    streams.push_back(client.generate([&](rpc::GenerateRequest::Builder r) {
      r.initPrompt().setText("Request number " + std::to_string(i) + " says");
      r.setMaxTokens(kTokens);
      r.setIgnoreEos(true);
      r.setIncludeTokenIds(true);
    }));
    ASSERT_FALSE(streams.back().refused) << i;
  }
  for (int i = 0; i < kStreams; ++i) {
    client.wait(kj::mv(streams[i].done));
    const StreamRecord& r = *streams[i].record;
    EXPECT_EQ(r.reason, rpc::FinishReason::LENGTH) << i;
    EXPECT_EQ(r.completion_tokens, kTokens) << i;
    EXPECT_EQ(r.tokens.size(), kTokens) << i;
    EXPECT_EQ(r.text, tokenizer_->decode(r.tokens, /*skip_special=*/true)) << i;
    EXPECT_LE(r.n_writes, static_cast<int>(kTokens)) << i;
  }
  expect_kv_free(client);
}

TEST_F(RpcTest, RefusalsAreTypedAndTheServerKeepsServing) {
  start();
  Client& client = connect();
  const auto refusal = [&](auto fill) {
    Stream s = client.generate(fill);
    EXPECT_TRUE(s.refused);
    return s.error;
  };
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) {
              std::string prompt;
              for (int i = 0; i < 100; ++i) prompt += " word";
              r.initPrompt().setText(prompt);  // over max_prompt_tokens (64)
            }),
            rpc::ErrorKind::TOO_LONG);
  expect_serving(client);
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) {
              r.initPrompt().setText("Hi");
              r.setMaxTokens(5000);  // over max_tokens (1024)
            }),
            rpc::ErrorKind::TOO_LONG);
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) {
              r.initPrompt().setText("Hi");
              r.initSampling().setTemperature(-1.0f);
            }),
            rpc::ErrorKind::INVALID_ARGUMENT);
  expect_serving(client);
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) { r.initPrompt().setText(""); }),
            rpc::ErrorKind::INVALID_ARGUMENT);
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) {
              r.initPrompt().setText("Hi");
              r.setModel("no-such-model");
            }),
            rpc::ErrorKind::NOT_FOUND);
  EXPECT_EQ(refusal([](rpc::GenerateRequest::Builder r) {
              r.initPrompt().initTokens(1).set(0, 1 << 30);  // outside the vocabulary
              r.setMaxTokens(2);
            }),
            rpc::ErrorKind::INVALID_ARGUMENT);
  expect_serving(client);
  auto response = client.stats();
  EXPECT_GE(response.getStats().getRefusedRequests(), 5u);
}

TEST_F(RpcTest, ApiKeyIsRequiredWhenSet) {
  start({.api_key = "sesame"});
  {
    Client wrong(*io_, rpc_->port());
    rpc::ErrorKind error = rpc::ErrorKind::INTERNAL;
    EXPECT_FALSE(wrong.login("open", &error));
    EXPECT_EQ(error, rpc::ErrorKind::UNAUTHENTICATED);
    EXPECT_FALSE(wrong.login("", &error));
    EXPECT_EQ(error, rpc::ErrorKind::UNAUTHENTICATED);
  }
  Client& client = connect("sesame");
  expect_serving(client);
}

TEST_F(RpcTest, BindingABusyPortThrows) {
  start();
  EXPECT_THROW(RpcServer(*service_, {.port = rpc_->port()}), Error);
}

// Whether a call on `client` fails because the server closed its connection;
// `why` gets the reason the client saw.
bool disconnected(Client& client, std::string* why = nullptr) {
  try {
    client.wait(client.gateway().versionRequest().send());
    return false;
  } catch (const kj::Exception& e) {
    if (why != nullptr) *why = e.getDescription().cStr();
    return e.getType() == kj::Exception::Type::DISCONNECTED;
  }
}

// Past max_connections a connection is closed at once, and counted; once one
// leaves, a new one is served.
TEST_F(RpcTest, ConnectionsPastTheCapAreClosedAndCounted) {
  start({.max_connections = 2});
  Client& first = connect();
  auto second = std::make_unique<Client>(*io_, rpc_->port());
  ASSERT_TRUE(second->login(""));
  Client third(*io_, rpc_->port());
  EXPECT_TRUE(disconnected(third));
  const std::string metrics = service_->metrics_text();
  EXPECT_NE(metrics.find("duet_connections_refused_total{front=\"rpc\"} 1"), std::string::npos)
      << metrics;
  expect_serving(first);
  second.reset();
  sleep_ms(100);  // the server sees the close
  Client fourth(*io_, rpc_->port());
  ASSERT_TRUE(fourth.login(""));
  expect_serving(fourth);
}

// A connection with no call and no stream for idle_timeout is closed; one
// whose stream waits in the queue for its first token, or generates, is not.
TEST_F(RpcTest, IdleConnectionsCloseButStreamingOnesStay) {
  start({.idle_timeout = std::chrono::milliseconds(300)}, /*max_running=*/1);
  Client& idle = connect();
  Client& busy = connect();
  Client& queued = connect();
  Stream running;
  ASSERT_NO_FATAL_FAILURE(start_long_request(busy, running));
  Stream waiting = queued.generate([](rpc::GenerateRequest::Builder r) {
    r.initPrompt().setText("Hello");
    r.setMaxTokens(2);
    r.setIgnoreEos(true);
  });
  ASSERT_FALSE(waiting.refused);
  sleep_ms(1000);  // over three timeouts: `waiting` has no token yet (one runs at a time)
  EXPECT_EQ(waiting.record->n_writes, 0);
  std::string why;
  EXPECT_TRUE(disconnected(idle, &why)) << why;
  EXPECT_FALSE(disconnected(busy, &why)) << why;
  EXPECT_FALSE(disconnected(queued, &why)) << why;
  busy.wait(running.handle.cancelRequest().send());
  busy.wait(kj::mv(running.done));
  queued.wait(kj::mv(waiting.done));
  EXPECT_EQ(waiting.record->reason, rpc::FinishReason::LENGTH);
  expect_recovered(queued);
}

// A message over the reader limits (rpc_reader_limits) ends its connection
// with the reason; the server goes on serving new ones.
TEST_F(RpcTest, OversizeMessageIsRefusedAndTheServerKeepsServing) {
  start();
  const RpcReaderLimits limits = rpc_reader_limits(*service_);
  EXPECT_LT(limits.traversal_limit_words, 8u << 20) << "no tighter than Cap'n Proto's default";
  Client& client = connect();
  const size_t too_big = limits.traversal_limit_words * sizeof(capnp::word) + 1024;
  std::string why;
  try {
    client.generate([&](rpc::GenerateRequest::Builder r) {
      r.initPrompt().setText(std::string(too_big, 'a'));
      r.setMaxTokens(2);
    });
    ADD_FAILURE() << "an oversize message was served";
  } catch (const kj::Exception& e) {
    why = e.getDescription().cStr();
  }
  EXPECT_NE(why.find("too large"), std::string::npos) << why;
  Client& next = connect();
  expect_serving(next);
}

}  // namespace
}  // namespace duet
