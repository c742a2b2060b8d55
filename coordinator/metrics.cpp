#include "coordinator/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "coordinator/service.h"

namespace duet {
namespace {

constexpr auto kRateWindow = std::chrono::seconds(10);
// The finished requests kept for recent_latency: the last minute's, at most this many.
constexpr auto kRecentWindow = std::chrono::seconds(60);
constexpr size_t kRecentFinished = 4096;

std::vector<double> latency_bounds() {  // seconds: queue, TTFT, E2E
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
}
std::vector<double> token_gap_bounds() {  // seconds: TPOT
  return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5};
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void scalar(std::string& out, std::string_view name, std::string_view type, std::string_view help,
            double value) {
  header(out, name, type, help);
  fmt::format_to(std::back_inserter(out), "{} {}\n", name, value);
}

void histogram(std::string& out, std::string_view name, std::string_view help, const Histogram& h) {
  header(out, name, "histogram", help);
  int64_t cumulative = 0;
  for (size_t i = 0; i < h.upper_bounds().size(); ++i) {
    cumulative += h.counts()[i];
    fmt::format_to(std::back_inserter(out), "{}_bucket{{le=\"{}\"}} {}\n", name,
                   h.upper_bounds()[i], cumulative);
  }
  fmt::format_to(std::back_inserter(out), "{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n",
                 name, h.count(), name, h.sum(), name, h.count());
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const auto bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[static_cast<size_t>(bucket)];
  ++count_;
  sum_ += value;
}

Metrics::Metrics()
    : queue_(latency_bounds()),
      ttft_(latency_bounds()),
      tpot_(token_gap_bounds()),
      e2e_(latency_bounds()) {
  // Every outcome is exported from the start, at zero, so dashboards see the series.
  for (ServeFinish f :
       {ServeFinish::kStop, ServeFinish::kLength, ServeFinish::kCancelled, ServeFinish::kError})
    outcomes_.emplace(std::string(serve_finish_name(f)), 0);
  for (ServeErrorKind k :
       {ServeErrorKind::kInvalidArgument, ServeErrorKind::kTooLong, ServeErrorKind::kNotFound,
        ServeErrorKind::kUnauthenticated, ServeErrorKind::kOverloaded, ServeErrorKind::kUnavailable,
        ServeErrorKind::kInternal})
    outcomes_.emplace(fmt::format("refused_{}", serve_error_kind_name(k)), 0);
  for (std::string_view front : {"http", "rpc"}) connections_refused_.emplace(front, 0);
  for (std::string_view role : {"prefill", "decode"}) rebalances_.emplace(role, 0);
}

void Metrics::record_finished(ServeFinish finish, const RequestTimings& t) {
  std::lock_guard lock(mutex_);
  ++outcomes_[std::string(serve_finish_name(finish))];
  prompt_tokens_ += t.prompt_tokens;
  completion_tokens_ += t.completion_tokens;
  cached_tokens_ += t.cached_tokens;
  e2e_.observe(t.e2e_s);
  if (t.completion_tokens > 0) {
    queue_.observe(t.queue_s);
    ttft_.observe(t.ttft_s);
  }
  if (t.completion_tokens > 1) tpot_.observe(t.tpot_s);
  if (finish == ServeFinish::kStop || finish == ServeFinish::kLength) {
    const Clock::time_point now = Clock::now();
    recent_finished_.push_back({now, t.completion_tokens > 0 ? t.ttft_s : -1.0,
                                t.completion_tokens > 1 ? t.tpot_s : -1.0});
    while (!recent_finished_.empty() && (now - recent_finished_.front().at > kRecentWindow ||
                                         recent_finished_.size() > kRecentFinished))
      recent_finished_.pop_front();
  }
}

Metrics::RecentLatency Metrics::recent_latency(Clock::time_point since) const {
  std::lock_guard lock(mutex_);
  RecentLatency recent;
  for (const Finished& f : recent_finished_) {
    if (f.at < since) continue;
    if (f.ttft_s >= 0) recent.ttft_s.push_back(f.ttft_s);
    if (f.tpot_s >= 0) recent.tpot_s.push_back(f.tpot_s);
  }
  return recent;
}

void Metrics::set_instances_wanted(int64_t n) {
  std::lock_guard lock(mutex_);
  instances_wanted_ = n;
}

void Metrics::record_rebalance(std::string_view role) {
  std::lock_guard lock(mutex_);
  auto it = rebalances_.find(role);
  if (it == rebalances_.end()) it = rebalances_.emplace(role, 0).first;
  ++it->second;
}

void Metrics::record_refused(ServeErrorKind kind) {
  std::lock_guard lock(mutex_);
  ++outcomes_[fmt::format("refused_{}", serve_error_kind_name(kind))];
}

void Metrics::record_tokens(int64_t n_tokens, Clock::time_point now) {
  std::lock_guard lock(mutex_);
  generated_tokens_ += n_tokens;
  if (first_tokens_ == Clock::time_point{}) first_tokens_ = now;
  recent_tokens_.emplace_back(now, n_tokens);
  while (!recent_tokens_.empty() && now - recent_tokens_.front().first > kRateWindow)
    recent_tokens_.pop_front();
}

void Metrics::record_connection_refused(std::string_view front) {
  std::lock_guard lock(mutex_);
  auto it = connections_refused_.find(front);
  if (it == connections_refused_.end()) it = connections_refused_.emplace(front, 0).first;
  ++it->second;
}

double Metrics::tokens_per_second(Clock::time_point now) const {
  int64_t n = 0;
  for (const auto& [when, count] : recent_tokens_)
    if (now - when <= kRateWindow) n += count;
  if (n == 0) return 0.0;
  // The window, or less when tokens have been counted for less than that.
  const double window = std::min(std::chrono::duration<double>(kRateWindow).count(),
                                 std::chrono::duration<double>(now - first_tokens_).count());
  return static_cast<double>(n) / std::max(window, 1e-3);
}

int64_t Metrics::requests_with_outcome(std::string_view outcome) const {
  std::lock_guard lock(mutex_);
  auto it = outcomes_.find(outcome);
  return it == outcomes_.end() ? 0 : it->second;
}

std::string Metrics::render(const ServiceStats& stats, Clock::time_point now) const {
  std::string out;
  std::lock_guard lock(mutex_);
  header(out, "duet_requests_total", "counter",
         "Requests by outcome: how they finished, or why they were refused.");
  for (const auto& [outcome, n] : outcomes_)
    fmt::format_to(std::back_inserter(out), "duet_requests_total{{outcome=\"{}\"}} {}\n", outcome,
                   n);
  header(out, "duet_connections_refused_total", "counter",
         "Connections a front refused because it had max_connections open.");
  for (const auto& [front, n] : connections_refused_)
    fmt::format_to(std::back_inserter(out), "duet_connections_refused_total{{front=\"{}\"}} {}\n",
                   front, n);
  header(out, "duet_rebalance_decisions_total", "counter",
         "Instances the rebalancer (--rebalance auto) moved, by the role it gave them.");
  for (const auto& [role, n] : rebalances_)
    fmt::format_to(std::back_inserter(out), "duet_rebalance_decisions_total{{to=\"{}\"}} {}\n",
                   role, n);
  if (instances_wanted_ > 0) {
    scalar(out, "duet_cluster_instances_wanted", "gauge",
           "Live instances the rebalancer finds the load wants (--rebalance auto): one more "
           "when a side misses the SLO and no role change helps, one fewer when every side is "
           "under half its target or idle; launch/local.sh starts or stops joined instances "
           "to match.",
           static_cast<double>(instances_wanted_));
  }
  histogram(out, "duet_queue_time_seconds", "Arrival to first compute.", queue_);
  histogram(out, "duet_time_to_first_token_seconds", "Arrival to first token.", ttft_);
  histogram(out, "duet_time_per_output_token_seconds", "Mean gap between later tokens.", tpot_);
  histogram(out, "duet_e2e_request_latency_seconds", "Arrival to finish.", e2e_);
  scalar(out, "duet_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
         static_cast<double>(prompt_tokens_));
  scalar(out, "duet_completion_tokens_total", "counter", "Tokens of finished requests.",
         static_cast<double>(completion_tokens_));
  scalar(out, "duet_generation_tokens_total", "counter", "Tokens generated.",
         static_cast<double>(generated_tokens_));
  scalar(out, "duet_generation_tokens_per_second", "gauge",
         "Tokens generated per second over the last 10 seconds.", tokens_per_second(now));
  const InstanceStats& s = stats.instance;
  scalar(out, "duet_running_sequences", "gauge", "Sequences holding KV.",
         static_cast<double>(s.running));
  scalar(out, "duet_waiting_sequences", "gauge", "Sequences waiting for KV.",
         static_cast<double>(s.waiting));
  scalar(out, "duet_active_requests", "gauge", "Requests started and not finished.",
         static_cast<double>(stats.active_requests));
  scalar(out, "duet_kv_blocks_total", "gauge", "KV cache blocks.",
         static_cast<double>(s.kv_blocks_total));
  scalar(out, "duet_kv_blocks_free", "gauge", "KV cache blocks free (cached blocks count as free).",
         static_cast<double>(s.kv_blocks_free));
  scalar(out, "duet_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.",
         s.kv_blocks_total > 0
             ? 1.0 - static_cast<double>(s.kv_blocks_free) / static_cast<double>(s.kv_blocks_total)
             : 0.0);
  scalar(out, "duet_prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens served from the prefix cache.", static_cast<double>(s.prefix_hit_tokens));
  scalar(out, "duet_prefix_cache_queried_tokens_total", "counter",
         "Prompt tokens looked up in the prefix cache.", static_cast<double>(s.prompt_tokens));
  scalar(out, "duet_prefix_cache_hit_ratio", "gauge", "Prefix-cache hit tokens / prompt tokens.",
         s.prompt_tokens > 0
             ? static_cast<double>(s.prefix_hit_tokens) / static_cast<double>(s.prompt_tokens)
             : 0.0);
  scalar(out, "duet_preemptions_total", "counter", "Sequences preempted (recomputed later).",
         static_cast<double>(s.preemptions));
  scalar(out, "duet_engine_steps_total", "counter", "Engine steps run.",
         static_cast<double>(s.steps));
  scalar(out, "duet_draining", "gauge",
         "1 while the server drains (stopping: new requests refused, running ones finish).",
         stats.draining ? 1.0 : 0.0);
  const InstanceClient::Health& h = stats.health;
  scalar(out, "duet_instances", "gauge", "Instances behind the coordinator.",
         static_cast<double>(h.n_instances));
  scalar(out, "duet_instances_lost", "gauge",
         "Instances lost (dead or stalled past their lease); they get no work.",
         static_cast<double>(h.n_lost));
  scalar(out, "duet_instances_joined_total", "counter",
         "Instances that joined the cluster while it served (--join).",
         static_cast<double>(h.joins));
  scalar(out, "duet_instances_left_total", "counter",
         "Joined instances that left after draining (SIGTERM); not losses.",
         static_cast<double>(h.leaves));
  scalar(out, "duet_instance_role_changes_total", "counter",
         "Instances that took another role while the cluster served (duet-client set-role).",
         static_cast<double>(h.role_changes));
  scalar(out, "duet_request_reruns_total", "counter",
         "Requests re-run on another instance after the one they were on was lost.",
         static_cast<double>(h.reruns));
  scalar(out, "duet_requests_failed_after_retries_total", "counter",
         "Requests ended unavailable by losses: out of re-runs, or of live instances.",
         static_cast<double>(h.failed_after_retries));
  scalar(out, "duet_kv_blocks_quarantined", "gauge",
         "KV blocks a lost rank may still write; never reused.",
         static_cast<double>(s.kv_blocks_quarantined));
  scalar(out, "duet_send_bytes_abandoned", "gauge",
         "Bytes of unfinished sends to lost ranks, which MPI keeps for good.",
         static_cast<double>(s.send_bytes_abandoned));
  header(out, "duet_instance_up", "gauge",
         "Per instance: 1 while it serves, 0 once lost or left (labels: its index, role, leader "
         "rank or member address, and whether it joined while serving).");
  // No per-instance list: one instance, in this process, up while it serves.
  const std::vector<InstanceClient::InstanceState> in_process(1);
  const auto& instances = h.instances.empty() ? in_process : h.instances;
  for (size_t i = 0; i < instances.size(); ++i) {
    const InstanceClient::InstanceState& state = instances[i];
    fmt::format_to(std::back_inserter(out),
                   "duet_instance_up{{instance=\"{}\",role=\"{}\",leader=\"{}\",joined=\"{}\"}} "
                   "{}\n",
                   i, state.role, state.leader, state.joined ? 1 : 0,
                   state.lost || state.left ? 0 : 1);
  }
  return out;
}

}  // namespace duet
