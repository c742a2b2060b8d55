// The coordinator's service over a real engine thread (LocalInstance) on the
// default model: validation refuses bad requests with typed errors, greedy
// text equals the engine's own, stop strings end a request early, cancel
// frees the KV at once, admission refuses with kOverloaded when the waiting
// queue is full, the metrics count what happened, and a drain refuses new
// requests (kUnavailable) while running ones finish, until a cut ends them.
#include "coordinator/service.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/local_instance.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

// Collects every update, by request; waits for final ones.
class CollectingSink final : public UpdateSink {
 public:
  void deliver(std::vector<RequestUpdate> updates) override {
    std::lock_guard lock(mutex_);
    for (RequestUpdate& u : updates) {
      Output& out = outputs_[u.id];
      out.text += u.text;
      out.tokens.insert(out.tokens.end(), u.tokens.begin(), u.tokens.end());
      ++out.n_updates;
      if (u.finished) {
        EXPECT_FALSE(out.finished) << "two final updates for one request";
        out.finished = true;
        out.finish = u.finish;
        out.timings = u.timings;
        out.error = u.error;
      }
    }
    changed_.notify_all();
  }

  struct Output {
    std::string text;
    std::vector<int32_t> tokens;
    int n_updates = 0;
    bool finished = false;
    ServeFinish finish = ServeFinish::kError;
    RequestTimings timings;
    std::optional<ServeError> error;
  };

  Output wait(RequestId id) {
    std::unique_lock lock(mutex_);
    const bool done = changed_.wait_for(lock, 60s, [&] { return outputs_[id].finished; });
    EXPECT_TRUE(done) << "request " << id.value << " did not finish";
    return outputs_[id];
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<RequestId, Output> outputs_;
};

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
    model_ = LlamaModel::load(path);
    tokenizer_ = std::make_unique<Tokenizer>(tokenizer_from_gguf(model_->file()));
    pool_ = std::make_unique<cpu::ThreadPool>(1);
  }

  void start(EngineConfig config = {}, ServiceLimits limits = {}) {
    config.end_of_generation = tokenizer_->end_of_generation_ids();
    instance_ = std::make_unique<LocalInstance>(*model_, cpu::kernel_table(cpu::best_isa()), *pool_,
                                                config, "smollm2");
    service_ = std::make_unique<Service>(*instance_, *tokenizer_, ChatTemplateKind::kChatMl,
                                         "smollm2", limits);
  }

  void TearDown() override {
    service_.reset();  // before the instance it listens to
    instance_.reset();
  }

  RequestId started(ServeRequest request) {
    Result<Admitted> r = service_->start(std::move(request), sink_);
    if (auto* e = std::get_if<ServeError>(&r)) {
      ADD_FAILURE() << "refused: " << e->message;
      return {};
    }
    return std::get<Admitted>(r).id;
  }

  ServeErrorKind refusal(ServeRequest request) {
    Result<Admitted> r = service_->start(std::move(request), sink_);
    auto* e = std::get_if<ServeError>(&r);
    if (e == nullptr) {
      ADD_FAILURE() << "accepted a request that should be refused";
      return ServeErrorKind::kInternal;
    }
    EXPECT_FALSE(e->message.empty());
    return e->kind;
  }

  // Polls the instance until every KV block is free and nothing runs.
  void expect_kv_free() {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    InstanceStats s;
    do {
      s = service_->stats().instance;
      if (s.running == 0 && s.waiting == 0 && s.kv_blocks_free == s.kv_blocks_total) return;
      std::this_thread::sleep_for(5ms);
    } while (std::chrono::steady_clock::now() < deadline);
    ADD_FAILURE() << "KV not freed: running " << s.running << ", free " << s.kv_blocks_free << "/"
                  << s.kv_blocks_total;
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  std::unique_ptr<LocalInstance> instance_;
  std::unique_ptr<Service> service_;
  CollectingSink sink_;
};

TEST_F(ServiceTest, GreedyTextEqualsTheEnginesOwn) {
  start();
  const std::string prompt = "The capital of France is";
  const std::vector<int32_t> ids = tokenizer_->encode(prompt, true, true);

  // The engine alone, on this thread.
  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_,
                {.end_of_generation = tokenizer_->end_of_generation_ids()});
  std::vector<int32_t> expected;
  engine.submit(ids, {.max_tokens = 24}, [&](const TokenEvent& e) {
    if (e.token >= 0) expected.push_back(e.token);
  });
  engine.run_until_idle();

  const RequestId id = started({.prompt = prompt, .max_tokens = 24, .include_token_ids = true});
  const CollectingSink::Output out = sink_.wait(id);
  EXPECT_EQ(out.tokens, expected);
  EXPECT_EQ(out.text, tokenizer_->decode(expected, /*skip_special=*/true));
  EXPECT_EQ(out.timings.prompt_tokens, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(out.timings.completion_tokens, static_cast<int64_t>(expected.size()));
  EXPECT_GT(out.timings.ttft_s, 0.0);
  EXPECT_GE(out.timings.e2e_s, out.timings.ttft_s);
  EXPECT_LT(out.timings.queue_s, out.timings.ttft_s);  // admitted before its first forward step
  expect_kv_free();
}

TEST_F(ServiceTest, TokenPromptsAndChatPromptsWork) {
  start();
  const RequestId chat =
      started({.prompt = std::vector<ChatMessage>{{"user", "Say hi."}}, .max_tokens = 8});
  const RequestId tokens =
      started({.prompt = std::vector<int32_t>{1, 2, 3, 400}, .max_tokens = 4, .ignore_eos = true});
  EXPECT_NE(sink_.wait(chat).finish, ServeFinish::kError);
  const CollectingSink::Output out = sink_.wait(tokens);
  EXPECT_EQ(out.finish, ServeFinish::kLength);
  EXPECT_EQ(out.timings.completion_tokens, 4);
}

TEST_F(ServiceTest, StopStringEndsTheRequestAndIsNotShown) {
  start();
  // Find what greedy decoding says, then stop on a word inside it.
  const RequestId probe =
      started({.prompt = "One, two, three, four,", .max_tokens = 16, .ignore_eos = true});
  const std::string full = sink_.wait(probe).text;
  ASSERT_GE(full.size(), 8u) << full;
  const std::string stop = full.substr(4, 3);
  const RequestId id = started(
      {.prompt = "One, two, three, four,", .max_tokens = 16, .stop = {stop}, .ignore_eos = true});
  const CollectingSink::Output out = sink_.wait(id);
  EXPECT_EQ(out.finish, ServeFinish::kStop);
  EXPECT_EQ(out.text, full.substr(0, full.find(stop)));
  EXPECT_LT(out.timings.completion_tokens, 16);
  expect_kv_free();
}

TEST_F(ServiceTest, CancelFreesTheKvAtOnce) {
  start();
  const RequestId id =
      started({.prompt = "Tell me a long story.", .max_tokens = 2000, .ignore_eos = true});
  // Wait until it runs, then cancel.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (service_->stats().instance.generated_tokens == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  service_->cancel(id);
  const CollectingSink::Output out = sink_.wait(id);
  EXPECT_EQ(out.finish, ServeFinish::kCancelled);
  EXPECT_LT(out.timings.completion_tokens, 2000);
  expect_kv_free();
  EXPECT_EQ(service_->metrics().requests_with_outcome("cancelled"), 1);
}

TEST_F(ServiceTest, BadRequestsGetTypedErrorsAndTheServiceGoesOn) {
  start({}, {.max_prompt_tokens = 64, .max_tokens = 100});
  EXPECT_EQ(refusal({.prompt = ""}), ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = std::string("bad \xff utf-8")}), ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = std::vector<int32_t>{1, -5}}), ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = std::vector<int32_t>{1, 1 << 30}}),
            ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = "hi", .max_tokens = 0}), ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = "hi", .max_tokens = -3}), ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = "hi", .max_tokens = 1'000'000}), ServeErrorKind::kTooLong);
  EXPECT_EQ(refusal({.prompt = "hi", .sampling = {.temperature = -1.0f}}),
            ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = "hi", .sampling = {.top_p = 1.5f}}),
            ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = "hi", .stop = {""}}), ServeErrorKind::kInvalidArgument);
  std::string long_prompt;
  for (int i = 0; i < 100; ++i) long_prompt += " word";
  EXPECT_EQ(refusal({.prompt = long_prompt}), ServeErrorKind::kTooLong);
  EXPECT_EQ(refusal({.prompt = std::vector<ChatMessage>{{"robot", "hi"}}}),
            ServeErrorKind::kInvalidArgument);
  EXPECT_EQ(refusal({.prompt = std::vector<ChatMessage>{}}), ServeErrorKind::kInvalidArgument);

  const RequestId ok = started({.prompt = "hi", .max_tokens = 3, .ignore_eos = true});
  EXPECT_EQ(sink_.wait(ok).timings.completion_tokens, 3);
  const std::string metrics = service_->metrics_text();
  EXPECT_NE(metrics.find("duet_requests_total{outcome=\"refused_too_long\"} 2"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("duet_requests_total{outcome=\"length\"} 1"), std::string::npos);
  EXPECT_NE(metrics.find("duet_time_to_first_token_seconds_count 1"), std::string::npos);
  EXPECT_NE(
      metrics.find("duet_instance_up{instance=\"0\",role=\"both\",leader=\"-1\",joined=\"0\"} 1"),
      std::string::npos)
      << metrics;
  EXPECT_EQ(service_->stats().refused_requests, 13);
}

// A text prompt longer than any text that fits max_prompt_tokens is refused
// from its byte length, before it is tokenized (tokenizing 16 MiB would take
// seconds); a prompt just under the limit still tokenizes and runs.
TEST_F(ServiceTest, OverlongPromptIsRefusedFromItsLengthBeforeTokenizing) {
  start({}, {.max_prompt_tokens = 64, .max_tokens = 100});
  ASSERT_EQ(service_->max_prompt_bytes(), 64 * static_cast<int64_t>(tokenizer_->max_token_bytes()));
  auto refused = [&](ServeRequest request) {
    const auto begin = std::chrono::steady_clock::now();
    Result<PreparedRequest> r = service_->prepare(std::move(request));
    const auto elapsed = std::chrono::steady_clock::now() - begin;
    auto* e = std::get_if<ServeError>(&r);
    if (e == nullptr) {
      ADD_FAILURE() << "an overlong prompt was accepted";
      return;
    }
    EXPECT_EQ(e->kind, ServeErrorKind::kTooLong);
    EXPECT_NE(e->message.find("at least"), std::string::npos) << e->message;
    EXPECT_LT(elapsed, 500ms) << "as long as tokenizing: " << e->message;
  };
  const std::string huge(16 << 20, 'a');
  refused({.prompt = huge});
  refused({.prompt = std::vector<ChatMessage>{{"user", huge.substr(0, 8 << 20)},
                                              {"assistant", huge.substr(0, 8 << 20)}}});
  // One byte over the bound is enough.
  refused({.prompt = std::string(static_cast<size_t>(service_->max_prompt_bytes()) + 1, 'a')});

  // Under the bound, the token count decides: 40 tokens run.
  std::string fits;
  for (int i = 0; i < 39; ++i) fits += " word";
  const RequestId ok = started({.prompt = fits, .max_tokens = 2, .ignore_eos = true});
  const auto out = sink_.wait(ok);
  EXPECT_EQ(out.timings.prompt_tokens,
            static_cast<int64_t>(tokenizer_->encode(fits, true, true).size()));
  EXPECT_EQ(out.timings.completion_tokens, 2);
}

TEST_F(ServiceTest, FullWaitingQueueRefusesWithOverloaded) {
  EngineConfig config;
  config.scheduler.max_running = 1;
  start(config, {.max_waiting = 1});
  const RequestId running = started({.prompt = "a", .max_tokens = 4000, .ignore_eos = true});
  // Running as the service counts it: the instance may report the sequence
  // running before the service has taken the admission off its waiting count.
  auto is_running = [&] {
    const ServiceStats s = service_->stats();
    return s.instance.running == 1 && s.waiting_requests == 0;
  };
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (!is_running() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(is_running());
  const RequestId waiting = started({.prompt = "b", .max_tokens = 2, .ignore_eos = true});
  EXPECT_EQ(refusal({.prompt = "c", .max_tokens = 2}), ServeErrorKind::kOverloaded);
  service_->cancel(running);
  EXPECT_EQ(sink_.wait(running).finish, ServeFinish::kCancelled);
  EXPECT_EQ(sink_.wait(waiting).finish, ServeFinish::kLength);
  // Room again.
  const RequestId later = started({.prompt = "c", .max_tokens = 2, .ignore_eos = true});
  EXPECT_EQ(sink_.wait(later).finish, ServeFinish::kLength);
  expect_kv_free();
}

TEST_F(ServiceTest, DrainRefusesNewRequestsAndLetsRunningOnesFinish) {
  start();
  const RequestId running = started({.prompt = "a", .max_tokens = 24, .ignore_eos = true});
  service_->begin_drain();
  EXPECT_EQ(service_->health().state, Service::HealthState::kDraining);
  EXPECT_FALSE(service_->healthy());
  EXPECT_TRUE(service_->stats().draining);
  EXPECT_NE(service_->metrics_text().find("duet_draining 1"), std::string::npos);
  EXPECT_EQ(refusal({.prompt = "b", .max_tokens = 2}), ServeErrorKind::kUnavailable);
  EXPECT_TRUE(service_->wait_idle(std::chrono::steady_clock::now() + 60s));
  const CollectingSink::Output out = sink_.wait(running);
  EXPECT_EQ(out.finish, ServeFinish::kLength);
  EXPECT_EQ(out.timings.completion_tokens, 24);
  EXPECT_EQ(service_->stats().active_requests, 0);
  expect_kv_free();
}

TEST_F(ServiceTest, DrainCutsWhatStillRunsAtItsDeadlineWithUnavailable) {
  start();
  const RequestId slow = started({.prompt = "a", .max_tokens = 4000, .ignore_eos = true});
  const RequestId queued = started({.prompt = "b", .max_tokens = 4000, .ignore_eos = true});
  service_->begin_drain();
  const auto begun = std::chrono::steady_clock::now();
  EXPECT_FALSE(service_->wait_idle(begun + 300ms));
  EXPECT_GE(std::chrono::steady_clock::now() - begun, 300ms);
  EXPECT_EQ(service_->stats().active_requests, 2);
  service_->cut("the server is shutting down");
  for (RequestId id : {slow, queued}) {
    const CollectingSink::Output out = sink_.wait(id);
    EXPECT_EQ(out.finish, ServeFinish::kError);
    ASSERT_TRUE(out.error.has_value());
    EXPECT_EQ(out.error->kind, ServeErrorKind::kUnavailable);
    EXPECT_EQ(out.error->message, "the server is shutting down");
    EXPECT_LT(out.timings.completion_tokens, 4000);
  }
  EXPECT_TRUE(service_->wait_idle(std::chrono::steady_clock::now() + 10s));
  EXPECT_EQ(service_->health().state, Service::HealthState::kUnavailable);
  EXPECT_EQ(refusal({.prompt = "c", .max_tokens = 2}), ServeErrorKind::kUnavailable);
  expect_kv_free();
}

TEST_F(ServiceTest, CutWakesAWaitForIdle) {
  start();
  started({.prompt = "a", .max_tokens = 4000, .ignore_eos = true});
  service_->begin_drain();
  std::thread cutter([&] {
    std::this_thread::sleep_for(100ms);
    service_->cut("the server is shutting down");
  });
  const auto begun = std::chrono::steady_clock::now();
  service_->wait_idle(begun + 60s);
  EXPECT_LT(std::chrono::steady_clock::now() - begun, 30s);
  cutter.join();
  EXPECT_TRUE(service_->wait_idle(std::chrono::steady_clock::now() + 10s));
}

}  // namespace
}  // namespace duet
