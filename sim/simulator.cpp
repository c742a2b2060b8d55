#include "sim/simulator.h"

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <memory>
#include <random>
#include <sstream>

#include "common/error.h"
#include "coordinator/router.h"
#include "loadgen/stats.h"
#include "sim/sim_instance.h"

namespace duet::sim {
namespace {

struct LayoutPart {
  int count = 0;
  char role = 'C';  // 'P', 'D' or 'C'
  int tp = 1;
};

LayoutPart parse_part(std::string_view text, std::string_view whole) {
  LayoutPart part;
  size_t i = 0;
  int64_t count = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9' && count < 1'000'000)
    count = count * 10 + (text[i++] - '0');
  DUET_REQUIRE(i > 0 && i < text.size() && count >= 1,
               "cluster layout '{}': '{}' is not COUNT then P, D or C (e.g. 1P+2D, 4C@tp2)", whole,
               text);
  part.count = static_cast<int>(count);
  part.role = text[i++];
  DUET_REQUIRE(part.role == 'P' || part.role == 'D' || part.role == 'C',
               "cluster layout '{}': role '{}' is not P, D or C", whole, part.role);
  std::string_view rest = text.substr(i);
  if (!rest.empty()) {
    DUET_REQUIRE(rest.starts_with("@tp") && rest.size() > 3,
                 "cluster layout '{}': '{}' should end in @tpN", whole, text);
    int tp = 0;
    for (char c : rest.substr(3)) {
      DUET_REQUIRE(c >= '0' && c <= '9' && tp < 100'000, "cluster layout '{}': bad tp in '{}'",
                   whole, text);
      tp = tp * 10 + (c - '0');
    }
    DUET_REQUIRE(tp >= 1, "cluster layout '{}': tp must be >= 1", whole);
    part.tp = tp;
  }
  return part;
}

}  // namespace

ClusterSpec parse_cluster_layout(std::string_view text) {
  ClusterSpec spec;
  bool colocated = false, disaggregated = false;
  int rank = 1;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t plus = text.find('+', start);
    const std::string_view piece =
        text.substr(start, plus == std::string_view::npos ? std::string_view::npos : plus - start);
    const LayoutPart part = parse_part(piece, text);
    (part.role == 'C' ? colocated : disaggregated) = true;
    for (int i = 0; i < part.count; ++i) {
      InstanceSpec instance;
      instance.id = static_cast<int>(spec.instances.size());
      instance.role = part.role == 'P'   ? InstanceRole::kPrefill
                      : part.role == 'D' ? InstanceRole::kDecode
                                         : InstanceRole::kBoth;
      instance.tp = part.tp;
      for (int r = 0; r < part.tp; ++r) instance.ranks.push_back(Rank{rank++});
      spec.instances.push_back(std::move(instance));
    }
    if (plus == std::string_view::npos) break;
    start = plus + 1;
  }
  DUET_REQUIRE(!(colocated && disaggregated),
               "cluster layout '{}': colocated instances (C) do not mix with P and D", text);
  spec.mode = colocated ? ClusterMode::kColocated : ClusterMode::kDisaggregated;
  spec.validate(spec.required_world_size());
  return spec;
}

std::string describe_layout(const ClusterSpec& spec) {
  // Runs of (role, tp) in instance order, merged when adjacent.
  std::vector<std::pair<std::pair<char, int>, int>> runs;
  for (const InstanceSpec& instance : spec.instances) {
    const char role = instance.role == InstanceRole::kPrefill  ? 'P'
                      : instance.role == InstanceRole::kDecode ? 'D'
                                                               : 'C';
    if (!runs.empty() && runs.back().first == std::pair{role, instance.tp}) {
      ++runs.back().second;
    } else {
      runs.push_back({{role, instance.tp}, 1});
    }
  }
  std::string out;
  for (const auto& [key, count] : runs) {
    if (!out.empty()) out += '+';
    out += fmt::format("{}{}", count, key.first);
    if (key.second != 1) out += fmt::format("@tp{}", key.second);
  }
  return out;
}

SimResult simulate(const Profile& profile, const SimOptions& options,
                   std::span<const loadgen::PlannedRequest> trace) {
  const auto wall_start = std::chrono::steady_clock::now();
  const ClusterSpec& cluster = options.cluster;
  cluster.validate(cluster.required_world_size());
  const ModelShape& model = profile.model;
  DUET_REQUIRE(model.n_layers >= 1 && model.n_vocab >= 1 && model.n_ctx >= 1,
               "the profile's model shape is incomplete (layers, vocabulary, context)");

  SimTransfer transfer{{}, model.kv_bytes_per_token, model.n_layers};
  if (cluster.mode == ClusterMode::kDisaggregated) {
    DUET_REQUIRE(!profile.transfers.empty() || !options.transfer_path.empty(),
                 "a disaggregated cluster needs a KV transfer path; the profile has none");
    transfer.link = options.transfer_path.empty() ? profile.transfers.front().cost
                                                  : profile.transfer(options.transfer_path).cost;
  }

  EventQueue clock;
  SharedCores cores{options.host_cores,
                    options.neighbour_slowdown.value_or(profile.host.neighbour_slowdown)};
  std::vector<std::unique_ptr<SimInstance>> instances;
  std::map<int32_t, SimInstance*> by_address;
  std::vector<RoutedInstance> routed;
  for (const InstanceSpec& spec : cluster.instances) {
    const InstanceProfile& costs = profile.instance(spec.tp);
    EngineConfig config = options.engine;
    if (config.n_kv_blocks <= 0) {
      config.n_kv_blocks =
          std::max<int64_t>(1, costs.kv_capacity_tokens / KvLayout::kDefaultBlockSize);
    }
    InstanceInfo info{model.name, model.n_ctx, model.n_vocab,
                      config.n_kv_blocks * KvLayout::kDefaultBlockSize, config.end_of_generation};
    const int32_t peer = spec.id;  // an instance's transfer address: its index
    instances.push_back(std::make_unique<SimInstance>(
        clock, spec.tp, costs.step, std::move(config), std::move(info), model, transfer, peer,
        [&by_address](int32_t p) -> SimInstance* {
          auto it = by_address.find(p);
          return it == by_address.end() ? nullptr : it->second;
        },
        cores));
    by_address.emplace(peer, instances.back().get());
    routed.push_back(
        {instances.back().get(), spec.role, peer, cluster.mode == ClusterMode::kDisaggregated});
  }
  RoutedInstances router(std::move(routed), make_routing_policy(cluster.mode), options.max_retries);

  SimResult result;
  result.records.resize(trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    loadgen::RequestRecord& r = result.records[i];
    r.index = static_cast<int64_t>(i);
    r.scheduled = r.sent = trace[i].at;
    r.prompt_tokens = trace[i].prompt_tokens;
    r.output_tokens = trace[i].output_tokens;
    r.error_kind = "unfinished";
    r.error_message = "the simulation ended before the request did";
  }
  // Request ids are the trace index + 1.
  router.set_event_handler([&](std::span<const InstanceEvent> events) {
    const double now = clock.now();
    for (const InstanceEvent& e : events) {
      loadgen::RequestRecord& r = result.records.at(e.id.value - 1);
      if (e.token >= 0) {
        if (!r.first_token) r.first_token = now;
        r.token_times.push_back(now);
        ++r.received_tokens;
      }
      if (!e.finished) continue;
      r.finished = now;
      r.ok = e.finish != InstanceFinish::kFailed && e.finish != InstanceFinish::kCancelled;
      r.error_kind.clear();
      r.error_message.clear();
      if (!r.ok) {
        r.error_kind = e.error ? std::string(serve_error_kind_name(e.error->kind)) : "cancelled";
        r.error_message = e.error ? e.error->message : "";
      }
    }
  });

  // Arrivals, each scheduling the next (the queue holds one at a time).
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<int32_t> token_id(0, static_cast<int32_t>(model.n_vocab - 1));
  std::function<void(size_t)> arrive = [&](size_t i) {
    const loadgen::PlannedRequest& planned = trace[i];
    InstanceRequest request;
    request.id = RequestId{i + 1};
    if (planned.prompt_ids.empty()) {
      request.prompt.resize(static_cast<size_t>(planned.prompt_tokens));
      for (int32_t& id : request.prompt) id = token_id(rng);
    } else {
      request.prompt = planned.prompt_ids;
    }
    request.max_tokens = planned.output_tokens;
    request.ignore_eos = true;
    router.submit(std::move(request));
    if (i + 1 < trace.size()) clock.at(trace[i + 1].at, [&arrive, i] { arrive(i + 1); });
  };
  // The rebalancer's looks, each scheduling the next while anything else is pending.
  std::optional<RebalanceLoop> rebalancer;
  if (options.rebalance) {
    DUET_REQUIRE(cluster.mode == ClusterMode::kDisaggregated,
                 "rebalancing needs a disaggregated cluster (P and D instances)");
    rebalancer.emplace(*options.rebalance);
  }
  const double look_every =
      options.rebalance ? static_cast<double>(options.rebalance->interval.count()) / 1e3 : 0;
  DUET_REQUIRE(!options.rebalance || look_every > 0, "the rebalancer's interval must be positive");
  const auto finished_since = [&](double since) {
    Metrics::RecentLatency recent;
    for (const loadgen::RequestRecord& r : result.records) {
      if (!r.ok || !r.first_token || r.finished < since) continue;
      recent.ttft_s.push_back(*loadgen::ttft_of(r));
      if (const std::optional<double> tpot = loadgen::tpot_of(r)) recent.tpot_s.push_back(*tpot);
    }
    return recent;
  };
  std::function<void()> look = [&] {
    const std::vector<RoutedInstances::RoleView> views = router.role_views();
    if (std::optional<RebalanceDecision> d = rebalancer->look(clock.now(), views, finished_since)) {
      result.role_changes.push_back(
          {clock.now(), d->instance, views[d->instance].role, d->to, std::move(d->why)});
      router.change_role(static_cast<int64_t>(d->instance), d->to);
    }
    if (!clock.empty()) clock.after(look_every, look);
  };

  if (!trace.empty()) {
    for (size_t i = 1; i < trace.size(); ++i)
      DUET_REQUIRE(trace[i].at >= trace[i - 1].at, "the trace is not in time order (row {})", i);
    clock.at(trace.front().at, [&arrive] { arrive(0); });
    if (rebalancer) clock.at(trace.front().at + look_every, look);
  }
  clock.run();

  const std::vector<int64_t> counts = router.routed_counts();
  const std::vector<RoutedInstances::RoleView> roles = router.role_views();
  for (size_t i = 0; i < instances.size(); ++i) {
    const SimInstance& instance = *instances[i];
    result.instances.push_back({roles[i].role, instance.tp(), counts[i], instance.steps(),
                                instance.busy_seconds(), instance.stats().preemptions});
  }
  result.simulated_s = clock.now();
  result.events = clock.n_run();
  result.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace duet::sim
