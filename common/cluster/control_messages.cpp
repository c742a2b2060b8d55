#include "common/cluster/control_messages.h"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <fmt/format.h>
#include <kj/exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/cluster/control.capnp.h"
#include "common/error.h"

namespace duet {
namespace {

static_assert(kControlProtocolVersion == control::PROTOCOL_VERSION,
              "kControlProtocolVersion must equal protocolVersion in control.capnp");

using Clock = std::chrono::steady_clock;

[[noreturn]] void corrupt(const std::string& what) {
  throw Error(ErrorKind::kCorruptFile, "control message: " + what);
}

// ---------------------------------------------------------------- enums

control::Role to_wire(InstanceRole role) {
  switch (role) {
    case InstanceRole::kPrefill:
      return control::Role::PREFILL;
    case InstanceRole::kDecode:
      return control::Role::DECODE;
    case InstanceRole::kBoth:
      return control::Role::BOTH;
  }
  throw_assert_failure("known enum value", __FILE__, __LINE__, "unknown role");
}

InstanceRole from_wire(control::Role role) {
  switch (role) {
    case control::Role::PREFILL:
      return InstanceRole::kPrefill;
    case control::Role::DECODE:
      return InstanceRole::kDecode;
    case control::Role::BOTH:
      return InstanceRole::kBoth;
  }
  corrupt(fmt::format("unknown role {}", static_cast<int>(role)));
}

control::Finish to_wire(InstanceFinish finish) {
  switch (finish) {
    case InstanceFinish::kEndOfGeneration:
      return control::Finish::END_OF_GENERATION;
    case InstanceFinish::kLength:
      return control::Finish::LENGTH;
    case InstanceFinish::kCancelled:
      return control::Finish::CANCELLED;
    case InstanceFinish::kFailed:
      return control::Finish::FAILED;
  }
  throw_assert_failure("known enum value", __FILE__, __LINE__, "unknown finish");
}

InstanceFinish from_wire(control::Finish finish) {
  switch (finish) {
    case control::Finish::END_OF_GENERATION:
      return InstanceFinish::kEndOfGeneration;
    case control::Finish::LENGTH:
      return InstanceFinish::kLength;
    case control::Finish::CANCELLED:
      return InstanceFinish::kCancelled;
    case control::Finish::FAILED:
      return InstanceFinish::kFailed;
  }
  corrupt(fmt::format("unknown finish reason {}", static_cast<int>(finish)));
}

control::ErrorKind to_wire(ServeErrorKind kind) {
  switch (kind) {
    case ServeErrorKind::kInvalidArgument:
      return control::ErrorKind::INVALID_ARGUMENT;
    case ServeErrorKind::kTooLong:
      return control::ErrorKind::TOO_LONG;
    case ServeErrorKind::kNotFound:
      return control::ErrorKind::NOT_FOUND;
    case ServeErrorKind::kUnauthenticated:
      return control::ErrorKind::UNAUTHENTICATED;
    case ServeErrorKind::kOverloaded:
      return control::ErrorKind::OVERLOADED;
    case ServeErrorKind::kUnavailable:
      return control::ErrorKind::UNAVAILABLE;
    case ServeErrorKind::kInternal:
      return control::ErrorKind::INTERNAL;
  }
  throw_assert_failure("known enum value", __FILE__, __LINE__, "unknown error kind");
}

ServeErrorKind from_wire(control::ErrorKind kind) {
  switch (kind) {
    case control::ErrorKind::INVALID_ARGUMENT:
      return ServeErrorKind::kInvalidArgument;
    case control::ErrorKind::TOO_LONG:
      return ServeErrorKind::kTooLong;
    case control::ErrorKind::NOT_FOUND:
      return ServeErrorKind::kNotFound;
    case control::ErrorKind::UNAUTHENTICATED:
      return ServeErrorKind::kUnauthenticated;
    case control::ErrorKind::OVERLOADED:
      return ServeErrorKind::kOverloaded;
    case control::ErrorKind::UNAVAILABLE:
      return ServeErrorKind::kUnavailable;
    case control::ErrorKind::INTERNAL:
      return ServeErrorKind::kInternal;
  }
  corrupt(fmt::format("unknown error kind {}", static_cast<int>(kind)));
}

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

void write_kv_link(control::KvLinkAddress::Builder out, const KvLinkAddress& in) {
  out.setRank(in.rank);
  out.setHost(in.host);
  out.setPort(in.port);
  auto ipv4 = out.initIpv4(static_cast<unsigned>(in.ipv4.size()));
  for (size_t i = 0; i < in.ipv4.size(); ++i) ipv4.set(static_cast<unsigned>(i), in.ipv4[i]);
  out.setLeader(in.leader);
}

KvLinkAddress read_kv_link(control::KvLinkAddress::Reader in) {
  KvLinkAddress out{in.getRank(), to_string(in.getHost()), in.getPort(), {}, in.getLeader()};
  for (uint32_t ipv4 : in.getIpv4()) out.ipv4.push_back(ipv4);
  return out;
}

// ---------------------------------------------------------------- structs

void fill(control::SubmitRequest::Builder out, const InstanceRequest& in) {
  out.setId(in.id.value);
  auto prompt = out.initPrompt(static_cast<unsigned>(in.prompt.size()));
  for (size_t i = 0; i < in.prompt.size(); ++i) prompt.set(static_cast<unsigned>(i), in.prompt[i]);
  out.setMaxTokens(in.max_tokens);
  auto sampling = out.initSampling();
  const SamplingParams& s = in.sampling;
  sampling.setTemperature(s.temperature);
  sampling.setSeed(s.seed);
  sampling.setTopK(s.top_k);
  sampling.setTopP(s.top_p);
  sampling.setMinP(s.min_p);
  sampling.setRepetitionPenalty(s.repetition_penalty);
  sampling.setFrequencyPenalty(s.frequency_penalty);
  sampling.setPresencePenalty(s.presence_penalty);
  sampling.setPenaltyLastN(s.penalty_last_n);
  out.setIgnoreEos(in.ignore_eos);
  out.setPrefillRank(in.prefill_peer);
  out.setNPrompt(in.n_prompt);
  out.setPrefillTp(in.prefill_tp);
}

InstanceRequest read(control::SubmitRequest::Reader in) {
  InstanceRequest out;
  out.id = RequestId{in.getId()};
  auto prompt = in.getPrompt();
  out.prompt.resize(prompt.size());
  for (unsigned i = 0; i < prompt.size(); ++i) out.prompt[i] = prompt[i];
  out.max_tokens = in.getMaxTokens();
  auto sampling = in.getSampling();
  SamplingParams& s = out.sampling;
  s.temperature = sampling.getTemperature();
  s.seed = sampling.getSeed();
  s.top_k = sampling.getTopK();
  s.top_p = sampling.getTopP();
  s.min_p = sampling.getMinP();
  s.repetition_penalty = sampling.getRepetitionPenalty();
  s.frequency_penalty = sampling.getFrequencyPenalty();
  s.presence_penalty = sampling.getPresencePenalty();
  s.penalty_last_n = sampling.getPenaltyLastN();
  out.ignore_eos = in.getIgnoreEos();
  out.prefill_peer = in.getPrefillRank();
  out.n_prompt = in.getNPrompt();
  out.prefill_tp = in.getPrefillTp();
  return out;
}

void fill(control::Event::Builder out, const InstanceEvent& in) {
  out.setId(in.id.value);
  out.setAdmitted(in.admitted);
  out.setCachedTokens(in.cached_tokens);
  out.setAdmittedAgoNs(
      in.admitted_at == Clock::time_point{}
          ? -1
          : std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     Clock::now() - in.admitted_at)
                                     .count()));
  out.setToken(in.token);
  out.setFinished(in.finished);
  out.setFinish(to_wire(in.finish));
  out.setHasError(in.error.has_value());
  if (in.error) {
    auto error = out.initError();
    error.setKind(to_wire(in.error->kind));
    error.setMessage(in.error->message);
  }
}

InstanceEvent read(control::Event::Reader in) {
  InstanceEvent out;
  out.id = RequestId{in.getId()};
  out.admitted = in.getAdmitted();
  out.cached_tokens = in.getCachedTokens();
  if (in.getAdmittedAgoNs() >= 0) {
    out.admitted_at = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::nanoseconds(in.getAdmittedAgoNs()));
  }
  out.token = in.getToken();
  out.finished = in.getFinished();
  out.finish = from_wire(in.getFinish());
  if (in.getHasError()) {
    auto error = in.getError();
    out.error = ServeError{from_wire(error.getKind()), to_string(error.getMessage())};
  }
  return out;
}

void fill(control::Stats::Builder out, int32_t instance_id, const InstanceStats& s) {
  out.setInstanceId(instance_id);
  out.setRunning(s.running);
  out.setWaiting(s.waiting);
  out.setKvBlocksTotal(s.kv_blocks_total);
  out.setKvBlocksFree(s.kv_blocks_free);
  out.setKvBlockTokens(s.kv_block_tokens);
  out.setSteps(s.steps);
  out.setPromptTokens(s.prompt_tokens);
  out.setPrefixHitTokens(s.prefix_hit_tokens);
  out.setGeneratedTokens(s.generated_tokens);
  out.setPreemptions(s.preemptions);
  out.setKvBlocksQuarantined(s.kv_blocks_quarantined);
  out.setSendBytesAbandoned(s.send_bytes_abandoned);
}

InstanceStats read(control::Stats::Reader in) {
  InstanceStats s;
  s.running = in.getRunning();
  s.waiting = in.getWaiting();
  s.kv_blocks_total = in.getKvBlocksTotal();
  s.kv_blocks_free = in.getKvBlocksFree();
  s.kv_block_tokens = in.getKvBlockTokens();
  s.steps = in.getSteps();
  s.prompt_tokens = in.getPromptTokens();
  s.prefix_hit_tokens = in.getPrefixHitTokens();
  s.generated_tokens = in.getGeneratedTokens();
  s.preemptions = in.getPreemptions();
  s.kv_blocks_quarantined = in.getKvBlocksQuarantined();
  s.send_bytes_abandoned = in.getSendBytesAbandoned();
  return s;
}

void fill(control::InstanceReady::Builder out, const InstanceReady& in) {
  out.setInstanceId(in.instance_id);
  out.setModelName(in.info.model_name);
  out.setNCtx(in.info.n_ctx);
  out.setNVocab(in.info.n_vocab);
  out.setKvCapacityTokens(in.info.kv_capacity_tokens);
  const std::vector<int32_t>& eog = in.info.end_of_generation;
  auto ids = out.initEndOfGeneration(static_cast<unsigned>(eog.size()));
  for (size_t i = 0; i < eog.size(); ++i) ids.set(static_cast<unsigned>(i), eog[i]);
  fill(out.initStats(), in.instance_id, in.stats);
  out.setError(in.error);
}

InstanceReady read(control::InstanceReady::Reader in) {
  InstanceReady out;
  out.instance_id = in.getInstanceId();
  out.info.model_name = to_string(in.getModelName());
  out.info.n_ctx = in.getNCtx();
  out.info.n_vocab = in.getNVocab();
  out.info.kv_capacity_tokens = in.getKvCapacityTokens();
  for (int32_t id : in.getEndOfGeneration()) out.info.end_of_generation.push_back(id);
  out.stats = read(in.getStats());
  out.error = to_string(in.getError());
  return out;
}

// Fills the envelope's union member for each kind of message.
struct Filler {
  control::Message::Builder out;

  void operator()(const Hello& m) {
    auto hello = out.initHello();
    hello.setProtocolVersion(m.protocol_version);
    hello.setRank(m.rank.value);
    hello.setInstanceId(m.instance_id);
    hello.setRole(to_wire(m.role));
  }
  void operator()(const HelloReply& m) {
    auto reply = out.initHelloReply();
    reply.setAccepted(m.accepted);
    reply.setProtocolVersion(m.protocol_version);
    reply.setReason(m.reason);
  }
  void operator()(const SubmitRequest& m) { fill(out.initSubmit(), m.request); }
  void operator()(const Cancel& m) { out.initCancel().setId(m.id.value); }
  void operator()(const StepEvents& m) {
    auto step = out.initStepEvents();
    step.setInstanceId(m.instance_id);
    step.setStep(m.step);
    auto events = step.initEvents(static_cast<unsigned>(m.events.size()));
    for (size_t i = 0; i < m.events.size(); ++i)
      fill(events[static_cast<unsigned>(i)], m.events[i]);
  }
  void operator()(const StatsReport& m) { fill(out.initStats(), m.instance_id, m.stats); }
  void operator()(const Shutdown& m) { out.initShutdown().setReason(m.reason); }
  void operator()(const InstanceReady& m) { fill(out.initReady(), m); }
  void operator()(const Heartbeat& m) {
    auto beat = out.initHeartbeat();
    beat.setInstanceId(m.instance_id);
    beat.setRank(m.rank.value);
    beat.setEpoch(m.epoch);
    beat.setStep(m.step);
    beat.setBusy(m.busy);
  }
  void operator()(const RanksLost& m) {
    auto lost = out.initRanksLost();
    lost.setEpoch(m.epoch);
    auto ranks = lost.initRanks(static_cast<unsigned>(m.ranks.size()));
    for (size_t i = 0; i < m.ranks.size(); ++i)
      ranks.set(static_cast<unsigned>(i), m.ranks[i].value);
    lost.setReason(m.reason);
  }
  void operator()(const JoinRequest& m) {
    auto join = out.initJoinRequest();
    join.setProtocolVersion(m.protocol_version);
    join.setVersion(m.version);
    join.setModelFingerprint(m.model_fingerprint);
    join.setRole(to_wire(m.role));
    join.setTp(m.tp);
    join.setHost(m.host);
    auto kv = join.initKv(static_cast<unsigned>(m.kv.size()));
    for (size_t i = 0; i < m.kv.size(); ++i) write_kv_link(kv[static_cast<unsigned>(i)], m.kv[i]);
  }
  void operator()(const JoinVerdict& m) {
    auto verdict = out.initJoinVerdict();
    verdict.setAccepted(m.accepted);
    verdict.setMember(m.member.value);
    verdict.setInstanceId(m.instance_id);
    verdict.setLeaseMs(m.lease_ms);
    verdict.setReason(m.reason);
    auto peers = verdict.initKvPeers(static_cast<unsigned>(m.kv_peers.size()));
    for (size_t i = 0; i < m.kv_peers.size(); ++i)
      write_kv_link(peers[static_cast<unsigned>(i)], m.kv_peers[i]);
  }
  void operator()(const Leaving& m) {
    auto leaving = out.initLeaving();
    leaving.setInstanceId(m.instance_id);
    leaving.setReason(m.reason);
    leaving.setDone(m.done);
  }
  void operator()(const LeaveAccepted& m) { out.initLeaveAccepted().setInstanceId(m.instance_id); }
  void operator()(const PrefillOrder& m) {
    auto order = out.initPrefillOrder();
    fill(order.initRequest(), m.request);
    order.setSendFrom(m.send_from);
    auto ranks = order.initDecodeRanks(static_cast<unsigned>(m.decode_ranks.size()));
    for (size_t i = 0; i < m.decode_ranks.size(); ++i)
      ranks.set(static_cast<unsigned>(i), m.decode_ranks[i]);
  }
  void operator()(const KvHandoff& m) {
    auto handoff = out.initKvHandoff();
    handoff.setId(m.id.value);
    handoff.setFirstToken(m.first_token);
    handoff.setCachedTokens(m.cached_tokens);
    handoff.setPrefillNs(m.prefill_ns);
    handoff.setRowsSent(m.rows_sent);
    handoff.setHasError(m.error.has_value());
    if (m.error) {
      auto error = handoff.initError();
      error.setKind(to_wire(m.error->kind));
      error.setMessage(m.error->message);
    }
  }
};

ControlMessage read(control::Message::Reader in) {
  switch (in.which()) {
    case control::Message::HELLO: {
      auto hello = in.getHello();
      return Hello{hello.getProtocolVersion(), Rank{hello.getRank()}, hello.getInstanceId(),
                   from_wire(hello.getRole())};
    }
    case control::Message::HELLO_REPLY: {
      auto reply = in.getHelloReply();
      return HelloReply{reply.getAccepted(), reply.getProtocolVersion(),
                        to_string(reply.getReason())};
    }
    case control::Message::SUBMIT:
      return SubmitRequest{read(in.getSubmit())};
    case control::Message::CANCEL:
      return Cancel{RequestId{in.getCancel().getId()}};
    case control::Message::STEP_EVENTS: {
      auto step = in.getStepEvents();
      StepEvents out;
      out.instance_id = step.getInstanceId();
      out.step = step.getStep();
      auto events = step.getEvents();
      out.events.reserve(events.size());
      for (auto event : events) out.events.push_back(read(event));
      return out;
    }
    case control::Message::STATS: {
      auto stats = in.getStats();
      return StatsReport{stats.getInstanceId(), read(stats)};
    }
    case control::Message::SHUTDOWN:
      return Shutdown{to_string(in.getShutdown().getReason())};
    case control::Message::READY:
      return read(in.getReady());
    case control::Message::PREFILL_ORDER: {
      auto order = in.getPrefillOrder();
      PrefillOrder out{read(order.getRequest()), order.getSendFrom(), {}};
      for (int32_t rank : order.getDecodeRanks()) out.decode_ranks.push_back(rank);
      return out;
    }
    case control::Message::KV_HANDOFF: {
      auto handoff = in.getKvHandoff();
      KvHandoff out{RequestId{handoff.getId()}, handoff.getFirstToken(), handoff.getCachedTokens(),
                    handoff.getPrefillNs(),     handoff.getRowsSent(),   std::nullopt};
      if (handoff.getHasError()) {
        out.error = ServeError{from_wire(handoff.getError().getKind()),
                               to_string(handoff.getError().getMessage())};
      }
      return out;
    }
    case control::Message::HEARTBEAT: {
      auto beat = in.getHeartbeat();
      return Heartbeat{beat.getInstanceId(), Rank{beat.getRank()}, beat.getEpoch(), beat.getStep(),
                       beat.getBusy()};
    }
    case control::Message::RANKS_LOST: {
      auto lost = in.getRanksLost();
      RanksLost out{lost.getEpoch(), {}, to_string(lost.getReason())};
      for (int32_t rank : lost.getRanks()) out.ranks.push_back(Rank{rank});
      return out;
    }
    case control::Message::JOIN_REQUEST: {
      auto join = in.getJoinRequest();
      JoinRequest out{join.getProtocolVersion(),
                      to_string(join.getVersion()),
                      to_string(join.getModelFingerprint()),
                      from_wire(join.getRole()),
                      join.getTp(),
                      to_string(join.getHost()),
                      {}};
      for (auto link : join.getKv()) out.kv.push_back(read_kv_link(link));
      return out;
    }
    case control::Message::JOIN_VERDICT: {
      auto verdict = in.getJoinVerdict();
      JoinVerdict out{verdict.getAccepted(),          Rank{verdict.getMember()},
                      verdict.getInstanceId(),        verdict.getLeaseMs(),
                      to_string(verdict.getReason()), {}};
      for (auto peer : verdict.getKvPeers()) out.kv_peers.push_back(read_kv_link(peer));
      return out;
    }
    case control::Message::LEAVING: {
      auto leaving = in.getLeaving();
      return Leaving{leaving.getInstanceId(), to_string(leaving.getReason()), leaving.getDone()};
    }
    case control::Message::LEAVE_ACCEPTED:
      return LeaveAccepted{in.getLeaveAccepted().getInstanceId()};
  }
  corrupt(fmt::format("unknown message kind {} (a newer protocol?)", static_cast<int>(in.which())));
}

}  // namespace

std::string_view control_message_name(const ControlMessage& message) {
  static constexpr std::string_view kNames[] = {
      "hello",         "hello_reply",  "submit",    "cancel",
      "step_events",   "stats",        "shutdown",  "instance_ready",
      "prefill_order", "kv_handoff",   "heartbeat", "ranks_lost",
      "join_request",  "join_verdict", "leaving",   "leave_accepted"};
  static_assert(std::size(kNames) == std::variant_size_v<ControlMessage>);
  return kNames[message.index()];
}

std::vector<std::byte> encode_control_message(const ControlMessage& message) {
  capnp::MallocMessageBuilder builder;
  std::visit(Filler{builder.initRoot<control::Message>()}, message);
  const kj::Array<capnp::word> words = capnp::messageToFlatArray(builder);
  const kj::ArrayPtr<const kj::byte> bytes = words.asBytes();
  std::vector<std::byte> out(bytes.size());
  std::memcpy(out.data(), bytes.begin(), bytes.size());
  return out;
}

ControlMessage decode_control_message(std::span<const std::byte> bytes) {
  if (bytes.size() % sizeof(capnp::word) != 0) {
    corrupt(fmt::format("{} bytes is not a whole number of 8-byte words", bytes.size()));
  }
  // Cap'n Proto reads words in place, so they must be word-aligned.
  kj::Array<capnp::word> copy;
  kj::ArrayPtr<const capnp::word> words;
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(capnp::word) == 0) {
    words = kj::arrayPtr(reinterpret_cast<const capnp::word*>(bytes.data()),
                         bytes.size() / sizeof(capnp::word));
  } else {
    copy = kj::heapArray<capnp::word>(bytes.size() / sizeof(capnp::word));
    std::memcpy(copy.begin(), bytes.data(), bytes.size());
    words = copy;
  }
  try {
    capnp::ReaderOptions options;
    // Our messages are trees: a reader visits each word once. The limit stops
    // a hostile message from amplifying (a long list of empty structs).
    options.traversalLimitInWords = words.size() * 2 + 64;
    capnp::FlatArrayMessageReader reader(words, options);
    return read(reader.getRoot<control::Message>());
  } catch (const kj::Exception& e) {
    corrupt(e.getDescription().cStr());
  }
}

}  // namespace duet
