// The Cap'n Proto front's test fixture (tests/serve/rpc_test.cpp and
// rpc_limits_test.cpp): a LocalInstance on the default model, the Service, an
// RpcServer on a free port, and a kj client on the test's thread; RpcRunningTest
// adds a long request running on one client.
#pragma once

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

namespace duet::rpc_testing {

inline constexpr kj::Duration kCallTimeout = 60 * kj::SECONDS;

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

inline void set_tokens(rpc::GenerateRequest::Builder request, const std::vector<int32_t>& tokens) {
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

}  // namespace duet::rpc_testing
