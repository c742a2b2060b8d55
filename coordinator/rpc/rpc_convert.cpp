#include "coordinator/rpc/rpc_convert.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace duet::rpc_convert {

uint32_t clamp_u32(int64_t value) {
  return static_cast<uint32_t>(std::clamp<int64_t>(value, 0, std::numeric_limits<uint32_t>::max()));
}

std::string to_string(capnp::Text::Reader text) { return std::string(text.cStr(), text.size()); }

std::vector<int32_t> to_vector(capnp::List<int32_t>::Reader list) {
  std::vector<int32_t> out;
  out.reserve(list.size());
  for (const int32_t value : list) out.push_back(value);
  return out;
}

void fill_list(capnp::List<int32_t>::Builder out, const std::vector<int32_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) out.set(static_cast<unsigned>(i), values[i]);
}

rpc::ErrorKind to_rpc(ServeErrorKind kind) {
  switch (kind) {
    case ServeErrorKind::kInvalidArgument:
      return rpc::ErrorKind::INVALID_ARGUMENT;
    case ServeErrorKind::kTooLong:
      return rpc::ErrorKind::TOO_LONG;
    case ServeErrorKind::kNotFound:
      return rpc::ErrorKind::NOT_FOUND;
    case ServeErrorKind::kUnauthenticated:
      return rpc::ErrorKind::UNAUTHENTICATED;
    case ServeErrorKind::kOverloaded:
      return rpc::ErrorKind::OVERLOADED;
    case ServeErrorKind::kUnavailable:
      return rpc::ErrorKind::UNAVAILABLE;
    case ServeErrorKind::kInternal:
      return rpc::ErrorKind::INTERNAL;
  }
  return rpc::ErrorKind::INTERNAL;
}

rpc::FinishReason to_rpc(ServeFinish finish) {
  switch (finish) {
    case ServeFinish::kStop:
      return rpc::FinishReason::STOP;
    case ServeFinish::kLength:
      return rpc::FinishReason::LENGTH;
    case ServeFinish::kCancelled:
      return rpc::FinishReason::CANCELLED;
    case ServeFinish::kError:
      return rpc::FinishReason::ERROR;
  }
  return rpc::FinishReason::ERROR;
}

ServeErrorKind serve_error_kind_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
    case ErrorKind::kUnsupported:
      return ServeErrorKind::kInvalidArgument;
    case ErrorKind::kNotFound:
      return ServeErrorKind::kNotFound;
    case ErrorKind::kCorruptFile:
    case ErrorKind::kInternal:
      return ServeErrorKind::kInternal;
  }
  return ServeErrorKind::kInternal;
}

void fill_error(rpc::Error::Builder out, ServeErrorKind kind, const std::string& message) {
  out.setKind(to_rpc(kind));
  out.setMessage(message);
}

void fill_finish(rpc::Finish::Builder out, ServeFinish finish, const RequestTimings& timings,
                 const std::optional<ServeError>& error) {
  out.setReason(to_rpc(finish));
  auto t = out.initTimings();
  t.setQueueMs(timings.queue_s * 1e3);
  t.setTtftMs(timings.ttft_s * 1e3);
  t.setTpotMs(timings.tpot_s * 1e3);
  t.setE2eMs(timings.e2e_s * 1e3);
  t.setPromptTokens(clamp_u32(timings.prompt_tokens));
  t.setCompletionTokens(clamp_u32(timings.completion_tokens));
  t.setCachedTokens(clamp_u32(timings.cached_tokens));
  t.setRetries(clamp_u32(timings.retries));
  if (error) fill_error(out.initError(), error->kind, error->message);
}

void fill_model_info(rpc::ModelInfo::Builder out, const ModelSummary& model) {
  out.setName(model.name);
  out.setContextLength(clamp_u32(model.n_ctx));
  out.setVocabSize(clamp_u32(model.n_vocab));
  out.setKvCapacityTokens(clamp_u32(model.kv_capacity_tokens));
  out.setMaxPromptTokens(clamp_u32(model.max_prompt_tokens));
  out.setMaxTokens(clamp_u32(model.max_tokens));
}

void fill_stats(rpc::Stats::Builder out, const ServiceStats& stats) {
  const InstanceStats& instance = stats.instance;
  out.setRunningSequences(clamp_u32(instance.running));
  out.setWaitingSequences(clamp_u32(instance.waiting));
  out.setActiveRequests(clamp_u32(stats.active_requests));
  out.setFinishedRequests(static_cast<uint64_t>(std::max<int64_t>(stats.finished_requests, 0)));
  out.setRefusedRequests(static_cast<uint64_t>(std::max<int64_t>(stats.refused_requests, 0)));
  out.setKvBlocksTotal(clamp_u32(instance.kv_blocks_total));
  out.setKvBlocksFree(clamp_u32(instance.kv_blocks_free));
  out.setKvBlockTokens(clamp_u32(instance.kv_block_tokens));
  out.setPromptTokens(static_cast<uint64_t>(std::max<int64_t>(instance.prompt_tokens, 0)));
  out.setPrefixHitTokens(static_cast<uint64_t>(std::max<int64_t>(instance.prefix_hit_tokens, 0)));
  out.setGeneratedTokens(static_cast<uint64_t>(std::max<int64_t>(instance.generated_tokens, 0)));
  out.setSteps(static_cast<uint64_t>(std::max<int64_t>(instance.steps, 0)));
  out.setPreemptions(static_cast<uint64_t>(std::max<int64_t>(instance.preemptions, 0)));
  out.setKvBlocksQuarantined(clamp_u32(instance.kv_blocks_quarantined));
  out.setDraining(stats.draining);
  const auto& states = stats.health.instances;
  auto list = out.initInstances(static_cast<unsigned>(states.size()));
  for (size_t i = 0; i < states.size(); ++i) {
    auto state = list[static_cast<unsigned>(i)];
    state.setRole(states[i].role);
    state.setLeaderRank(states[i].leader);
    state.setLost(states[i].lost);
    state.setEpoch(states[i].epoch);
    state.setReason(states[i].reason);
    state.setJoined(states[i].joined);
    state.setDraining(states[i].draining);
    state.setLeft(states[i].left);
    state.setHost(states[i].host);
    state.setSwitchingTo(states[i].switching_to);
  }
}

Result<ServeRequest> to_serve_request(rpc::GenerateRequest::Reader in) {
  ServeRequest out;
  const auto prompt = in.getPrompt();
  switch (prompt.which()) {
    case rpc::GenerateRequest::Prompt::TEXT:
      out.prompt = to_string(prompt.getText());
      break;
    case rpc::GenerateRequest::Prompt::TOKENS:
      out.prompt = to_vector(prompt.getTokens());
      break;
    case rpc::GenerateRequest::Prompt::CHAT: {
      std::vector<ChatMessage> messages;
      for (const auto message : prompt.getChat()) {
        messages.push_back({to_string(message.getRole()), to_string(message.getContent())});
      }
      out.prompt = std::move(messages);
      break;
    }
    default:
      return ServeError{ServeErrorKind::kInvalidArgument, "unknown prompt form (a newer client?)"};
  }
  if (in.getMaxTokens() > 0) out.max_tokens = in.getMaxTokens();
  const auto sampling = in.getSampling();
  out.sampling.temperature = sampling.getTemperature();
  out.sampling.top_k = sampling.getTopK();
  out.sampling.top_p = sampling.getTopP();
  out.sampling.min_p = sampling.getMinP();
  out.sampling.seed = sampling.getSeed();
  out.sampling.repetition_penalty = sampling.getRepetitionPenalty();
  out.sampling.frequency_penalty = sampling.getFrequencyPenalty();
  out.sampling.presence_penalty = sampling.getPresencePenalty();
  for (const auto stop : in.getStop()) out.stop.push_back(to_string(stop));
  out.ignore_eos = in.getIgnoreEos();
  out.include_token_ids = in.getIncludeTokenIds();
  return out;
}

}  // namespace duet::rpc_convert
