// The control messages round-trip common/serving.h's types exactly through
// their Cap'n Proto form, and bytes that are not a control message are a clear
// error. No MPI.
#include "common/cluster/control_messages.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <limits>
#include <random>

#include "common/error.h"

namespace duet {
namespace {

ControlMessage round_trip(const ControlMessage& message) {
  const std::vector<std::byte> bytes = encode_control_message(message);
  EXPECT_EQ(bytes.size() % 8, 0u);
  return decode_control_message(bytes);
}

template <typename T>
T round_trip_as(const T& message) {
  ControlMessage decoded = round_trip(message);
  EXPECT_TRUE(std::holds_alternative<T>(decoded)) << control_message_name(decoded);
  return std::get<T>(decoded);
}

// Floats compared bit for bit: the wire must not round or normalize.
void expect_same(const SamplingParams& a, const SamplingParams& b) {
  EXPECT_EQ(std::bit_cast<uint32_t>(a.temperature), std::bit_cast<uint32_t>(b.temperature));
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.top_k, b.top_k);
  EXPECT_EQ(std::bit_cast<uint32_t>(a.top_p), std::bit_cast<uint32_t>(b.top_p));
  EXPECT_EQ(std::bit_cast<uint32_t>(a.min_p), std::bit_cast<uint32_t>(b.min_p));
  EXPECT_EQ(std::bit_cast<uint32_t>(a.repetition_penalty),
            std::bit_cast<uint32_t>(b.repetition_penalty));
  EXPECT_EQ(std::bit_cast<uint32_t>(a.frequency_penalty),
            std::bit_cast<uint32_t>(b.frequency_penalty));
  EXPECT_EQ(std::bit_cast<uint32_t>(a.presence_penalty),
            std::bit_cast<uint32_t>(b.presence_penalty));
  EXPECT_EQ(a.penalty_last_n, b.penalty_last_n);
}

void expect_same(const InstanceRequest& a, const InstanceRequest& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_EQ(a.max_tokens, b.max_tokens);
  expect_same(a.sampling, b.sampling);
  EXPECT_EQ(a.ignore_eos, b.ignore_eos);
  EXPECT_EQ(a.prefill_peer, b.prefill_peer);
  EXPECT_EQ(a.prefill_tp, b.prefill_tp);
}

void expect_same(const InstanceEvent& a, const InstanceEvent& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.admitted, b.admitted);
  EXPECT_EQ(a.cached_tokens, b.cached_tokens);
  // Travels as "how long ago", so it comes back shifted by the time the round trip took.
  if (a.admitted_at == std::chrono::steady_clock::time_point{}) {
    EXPECT_EQ(b.admitted_at, a.admitted_at);
  } else {
    EXPECT_NEAR(std::chrono::duration<double>(b.admitted_at - a.admitted_at).count(), 0.0, 0.5);
  }
  EXPECT_EQ(a.token, b.token);
  EXPECT_EQ(a.finished, b.finished);
  EXPECT_EQ(a.finish, b.finish);
  ASSERT_EQ(a.error.has_value(), b.error.has_value());
  if (a.error) {
    EXPECT_EQ(a.error->kind, b.error->kind);
    EXPECT_EQ(a.error->message, b.error->message);
  }
}

TEST(ControlMessages, HandshakeRoundTrips) {
  for (InstanceRole role : {InstanceRole::kPrefill, InstanceRole::kDecode, InstanceRole::kBoth}) {
    const Hello hello{7, Rank{5}, 3, role};
    const Hello back = round_trip_as(hello);
    EXPECT_EQ(back.protocol_version, 7u);
    EXPECT_EQ(back.rank, Rank{5});
    EXPECT_EQ(back.instance_id, 3);
    EXPECT_EQ(back.role, role);
  }
  EXPECT_EQ(Hello{}.protocol_version, kControlProtocolVersion);
  const HelloReply reply = round_trip_as(HelloReply{false, 2, "rank 1 speaks version 9"});
  EXPECT_FALSE(reply.accepted);
  EXPECT_EQ(reply.protocol_version, 2u);
  EXPECT_EQ(reply.reason, "rank 1 speaks version 9");
  EXPECT_TRUE(round_trip_as(HelloReply{true, 1, ""}).accepted);
}

TEST(ControlMessages, SubmitRoundTripsEveryField) {
  InstanceRequest request;
  request.id = RequestId{std::numeric_limits<uint64_t>::max() - 3};
  request.prompt = {
      1, 0, -1, 49151, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  request.max_tokens = (int64_t{1} << 40) + 1;
  request.sampling.temperature = 0.7f;
  request.sampling.seed = 0xdeadbeefcafef00dull;
  request.sampling.top_k = 40;
  request.sampling.top_p = 0.95f;
  request.sampling.min_p = 0.05f;
  request.sampling.repetition_penalty = 1.1f;
  request.sampling.frequency_penalty = -0.5f;
  request.sampling.presence_penalty = 1e-30f;
  request.sampling.penalty_last_n = -1;
  request.ignore_eos = true;
  request.prefill_peer = 5;
  request.prefill_tp = 2;
  expect_same(round_trip_as(SubmitRequest{request}).request, request);

  // Defaults (every control off) survive too, and an empty prompt.
  InstanceRequest plain;
  expect_same(round_trip_as(SubmitRequest{plain}).request, plain);

  // A long prompt (a rendezvous-sized MPI message).
  InstanceRequest long_prompt;
  std::mt19937 random(7);
  for (int i = 0; i < 100'000; ++i) long_prompt.prompt.push_back(static_cast<int32_t>(random()));
  expect_same(round_trip_as(SubmitRequest{long_prompt}).request, long_prompt);
}

TEST(ControlMessages, StepEventsRoundTripEveryKindOfEvent) {
  using namespace std::chrono_literals;
  StepEvents step;
  step.instance_id = 4;
  step.step = 123456789;
  InstanceEvent admitted;
  admitted.id = RequestId{1};
  admitted.admitted = true;
  admitted.cached_tokens = 32;
  admitted.admitted_at = std::chrono::steady_clock::now() - 5ms;
  admitted.token = 42;
  step.events.push_back(admitted);
  InstanceEvent token;
  token.id = RequestId{2};
  token.token = 0;
  step.events.push_back(token);
  for (InstanceFinish finish :
       {InstanceFinish::kEndOfGeneration, InstanceFinish::kLength, InstanceFinish::kCancelled}) {
    InstanceEvent finished;
    finished.id = RequestId{3};
    finished.finished = true;
    finished.finish = finish;
    step.events.push_back(finished);
  }
  for (ServeErrorKind kind :
       {ServeErrorKind::kInvalidArgument, ServeErrorKind::kTooLong, ServeErrorKind::kNotFound,
        ServeErrorKind::kUnauthenticated, ServeErrorKind::kOverloaded, ServeErrorKind::kUnavailable,
        ServeErrorKind::kInternal}) {
    InstanceEvent failed;
    failed.id = RequestId{4};
    failed.finished = true;
    failed.finish = InstanceFinish::kFailed;
    failed.error =
        ServeError{kind, std::string("why: ") + std::string(serve_error_kind_name(kind))};
    step.events.push_back(failed);
  }
  InstanceEvent empty_message_error;
  empty_message_error.error = ServeError{ServeErrorKind::kInternal, ""};
  step.events.push_back(empty_message_error);

  const StepEvents back = round_trip_as(step);
  EXPECT_EQ(back.instance_id, 4);
  EXPECT_EQ(back.step, 123456789);
  ASSERT_EQ(back.events.size(), step.events.size());
  for (size_t i = 0; i < step.events.size(); ++i) {
    SCOPED_TRACE(i);
    expect_same(back.events[i], step.events[i]);
  }
  EXPECT_TRUE(round_trip_as(StepEvents{}).events.empty());
}

TEST(ControlMessages, StatsCancelAndShutdownRoundTrip) {
  StatsReport report;
  report.instance_id = 2;
  report.stats = {1, 2, 3, 4, 16, 6, 7, 8, 9, int64_t{1} << 50};
  const StatsReport back = round_trip_as(report);
  EXPECT_EQ(back.instance_id, 2);
  EXPECT_EQ(back.stats.running, 1);
  EXPECT_EQ(back.stats.waiting, 2);
  EXPECT_EQ(back.stats.kv_blocks_total, 3);
  EXPECT_EQ(back.stats.kv_blocks_free, 4);
  EXPECT_EQ(back.stats.kv_block_tokens, 16);
  EXPECT_EQ(back.stats.steps, 6);
  EXPECT_EQ(back.stats.prompt_tokens, 7);
  EXPECT_EQ(back.stats.prefix_hit_tokens, 8);
  EXPECT_EQ(back.stats.generated_tokens, 9);
  EXPECT_EQ(back.stats.preemptions, int64_t{1} << 50);

  EXPECT_EQ(round_trip_as(Cancel{RequestId{99}}).id, RequestId{99});
  EXPECT_EQ(round_trip_as(Shutdown{"bye"}).reason, "bye");
}

TEST(ControlMessages, InstanceReadyRoundTrips) {
  InstanceReady ready;
  ready.instance_id = 3;
  ready.info = {"smollm2", 8192, 49152, 16384, {0, 2, 49151}};
  ready.stats.kv_blocks_total = 1024;
  ready.stats.kv_blocks_free = 1000;
  ready.stats.kv_block_tokens = 16;
  const InstanceReady back = round_trip_as(ready);
  EXPECT_EQ(back.instance_id, 3);
  EXPECT_EQ(back.info.model_name, "smollm2");
  EXPECT_EQ(back.info.n_ctx, 8192);
  EXPECT_EQ(back.info.n_vocab, 49152);
  EXPECT_EQ(back.info.kv_capacity_tokens, 16384);
  EXPECT_EQ(back.info.end_of_generation, (std::vector<int32_t>{0, 2, 49151}));
  EXPECT_EQ(back.stats.kv_blocks_total, 1024);
  EXPECT_EQ(back.stats.kv_blocks_free, 1000);
  EXPECT_EQ(back.stats.kv_block_tokens, 16);
  EXPECT_TRUE(back.error.empty());
  EXPECT_EQ(round_trip_as(InstanceReady{.error = "no such file"}).error, "no such file");
}

TEST(ControlMessages, NamesFollowTheVariant) {
  EXPECT_EQ(control_message_name(Hello{}), "hello");
  EXPECT_EQ(control_message_name(HelloReply{}), "hello_reply");
  EXPECT_EQ(control_message_name(SubmitRequest{}), "submit");
  EXPECT_EQ(control_message_name(Cancel{}), "cancel");
  EXPECT_EQ(control_message_name(StepEvents{}), "step_events");
  EXPECT_EQ(control_message_name(StatsReport{}), "stats");
  EXPECT_EQ(control_message_name(Shutdown{}), "shutdown");
  EXPECT_EQ(control_message_name(InstanceReady{}), "instance_ready");
  EXPECT_EQ(control_message_name(PrefillOrder{}), "prefill_order");
  EXPECT_EQ(control_message_name(KvHandoff{}), "kv_handoff");
  EXPECT_EQ(control_message_name(Heartbeat{}), "heartbeat");
  EXPECT_EQ(control_message_name(RanksLost{}), "ranks_lost");
  EXPECT_EQ(control_message_name(JoinRequest{}), "join_request");
  EXPECT_EQ(control_message_name(JoinVerdict{}), "join_verdict");
  EXPECT_EQ(control_message_name(Leaving{}), "leaving");
  EXPECT_EQ(control_message_name(LeaveAccepted{}), "leave_accepted");
}

TEST(ControlMessages, MembershipMessagesRoundTrip) {
  JoinRequest join{6, "duet 0.9", "sha256:abcd", InstanceRole::kDecode, 2, "node-7", {}};
  join.kv = {{-1, "", 4242, {7, 9}, -1}, {-1, "", 4243, {7}, -1}};
  const JoinRequest j = round_trip_as(join);
  EXPECT_EQ(j.protocol_version, 6u);
  EXPECT_EQ(j.version, join.version);
  EXPECT_EQ(j.model_fingerprint, join.model_fingerprint);
  EXPECT_EQ(j.role, InstanceRole::kDecode);
  EXPECT_EQ(j.tp, 2);
  EXPECT_EQ(j.host, "node-7");
  ASSERT_EQ(j.kv.size(), 2u);
  EXPECT_EQ(j.kv[0].port, 4242);
  EXPECT_EQ(j.kv[0].ipv4, (std::vector<uint32_t>{7, 9}));
  EXPECT_EQ(j.kv[1].port, 4243);

  const JoinVerdict verdict{
      true, Rank{12}, 5, 3000, "", {{1, "node-1", 5000, {1}, 1}, {2, "node-2", 5001, {2, 3}, 1}}};
  const JoinVerdict v = round_trip_as(verdict);
  ASSERT_EQ(v.kv_peers.size(), 2u);
  EXPECT_EQ(v.kv_peers[1].rank, 2);
  EXPECT_EQ(v.kv_peers[1].host, "node-2");
  EXPECT_EQ(v.kv_peers[1].port, 5001);
  EXPECT_EQ(v.kv_peers[1].ipv4, (std::vector<uint32_t>{2, 3}));
  EXPECT_EQ(v.kv_peers[1].leader, 1);
  EXPECT_TRUE(v.accepted);
  EXPECT_EQ(v.member, Rank{12});
  EXPECT_EQ(v.instance_id, 5);
  EXPECT_EQ(v.lease_ms, 3000);
  EXPECT_EQ(round_trip_as(JoinVerdict{false, {}, 0, 0, "wrong model", {}}).reason, "wrong model");

  const Leaving leaving = round_trip_as(Leaving{5, "SIGTERM"});
  EXPECT_EQ(leaving.instance_id, 5);
  EXPECT_EQ(leaving.reason, "SIGTERM");
  EXPECT_EQ(round_trip_as(LeaveAccepted{5}).instance_id, 5);
}

TEST(ControlMessages, LivenessMessagesRoundTrip) {
  const Heartbeat beat{3, Rank{7}, 2, 123'456, true};
  const Heartbeat b = round_trip_as(beat);
  EXPECT_EQ(b.instance_id, 3);
  EXPECT_EQ(b.rank, Rank{7});
  EXPECT_EQ(b.epoch, 2u);
  EXPECT_EQ(b.step, 123'456);
  EXPECT_TRUE(b.busy);
  EXPECT_EQ(round_trip_as(Heartbeat{}).step, -1);  // a follower's

  const RanksLost lost{4, {Rank{2}, Rank{3}}, "instance 1 (rank 2): lease expired"};
  const RanksLost l = round_trip_as(lost);
  EXPECT_EQ(l.epoch, 4u);
  EXPECT_EQ(l.ranks, (std::vector<Rank>{Rank{2}, Rank{3}}));
  EXPECT_EQ(l.reason, lost.reason);
}

TEST(ControlMessages, PrefillOrderAndHandoffRoundTrip) {
  PrefillOrder order;
  order.request.id = RequestId{77};
  order.request.prompt = {5, 6, 7};
  order.request.max_tokens = 9;
  order.request.sampling.temperature = 0.25f;
  order.request.sampling.seed = 42;
  order.send_from = 32;
  order.decode_ranks = {4, 5, 6};
  const PrefillOrder o = round_trip_as(order);
  expect_same(o.request, order.request);
  EXPECT_EQ(o.request.prefill_peer, -1);  // the field's default survives
  EXPECT_EQ(o.send_from, 32);
  EXPECT_EQ(o.decode_ranks, (std::vector<int32_t>{4, 5, 6}));

  const KvHandoff handoff{RequestId{77}, 1234, 16, 5'000'000, 30 * 3, std::nullopt};
  const KvHandoff h = round_trip_as(handoff);
  EXPECT_EQ(h.id, handoff.id);
  EXPECT_EQ(h.first_token, 1234);
  EXPECT_EQ(h.cached_tokens, 16);
  EXPECT_EQ(h.prefill_ns, 5'000'000);
  EXPECT_EQ(h.rows_sent, 90);
  EXPECT_FALSE(h.error.has_value());

  KvHandoff failed{
      RequestId{78}, -1, 0, 0, 0, ServeError{ServeErrorKind::kTooLong, "the prompt does not fit"}};
  const KvHandoff f = round_trip_as(failed);
  ASSERT_TRUE(f.error.has_value());
  EXPECT_EQ(f.error->kind, ServeErrorKind::kTooLong);
  EXPECT_EQ(f.error->message, "the prompt does not fit");
}

TEST(ControlMessages, UnalignedBytesDecode) {
  const std::vector<std::byte> bytes = encode_control_message(Shutdown{"unaligned"});
  std::vector<std::byte> shifted(bytes.size() + 1);
  std::memcpy(shifted.data() + 1, bytes.data(), bytes.size());
  const ControlMessage back =
      decode_control_message(std::span<const std::byte>(shifted).subspan(1));
  EXPECT_EQ(std::get<Shutdown>(back).reason, "unaligned");
}

std::string decode_error(std::span<const std::byte> bytes) {
  try {
    decode_control_message(bytes);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kCorruptFile);
    return e.what();
  }
  return "";
}

TEST(ControlMessages, GarbageIsAClearError) {
  EXPECT_EQ(decode_error({}).rfind("control message: ", 0), 0u);
  std::vector<std::byte> odd(12, std::byte{0});
  EXPECT_EQ(decode_error(odd), "control message: 12 bytes is not a whole number of 8-byte words");

  // A segment table that promises more words than there are.
  std::vector<std::byte> short_message(16, std::byte{0});
  short_message[4] = std::byte{100};
  EXPECT_EQ(decode_error(short_message).rfind("control message: ", 0), 0u);

  // A union discriminant from a newer protocol: patch the Message struct's
  // discriminant (its data section's first 16 bits) to an unknown kind.
  std::vector<std::byte> bytes = encode_control_message(Cancel{RequestId{1}});
  // Layout: 8-byte segment table, root pointer (8 bytes), then the struct's
  // data word whose first two bytes hold the discriminant.
  ASSERT_GE(bytes.size(), 24u);
  bytes[16] = std::byte{50};
  bytes[17] = std::byte{0};
  EXPECT_EQ(decode_error(bytes), "control message: unknown message kind 50 (a newer protocol?)");
}

TEST(ControlMessages, RandomBytesNeverCrash) {
  std::mt19937 random(1);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::byte> bytes(8 * (random() % 12));
    for (std::byte& b : bytes) b = static_cast<std::byte>(random());
    try {
      decode_control_message(bytes);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCorruptFile);
    }
  }
}

}  // namespace
}  // namespace duet
