// The Cap'n Proto front end to end, in one process over real loopback
// sockets: a LocalInstance on the default model, the Service, an RpcServer on
// a free port, and a kj client on the test's thread. Greedy text over RPC
// equals the engine's own; cancel(), dropping the handle, disconnecting and
// destroying the server all end the request and free its KV; 64 concurrent
// streams all complete; refusals arrive typed and the server keeps serving.
#include "tests/serve/rpc_fixture.h"

namespace duet::rpc_testing {

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

}  // namespace duet::rpc_testing
