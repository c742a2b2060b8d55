// The Cap'n Proto front's limits, in one process over real loopback sockets:
// the API key, a busy port, connections past the cap, idle connections (a
// queued stream is not idle), and a message past the reader limits, after
// which the server keeps serving.
#include "tests/serve/rpc_fixture.h"

namespace duet::rpc_testing {

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

}  // namespace duet::rpc_testing
