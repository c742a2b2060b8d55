// The instance layer's two shells, driven with the same commands: a
// LocalInstance (its engine thread, a tiny real model, KV over a real
// TcpKvTransfer on loopback) and the simulator's SimInstance (a step-time
// model, simulated time, a modelled link) must give the same events in the
// same order, tokens' values aside (one model computes them, the other only
// takes time).
//
// Commands come from a script that reacts to the events: the handler of a
// batch posts the next commands, which both shells apply before their next
// step, so the two see each command between the same two steps.
// - Colocated: admissions, chunked prefill, preemption (few KV blocks), a
//   cancel, a refused prompt; the whole stream compared, and the stats.
// - Disaggregated (1 prefill + 1 decode): imports and exports, a cancel
//   after the first token, a prompt the prefill side refuses. The rows'
//   arrival is real time on one side, so each request's own events are
//   compared, in order.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/net/tcp_connect.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "sim/sim_instance.h"
#include "tests/test_paths.h"
#include "worker/local_instance.h"
#include "worker/model/llama_model.h"
#include "worker/transfer/tcp_kv_transfer.h"

namespace duet {
namespace {

using namespace std::chrono_literals;

// An event as both shells must agree on it.
struct Seen {
  uint64_t id = 0;
  bool admitted = false;
  int64_t cached_tokens = 0;
  bool token = false;  // carries a token (its value is the model's)
  bool finished = false;
  InstanceFinish finish = InstanceFinish::kLength;
  std::optional<ServeErrorKind> error;
  bool operator==(const Seen&) const = default;
};

std::string describe(const Seen& e) {
  std::string s = "#" + std::to_string(e.id);
  if (e.admitted) s += " admitted(cached " + std::to_string(e.cached_tokens) + ")";
  if (e.token) s += " token";
  if (e.finished) s += " finished(" + std::to_string(static_cast<int>(e.finish)) + ")";
  if (e.error) s += " error(" + std::to_string(static_cast<int>(*e.error)) + ")";
  return s;
}

std::string describe(const std::vector<Seen>& events) {
  std::string s;
  for (const Seen& e : events) s += describe(e) + "\n";
  return s;
}

InstanceRequest request(uint64_t id, int64_t prompt, int64_t max_tokens, int32_t prefill = -1) {
  InstanceRequest r;
  r.id = RequestId{id};
  // Prompts of distinct tokens per request: no prefix is shared by chance.
  for (int64_t i = 0; i < prompt; ++i)
    r.prompt.push_back(static_cast<int32_t>(5 + (id * 37 + static_cast<uint64_t>(i) * 11) % 200));
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.prefill_peer = prefill;
  return r;
}

// Commands for one shell: submit and cancel on the instance that serves
// the coordinator's requests.
struct Door {
  std::function<void(InstanceRequest)> submit;
  std::function<void(RequestId)> cancel;
};

// The script: what to post after the k-th batch of events, and after a
// request's first token. Identical for both shells.
class Script {
 public:
  using Step = std::function<void(Door&)>;
  Script(std::map<int, Step> after_batch, std::map<uint64_t, Step> after_first_token,
         int64_t n_requests)
      : after_batch_(std::move(after_batch)),
        after_first_token_(std::move(after_first_token)),
        n_requests_(n_requests) {}

  // The event handler of the instance behind `door`; returns when done.
  void on_events(std::span<const InstanceEvent> events, Door& door) {
    std::vector<Step> next;
    {
      std::lock_guard lock(mutex_);
      for (const InstanceEvent& e : events) {
        seen_.push_back({e.id.value, e.admitted, e.cached_tokens, e.token >= 0, e.finished,
                         e.finish, e.error ? std::optional(e.error->kind) : std::nullopt});
        if (e.token >= 0 && first_tokens_.insert(e.id.value).second) {
          if (auto it = after_first_token_.find(e.id.value); it != after_first_token_.end())
            next.push_back(it->second);
        }
        if (e.finished) ++finished_;
      }
      if (auto it = after_batch_.find(batches_++); it != after_batch_.end())
        next.push_back(it->second);
    }
    for (Step& step : next) step(door);
    done_.notify_all();
  }

  bool wait_done(std::chrono::milliseconds patience) {
    std::unique_lock lock(mutex_);
    return done_.wait_for(lock, patience, [&] { return finished_ >= n_requests_; });
  }
  std::vector<Seen> seen() const {
    std::lock_guard lock(mutex_);
    return seen_;
  }
  std::map<uint64_t, std::vector<Seen>> per_request() const {
    std::map<uint64_t, std::vector<Seen>> out;
    for (const Seen& e : seen()) out[e.id].push_back(e);
    return out;
  }

 private:
  const std::map<int, Step> after_batch_;
  const std::map<uint64_t, Step> after_first_token_;
  const int64_t n_requests_;
  mutable std::mutex mutex_;
  std::condition_variable done_;
  std::vector<Seen> seen_;
  std::set<uint64_t> first_tokens_;
  int batches_ = 0;
  int64_t finished_ = 0;
};

class InstanceTwins : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LlamaModel::load(*testing::model_for_param("tiny_q8_0_mha_untied.gguf"));
    pool_ = std::make_unique<cpu::ThreadPool>(1);
    const ModelConfig& c = model_->config();
    shape_.name = "tiny";
    shape_.n_layers = c.n_layers;
    shape_.n_kv_heads = c.n_kv_heads;
    shape_.head_dim = c.n_embd / c.n_heads;
    shape_.n_vocab = c.n_vocab;
    shape_.n_ctx = c.n_ctx_train;
    shape_.kv_bytes_per_token = 2.0 * c.n_layers * c.n_kv_heads * shape_.head_dim * 2;
    cost_.token_knots = {1, 512};
    cost_.knot_seconds = {0.010, 0.010 + 511 * 1e-4};
  }

  InstanceInfo info(const EngineConfig& config) const {
    return {"tiny", shape_.n_ctx, shape_.n_vocab, config.n_kv_blocks * 16, {}};
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<cpu::ThreadPool> pool_;
  sim::ModelShape shape_;
  sim::StepCost cost_;
};

EngineConfig small_engine(int64_t blocks) {
  EngineConfig config;
  config.n_kv_blocks = blocks;
  config.scheduler = {.max_step_tokens = 48, .max_running = 4};
  return config;
}

Script colocated_script() {
  // Request 1 starts alone; 2-4 come after its first batch and overrun the
  // 12 blocks (preemption); 5 is longer than the KV cache (refused); 3 is
  // cancelled after its first token; 6 comes late and is short.
  return Script({{0,
                  [](Door& d) {
                    d.submit(request(2, 40, 60));
                    d.submit(request(3, 33, 40));
                    d.submit(request(4, 50, 50));
                    d.submit(request(5, 400, 8));
                  }},
                 {6, [](Door& d) { d.submit(request(6, 9, 5)); }}},
                {{3, [](Door& d) { d.cancel(RequestId{3}); }}}, 6);
}

TEST_F(InstanceTwins, ColocatedGiveTheSameEventsInTheSameOrder) {
  const EngineConfig config = small_engine(12);

  Script local_script = colocated_script();
  LocalInstance local(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config, "tiny");
  Door local_door{[&](InstanceRequest r) { local.submit(std::move(r)); },
                  [&](RequestId id) { local.cancel(id); }};
  local.set_event_handler(
      [&](std::span<const InstanceEvent> events) { local_script.on_events(events, local_door); });
  local.submit(request(1, 20, 25));
  ASSERT_TRUE(local_script.wait_done(60s)) << describe(local_script.seen());

  Script sim_script = colocated_script();
  sim::EventQueue clock;
  sim::SharedCores cores;
  sim::SimInstance simulated(
      clock, 1, cost_, config, info(config), shape_,
      {{}, shape_.kv_bytes_per_token, shape_.n_layers}, 0,
      [](int32_t) -> sim::SimInstance* { return nullptr; }, cores);
  Door sim_door{[&](InstanceRequest r) { simulated.submit(std::move(r)); },
                [&](RequestId id) { simulated.cancel(id); }};
  simulated.set_event_handler(
      [&](std::span<const InstanceEvent> events) { sim_script.on_events(events, sim_door); });
  simulated.submit(request(1, 20, 25));
  clock.run();
  ASSERT_TRUE(sim_script.wait_done(0ms)) << describe(sim_script.seen());

  EXPECT_EQ(describe(sim_script.seen()), describe(local_script.seen()));
  const InstanceStats a = local.stats();
  const InstanceStats b = simulated.stats();
  EXPECT_GT(a.preemptions, 0) << "the workload should preempt";
  EXPECT_EQ(b.preemptions, a.preemptions);
  EXPECT_EQ(b.steps, a.steps);
  EXPECT_EQ(b.generated_tokens, a.generated_tokens);
  EXPECT_EQ(b.prompt_tokens, a.prompt_tokens);
  EXPECT_EQ(b.prefix_hit_tokens, a.prefix_hit_tokens);
  for (const InstanceStats& s : {a, b}) {
    EXPECT_EQ(s.running + s.waiting, 0);
    EXPECT_EQ(s.kv_blocks_free, s.kv_blocks_total) << "KV blocks leaked";
  }
}

constexpr int kPrefillRank = 1;
constexpr int kDecodeRank = 2;

// Connected sockets between the two ranks, as duet serve's start-up makes them.
std::pair<int, int> connected_pair() {
  TcpListener prefill_listener, decode_listener;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  auto prefill = std::async(std::launch::async, [&] {
    const TcpPeer peer{kDecodeRank, decode_listener.address(), true, true};
    return connect_tcp_peers(kPrefillRank, &prefill_listener, std::span(&peer, 1), kKvPurpose,
                             deadline);
  });
  const TcpPeer peer{kPrefillRank, prefill_listener.address(), true, false};
  std::map<int, int> decode =
      connect_tcp_peers(kDecodeRank, &decode_listener, std::span(&peer, 1), kKvPurpose, deadline);
  return {prefill.get().at(kDecodeRank), decode.at(kPrefillRank)};
}

Script disaggregated_script(int32_t prefill) {
  // 1 and 2 import at once, 3 after 1's first batch; 2 is cancelled after
  // its first token; 4 fits the decode side's cache but not the prefill
  // side's (refused there).
  return Script({{0,
                  [prefill](Door& d) {
                    d.submit(request(3, 70, 12, prefill));
                    d.submit(request(4, 200, 4, prefill));
                  }}},
                {{2, [](Door& d) { d.cancel(RequestId{2}); }}}, 4);
}

TEST_F(InstanceTwins, DisaggregatedGiveEachRequestTheSameEvents) {
  const EngineConfig prefill_config = small_engine(8);  // 128 positions: refuses 200
  const EngineConfig decode_config = small_engine(40);

  std::map<uint64_t, std::vector<Seen>> local_events;
  {
    const auto [prefill_fd, decode_fd] = connected_pair();
    TcpKvTransfer prefill_transfer(kPrefillRank, {{kDecodeRank, prefill_fd}});
    TcpKvTransfer decode_transfer(kDecodeRank, {{kPrefillRank, decode_fd}});
    cpu::ThreadPool prefill_pool(1);
    const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
    LocalInstance prefill(*model_, kernels, prefill_pool, prefill_config, "tiny",
                          PeerLinks{.transfer = &prefill_transfer});
    LocalInstance decode(*model_, kernels, *pool_, decode_config, "tiny",
                         PeerLinks{.transfer = &decode_transfer});
    Script script = disaggregated_script(kPrefillRank);
    Door door{[&](InstanceRequest r) { decode.submit(std::move(r)); },
              [&](RequestId id) { decode.cancel(id); }};
    prefill.set_event_handler([](std::span<const InstanceEvent> events) {
      ADD_FAILURE() << "a prefill instance reports no events; got " << events.size();
    });
    decode.set_event_handler(
        [&](std::span<const InstanceEvent> events) { script.on_events(events, door); });
    decode.submit(request(1, 45, 10, kPrefillRank));
    decode.submit(request(2, 30, 8, kPrefillRank));
    ASSERT_TRUE(script.wait_done(60s)) << describe(script.seen());
    local_events = script.per_request();
    // The prefill side publishes its stats after the step that sent the
    // last handoff: give it a moment.
    auto settled = [](const LocalInstance& instance) {
      const InstanceStats s = instance.stats();
      return s.kv_blocks_free == s.kv_blocks_total && s.running + s.waiting == 0;
    };
    for (int i = 0; i < 500 && !(settled(prefill) && settled(decode)); ++i)
      std::this_thread::sleep_for(10ms);
    for (const LocalInstance* instance : {&prefill, &decode}) {
      EXPECT_EQ(instance->stats().kv_blocks_free, instance->stats().kv_blocks_total);
      EXPECT_EQ(instance->stats().running + instance->stats().waiting, 0);
    }
  }

  sim::EventQueue clock;
  sim::SharedCores cores;
  const sim::SimTransfer link{{0.0005, 1e9}, shape_.kv_bytes_per_token, shape_.n_layers};
  std::map<int32_t, sim::SimInstance*> by_address;
  auto lookup = [&](int32_t address) { return by_address.at(address); };
  sim::SimInstance prefill(clock, 1, cost_, prefill_config, info(prefill_config), shape_, link, 0,
                           lookup, cores);
  sim::SimInstance decode(clock, 1, cost_, decode_config, info(decode_config), shape_, link, 1,
                          lookup, cores);
  by_address = {{0, &prefill}, {1, &decode}};
  Script script = disaggregated_script(0);
  Door door{[&](InstanceRequest r) { decode.submit(std::move(r)); },
            [&](RequestId id) { decode.cancel(id); }};
  decode.set_event_handler(
      [&](std::span<const InstanceEvent> events) { script.on_events(events, door); });
  decode.submit(request(1, 45, 10, 0));
  decode.submit(request(2, 30, 8, 0));
  clock.run();
  ASSERT_TRUE(script.wait_done(0ms)) << describe(script.seen());

  const std::map<uint64_t, std::vector<Seen>> sim_events = script.per_request();
  ASSERT_EQ(sim_events.size(), 4u);
  for (const auto& [id, events] : sim_events) {
    EXPECT_EQ(describe(events), describe(local_events[id])) << "request " << id;
  }
  // What the workload was meant to show.
  EXPECT_EQ(sim_events.at(2).back().finish, InstanceFinish::kCancelled);
  EXPECT_EQ(sim_events.at(4).back().error, ServeErrorKind::kInvalidArgument);
  for (const sim::SimInstance* instance : {&prefill, &decode}) {
    EXPECT_EQ(instance->stats().kv_blocks_free, instance->stats().kv_blocks_total);
    EXPECT_EQ(instance->stats().running + instance->stats().waiting, 0);
  }
}

}  // namespace
}  // namespace duet
