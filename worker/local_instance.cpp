#include "worker/local_instance.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "common/model/kv_layout.h"

namespace duet {

class LocalInstance::TransferPeers final : public InstancePeers {
 public:
  TransferPeers(KvTransfer& transfer, const LlamaModel& model) : transfer_(transfer), model_(model) {}

  void start_import(int32_t prefill_peer, const PrefillOrder& order, const TpImport& import,
                    KvCache& cache) override {
    transfer_.start_import(prefill_peer, order, tp_import_plan(import, model_, cache));
  }
  bool abort_import(int32_t, RequestId id) override {
    transfer_.abort_import(id);
    return false;  // rows may be on their way: ImportReleased frees the blocks
  }
  void send_rows(RequestId id, int64_t layer, int64_t pos0, int64_t n,
                 std::span<const int32_t> decode_ranks, const KvCache& cache,
                 std::span<const int32_t> block_table) override {
    tp_send_rows(transfer_, model_, id, layer, pos0, n, decode_ranks, cache, block_table);
  }
  void send_handoff(int32_t decode_peer, const KvHandoff& handoff) override {
    transfer_.send_handoff(decode_peer, handoff);
  }
  bool device_transfer(int32_t rank) const override { return transfer_.device_transfer(rank); }

 private:
  KvTransfer& transfer_;
  const LlamaModel& model_;
};

namespace {

InstanceCoreOptions core_options(const PeerLinks& peers, InstancePeers* transfer_peers,
                                 TpLeader* tp) {
  InstanceCoreOptions options;
  options.peers = transfer_peers;
  options.tp = tp;
  options.transfer_timeout = peers.transfer_timeout;
  options.own_ranks = peers.own_ranks;
  options.instance_ranks = peers.instance_ranks;
  options.now = [] { return std::chrono::steady_clock::now(); };
  return options;
}

}  // namespace

LocalInstance::LocalInstance(const LlamaModel& model, const cpu::KernelTable& kernels,
                             cpu::ThreadPool& pool, EngineConfig config, std::string model_name,
                             PeerLinks peers, TpLeader* tp)
    : info_{std::move(model_name), model.config().n_ctx_train, model.config().n_vocab,
            config.n_kv_blocks * KvLayout::kDefaultBlockSize, config.end_of_generation},
      transfer_(peers.transfer),
      transfer_peers_(transfer_ != nullptr ? std::make_unique<TransferPeers>(*transfer_, model)
                                           : nullptr),
      core_(std::make_unique<Engine>(model, kernels, pool, std::move(config),
                                     tp != nullptr ? &tp->collective() : nullptr,
                                     tp != nullptr ? tp->device_collective() : nullptr),
            core_options(peers, transfer_peers_.get(), tp)) {
  publish_stats();
  if (transfer_ != nullptr) {
    // The handlers only queue commands: every engine call stays on the engine thread.
    KvTransfer::Handlers handlers;
    handlers.on_order = [this](int peer, PrefillOrder order) {
      post(PeerOrder{peer, std::move(order)});
    };
    handlers.on_cancel = [this](int, RequestId id) { post(OrderWithdrawn{id}); };
    handlers.on_complete = [this](RequestId id, const KvHandoff& handoff) {
      post(ImportDone{id, handoff});
    };
    handlers.on_failed = [this](RequestId id, const ServeError& error) {
      post(ImportFailed{id, error});
    };
    handlers.on_released = [this](RequestId id) { post(ImportReleased{id}); };
    handlers.on_quarantined = [this](RequestId id) { post(ImportQuarantined{id}); };
    transfer_->set_handlers(std::move(handlers));
  }
  thread_ = std::thread([this] { run(); });
}

LocalInstance::~LocalInstance() {
  if (transfer_ != nullptr) transfer_->set_handlers({});
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
  // Rows still on their way must not land in the engine's cache once it is gone.
  if (transfer_ != nullptr) transfer_->forget_imports(core_.engine().cache());
}

void LocalInstance::set_event_handler(EventHandler handler) {
  std::lock_guard lock(callback_mutex_);
  handler_ = std::move(handler);
}

void LocalInstance::set_step_observer(StepObserver observer) {
  std::lock_guard lock(callback_mutex_);
  observer_ = std::move(observer);
}

void LocalInstance::post(InstanceCommand command) {
  {
    std::lock_guard lock(mutex_);
    commands_.push_back(std::move(command));
  }
  wake_.notify_one();
}

void LocalInstance::submit(InstanceRequest request) { post(std::move(request)); }

void LocalInstance::cancel(RequestId id) { post(CancelRequest{id}); }

InstanceStats LocalInstance::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

InstanceStats LocalInstance::publish_stats() {
  const InstanceStats stats = core_.stats();
  std::lock_guard lock(mutex_);
  stats_ = stats;
  return stats;
}

void LocalInstance::run() {
  std::deque<InstanceCommand> commands;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !commands_.empty() || !core_.idle(); });
      if (stopping_) return;
      commands.swap(commands_);
    }
    for (InstanceCommand& command : commands) core_.apply(command);
    commands.clear();
    // An imported prompt's first token (or a refusal) leaves now, not after
    // the next step: it is the request's time to first token.
    if (core_.has_events()) publish();
    in_step_ = true;
    core_.step();
    in_step_ = false;
    publish();
  }
}

void LocalInstance::publish() {
  const InstanceStats stats = publish_stats();
  const std::vector<InstanceEvent> events = core_.take_events();
  std::lock_guard callbacks(callback_mutex_);
  try {
    if (observer_) observer_(stats);
    if (!events.empty() && handler_) handler_(events);
  } catch (const std::exception& e) {
    // The consumer's fault; the engine and every other request go on.
    spdlog::error("instance: an event consumer failed: {}", e.what());
  }
}

}  // namespace duet
