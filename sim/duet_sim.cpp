// duet-sim: a cluster of any size simulated on a profile's cost model
// (sim/simulator.h), driven by the workloads duet-bench sends and
// reported as duet-bench reports; `duet-sim plan` searches layouts for the
// best goodput per GPU under an SLO (sim/planner.h). Wiring only.
//
//   duet-sim --profile cpu.json --cluster 1P+2D --trace bench/traces/chat_80.csv
//            --slo ttft=3000,tpot=150 --json sim.json
//   duet-sim --profile h200.json --cluster 4P@tp2+4D@tp4 --rate 10,20 -n 5000
//            --input-len normal:1000:300 --output-len normal:200:80
//   duet-sim --profile cpu.json --cluster 1P+2D --trace bench/traces/shift.csv
//            --slo ttft=2000,tpot=200 --rebalance auto
//   duet-sim plan --profile h200.json --mix chat --slo ttft=1000,tpot=50 --gpus 8,64,512
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "loadgen/command_line.h"
#include "loadgen/report.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"
#include "sim/planner.h"
#include "sim/profile.h"
#include "sim/simulator.h"

namespace {

using namespace duet;
using namespace duet::loadgen;

struct EngineFlags {
  int64_t max_running = 64;  // as `duet serve`
  int64_t step_tokens = 512;
  int64_t kv_blocks = 0;  // 0: the profile's capacity
};

struct Flags {
  std::string profile;
  std::string cluster = "1C";
  std::string transfer;
  int host_cores = 0;
  double neighbour_slowdown = 0;  // 0: the profile's
  std::string rates;
  double burstiness = 1;
  int64_t n_requests = 100;
  std::string input_len = "128";
  std::string output_len = "128";
  std::string trace;
  double time_scale = 1;
  uint64_t seed = 0;
  std::string slo;
  std::string rebalance = "off";
  std::string json;
  std::string plot;
  EngineFlags engine;
};

EngineConfig engine_config(const EngineFlags& flags) {
  EngineConfig config;
  config.n_kv_blocks = flags.kv_blocks;
  config.scheduler.max_running = flags.max_running;
  config.scheduler.max_step_tokens = std::max(flags.step_tokens, flags.max_running);
  return config;
}

ClusterSpec cluster_spec(const std::string& text) {
  if (std::filesystem::exists(text)) return parse_cluster_file(text);
  return sim::parse_cluster_layout(text);
}

nlohmann::json instances_json(const sim::SimResult& result) {
  nlohmann::json out = nlohmann::json::array();
  for (const sim::InstanceReport& i : result.instances) {
    out.push_back({{"role", instance_role_name(i.role)},
                   {"tp", i.tp},
                   {"routed", i.routed},
                   {"steps", i.steps},
                   {"busy_s", i.busy_s},
                   {"utilization", result.simulated_s > 0 ? i.busy_s / result.simulated_s : 0.0},
                   {"preemptions", i.preemptions}});
  }
  return out;
}

nlohmann::json role_changes_json(const sim::SimResult& result) {
  nlohmann::json out = nlohmann::json::array();
  for (const sim::RoleChange& c : result.role_changes) {
    out.push_back({{"at_s", c.at},
                   {"instance", c.instance},
                   {"from", instance_role_name(c.from)},
                   {"to", instance_role_name(c.to)},
                   {"why", c.why}});
  }
  return out;
}

int run_command(const Flags& flags) {
  const sim::Profile profile = sim::read_profile(flags.profile);
  const Slo slo = parse_slo(flags.slo);
  sim::SimOptions options;
  options.cluster = cluster_spec(flags.cluster);
  options.engine = engine_config(flags.engine);
  options.transfer_path = flags.transfer;
  options.host_cores = flags.host_cores;
  if (flags.neighbour_slowdown > 0) options.neighbour_slowdown = flags.neighbour_slowdown;
  options.seed = flags.seed;
  if (flags.rebalance == "auto") {
    DUET_REQUIRE(slo.ttft || slo.tpot, "--rebalance auto needs --slo ttft=MS,tpot=MS");
    options.rebalance = RebalancerOptions{.slo = {slo.ttft.value_or(0), slo.tpot.value_or(0)}};
  }

  const bool from_trace = !flags.trace.empty();
  std::vector<double> rates = parse_rates(flags.rates);
  DUET_REQUIRE(from_trace || !rates.empty(), "say what to send: --rate R[,R...] or --trace FILE");
  DUET_REQUIRE(flags.n_requests >= 1, "--num-requests must be at least 1");
  const std::vector<PlannedRequest> workload =
      make_workload({flags.trace, flags.n_requests, flags.input_len, flags.output_len, flags.seed});
  const ArrivalOptions arrivals{from_trace, flags.time_scale, flags.burstiness, flags.seed};
  std::vector<std::optional<double>> plans(rates.begin(), rates.end());
  if (plans.empty()) plans.push_back(std::nullopt);

  std::cerr << fmt::format("duet-sim: {} ({}), cluster {}\n", profile.device, profile.source,
                           sim::describe_layout(options.cluster));
  std::vector<RunResult> results;
  nlohmann::json simulations = nlohmann::json::array();
  for (const std::optional<double>& rate : plans) {
    const std::vector<PlannedRequest> plan = open_loop_plan(workload, rate, arrivals);
    sim::SimResult sim = sim::simulate(profile, options, plan);
    RunResult run;
    run.label = rate ? format_rate(*rate) : fmt::format("trace x{:g}", flags.time_scale);
    run.rate = rate;
    run.records = std::move(sim.records);
    run.summary = summarize(run.records, slo);
    print_run(std::cout, run, slo);
    std::cout << fmt::format("{:<24}{:.1f} s simulated in {:.2f} s ({} events)\n", "simulation",
                             sim.simulated_s, sim.wall_s, sim.events);
    for (const sim::RoleChange& c : sim.role_changes) {
      std::cout << fmt::format("{:<24}at {:.1f} s instance {} {} -> {}: {}\n", "role change", c.at,
                               c.instance, instance_role_name(c.from), instance_role_name(c.to),
                               c.why);
    }
    simulations.push_back({{"label", run.label},
                           {"simulated_s", sim.simulated_s},
                           {"wall_s", sim.wall_s},
                           {"events", sim.events},
                           {"instances", instances_json(sim)},
                           {"role_changes", role_changes_json(sim)}});
    results.push_back(std::move(run));
  }
  if (results.size() > 1) print_sweep(std::cout, results);
  std::cout.flush();

  const nlohmann::json config = {
      {"profile", flags.profile},
      {"profile_source", profile.source},
      {"device", profile.device},
      {"model", profile.model.name},
      {"cluster", sim::describe_layout(options.cluster)},
      {"transfer", flags.transfer},
      {"host_cores", flags.host_cores},
      {"neighbour_slowdown", options.neighbour_slowdown.value_or(profile.host.neighbour_slowdown)},
      {"max_running", flags.engine.max_running},
      {"step_tokens", flags.engine.step_tokens},
      {"kv_blocks", flags.engine.kv_blocks},
      {"rates", flags.rates},
      {"burstiness", flags.burstiness},
      {"num_requests", flags.n_requests},
      {"input_len", from_trace ? "trace" : flags.input_len},
      {"output_len", from_trace ? "trace" : flags.output_len},
      {"trace", flags.trace},
      {"time_scale", flags.time_scale},
      {"seed", flags.seed},
      {"rebalance", flags.rebalance}};
  std::string json_path = flags.json;
  if (json_path.empty() && !flags.plot.empty())
    json_path = (std::filesystem::temp_directory_path() /
                 fmt::format("duet-sim-{}.json", static_cast<long>(getpid())))
                    .string();
  if (!json_path.empty()) {
    nlohmann::json report = report_json(config, slo, results);
    report["tool"] = "duet-sim";
    report["simulation"] = std::move(simulations);
    write_json(json_path, report);
    if (!flags.json.empty()) std::cerr << "duet-sim: wrote " << json_path << "\n";
  }
  if (!flags.plot.empty()) plot("duet-sim", DUET_BENCH_PLOT_SCRIPT, json_path, flags.plot);
  if (flags.json.empty() && !json_path.empty()) std::filesystem::remove(json_path);
  return 0;
}

void add_engine_flags(CLI::App& app, EngineFlags& flags) {
  app.add_option("--max-running", flags.max_running, "Sequences an instance decodes at once")
      ->capture_default_str();
  app.add_option("--step-tokens", flags.step_tokens, "Token budget of one engine step")
      ->capture_default_str();
  app.add_option("--kv-blocks", flags.kv_blocks,
                 "KV blocks of 16 tokens per instance (0: the profile's capacity)")
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"duet-sim: a Duet cluster of any size, simulated on a profile's cost model"};
  Flags flags;
  app.add_option("--profile", flags.profile, "Profile (duet profile --out)");
  app.add_option("--cluster", flags.cluster,
                 "Layout (2C, 1P+2D, 4P@tp2+8D@tp4) or a cluster spec JSON file")
      ->capture_default_str();
  app.add_option("--transfer", flags.transfer,
                 "KV transfer path in the profile (default: its first)");
  app.add_option("--host-cores", flags.host_cores,
                 "Cores all instances share (a CPU cluster on one host); 0: each its own")
      ->capture_default_str();
  app.add_option("--neighbour-slowdown", flags.neighbour_slowdown,
                 "With --host-cores: a step's slowdown beside another (0: the profile's)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rate", flags.rates, "Request rates, req/s, comma-separated (inf: all at once)");
  app.add_option("--burstiness", flags.burstiness, "Gamma arrivals' shape: 1 Poisson, < 1 burstier")
      ->capture_default_str();
  app.add_option("-n,--num-requests", flags.n_requests, "Requests per run (a trace: its first N)")
      ->capture_default_str();
  app.add_option("--input-len", flags.input_len, "Prompt tokens: N, uniform:A:B or normal:MEAN:SD")
      ->capture_default_str();
  app.add_option("--output-len", flags.output_len, "Generated tokens, as --input-len")
      ->capture_default_str();
  app.add_option("--trace", flags.trace,
                 "CSV trace (TIMESTAMP, ContextTokens, GeneratedTokens[, TokenIds]), replayed at "
                 "its times, or scaled to --rate");
  app.add_option("--time-scale", flags.time_scale, "Replay a trace this many times faster")
      ->capture_default_str();
  app.add_option("--seed", flags.seed, "Seed of lengths, arrivals and prompt ids")
      ->capture_default_str();
  app.add_option("--slo", flags.slo, "Goodput's bounds, ttft=MS,tpot=MS");
  app.add_option("--rebalance", flags.rebalance,
                 "auto: move instances between prefill and decode as `duet serve --rebalance "
                 "auto` does, toward --slo's 90th percentiles")
      ->check(CLI::IsMember({"off", "auto"}))
      ->capture_default_str();
  app.add_option("--json", flags.json, "Write the report (duet-bench's layout) here");
  app.add_option("--plot", flags.plot, "Write latency CDFs (and sweep curves) to this PNG");
  add_engine_flags(app, flags.engine);

  sim::PlanFlags plan_flags;
  EngineFlags plan_engine;
  CLI::App* plan_cmd =
      app.add_subcommand("plan", "Best layouts by goodput per GPU under an SLO, from 8 GPUs up");
  sim::add_plan_flags(*plan_cmd, plan_flags);
  add_engine_flags(*plan_cmd, plan_engine);
  app.require_subcommand(0, 1);

  CLI11_PARSE(app, argc, argv);
  try {
    if (plan_cmd->parsed()) {
      plan_flags.engine = engine_config(plan_engine);
      return sim::plan_command(plan_flags, std::cout);
    }
    DUET_REQUIRE(!flags.profile.empty(), "--profile is required");
    return run_command(flags);
  } catch (const duet::Error& e) {
    std::cerr << "duet-sim: " << e.what() << "\n";
    return 2;
  }
}
