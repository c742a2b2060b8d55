#include "coordinator/cluster/remote_instance.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "common/error.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// How long the dispatcher's blocked receive sleeps before it looks again; a
// message or the channel's close wakes it at once.
constexpr auto kIdleReceive = std::chrono::milliseconds(60'000);

std::string describe(const InstanceSpec& instance) {
  return fmt::format("instance {} (rank {})", instance.id, instance.leader().value);
}

}  // namespace

// ---------------------------------------------------------------- RemoteInstance

RemoteInstance::RemoteInstance(ControlChannel& channel, Rank leader, const InstanceReady& ready)
    : channel_(channel), leader_(leader), info_(ready.info), stats_(ready.stats) {}

void RemoteInstance::set_event_handler(EventHandler handler) {
  std::lock_guard lock(mutex_);
  handler_ = std::move(handler);
}

void RemoteInstance::submit(InstanceRequest request) {
  {
    std::lock_guard lock(mutex_);
    if (lost_) {
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("the instance led by rank {} is lost", leader_.value));
    }
  }
  // Throws when the channel is closing: the service then refuses the request
  // (kUnavailable) instead of waiting for events that will never come.
  channel_.send(leader_, SubmitRequest{std::move(request)});
}

void RemoteInstance::mark_lost() {
  std::lock_guard lock(mutex_);
  lost_ = true;
}

void RemoteInstance::cancel(RequestId id) {
  {
    std::lock_guard lock(mutex_);
    if (lost_) return;  // it holds nothing any more
  }
  try {
    channel_.send(leader_, Cancel{id});
  } catch (const Error& e) {
    spdlog::debug("cancel of request {} to rank {} dropped: {}", id.value, leader_.value, e.what());
  }
}

InstanceStats RemoteInstance::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void RemoteInstance::on_step_events(std::span<const InstanceEvent> events) {
  EventHandler handler;
  {
    std::lock_guard lock(mutex_);
    handler = handler_;
  }
  // Outside the lock: the handler may call cancel() (a matched stop string).
  if (handler) handler(events);
}

void RemoteInstance::on_stats(const InstanceStats& stats) {
  std::lock_guard lock(mutex_);
  stats_ = stats;
}

// ---------------------------------------------------------------- start and end

std::vector<InstanceReady> await_instances_ready(ControlChannel& channel, const ClusterSpec& spec,
                                                 std::chrono::milliseconds timeout) {
  std::map<Rank, const InstanceSpec*> by_leader;
  for (const InstanceSpec& instance : spec.instances) by_leader[instance.leader()] = &instance;
  std::vector<std::optional<InstanceReady>> ready(spec.instances.size());
  size_t n_ready = 0;
  const auto deadline = Clock::now() + timeout;
  while (n_ready < ready.size()) {
    std::optional<ReceivedMessage> received = channel.receive_until(deadline);
    if (!received) {
      std::string silent;
      for (const InstanceSpec& instance : spec.instances) {
        if (!ready[static_cast<size_t>(instance.id)])
          silent += fmt::format("{}{}", silent.empty() ? "" : ", ", describe(instance));
      }
      throw Error(ErrorKind::kInternal,
                  fmt::format("{} did not report ready within {} ms", silent, timeout.count()));
    }
    if (std::holds_alternative<Heartbeat>(received->message)) continue;  // leases start later
    const auto it = by_leader.find(received->source);
    auto* message = std::get_if<InstanceReady>(&received->message);
    if (it == by_leader.end() || message == nullptr) {
      spdlog::error("before every instance was ready: dropped a {} message from rank {}",
                    control_message_name(received->message), received->source.value);
      continue;
    }
    const InstanceSpec& instance = *it->second;
    if (!message->error.empty()) {
      throw Error(ErrorKind::kInvalidArgument,
                  fmt::format("{} could not start: {}", describe(instance), message->error));
    }
    DUET_ASSERT(message->instance_id == instance.id, "a leader reports its own instance id");
    if (!ready[static_cast<size_t>(instance.id)]) ++n_ready;
    ready[static_cast<size_t>(instance.id)] = std::move(*message);
  }
  std::vector<InstanceReady> out;
  for (auto& r : ready) out.push_back(std::move(*r));
  return out;
}

void shut_down_leaders(ControlChannel& channel, const ClusterSpec& spec,
                       const std::string& reason) {
  for (Rank leader : spec.leaders()) channel.send(leader, Shutdown{reason});
}

// ---------------------------------------------------------------- RemoteCluster

RemoteCluster::RemoteCluster(ControlChannel& channel, const ClusterSpec& spec,
                             const std::vector<InstanceReady>& ready,
                             std::chrono::milliseconds lease)
    : channel_(channel),
      spec_(spec),
      liveness_(spec, lease, Clock::now()),
      next_member_(channel.world_size()),
      next_instance_id_(static_cast<int>(spec.instances.size())) {
  DUET_ASSERT(channel.rank() == kCoordinatorRank, "remote instances live on rank 0");
  DUET_ASSERT(ready.size() == spec.instances.size(), "one InstanceReady per instance");
  for (const InstanceSpec& instance : spec.instances) {
    instances_.push_back(std::make_unique<RemoteInstance>(channel, instance.leader(),
                                                          ready[static_cast<size_t>(instance.id)]));
    by_leader_[instance.leader()] = instances_.back().get();
  }
  n_started_ = instances_.size();
  // Over TCP a rank's connection that ends is a loss at once (the handler
  // runs on the channel's thread; the dispatcher's receive() returns and
  // its check_leases() acts on it).
  channel_.set_link_lost_handler([this](Rank rank, const std::string& why) {
    std::lock_guard lock(mutex_);
    liveness_.connection_lost(rank, why);
  });
  dispatcher_ = std::thread([this] { dispatch(); });
}

void RemoteCluster::set_membership_handlers(MembershipHandlers handlers) {
  std::lock_guard lock(mutex_);
  membership_ = std::move(handlers);
}

JoinVerdict RemoteCluster::judge_join(const JoinRequest& request, ClusterMode mode,
                                      const std::string& fingerprint) {
  auto refuse = [](std::string reason) {
    return JoinVerdict{false, {}, 0, 0, std::move(reason), {}};
  };
  if (request.protocol_version != kControlProtocolVersion) {
    return refuse(fmt::format("it speaks control protocol {} ({}), the coordinator {}",
                              request.protocol_version, request.version, kControlProtocolVersion));
  }
  if (request.model_fingerprint != fingerprint) {
    return refuse(fmt::format("it serves another model (fingerprint {}, the cluster's {})",
                              request.model_fingerprint, fingerprint));
  }
  if (request.tp < 1 || request.tp > kMaxJoinTp) {
    return refuse(
        fmt::format("it has tp {}; an instance joins with 1 to {} ranks", request.tp, kMaxJoinTp));
  }
  if (mode == ClusterMode::kColocated && request.role != InstanceRole::kBoth) {
    return refuse(fmt::format("the cluster is colocated: join with --role both, not {}",
                              instance_role_name(request.role)));
  }
  if (mode == ClusterMode::kDisaggregated && request.role == InstanceRole::kBoth) {
    return refuse("the cluster is disaggregated: join with --role prefill or --role decode");
  }
  if (mode == ClusterMode::kDisaggregated &&
      (std::ssize(request.kv) != request.tp ||
       std::any_of(request.kv.begin(), request.kv.end(),
                   [](const KvLinkAddress& link) { return link.port == 0; }))) {
    return refuse(
        "it opened no KV listener on every rank, which a prefill or decode instance "
        "needs");
  }
  std::lock_guard lock(mutex_);
  if (shut_down_) return refuse("the coordinator is shutting down");
  JoinVerdict verdict{true, Rank{next_member_}, next_instance_id_, liveness_.lease().count(), {},
                      {}};
  if (mode == ClusterMode::kDisaggregated) {
    if (kv_links_.empty()) {
      return refuse(
          "the cluster's instances take no KV links from joined instances (they run on GPUs)");
    }
    verdict.kv_peers = live_kv_links();
  }
  next_member_ += request.tp;  // its ranks' addresses, the leader's first
  ++next_instance_id_;
  return verdict;
}

std::vector<KvLinkAddress> RemoteCluster::live_kv_links() const {
  std::set<Rank> gone;  // the ranks of instances lost or left
  for (const Liveness::InstanceView& view : liveness_.view()) {
    if (!view.lost) continue;
    for (const InstanceSpec& instance : spec_.instances) {
      if (instance.id == view.instance_id)
        gone.insert(instance.ranks.begin(), instance.ranks.end());
    }
  }
  // A member admitted but not yet ready is in: it listens before it dials.
  for (const auto& [rank, member] : members_) {
    for (int32_t k = 0; member.left && k < member.tp; ++k) gone.insert(Rank{rank.value + k});
  }
  std::vector<KvLinkAddress> live;
  for (const auto& [rank, link] : kv_links_) {
    if (!gone.contains(rank)) live.push_back(link);
  }
  return live;
}

void RemoteCluster::set_kv_links(std::vector<KvLinkAddress> links) {
  std::lock_guard lock(mutex_);
  for (KvLinkAddress& link : links) kv_links_[Rank{link.rank}] = std::move(link);
}

void RemoteCluster::admit(const JoinVerdict& verdict, const JoinRequest& request, int socket) {
  {
    std::lock_guard lock(mutex_);
    // Its lease watches the leader, the one rank linked to the coordinator:
    // a follower that dies or stalls stops the leader's steps, which its
    // heartbeats report.
    liveness_.add_instance({verdict.instance_id, request.role, 1, {verdict.member}}, Clock::now());
    InstanceSpec instance{verdict.instance_id, request.role, request.tp, {}};
    for (int32_t k = 0; k < request.tp; ++k) {
      const Rank rank{verdict.member.value + k};
      instance.ranks.push_back(rank);
      if (static_cast<size_t>(k) < request.kv.size() && request.kv[k].port != 0) {
        KvLinkAddress link = request.kv[k];
        link.rank = rank.value;
        link.leader = verdict.member.value;
        link.host = request.host;
        kv_links_[rank] = std::move(link);
      }
    }
    spec_.instances.push_back(std::move(instance));
    Member member{verdict.instance_id, request.role, request.host};
    member.tp = request.tp;
    members_[verdict.member] = member;
  }
  channel_.admit(verdict.member, socket);
  spdlog::info("member {} ({}, {}, tp {}) admitted as instance {}; waiting for it to be ready",
               verdict.member.value, request.host, instance_role_name(request.role), request.tp,
               verdict.instance_id);
}

void RemoteCluster::member_ready(Rank source, const InstanceReady& ready) {
  Member member;
  MembershipHandlers handlers;
  {
    std::lock_guard lock(mutex_);
    auto it = members_.find(source);
    if (it == members_.end() || it->second.ready) {
      spdlog::error("dropped an instance_ready message from rank {}", source.value);
      return;
    }
    it->second.ready = true;
    member = it->second;
    handlers = membership_;
  }
  std::string refusal = ready.error;
  if (refusal.empty() && ready.instance_id != member.instance_id) {
    refusal = fmt::format("it reports instance {}, not {}", ready.instance_id, member.instance_id);
  }
  RemoteInstance* instance = nullptr;
  if (refusal.empty()) {
    auto owned = std::make_unique<RemoteInstance>(channel_, source, ready);
    instance = owned.get();
    std::lock_guard lock(mutex_);
    instances_.push_back(std::move(owned));
  }
  if (refusal.empty() && handlers.joined) {
    try {
      handlers.joined(member.instance_id, source, member.tp, instance, member.role, member.host);
    } catch (const std::exception& e) {
      refusal = e.what();
    }
  }
  if (!refusal.empty()) {
    spdlog::error("member {} ({}) refused: {}", source.value, member.host, refusal);
    if (instance != nullptr) instance->mark_lost();
    {
      std::lock_guard lock(mutex_);
      liveness_.retire(member.instance_id);
      members_[source].left = true;
    }
    try {
      channel_.send(source, Shutdown{fmt::format("refused: {}", refusal)});
    } catch (const Error&) {
    }
    return;
  }
  by_leader_[source] = instance;
  spdlog::info("instance {} joined: member {} on {} ({}); routed to from now on",
               member.instance_id, source.value, member.host, instance_role_name(member.role));
}

void RemoteCluster::member_leaving(Rank source, const Leaving& leaving) {
  Member member;
  MembershipHandlers handlers;
  {
    std::lock_guard lock(mutex_);
    auto it = members_.find(source);
    if (it == members_.end() || !it->second.ready || it->second.left) {
      spdlog::error("dropped a leaving message from rank {}", source.value);
      return;
    }
    if (leaving.done) {
      it->second.left = true;
      liveness_.retire(it->second.instance_id);
    } else {
      it->second.leaving = true;
    }
    member = it->second;
    handlers = membership_;
  }
  if (!leaving.done) {
    spdlog::info("instance {} (member {}, {}) is leaving ({}): no new work goes there",
                 member.instance_id, source.value, member.host, leaving.reason);
    if (handlers.leaving) handlers.leaving(member.instance_id);
    try {
      channel_.send(source, LeaveAccepted{member.instance_id});
    } catch (const Error& e) {
      spdlog::warn("LeaveAccepted to member {} not sent: {}", source.value, e.what());
    }
    return;
  }
  by_leader_.at(source)->mark_lost();
  spdlog::info("instance {} (member {}, {}) left: {}", member.instance_id, source.value,
               member.host, leaving.reason);
  if (handlers.left) handlers.left(member.instance_id, leaving.reason);
}

RemoteCluster::~RemoteCluster() {
  if (!shut_down_) shut_down("the coordinator is stopping");
  channel_.set_link_lost_handler({});
}

void RemoteCluster::set_loss_handler(LossHandler handler) {
  std::lock_guard lock(mutex_);
  on_lost_ = std::move(handler);
}

void RemoteCluster::set_tick_handler(std::function<void()> handler) {
  std::lock_guard lock(mutex_);
  on_tick_ = std::move(handler);
}

std::vector<Liveness::InstanceView> RemoteCluster::liveness() const {
  std::lock_guard lock(mutex_);
  return liveness_.view();
}

uint64_t RemoteCluster::epoch() const {
  std::lock_guard lock(mutex_);
  return liveness_.epoch();
}

std::vector<InstanceClient*> RemoteCluster::instances() const {
  std::lock_guard lock(mutex_);
  std::vector<InstanceClient*> out;
  for (size_t i = 0; i < n_started_; ++i) out.push_back(instances_[i].get());
  return out;
}

bool RemoteCluster::shut_down(const std::string& reason, std::chrono::milliseconds timeout) {
  {
    std::lock_guard lock(mutex_);
    DUET_ASSERT(!shut_down_, "RemoteCluster::shut_down called twice");
    shut_down_ = true;
  }
  // Every leader not lost and not gone, members admitted but not yet ready too.
  std::vector<Rank> leaders;
  {
    std::lock_guard lock(mutex_);
    const std::vector<Rank> lost = liveness_.lost_ranks();
    for (const InstanceSpec& instance : spec_.instances) {
      const auto member = members_.find(instance.leader());
      if (member != members_.end() && member->second.left) continue;
      if (std::find(lost.begin(), lost.end(), instance.leader()) != lost.end()) continue;
      leaders.push_back(instance.leader());
    }
  }
  for (Rank leader : leaders) {
    try {
      channel_.send(leader, Shutdown{reason});
    } catch (const Error& e) {
      spdlog::warn("Shutdown to rank {} not sent: {}", leader.value, e.what());
    }
  }
  const bool closed = channel_.close(timeout);
  dispatcher_.join();  // ends once the inbox is drained and the channel closed
  return closed;
}

void RemoteCluster::dispatch() {
  std::chrono::milliseconds tick;
  {
    std::lock_guard lock(mutex_);
    tick = std::max(liveness_.lease() / 4, std::chrono::milliseconds(1));
  }
  Clock::time_point last_judged = Clock::now();
  for (;;) {
    std::optional<ReceivedMessage> received = channel_.receive(tick);
    // The leases are judged at `judged_at`, once everything that had arrived
    // by then is applied: a heartbeat still waiting in the inbox (behind a
    // slow loss, say) is not silence.
    const Clock::time_point judged_at = Clock::now();
    if (judged_at - last_judged > 2 * tick) {
      // Woken far past its tick: the coordinator itself was not running
      // (descheduled, or busy in a handler), and nobody could be heard.
      std::lock_guard lock(mutex_);
      liveness_.coordinator_paused(last_judged + tick, judged_at);
    }
    last_judged = judged_at;
    const bool any = received.has_value();
    while (received) {
      apply(*received);
      if (received->arrived > judged_at) break;  // newer than the judgement: the next pass's
      received = channel_.try_receive();
    }
    check_leases(judged_at);
    std::function<void()> tick;
    {
      std::lock_guard lock(mutex_);
      tick = on_tick_;
    }
    if (tick) tick();
    if (!any && !channel_.receiving()) return;
  }
}

void RemoteCluster::apply(const ReceivedMessage& received) {
  bool from_lost = false;
  uint64_t epoch = 0;
  {
    std::lock_guard lock(mutex_);
    from_lost = liveness_.rank_lost(received.source);
    epoch = liveness_.epoch();
    if (!from_lost) {
      if (const auto* beat = std::get_if<Heartbeat>(&received.message)) {
        liveness_.on_heartbeat(*beat, received.arrived);
      } else {
        liveness_.heard_from(received.source, received.arrived);
      }
    }
  }
  if (from_lost) {
    // A lost rank that speaks again was stalled, not dead: tell it again
    // (it leaves), and drop what it says.
    if (std::holds_alternative<Heartbeat>(received.message)) {
      try {
        channel_.send(received.source,
                      RanksLost{epoch, {received.source}, "this rank's instance was lost"});
      } catch (const Error&) {
      }
    }
    return;
  }
  if (std::holds_alternative<Heartbeat>(received.message)) return;
  if (received.source.value >= channel_.world_size()) {
    // A member's own messages about its membership.
    if (const auto* ready = std::get_if<InstanceReady>(&received.message)) {
      member_ready(received.source, *ready);
      return;
    }
    if (const auto* leaving = std::get_if<Leaving>(&received.message)) {
      member_leaving(received.source, *leaving);
      return;
    }
  }
  const auto it = by_leader_.find(received.source);
  if (it == by_leader_.end()) {
    spdlog::error("dropped a {} message from rank {}, which leads no instance",
                  control_message_name(received.message), received.source.value);
    return;
  }
  try {
    if (const auto* step = std::get_if<StepEvents>(&received.message)) {
      it->second->on_step_events(step->events);
    } else if (const auto* report = std::get_if<StatsReport>(&received.message)) {
      it->second->on_stats(report->stats);
    } else {
      spdlog::error("dropped an unexpected {} message from rank {}",
                    control_message_name(received.message), received.source.value);
    }
  } catch (const std::exception& e) {
    // A handler's broken invariant must not end the dispatcher: every other
    // request still needs its events.
    spdlog::error("rank {}'s {} message: {}", received.source.value,
                  control_message_name(received.message), e.what());
  }
}

void RemoteCluster::check_leases(Clock::time_point now) {
  std::vector<InstanceLoss> losses;
  std::vector<std::string> notices;
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) return;  // the end of the cluster is not a loss
    losses = liveness_.check(now);
    notices = liveness_.take_notices();
  }
  for (const std::string& notice : notices) spdlog::warn("{}", notice);
  for (const InstanceLoss& loss : losses) lose(loss);
}

void RemoteCluster::lose(const InstanceLoss& loss) {
  // Every rank not lost or gone hears of it: the lost ones leave should they
  // wake, the others stop waiting on them. Sent before the channel forgets them.
  InstanceSpec instance;
  std::vector<Rank> told;
  {
    std::lock_guard lock(mutex_);
    for (const InstanceSpec& other : spec_.instances) {
      if (other.id == loss.instance_id) instance = other;
      const auto member = members_.find(other.leader());
      if (member != members_.end() && member->second.left) continue;
      // A member's followers have no link to the coordinator: its leader hears.
      if (member != members_.end()) {
        told.push_back(other.leader());
        continue;
      }
      told.insert(told.end(), other.ranks.begin(), other.ranks.end());
    }
  }
  spdlog::error("instance {} ({}, rank {}) lost at epoch {}: {}; its requests go elsewhere",
                instance.id, instance_role_name(instance.role), loss.ranks.front().value,
                loss.epoch, loss.reason);
  if (const auto it = by_leader_.find(loss.ranks.front()); it != by_leader_.end())
    it->second->mark_lost();
  // Every rank of the instance (a joined group's lease watches its leader only).
  const RanksLost message{loss.epoch, instance.ranks.empty() ? loss.ranks : instance.ranks,
                          fmt::format("instance {}: {}", instance.id, loss.reason)};
  for (Rank rank : told) {
    try {
      channel_.send(rank, message);
    } catch (const Error& e) {
      spdlog::warn("RanksLost to rank {} not sent: {}", rank.value, e.what());
    }
  }
  channel_.forget(loss.ranks);
  LossHandler handler;
  {
    std::lock_guard lock(mutex_);
    handler = on_lost_;
  }
  if (handler) handler(loss);
}

}  // namespace duet
