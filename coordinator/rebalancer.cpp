#include "coordinator/rebalancer.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <utility>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// A side's percentile counts as over its target only with enough samples,
// and as comfortably under it below this share of the target.
constexpr double kComfortable = 0.8;
// Below this share of every target the cluster has an instance to spare.
constexpr double kSpare = 0.5;

double parse_ms(std::string_view name, std::string_view value) {
  double ms = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), ms);
  if (error != std::errc() || end != value.data() + value.size() || !(ms > 0) || !std::isfinite(ms))
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("--slo: {}={} is not a positive number of milliseconds", name, value));
  return ms / 1000.0;
}

std::string ms(double seconds) { return fmt::format("{:.0f} ms", seconds * 1000.0); }

// A decision's reason: side `over` missed its target while `easy` had room.
std::string why(std::string_view over, double over_p90, double over_target, int64_t n_over,
                std::string_view easy, double easy_p90, double easy_target, int64_t n_easy) {
  const std::string room = easy_target > 0
                               ? fmt::format("{} p90 {} is under {:.0f}% of {}", easy, ms(easy_p90),
                                             kComfortable * 100, ms(easy_target))
                               : fmt::format("{} has no target", easy);
  return fmt::format("{} p90 {} over the SLO's {} while {} ({} and {} requests)", over,
                     ms(over_p90), ms(over_target), room, n_over, n_easy);
}

// The instance of `role` taking work that `better` prefers, if any.
template <typename Better>
std::optional<size_t> pick(std::span<const RoutedInstances::RoleView> instances, InstanceRole role,
                           Better better) {
  std::optional<size_t> best;
  for (size_t i = 0; i < instances.size(); ++i) {
    const RoutedInstances::RoleView& v = instances[i];
    if (!v.taking_work || !v.kv_links || v.role != role) continue;
    if (!best || better(v, instances[*best])) best = i;
  }
  return best;
}

}  // namespace

SloTargets parse_slo(std::string_view text) {
  SloTargets slo;
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const size_t equals = item.find('=');
    const std::string_view name = item.substr(0, equals);
    if (equals == std::string_view::npos || (name != "ttft" && name != "tpot")) {
      throw Error(
          ErrorKind::kInvalidArgument,
          fmt::format("--slo: '{}' is not ttft=MS or tpot=MS (e.g. ttft=2000,tpot=100)", item));
    }
    const double seconds = parse_ms(name, item.substr(equals + 1));
    (name == "ttft" ? slo.ttft_s : slo.tpot_s) = seconds;
  }
  if (slo.ttft_s == 0 && slo.tpot_s == 0)
    throw Error(ErrorKind::kInvalidArgument, "--slo needs ttft=MS, tpot=MS or both");
  return slo;
}

double percentile90(std::vector<double>& values) {
  if (values.empty()) return 0;
  // Nearest rank: the smallest value with at least 90% of them at or below it.
  const size_t rank = (values.size() * 9 + 9) / 10;  // ceil(0.9 n), at least 1
  std::nth_element(values.begin(), values.begin() + static_cast<ptrdiff_t>(rank - 1), values.end());
  return values[rank - 1];
}

std::optional<RebalanceDecision> decide_rebalance(
    std::span<const RoutedInstances::RoleView> instances, const RebalanceSignals& signals,
    const SloTargets& slo, int64_t min_samples) {
  const bool ttft_known = slo.ttft_s > 0 && signals.n_ttft >= min_samples;
  const bool tpot_known = slo.tpot_s > 0 && signals.n_tpot >= min_samples;
  const bool ttft_over = ttft_known && signals.ttft_p90_s > slo.ttft_s;
  const bool tpot_over = tpot_known && signals.tpot_p90_s > slo.tpot_s;
  const bool ttft_easy = !ttft_known || signals.ttft_p90_s < kComfortable * slo.ttft_s;
  const bool tpot_easy = !tpot_known || signals.tpot_p90_s < kComfortable * slo.tpot_s;
  auto count = [&](auto predicate) {
    return std::count_if(instances.begin(), instances.end(), predicate);
  };
  if (ttft_over && tpot_easy) {
    // Prompts wait: a decode instance to prefill, if another still takes whole requests.
    const auto decoders = count([](const RoutedInstances::RoleView& v) {
      return v.taking_work && v.role != InstanceRole::kPrefill;
    });
    const std::optional<size_t> from =
        pick(instances, InstanceRole::kDecode,
             [](const auto& a, const auto& b) { return a.sequences < b.sequences; });
    if (!from || decoders < 2) return std::nullopt;
    return RebalanceDecision{*from, InstanceRole::kPrefill,
                             why("TTFT", signals.ttft_p90_s, slo.ttft_s, signals.n_ttft, "TPOT",
                                 signals.tpot_p90_s, slo.tpot_s, signals.n_tpot)};
  }
  if (tpot_over && ttft_easy) {
    // Decodes crowd: a prefill instance to decode, if another prefill instance remains.
    const auto prefillers = count([](const RoutedInstances::RoleView& v) {
      return v.taking_work && v.role == InstanceRole::kPrefill;
    });
    const std::optional<size_t> from =
        pick(instances, InstanceRole::kPrefill, [](const auto& a, const auto& b) {
          return a.queued_prompt_tokens < b.queued_prompt_tokens;
        });
    if (!from || prefillers < 2) return std::nullopt;
    return RebalanceDecision{*from, InstanceRole::kDecode,
                             why("TPOT", signals.tpot_p90_s, slo.tpot_s, signals.n_tpot, "TTFT",
                                 signals.ttft_p90_s, slo.ttft_s, signals.n_ttft)};
  }
  return std::nullopt;
}

CapacityCall judge_capacity(const RebalanceSignals& signals, const SloTargets& slo,
                            int64_t min_samples, bool change, bool idle) {
  const bool ttft_known = slo.ttft_s > 0 && signals.n_ttft >= min_samples;
  const bool tpot_known = slo.tpot_s > 0 && signals.n_tpot >= min_samples;
  const bool over = (ttft_known && signals.ttft_p90_s > slo.ttft_s) ||
                    (tpot_known && signals.tpot_p90_s > slo.tpot_s);
  if (over) return change ? CapacityCall::kKeep : CapacityCall::kMore;
  if (idle) return CapacityCall::kFewer;
  // Spare room: every side with a target judged, and under half of it.
  const bool ttft_spare =
      slo.ttft_s == 0 || (ttft_known && signals.ttft_p90_s < kSpare * slo.ttft_s);
  const bool tpot_spare =
      slo.tpot_s == 0 || (tpot_known && signals.tpot_p90_s < kSpare * slo.tpot_s);
  return ttft_spare && tpot_spare ? CapacityCall::kFewer : CapacityCall::kKeep;
}

std::optional<RebalanceDecision> RebalanceLoop::look(
    double now, std::span<const RoutedInstances::RoleView> instances, const Recent& recent) {
  const auto seconds = [](std::chrono::milliseconds d) {
    return static_cast<double>(d.count()) / 1e3;
  };
  const auto live = static_cast<int64_t>(std::count_if(
      instances.begin(), instances.end(),
      [](const RoutedInstances::RoleView& v) { return v.taking_work || v.switching; }));
  instances_wanted_ = live;  // no opinion until judged below
  const bool switching =
      std::any_of(instances.begin(), instances.end(),
                  [](const RoutedInstances::RoleView& v) { return v.switching; });
  if (switching) return std::nullopt;  // a change still waits for its instance's work
  if (waiting_for_change_ || (live_ >= 0 && live != live_)) {
    // A change took effect now (a role, or the count): only what finishes
    // from here on counts.
    waiting_for_change_ = false;
    counted_from_ = now;
    quiet_until_ = now + seconds(options_.cooldown);
  }
  live_ = live;
  if (now < quiet_until_) return std::nullopt;
  Metrics::RecentLatency samples = recent(std::max(counted_from_, now - seconds(options_.window)));
  RebalanceSignals signals;
  signals.n_ttft = static_cast<int64_t>(samples.ttft_s.size());
  signals.n_tpot = static_cast<int64_t>(samples.tpot_s.size());
  signals.ttft_p90_s = percentile90(samples.ttft_s);
  signals.tpot_p90_s = percentile90(samples.tpot_s);
  std::optional<RebalanceDecision> decision =
      decide_rebalance(instances, signals, options_.slo, options_.min_samples);
  const SloTargets& slo = options_.slo;
  const bool both_over = !decision && slo.ttft_s > 0 && slo.tpot_s > 0 &&
                         signals.n_ttft >= options_.min_samples &&
                         signals.n_tpot >= options_.min_samples &&
                         signals.ttft_p90_s > slo.ttft_s && signals.tpot_p90_s > slo.tpot_s;
  if (both_over && !both_over_) {
    spdlog::warn(
        "rebalancer: TTFT p90 {} and TPOT p90 {} both over the SLO: the cluster needs more "
        "instances, not another split; nothing moves",
        ms(signals.ttft_p90_s), ms(signals.tpot_p90_s));
  }
  both_over_ = both_over;
  if (decision) waiting_for_change_ = true;
  // Idle: nothing finished over a whole window and nothing runs.
  const bool idle =
      signals.n_ttft == 0 && now - counted_from_ >= seconds(options_.window) &&
      std::all_of(instances.begin(), instances.end(), [](const RoutedInstances::RoleView& v) {
        return v.sequences == 0 && v.queued_prompt_tokens == 0;
      });
  switch (judge_capacity(signals, slo, options_.min_samples, decision.has_value(), idle)) {
    case CapacityCall::kMore:
      instances_wanted_ = live + 1;
      break;
    case CapacityCall::kFewer:
      instances_wanted_ = std::max<int64_t>(1, live - 1);
      break;
    case CapacityCall::kKeep:
      break;
  }
  return decision;
}

Rebalancer::Rebalancer(RoutedInstances& router, Service& service, RebalancerOptions options)
    : router_(router), service_(service), origin_(Clock::now()), loop_(options), thread_([this] {
        run();
      }) {
  spdlog::info("rebalancer: TTFT p90 target {}, TPOT p90 target {}, over the last {} ms",
               options.slo.ttft_s > 0 ? ms(options.slo.ttft_s) : "none",
               options.slo.tpot_s > 0 ? ms(options.slo.tpot_s) : "none", options.window.count());
}

Rebalancer::~Rebalancer() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Rebalancer::run() {
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, loop_.options().interval, [this] { return stopping_; })) {
    lock.unlock();
    try {
      look();
    } catch (const std::exception& e) {
      spdlog::error("rebalancer: {}", e.what());
    }
    lock.lock();
  }
}

void Rebalancer::look() {
  const std::vector<RoutedInstances::RoleView> instances = router_.role_views();
  const double now = std::chrono::duration<double>(Clock::now() - origin_).count();
  const std::optional<RebalanceDecision> decision =
      loop_.look(now, instances, [this](double since) {
        return service_.metrics().recent_latency(
            origin_ +
            std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(since)));
      });
  service_.set_instances_wanted(loop_.instances_wanted());
  if (!decision) return;
  const InstanceRole from = instances[decision->instance].role;
  const std::string said =
      router_.change_role(static_cast<int64_t>(decision->instance), decision->to);
  service_.record_rebalance(instance_role_name(decision->to));
  spdlog::info("rebalancer: instance {} {} -> {}: {}; {}", decision->instance,
               instance_role_name(from), instance_role_name(decision->to), decision->why, said);
}

}  // namespace duet
