#include "sim/planner.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "loadgen/command_line.h"
#include "sim/simulator.h"

namespace duet::sim {
namespace {

// A layout's shape, the same at every cluster size: colocated instances of
// one tp, or a (prefill tp, decode tp) pair with the prefill instances
// taking prefill_shares[share] of the GPUs.
struct Shape {
  bool colocated = false;
  int tp_prefill = 0;  // colocated: the instances' tp
  int tp_decode = 0;
  int share = -1;  // index into prefill_shares
  auto operator<=>(const Shape&) const = default;
};

// A candidate and what its search has found so far.
struct Candidate {
  LayoutGoodput result;
  std::vector<Shape> shapes;  // several shares may round to one layout
  int n_instances = 0;
  double lo = 0;                                        // a rate that meets the attainment
  double hi = std::numeric_limits<double>::infinity();  // one that does not
};

struct Probe {
  double attainment = 0;
  double ttft_p99 = 0;
  double tpot_p99 = 0;
};

// The traffic of one probe: n requests at `rate`.
std::vector<loadgen::PlannedRequest> traffic(const PlanOptions& options, int64_t n, double rate) {
  if (options.trace.empty()) return loadgen::make_trace(options.mix, n, rate, options.seed);
  // The trace's requests, repeated when it has fewer, its arrival pattern
  // stretched to `rate`.
  std::vector<loadgen::PlannedRequest> workload;
  const double span = options.trace.back().at - options.trace.front().at;
  const double period = span + span / std::max<size_t>(1, options.trace.size() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i) % options.trace.size();
    loadgen::PlannedRequest r = options.trace[k];
    r.at += period * static_cast<double>(static_cast<size_t>(i) / options.trace.size());
    workload.push_back(std::move(r));
  }
  return loadgen::open_loop_plan(workload, rate, {.from_trace = true});
}

// Requests per probe: enough for every instance to see
// requests_per_instance of them, and for the arrivals to span
// span_s seconds, so that a rate is held, not taken as one burst (a burst
// of a fixed size meets any TTFT bound a cluster can drain it within). The
// coarse pass simulates a quarter of the requests and half the span. Past
// kMaxProbeRequests the probe counts as failed: a rate that high is out of
// what the search simulates.
constexpr int64_t kMaxProbeRequests = 400'000;

int64_t probe_requests(const PlanOptions& options, const Candidate& candidate, double rate,
                       bool coarse) {
  const double share = coarse ? 0.25 : 1.0;  // of the requests per instance and the minimum
  const auto per_instance =
      std::max<int64_t>(1, static_cast<int64_t>(options.requests_per_instance * share));
  // The span is halved, not quartered: a shorter one lets queues build less
  // and flatters every candidate.
  const auto span = static_cast<int64_t>(std::ceil(rate * options.span_s * (coarse ? 0.5 : 1.0)));
  return std::max({static_cast<int64_t>(options.min_requests * share),
                   per_instance * candidate.n_instances, span});
}

Probe probe(const Profile& profile, const PlanOptions& options, const Candidate& candidate,
            double rate, bool coarse) {
  const int64_t n = probe_requests(options, candidate, rate, coarse);
  if (n > kMaxProbeRequests) return {};  // attainment 0: beyond the search
  SimOptions sim;
  sim.cluster = candidate.result.cluster;
  sim.engine = options.engine;
  sim.transfer_path = options.transfer_path;
  sim.seed = options.seed;
  const SimResult result = simulate(profile, sim, traffic(options, n, rate));
  const loadgen::Summary summary = loadgen::summarize(result.records, options.slo);
  return {summary.goodput_fraction, summary.ttft.p99, summary.tpot.p99};
}

void record(Candidate& c, double rate, const Probe& p, int cluster_gpus) {
  c.lo = rate;
  c.result.rate = rate;
  c.result.goodput_per_gpu = rate / cluster_gpus;
  c.result.attainment = p.attainment;
  c.result.ttft_p99 = p.ttft_p99;
  c.result.tpot_p99 = p.tpot_p99;
}

// Brackets the highest passing rate from `guess` (by factors of `factor`),
// then bisects the bracket `steps` times in log space.
// Returns the number of probes.
int search(const Profile& profile, const PlanOptions& options, Candidate& c, double guess,
           double factor, int steps, bool coarse, int cluster_gpus) {
  constexpr int kMaxExpansions = 16;
  int probes = 0;
  const auto passes = [&](double rate) {
    ++probes;
    const Probe p = probe(profile, options, c, rate, coarse);
    const bool ok = p.attainment >= options.attainment;
    if (ok) record(c, rate, p, cluster_gpus);
    return ok;
  };
  c.lo = 0;
  c.hi = std::numeric_limits<double>::infinity();
  c.result.rate = c.result.goodput_per_gpu = 0;
  double rate = guess;
  for (int i = 0; i < kMaxExpansions; ++i) {
    if (passes(rate)) {
      if (!std::isinf(c.hi)) break;
      rate *= factor;
    } else {
      c.hi = rate;
      if (c.lo > 0) break;
      rate /= factor;
    }
  }
  if (c.lo == 0 || std::isinf(c.hi)) return probes;  // no rate met the SLO, or none saturated
  for (int i = 0; i < steps; ++i) {
    const double mid = std::sqrt(c.lo * c.hi);
    if (!passes(mid)) c.hi = mid;
  }
  return probes;
}

// Every layout of `n_gpus` whose shape `keep` accepts; shapes that round to
// the same layout share one candidate.
std::vector<Candidate> candidates(int n_gpus, const std::vector<int>& tps,
                                  const std::vector<double>& shares,
                                  const std::function<bool(const Shape&)>& keep) {
  std::vector<Candidate> out;
  const auto add = [&](ClusterSpec spec, Shape shape) {
    Candidate c;
    c.n_instances = static_cast<int>(spec.instances.size());
    c.result.gpus = spec.required_world_size() - 1;
    c.result.layout = describe_layout(spec);
    c.result.cluster = std::move(spec);
    c.shapes.push_back(shape);
    out.push_back(std::move(c));
  };
  for (int tp : tps) {
    const Shape shape{.colocated = true, .tp_prefill = tp, .tp_decode = tp};
    if (n_gpus / tp >= 1 && keep(shape))
      add(parse_cluster_flags(0, n_gpus / tp, tp, tp, ClusterMode::kColocated), shape);
  }
  std::map<std::tuple<int, int, int, int>, size_t> seen;  // layout -> candidate
  for (int tp_p : tps) {
    for (int tp_d : tps) {
      for (size_t i = 0; i < shares.size(); ++i) {
        const Shape shape{.tp_prefill = tp_p, .tp_decode = tp_d, .share = static_cast<int>(i)};
        if (!keep(shape)) continue;
        const int p = std::max(1, static_cast<int>(std::lround(shares[i] * n_gpus / tp_p)));
        const int d = (n_gpus - p * tp_p) / tp_d;
        if (d < 1) continue;
        const auto [it, fresh] = seen.try_emplace({p, tp_p, d, tp_d}, out.size());
        if (fresh) {
          add(parse_cluster_flags(p, d, tp_p, tp_d, ClusterMode::kDisaggregated), shape);
        } else {
          out[it->second].shapes.push_back(shape);
        }
      }
    }
  }
  return out;
}

// Runs `work` on every candidate, `jobs` at a time (each probe is a
// simulation of its own: nothing is shared but the profile and options).
void for_each_candidate(const std::vector<Candidate*>& all, int jobs,
                        const std::function<void(Candidate&)>& work) {
  std::atomic<size_t> next = 0;
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto run = [&] {
    for (size_t i = next++; i < all.size(); i = next++) {
      try {
        work(*all[i]);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  const int n = std::clamp<int>(jobs, 1, static_cast<int>(std::max<size_t>(1, all.size())));
  for (int t = 1; t < n; ++t) threads.emplace_back(run);
  run();
  for (std::thread& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
}

bool colocated(const LayoutGoodput& l) { return l.cluster.mode == ClusterMode::kColocated; }

}  // namespace

std::vector<PlanResult> plan_layouts(const Profile& profile, const PlanOptions& options) {
  DUET_REQUIRE(options.slo.ttft || options.slo.tpot,
               "planning needs an SLO (--slo ttft=MS,tpot=MS)");
  DUET_REQUIRE(options.attainment > 0 && options.attainment <= 1,
               "the attainment is a share in (0, 1], got {}", options.attainment);
  std::vector<int> tps = options.tps;
  if (tps.empty()) {
    for (const InstanceProfile& i : profile.instances)
      if (i.kv_capacity_tokens > 0) tps.push_back(i.tp);
  }
  DUET_REQUIRE(!tps.empty(), "the profile has no instance size whose KV cache holds anything");
  for (int tp : tps) profile.instance(tp);  // each one there

  // Coarse: a quarter of the requests, a bracket of 4x bisected to ~19%, or
  // where the shape has a figure from the last size, a bracket of 1.5x
  // around it bisected to ~11%. Fine: all of them, a bracket of 1.3x around
  // the coarse figure bisected to ~3%.
  constexpr double kCoarseFactor = 4, kKnownFactor = 1.5, kFineFactor = 1.3;
  constexpr int kCoarseSteps = 3, kKnownSteps = 2, kFineSteps = 3;
  // Candidates within kNearBest of the best coarse figure are searched finely.
  constexpr double kNearBest = 0.8;
  // From the second size on, disaggregated shapes within kKeep of the best
  // one at the size before are searched again.
  constexpr double kKeep = 0.9;
  std::vector<PlanResult> results;
  double per_gpu_guess = 0.5;  // req/s per GPU to start from; then the last size's best
  // The last size's figure of each shape, and the best disaggregated one.
  std::map<Shape, double> known;
  double best_known_disaggregated = 0;
  for (int n_gpus : options.gpus) {
    DUET_REQUIRE(n_gpus >= 1, "a cluster needs at least one GPU, got {}", n_gpus);
    const auto wall_start = std::chrono::steady_clock::now();
    // Pruning by the last size: colocated shapes always; a disaggregated
    // one when it came within kKeep of the best disaggregated figure there
    // (closer than the coarse bracket resolves), is a neighbouring share of
    // the best one, or had no figure.
    const auto figure = [&](const Shape& s) -> std::optional<double> {
      const auto it = known.find(s);
      if (it == known.end()) return std::nullopt;
      return it->second;
    };
    const auto keep = [&](const Shape& s) {
      if (!options.prune || s.colocated || known.empty()) return true;
      const std::optional<double> own = figure(s);
      if (!own || *own >= kKeep * best_known_disaggregated) return true;
      for (int d : {-1, 1}) {
        Shape n = s;
        n.share += d;
        const std::optional<double> next = figure(n);
        if (next && *next >= best_known_disaggregated) return true;
      }
      return false;
    };
    std::vector<Candidate> all = candidates(n_gpus, tps, options.prefill_shares, keep);
    if (all.empty()) continue;
    std::vector<Candidate*> order;
    for (Candidate& c : all) order.push_back(&c);
    std::atomic<int64_t> probes = 0;
    for_each_candidate(order, options.jobs, [&](Candidate& c) {
      const auto it = known.find(c.shapes.front());
      const bool has_figure = it != known.end() && it->second > 0;
      const double guess = (has_figure ? it->second : per_gpu_guess) * n_gpus;
      probes += search(profile, options, c, guess, has_figure ? kKnownFactor : kCoarseFactor,
                       has_figure ? kKnownSteps : kCoarseSteps, true, n_gpus);
    });
    const auto by_goodput = [](const Candidate* a, const Candidate* b) {
      return a->result.goodput_per_gpu > b->result.goodput_per_gpu;
    };
    std::stable_sort(order.begin(), order.end(), by_goodput);
    // Finely: the candidates whose coarse figure is within kNearBest of the
    // best one (the coarse pass is optimistic about all of them alike), at
    // most `refine`, and the best colocated and best disaggregated ones.
    const double best_coarse = order.front()->result.goodput_per_gpu;
    std::vector<Candidate*> fine;
    for (Candidate* c : order) {
      if (static_cast<int>(fine.size()) >= options.refine) break;
      if (c->result.goodput_per_gpu < kNearBest * best_coarse && !fine.empty()) break;
      fine.push_back(c);
    }
    for (bool mode : {true, false}) {
      for (Candidate* c : order) {
        if (colocated(c->result) != mode) continue;
        if (std::find(fine.begin(), fine.end(), c) == fine.end()) fine.push_back(c);
        break;
      }
    }
    for_each_candidate(fine, options.jobs, [&](Candidate& c) {
      const double coarse_rate = c.lo > 0 ? c.lo : per_gpu_guess * n_gpus;
      probes += search(profile, options, c, coarse_rate, kFineFactor, kFineSteps, false, n_gpus);
      c.result.refined = true;
    });
    std::stable_sort(order.begin(), order.end(), [&](const Candidate* a, const Candidate* b) {
      if (a->result.refined != b->result.refined) return a->result.refined;
      return by_goodput(a, b);
    });
    PlanResult result;
    result.gpus = n_gpus;
    for (Candidate* c : order) {
      result.ranked.push_back(c->result);
      if (colocated(c->result) && !result.best_colocated) result.best_colocated = c->result;
      if (!colocated(c->result) && !result.best_disaggregated)
        result.best_disaggregated = c->result;
    }
    if (result.ranked.front().goodput_per_gpu > 0)
      per_gpu_guess = result.ranked.front().goodput_per_gpu;
    known.clear();
    best_known_disaggregated = 0;
    for (const Candidate& c : all) {
      for (const Shape& s : c.shapes) known[s] = c.result.goodput_per_gpu;
      if (!colocated(c.result))
        best_known_disaggregated = std::max(best_known_disaggregated, c.result.goodput_per_gpu);
    }
    if (options.progress) {
      *options.progress << fmt::format(
          "duet-sim plan: {} GPUs: {} layouts ({} finely), {} probes, {:.1f} s\n", n_gpus,
          all.size(), fine.size(), probes.load(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count());
    }
    results.push_back(std::move(result));
  }
  return results;
}

void print_plan(std::ostream& out, const std::vector<PlanResult>& results, int runners_up) {
  out << "| GPUs | best layout | goodput/GPU req/s | TTFT p99 ms | TPOT p99 ms | best colocated "
         "| its goodput/GPU | best / colocated | runners-up (goodput/GPU; ~ coarse) |\n";
  out << "|---:|---|---:|---:|---:|---|---:|---:|---|\n";
  for (const PlanResult& r : results) {
    const LayoutGoodput& best = r.ranked.front();
    std::string others;
    for (size_t i = 1; i < r.ranked.size() && static_cast<int>(i) <= runners_up; ++i) {
      if (!others.empty()) others += ", ";
      // A coarse figure (not refined) is marked: it comes from a shorter probe.
      others += fmt::format("{} ({}{:.3g})", r.ranked[i].layout, r.ranked[i].refined ? "" : "~",
                            r.ranked[i].goodput_per_gpu);
    }
    const double base = r.best_colocated ? r.best_colocated->goodput_per_gpu : 0.0;
    out << fmt::format("| {} | {} | {:.3g} | {:.0f} | {:.1f} | {} | {:.3g} | {} | {} |\n", r.gpus,
                       best.layout, best.goodput_per_gpu, best.ttft_p99 * 1e3, best.tpot_p99 * 1e3,
                       r.best_colocated ? r.best_colocated->layout : "-", base,
                       base > 0 ? fmt::format("{:.2f}x", best.goodput_per_gpu / base) : "-",
                       others);
  }
}

void add_plan_flags(CLI::App& app, PlanFlags& flags) {
  app.add_option("--profile", flags.profile, "Profile (duet profile --out)")->required();
  app.add_option("--gpus", flags.gpus, "Cluster sizes, comma-separated")->capture_default_str();
  app.add_option("--slo", flags.slo, "ttft=MS,tpot=MS")->required();
  app.add_option("--attainment", flags.attainment, "Share of requests that must meet the SLO")
      ->capture_default_str();
  app.add_option("--mix", flags.mix, "Traffic shape: chat, long or mixed")->capture_default_str();
  app.add_option("--trace", flags.trace, "Traffic shape from a trace file (instead of --mix)");
  app.add_option("--refine", flags.refine, "Best candidates per size searched finely")
      ->capture_default_str();
  app.add_flag("--no-prune", flags.no_prune,
               "Search every shape at every size, not only those near the best at the size before");
  app.add_option("--jobs", flags.jobs, "Layouts searched at once (0: one per hardware thread)")
      ->capture_default_str();
  app.add_option("--tp", flags.tps,
                 "Instance sizes to try, comma-separated (default: the profile's)");
  app.add_option("--requests-per-instance", flags.requests_per_instance,
                 "Simulated requests per probe, per instance")
      ->capture_default_str();
  app.add_option("--min-requests", flags.min_requests, "Simulated requests per probe, at least")
      ->capture_default_str();
  app.add_option("--span", flags.span_s, "Seconds of arrivals a probe simulates, at least")
      ->capture_default_str();
  app.add_option("--transfer", flags.transfer,
                 "KV transfer path in the profile (default: its first)");
  app.add_option("--seed", flags.seed, "Seed of the traffic")->capture_default_str();
  app.add_option("--json", flags.json, "Write every size's ranked layouts here");
  app.add_option("--plot", flags.plot, "Write goodput per GPU against cluster size to this PNG");
}

int plan_command(const PlanFlags& flags, std::ostream& out) {
  const Profile profile = read_profile(flags.profile);
  PlanOptions options;
  options.gpus.clear();
  for (const std::string& part : loadgen::split(flags.gpus, ','))
    options.gpus.push_back(static_cast<int>(loadgen::parse_number(part, "--gpus")));
  for (const std::string& part : loadgen::split(flags.tps, ','))
    options.tps.push_back(static_cast<int>(loadgen::parse_number(part, "--tp")));
  options.slo = loadgen::parse_slo(flags.slo);
  options.attainment = flags.attainment;
  options.mix = flags.mix;
  if (!flags.trace.empty()) options.trace = loadgen::read_trace(flags.trace);
  options.requests_per_instance = flags.requests_per_instance;
  options.min_requests = flags.min_requests;
  options.span_s = flags.span_s;
  options.refine = flags.refine;
  options.prune = !flags.no_prune;
  options.jobs = flags.jobs > 0
                     ? flags.jobs
                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  options.progress = &std::cerr;
  options.engine = flags.engine;
  options.transfer_path = flags.transfer;
  options.seed = flags.seed;

  std::cerr << fmt::format("duet-sim plan: {} ({}), {}; SLO {}, {:.0f}% attainment\n",
                           profile.device, profile.source, profile.model.name, flags.slo,
                           options.attainment * 100);
  const std::vector<PlanResult> results = plan_layouts(profile, options);
  print_plan(out, results);

  nlohmann::json sizes = nlohmann::json::array();
  for (const PlanResult& r : results) {
    nlohmann::json layouts = nlohmann::json::array();
    for (const LayoutGoodput& l : r.ranked) {
      layouts.push_back({{"layout", l.layout},
                         {"mode", cluster_mode_name(l.cluster.mode)},
                         {"gpus_used", l.gpus},
                         {"rate", l.rate},
                         {"goodput_per_gpu", l.goodput_per_gpu},
                         {"attainment", l.attainment},
                         {"ttft_p99_ms", l.ttft_p99 * 1e3},
                         {"tpot_p99_ms", l.tpot_p99 * 1e3},
                         {"refined", l.refined}});
    }
    sizes.push_back({{"gpus", r.gpus}, {"layouts", std::move(layouts)}});
  }
  const nlohmann::json report = {
      {"tool", "duet-sim plan"},
      {"profile",
       {{"path", flags.profile},
        {"source", profile.source},
        {"device", profile.device},
        {"model", profile.model.name}}},
      {"slo",
       {{"ttft_ms", options.slo.ttft ? nlohmann::json(*options.slo.ttft * 1e3) : nullptr},
        {"tpot_ms", options.slo.tpot ? nlohmann::json(*options.slo.tpot * 1e3) : nullptr}}},
      {"attainment", options.attainment},
      {"traffic", flags.trace.empty() ? flags.mix : flags.trace},
      {"sizes", std::move(sizes)}};
  std::string json_path = flags.json;
  if (json_path.empty() && !flags.plot.empty()) json_path = flags.plot + ".json";
  if (!json_path.empty()) {
    std::ofstream file(json_path);
    file << report.dump(1) << "\n";
    DUET_REQUIRE(file.good(), "cannot write {}", json_path);
    std::cerr << "duet-sim plan: wrote " << json_path << "\n";
  }
  if (!flags.plot.empty())
    loadgen::plot("duet-sim plan", DUET_SIM_PLAN_PLOT_SCRIPT, json_path, flags.plot);
  return 0;
}

}  // namespace duet::sim
