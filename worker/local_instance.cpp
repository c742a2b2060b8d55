#include "worker/local_instance.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "common/error.h"
#include "common/kv_layout.h"

namespace duet {
namespace {

InstanceFinish instance_finish(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEndOfGeneration:
      return InstanceFinish::kEndOfGeneration;
    case FinishReason::kLength:
      return InstanceFinish::kLength;
    case FinishReason::kStopped:
      return InstanceFinish::kCancelled;
  }
  return InstanceFinish::kFailed;
}

}  // namespace

LocalInstance::LocalInstance(const LlamaModel& model, const cpu::KernelTable& kernels,
                             cpu::ThreadPool& pool, EngineConfig config, std::string model_name)
    : info_{std::move(model_name), model.config().n_ctx_train, model.config().n_vocab,
            config.n_kv_blocks * KvLayout::kDefaultBlockSize, config.end_of_generation},
      engine_(model, kernels, pool, std::move(config)) {
  publish_stats();
  thread_ = std::thread([this] { run(); });
}

LocalInstance::~LocalInstance() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void LocalInstance::set_event_handler(EventHandler handler) {
  std::lock_guard lock(callback_mutex_);
  handler_ = std::move(handler);
}

void LocalInstance::set_step_observer(StepObserver observer) {
  std::lock_guard lock(callback_mutex_);
  observer_ = std::move(observer);
}

void LocalInstance::submit(InstanceRequest request) {
  {
    std::lock_guard lock(mutex_);
    commands_.emplace_back(std::move(request));
  }
  wake_.notify_one();
}

void LocalInstance::cancel(RequestId id) {
  {
    std::lock_guard lock(mutex_);
    commands_.emplace_back(id);
  }
  wake_.notify_one();
}

InstanceStats LocalInstance::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void LocalInstance::apply(Command& command) {
  if (auto* id = std::get_if<RequestId>(&command)) {
    auto it = sequences_.find(*id);
    if (it != sequences_.end()) engine_.cancel(it->second);  // its sink reports the finish
    return;
  }
  InstanceRequest& request = std::get<InstanceRequest>(command);
  const RequestId rid = request.id;
  RequestOptions options;
  options.max_tokens = request.max_tokens;
  options.sampling = request.sampling;
  options.ignore_eos = request.ignore_eos;
  auto on_token = [this, rid](const TokenEvent& e) {
    InstanceEvent event{.id = rid, .token = e.token, .finished = e.finished};
    if (e.finished) {
      event.finish = instance_finish(e.reason);
      requests_.erase(e.id);
      sequences_.erase(rid);
    }
    events_.push_back(std::move(event));
  };
  auto on_admitted = [this, rid](SequenceId, int64_t cached_tokens) {
    events_.push_back({.id = rid,
                       .admitted = true,
                       .cached_tokens = cached_tokens,
                       .admitted_at = std::chrono::steady_clock::now()});
  };
  try {
    const SequenceId sid =
        engine_.submit(std::move(request.prompt), options, on_token, on_admitted);
    sequences_.emplace(rid, sid);
    requests_.emplace(sid, rid);
  } catch (const Error& e) {
    events_.push_back({.id = rid,
                       .finished = true,
                       .finish = InstanceFinish::kFailed,
                       .error = ServeError{ServeErrorKind::kInvalidArgument, e.what()}});
  } catch (const std::exception& e) {
    events_.push_back({.id = rid,
                       .finished = true,
                       .finish = InstanceFinish::kFailed,
                       .error = ServeError{ServeErrorKind::kInternal, e.what()}});
  }
}

InstanceStats LocalInstance::publish_stats() {
  const EngineStats e = engine_.stats();
  InstanceStats s;
  s.running = engine_.n_running();
  s.waiting = engine_.n_waiting();
  s.kv_blocks_total = engine_.n_kv_blocks();
  s.kv_blocks_free = engine_.n_free_kv_blocks();
  s.kv_block_tokens = KvLayout::kDefaultBlockSize;
  s.steps = e.steps;
  s.prompt_tokens = e.prompt_tokens;
  s.prefix_hit_tokens = e.prefix_hit_tokens;
  s.generated_tokens = e.generated_tokens;
  s.preemptions = e.preemptions;
  std::lock_guard lock(mutex_);
  stats_ = s;
  return s;
}

void LocalInstance::run() {
  std::deque<Command> commands;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !commands_.empty() || !engine_.idle(); });
      if (stopping_) return;
      commands.swap(commands_);
    }
    for (Command& command : commands) apply(command);
    commands.clear();
    try {
      engine_.step();
    } catch (const std::exception& e) {
      // A broken invariant in the engine: fail every live request, keep the thread.
      for (const auto& [rid, sid] : sequences_) {
        events_.push_back({.id = rid,
                           .finished = true,
                           .finish = InstanceFinish::kFailed,
                           .error = ServeError{ServeErrorKind::kInternal, e.what()}});
      }
      std::vector<SequenceId> live;
      for (const auto& [sid, rid] : requests_) live.push_back(sid);
      std::vector<InstanceEvent> failed = std::move(events_);
      events_.clear();
      for (SequenceId sid : live) {
        try {
          engine_.cancel(sid);  // frees the KV; its events are dropped
        } catch (const std::exception& cancel_error) {
          spdlog::error("instance: cancel after a failed step failed: {}", cancel_error.what());
        }
      }
      events_ = std::move(failed);
    }
    const InstanceStats stats = publish_stats();
    std::lock_guard callbacks(callback_mutex_);
    try {
      if (observer_) observer_(stats);
      if (!events_.empty() && handler_) handler_(events_);
    } catch (const std::exception& e) {
      // The consumer's fault; the engine and every other request go on.
      spdlog::error("instance: an event consumer failed: {}", e.what());
    }
    events_.clear();
  }
}

}  // namespace duet
