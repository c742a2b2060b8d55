#include "worker/tensor_parallel.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include "common/error.h"
#include "worker/model/model_forward.h"
#include "worker/model/tp_shard.h"

namespace duet {
namespace {

enum class Command : uint32_t { kStep = 1, kExpect, kConfirm, kRelease, kStop, kLost };

// The leader's messages: plain values and counted arrays, in the order the
// follower reads them. Both ends are one build on one kind of host.
class Writer {
 public:
  explicit Writer(std::vector<std::byte>& bytes) : bytes_(bytes) { bytes_.clear(); }
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof value);
  }
  template <typename T>
  void put_array(std::span<const T> values) {
    put<uint64_t>(values.size());
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size_bytes());
  }

 private:
  std::vector<std::byte>& bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <typename T>
  T get() {
    T value;
    take(&value, sizeof value);
    return value;
  }
  template <typename T>
  std::vector<T> get_array() {
    std::vector<T> values(get<uint64_t>());
    take(values.data(), values.size() * sizeof(T));
    return values;
  }

 private:
  void take(void* to, size_t n) {
    DUET_ASSERT(at_ + n <= bytes_.size(), "a leader's message of {} bytes read past its end",
                bytes_.size());
    std::memcpy(to, bytes_.data() + at_, n);
    at_ += n;
  }
  std::span<const std::byte> bytes_;
  size_t at_ = 0;
};

void put_import(Writer& w, const TpImport& import) {
  w.put(import.id.value);
  w.put(import.send_from);
  w.put(import.n_prompt);
  w.put_array<int32_t>(import.block_table);
  w.put<int64_t>(import.timeout.count());
  w.put_array<int32_t>(import.prefill_ranks);
}

TpImport get_import(Reader& r) {
  TpImport import;
  import.id = RequestId{r.get<uint64_t>()};
  import.send_from = r.get<int64_t>();
  import.n_prompt = r.get<int64_t>();
  import.block_table = r.get_array<int32_t>();
  import.timeout = std::chrono::milliseconds(r.get<int64_t>());
  import.prefill_ranks = r.get_array<int32_t>();
  return import;
}

}  // namespace

KvTransfer::ImportPlan tp_import_plan(const TpImport& import, const LlamaModel& model,
                                      KvCache& cache) {
  const TpShard& shard = model.shard();
  KvTransfer::ImportPlan plan;
  plan.id = import.id;
  plan.send_from = import.send_from;
  plan.n_prompt = import.n_prompt;
  const int prefill_size = static_cast<int>(import.prefill_ranks.size());
  for (const KvPeer& peer :
       kv_peers(model.config().n_kv_heads, shard.rank, shard.size, prefill_size)) {
    plan.sources.push_back(
        {import.prefill_ranks[static_cast<size_t>(peer.index)], peer.head_begin, peer.head_end});
  }
  plan.head_offset = shard.kv_head_begin;
  plan.cache = &cache;
  plan.block_table = import.block_table;
  plan.deadline = KvTransfer::Clock::now() + import.timeout;
  return plan;
}

void tp_send_rows(KvTransfer& transfer, const LlamaModel& model, RequestId id, int64_t layer,
                  int64_t pos0, int64_t n, std::span<const int32_t> decode_ranks,
                  const KvCache& cache, std::span<const int32_t> block_table) {
  const TpShard& shard = model.shard();
  const int decode_size = static_cast<int>(decode_ranks.size());
  for (const KvPeer& peer :
       kv_peers(model.config().n_kv_heads, shard.rank, shard.size, decode_size)) {
    const int rank = decode_ranks[static_cast<size_t>(peer.index)];
    transfer.send_rows(rank, id, layer, pos0, n, cache, block_table, shard.kv_head_begin,
                       KvSource{rank, peer.head_begin, peer.head_end});
  }
}

// ------------------------------------------------------------------ leader

TpLeader::TpLeader(Collective& collective, DeviceCollective* device_collective)
    : collective_(collective), device_collective_(device_collective) {
  DUET_REQUIRE(collective.rank() == 0 && collective.size() >= 2,
               "a tensor-parallel leader is rank 0 of two or more, not {} of {}", collective.rank(),
               collective.size());
}

std::vector<std::byte> TpLeader::gather_answers() {
  const std::byte mine{1};
  std::vector<std::byte> all(static_cast<size_t>(collective_.size()));
  collective_.all_gather(std::span<const std::byte>(&mine, 1), all);
  return all;
}

void TpLeader::peers_lost(std::span<const Rank> ranks) {
  std::lock_guard lock(lost_mutex_);
  for (Rank rank : ranks) lost_.push_back(rank.value);
}

void TpLeader::tell_losses() {
  std::vector<int32_t> ranks;
  {
    std::lock_guard lock(lost_mutex_);
    ranks.swap(lost_);
  }
  if (ranks.empty()) return;
  Writer w(message_);
  w.put(Command::kLost);
  w.put_array<int32_t>(ranks);
  collective_.post(message_);
}

void TpLeader::step(const ForwardBatch& batch, std::span<const TpExport> exports) {
  tell_losses();
  Writer w(message_);
  w.put(Command::kStep);
  w.put_array(batch.tokens);
  w.put<uint64_t>(batch.sequences.size());
  for (const ForwardSequence& s : batch.sequences) {
    w.put(s.pos0);
    w.put(s.n_tokens);
    w.put(s.one_token_from);
    w.put_array(s.block_table);
  }
  w.put_array(batch.logit_rows);
  w.put<uint64_t>(exports.size());
  for (const TpExport& e : exports) {
    w.put(e.id.value);
    w.put<uint64_t>(e.sequence);
    w.put(e.pos0);
    w.put(e.n);
    w.put_array<int32_t>(e.decode_ranks);
  }
  collective_.post(message_);
}

void TpLeader::expect_import(const TpImport& import) {
  tell_losses();
  Writer w(message_);
  w.put(Command::kExpect);
  put_import(w, import);
  collective_.post(message_);
  gather_answers();
}

bool TpLeader::confirm_import(RequestId id) {
  tell_losses();
  Writer w(message_);
  w.put(Command::kConfirm);
  w.put(id.value);
  collective_.post(message_);
  const std::vector<std::byte> answers = gather_answers();
  return std::all_of(answers.begin(), answers.end(), [](std::byte b) { return b == std::byte{1}; });
}

void TpLeader::release_import(RequestId id) {
  tell_losses();
  Writer w(message_);
  w.put(Command::kRelease);
  w.put(id.value);
  collective_.post(message_);
  gather_answers();
}

void TpLeader::stop() {
  Writer w(message_);
  w.put(Command::kStop);
  collective_.post(message_);
}

// ------------------------------------------------------------------ follower

namespace {

// A follower's imports as its transfer reports them (the transfer's thread).
class ImportOutcomes {
 public:
  enum class State { kComplete, kFailed, kReleased };

  void set(RequestId id, State state) {
    {
      std::lock_guard lock(mutex_);
      outcomes_[id] = state;
    }
    changed_.notify_all();
  }
  // Waits for `id`'s outcome (at most `limit`), takes it; nullopt past the limit.
  std::optional<State> take(RequestId id, std::chrono::steady_clock::time_point limit) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_until(lock, limit, [&] { return outcomes_.contains(id); }))
      return std::nullopt;
    const State state = outcomes_.at(id);
    outcomes_.erase(id);
    return state;
  }
  bool has(RequestId id) const {
    std::lock_guard lock(mutex_);
    return outcomes_.contains(id);
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<RequestId, State> outcomes_;
};

// How long past its own deadline a follower waits for an import's outcome:
// the transfer reports a late import as failed by itself.
constexpr auto kOutcomeGrace = std::chrono::seconds(10);

class Follower {
 public:
  Follower(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
           Collective& collective, int64_t n_kv_blocks, KvTransfer* transfer,
           const TpFollowerPlacement& placement)
      : model_(model),
        collective_(collective),
        transfer_(transfer),
        cache_(model.kv_layout(n_kv_blocks)),
        forward_(make_forward(model, kernels, pool,
                              {placement.device, &collective, placement.device_collective})) {
    cache_.set_device_copy(forward_->device_kv(cache_.layout()));
    if (transfer_ == nullptr) return;
    KvTransfer::Handlers handlers;
    handlers.on_order = [](int peer, const PrefillOrder& order) {
      spdlog::error("tp follower: an order for request {} from rank {}; orders go to leaders",
                    order.request.id.value, peer);
    };
    handlers.on_cancel = [](int, RequestId) {};  // the leader withdraws exports
    handlers.on_complete = [this](RequestId id, const KvHandoff&) {
      outcomes_.set(id, ImportOutcomes::State::kComplete);
    };
    handlers.on_failed = [this](RequestId id, const ServeError&) {
      outcomes_.set(id, ImportOutcomes::State::kFailed);
    };
    handlers.on_released = [this](RequestId id) {
      outcomes_.set(id, ImportOutcomes::State::kReleased);
    };
    transfer_->set_handlers(std::move(handlers));
  }

  ~Follower() {
    if (transfer_ == nullptr) return;
    transfer_->set_handlers({});
    transfer_->forget_imports(cache_);
  }

  void run() {
    for (;;) {
      const std::vector<std::byte> message = collective_.next_message();
      Reader r(message);
      switch (r.get<Command>()) {
        case Command::kStep:
          step(r);
          break;
        case Command::kExpect:
          expect(get_import(r));
          break;
        case Command::kConfirm:
          answer(confirm(RequestId{r.get<uint64_t>()}));
          break;
        case Command::kRelease:
          release(RequestId{r.get<uint64_t>()});
          answer(true);
          break;
        case Command::kLost:
          lost(r.get_array<int32_t>());
          break;
        case Command::kStop:
          return;
      }
    }
  }

 private:
  struct Import {
    std::chrono::steady_clock::time_point deadline;
    std::vector<int32_t> block_table;
    int64_t send_from = 0, n_prompt = 0;
    bool device_rows = false;  // every source has a device transfer: rows land on the GPU
  };

  // Whether every rank of `ranks` moves rows device to device with this one.
  bool device_peers(std::span<const int32_t> ranks) const {
    return std::all_of(ranks.begin(), ranks.end(),
                       [this](int32_t rank) { return transfer_->device_transfer(rank); });
  }

  void answer(bool ok) {
    const std::byte mine = ok ? std::byte{1} : std::byte{0};
    std::vector<std::byte> all(static_cast<size_t>(collective_.size()));
    collective_.all_gather(std::span<const std::byte>(&mine, 1), all);
  }

  void step(Reader& r) {
    tokens_ = r.get_array<int32_t>();
    const auto n_sequences = r.get<uint64_t>();
    block_tables_.resize(n_sequences);
    sequences_.resize(n_sequences);
    for (size_t i = 0; i < n_sequences; ++i) {
      sequences_[i].pos0 = r.get<int64_t>();
      sequences_[i].n_tokens = r.get<int64_t>();
      sequences_[i].one_token_from = r.get<int64_t>();
      block_tables_[i] = r.get_array<int32_t>();
      sequences_[i].block_table = block_tables_[i];
    }
    logit_rows_ = r.get_array<int64_t>();
    exports_.resize(r.get<uint64_t>());
    for (TpExport& e : exports_) {
      e.id = RequestId{r.get<uint64_t>()};
      e.sequence = r.get<uint64_t>();
      e.pos0 = r.get<int64_t>();
      e.n = r.get<int64_t>();
      e.decode_ranks = r.get_array<int32_t>();
    }
    // Whether a step ships its layers is the leader's choice too (a GPU
    // forward captures decode graphs only for steps that ship nothing, and
    // every rank must capture at the same steps).
    ModelForward::LayerStored ship;
    if (!exports_.empty()) {
      ship = [this](int64_t layer) {
        if (transfer_ == nullptr) return;
        for (const TpExport& e : exports_) {
          const std::span<const int32_t> table = sequences_[e.sequence].block_table;
          // Rows for ranks without a device transfer leave from the host copy.
          if (!device_peers(e.decode_ranks))
            forward_->kv_to_host(layer, table, e.pos0, e.n, cache_);
          tp_send_rows(*transfer_, model_, e.id, layer, e.pos0, e.n, e.decode_ranks, cache_, table);
        }
      };
    }
    // The logits come out here as on the leader (the all-gather); only the
    // leader samples from them (a GPU forward keeps them on the device).
    const bool on_device = forward_->samples_on_device();
    if (!on_device)
      logits_.resize(logit_rows_.size() * static_cast<size_t>(model_.config().n_vocab));
    forward_->run(tokens_, sequences_, cache_, logit_rows_, on_device ? nullptr : logits_.data(),
                  ship);
  }

  void expect(const TpImport& import) {
    DUET_ASSERT(transfer_ != nullptr, "an import on an instance without a transfer");
    imports_[import.id] =
        Import{std::chrono::steady_clock::now() + import.timeout, import.block_table,
               import.send_from, import.n_prompt, device_peers(import.prefill_ranks)};
    transfer_->expect_import(tp_import_plan(import, model_, cache_));
    answer(true);
  }

  bool confirm(RequestId id) {
    auto it = imports_.find(id);
    if (it == imports_.end()) return false;
    const auto state = outcomes_.take(id, it->second.deadline + kOutcomeGrace);
    const Import import = std::move(it->second);
    imports_.erase(it);
    if (!state) spdlog::error("tp follower: request {}: the transfer never settled", id.value);
    if (state != ImportOutcomes::State::kComplete) return false;
    // Rows that came through the host staging copy go to the device (GPU only).
    if (!import.device_rows) {
      forward_->kv_from_host(import.block_table, import.send_from,
                             import.n_prompt - import.send_from, cache_);
    }
    return true;
  }

  void lost(const std::vector<int32_t>& ranks) {
    if (transfer_ == nullptr) return;
    std::vector<Rank> lost;
    for (int32_t rank : ranks) lost.push_back(Rank{rank});
    transfer_->peers_lost(lost);
  }

  void release(RequestId id) {
    auto it = imports_.find(id);
    if (it == imports_.end()) return;  // confirmed already
    if (!outcomes_.has(id)) transfer_->abort_import(id);
    // Completed, failed or released: the transfer writes nothing any more.
    outcomes_.take(id, it->second.deadline + kOutcomeGrace);
    imports_.erase(it);
  }

  const LlamaModel& model_;
  Collective& collective_;
  KvTransfer* transfer_;
  KvCache cache_;
  std::unique_ptr<ModelForward> forward_;
  ImportOutcomes outcomes_;
  std::map<RequestId, Import> imports_;
  // The running step's batch, reused.
  std::vector<int32_t> tokens_;
  std::vector<std::vector<int32_t>> block_tables_;
  std::vector<ForwardSequence> sequences_;
  std::vector<int64_t> logit_rows_;
  std::vector<TpExport> exports_;
  std::vector<float> logits_;
};

}  // namespace

void run_tp_follower(const LlamaModel& model, const cpu::KernelTable& kernels,
                     cpu::ThreadPool& pool, Collective& collective, int64_t n_kv_blocks,
                     KvTransfer* transfer, const TpFollowerPlacement& placement) {
  Follower follower(model, kernels, pool, collective, n_kv_blocks, transfer, placement);
  follower.run();
}

}  // namespace duet
