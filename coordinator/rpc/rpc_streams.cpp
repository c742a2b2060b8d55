#include "coordinator/rpc/rpc_streams.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "coordinator/rpc/rpc_convert.h"

namespace duet {

// ------------------------------------------------------------------ relay

void UpdateRelay::attach(LoopHandler handler) {
  std::lock_guard lock(mutex_);
  handler_ = std::move(handler);
  attached_ = true;
}

kj::Promise<void> UpdateRelay::run() {
  auto paf = kj::newPromiseAndCrossThreadFulfiller<void>();
  {
    std::lock_guard lock(mutex_);
    if (!attached_) return kj::NEVER_DONE;
    if (queue_.empty()) {
      wake_ = kj::mv(paf.fulfiller);
    } else {
      paf.fulfiller->fulfill();  // updates came while the last batch was handled
    }
  }
  return paf.promise.then([this]() -> kj::Promise<void> {
    drain();
    return run();
  });
}

void UpdateRelay::detach() {
  std::lock_guard lock(mutex_);
  attached_ = false;
  queue_.clear();
  // Fulfilled rather than dropped (which would reject run()'s promise): the
  // next run() sees the relay detached and waits forever.
  if (wake_.get() != nullptr) wake_->fulfill();
  wake_ = nullptr;
}

void UpdateRelay::started() {
  std::lock_guard lock(mutex_);
  ++n_unfinished_;
}

void UpdateRelay::deliver(std::vector<RequestUpdate> updates) {
  const auto n_finished = static_cast<int64_t>(
      std::count_if(updates.begin(), updates.end(), [](const auto& u) { return u.finished; }));
  std::lock_guard lock(mutex_);
  if (attached_) {
    queue_.push_back(std::move(updates));
    if (wake_.get() != nullptr) {
      wake_->fulfill();  // posts to the loop; never waits for it
      wake_ = nullptr;
    }
  }
  n_unfinished_ -= n_finished;
  // Notified under the lock: the waiter may destroy this as soon as it sees zero.
  if (n_unfinished_ == 0) finished_cv_.notify_all();
}

void UpdateRelay::wait_finished() {
  std::unique_lock lock(mutex_);
  while (!finished_cv_.wait_for(lock, std::chrono::seconds(10),
                                [this] { return n_unfinished_ <= 0; })) {
    spdlog::warn("rpc: waiting for {} cancelled requests to finish", n_unfinished_);
  }
}

void UpdateRelay::drain() {
  std::vector<std::vector<RequestUpdate>> steps;
  {
    std::lock_guard lock(mutex_);
    steps.swap(queue_);
  }
  for (std::vector<RequestUpdate>& updates : steps) {
    try {
      handler_(updates);
    } catch (const kj::Exception& e) {
      spdlog::error("rpc: handling updates failed: {}", e.getDescription().cStr());
    } catch (const std::exception& e) {
      spdlog::error("rpc: handling updates failed: {}", e.what());
    }
  }
}

// ------------------------------------------------------------ stream table

void StreamTable::add(RequestId id, rpc::TokenSink::Client sink, bool include_token_ids,
                      kj::Own<ConnectionActivity> connection) {
  connection->stream_started();
  streams_.emplace(id, Stream{.sink = kj::mv(sink),
                              .include_token_ids = include_token_ids,
                              .connection = kj::mv(connection)});
}

void StreamTable::on_updates(std::vector<RequestUpdate>& updates) {
  for (RequestUpdate& update : updates) {
    auto it = streams_.find(update.id);
    if (it == streams_.end()) continue;  // shut down, or not ours
    Stream& stream = it->second;
    if (!stream.broken) {
      stream.text += update.text;
      if (stream.include_token_ids) {
        stream.tokens.insert(stream.tokens.end(), update.tokens.begin(), update.tokens.end());
      }
    }
    if (update.finished) {
      stream.final_update = FinalUpdate{update.finish, update.timings, std::move(update.error)};
    }
    pump(update.id);
  }
}

void StreamTable::cancel(RequestId id) {
  auto it = streams_.find(id);
  if (it == streams_.end() || it->second.final_update) return;
  service_.cancel(id);
}

void StreamTable::close() {
  closed_ = true;
  for (RequestId id : unfinished()) service_.cancel(id);
}

kj::Promise<void> StreamTable::drained() {
  kj::Promise<void> streams_gone = kj::READY_NOW;
  if (!streams_.empty()) {
    auto paf = kj::newPromiseAndFulfiller<void>();
    empty_fulfiller_ = kj::mv(paf.fulfiller);
    streams_gone = kj::mv(paf.promise);
  }
  return streams_gone.then([this]() -> kj::Promise<void> {
    if (tasks_.isEmpty()) return kj::READY_NOW;
    return tasks_.onEmpty();
  });
}

void StreamTable::shut_down() {
  closed_ = true;
  const std::vector<RequestId> ids = unfinished();
  for (auto& [id, stream] : streams_) stream.connection->stream_ended();
  streams_.clear();
  empty_fulfiller_ = nullptr;
  for (RequestId id : ids) service_.cancel(id);
}

void StreamTable::pump(RequestId id) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;
  Stream& stream = it->second;
  if (stream.writing) return;
  if (stream.broken) {
    if (stream.final_update) erase(it);
    return;
  }
  if (!stream.text.empty() || !stream.tokens.empty()) {
    auto request = stream.sink.writeRequest();
    auto chunk = request.initChunk();
    chunk.setText(stream.text);
    if (!stream.tokens.empty()) {
      rpc_convert::fill_list(chunk.initTokenIds(static_cast<unsigned>(stream.tokens.size())),
                             stream.tokens);
    }
    stream.text.clear();
    stream.tokens.clear();
    stream.writing = true;
    tasks_.add(request.send().then([this, id]() { on_written(id, true); },
                                   [this, id](kj::Exception&&) { on_written(id, false); }));
    return;
  }
  if (stream.final_update) {
    auto request = stream.sink.doneRequest();
    const FinalUpdate& last = *stream.final_update;
    rpc_convert::fill_finish(request.initFinish(), last.finish, last.timings, last.error);
    // The request is over either way; a failed done() only means the client left.
    tasks_.add(request.send().ignoreResult().catch_([](kj::Exception&&) {}));
    erase(it);
  }
}

void StreamTable::on_written(RequestId id, bool ok) {
  auto it = streams_.find(id);
  if (it == streams_.end()) return;
  it->second.writing = false;
  if (!ok) {
    it->second.broken = true;
    it->second.text.clear();
    it->second.tokens.clear();
    if (!it->second.final_update) service_.cancel(id);  // frees its KV now
  }
  pump(id);
}

std::vector<RequestId> StreamTable::unfinished() const {
  std::vector<RequestId> ids;
  for (const auto& [id, stream] : streams_) {
    if (!stream.final_update) ids.push_back(id);
  }
  return ids;
}

void StreamTable::erase(Streams::iterator it) {
  it->second.connection->stream_ended();
  streams_.erase(it);
  if (streams_.empty() && empty_fulfiller_.get() != nullptr) {
    empty_fulfiller_->fulfill();
    empty_fulfiller_ = nullptr;
  }
}

void StreamTable::taskFailed(kj::Exception&& exception) {
  spdlog::warn("rpc: stream task failed: {}", exception.getDescription().cStr());
}

}  // namespace duet
