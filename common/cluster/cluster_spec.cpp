#include "common/cluster/cluster_spec.h"

#include <fmt/format.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"

namespace duet {
namespace {

constexpr std::string_view kPrefix = "cluster spec: ";

std::string rank_list(const std::vector<Rank>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += fmt::format("{}{}", i ? ", " : "", ranks[i].value);
  }
  return out + "]";
}

std::string instance_name(const InstanceSpec& instance) {
  return fmt::format("instance {} ({})", instance.id, instance_role_name(instance.role));
}

InstanceRole parse_role(std::string_view name, std::string_view where) {
  if (name == "prefill") return InstanceRole::kPrefill;
  if (name == "decode") return InstanceRole::kDecode;
  if (name == "both") return InstanceRole::kBoth;
  throw Error(
      ErrorKind::kInvalidArgument,
      fmt::format("{}: role must be \"prefill\", \"decode\" or \"both\", got \"{}\"", where, name));
}

int json_int(const nlohmann::json& value, std::string_view where) {
  DUET_REQUIRE(value.is_number_integer(), "{}: must be an integer, got {}", where, value.dump());
  const int64_t v = value.get<int64_t>();
  DUET_REQUIRE(v >= INT32_MIN && v <= INT32_MAX, "{}: {} is out of range", where, v);
  return static_cast<int>(v);
}

void require_known_keys(const nlohmann::json& object, std::initializer_list<std::string_view> keys,
                        std::string_view where) {
  for (const auto& [key, value] : object.items()) {
    bool known = false;
    for (std::string_view k : keys) known = known || key == k;
    if (known) continue;
    std::string allowed;
    for (std::string_view k : keys) {
      allowed += fmt::format("{}\"{}\"", allowed.empty() ? "" : ", ", k);
    }
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("{}: unknown key \"{}\" (allowed: {})", where, key, allowed));
  }
}

}  // namespace

std::string_view cluster_mode_name(ClusterMode mode) {
  switch (mode) {
    case ClusterMode::kDisaggregated:
      return "disaggregated";
    case ClusterMode::kColocated:
      return "colocated";
  }
  return "disaggregated";
}

std::string_view instance_role_name(InstanceRole role) {
  switch (role) {
    case InstanceRole::kPrefill:
      return "prefill";
    case InstanceRole::kDecode:
      return "decode";
    case InstanceRole::kBoth:
      return "both";
  }
  return "both";
}

int ClusterSpec::required_world_size() const {
  int n = 1;  // the coordinator
  for (const InstanceSpec& instance : instances) n += static_cast<int>(instance.ranks.size());
  return n;
}

const InstanceSpec* ClusterSpec::instance_of(Rank rank) const {
  for (const InstanceSpec& instance : instances) {
    for (Rank r : instance.ranks) {
      if (r == rank) return &instance;
    }
  }
  return nullptr;
}

bool ClusterSpec::is_leader(Rank rank) const {
  const InstanceSpec* instance = instance_of(rank);
  return instance != nullptr && instance->leader() == rank;
}

std::vector<Rank> ClusterSpec::leaders() const {
  std::vector<Rank> out;
  for (const InstanceSpec& instance : instances) {
    if (!instance.ranks.empty()) out.push_back(instance.leader());
  }
  return out;
}

int ClusterSpec::count(InstanceRole role) const {
  int n = 0;
  for (const InstanceSpec& instance : instances) n += instance.role == role ? 1 : 0;
  return n;
}

void ClusterSpec::validate(int world_size) const {
  DUET_REQUIRE(!instances.empty(), "{}no instance: at least one is needed", kPrefix);

  // The shape of each instance and the roles the mode allows.
  for (size_t i = 0; i < instances.size(); ++i) {
    const InstanceSpec& instance = instances[i];
    DUET_ASSERT(instance.id == static_cast<int>(i), "instance ids are list indices");
    DUET_REQUIRE(instance.tp >= 1, "{}{} has tp {}; tp must be at least 1", kPrefix,
                 instance_name(instance), instance.tp);
    DUET_REQUIRE(static_cast<int>(instance.ranks.size()) == instance.tp,
                 "{}{} has tp {} but {} rank(s) {}; an instance needs exactly tp ranks", kPrefix,
                 instance_name(instance), instance.tp, instance.ranks.size(),
                 rank_list(instance.ranks));
    if (mode == ClusterMode::kDisaggregated) {
      DUET_REQUIRE(instance.role != InstanceRole::kBoth,
                   "{}{}: role \"both\" needs mode \"colocated\"; disaggregated instances are "
                   "\"prefill\" or \"decode\"",
                   kPrefix, instance_name(instance));
    } else {
      DUET_REQUIRE(instance.role == InstanceRole::kBoth,
                   "{}{}: in colocated mode every instance has role \"both\"", kPrefix,
                   instance_name(instance));
    }
  }
  if (mode == ClusterMode::kDisaggregated) {
    DUET_REQUIRE(count(InstanceRole::kPrefill) > 0,
                 "{}disaggregated mode needs at least one prefill instance, got 0 (and {} decode)",
                 kPrefix, count(InstanceRole::kDecode));
    DUET_REQUIRE(count(InstanceRole::kDecode) > 0,
                 "{}disaggregated mode needs at least one decode instance, got 0 (and {} prefill)",
                 kPrefix, count(InstanceRole::kPrefill));
  }

  // Ranks: never the coordinator's, never two instances.
  std::map<Rank, int> owner;  // rank -> instance id
  for (const InstanceSpec& instance : instances) {
    for (Rank rank : instance.ranks) {
      DUET_REQUIRE(rank.value >= 0, "{}{} names rank {}; ranks are not negative", kPrefix,
                   instance_name(instance), rank.value);
      DUET_REQUIRE(rank != kCoordinatorRank,
                   "{}{} names rank 0, which is the coordinator's; instances use ranks 1 and up",
                   kPrefix, instance_name(instance));
      const auto [it, inserted] = owner.emplace(rank, instance.id);
      DUET_REQUIRE(inserted, "{}rank {} is in two instances: {} and {}", kPrefix, rank.value,
                   instance_name(instances[it->second]), instance_name(instance));
    }
  }

  // The world mpirun started. Ranks 1..n-1 exactly (always so from flags):
  // only the count can be wrong. Otherwise name the rank that does not fit.
  const int needed = required_world_size();
  if (owner.rbegin()->first.value == needed - 1) {
    DUET_REQUIRE(world_size == needed,
                 "{}the spec needs {} processes (1 coordinator + {} instance ranks) but mpirun "
                 "started {} (mpirun -np {})",
                 kPrefix, needed, needed - 1, world_size, needed);
    return;
  }
  for (const auto& [rank, id] : owner) {
    DUET_REQUIRE(rank.value < world_size,
                 "{}{} names rank {}, outside the world of {} ranks (0-{}) mpirun started", kPrefix,
                 instance_name(instances[id]), rank.value, world_size, world_size - 1);
  }
  for (int r = 1; r < world_size; ++r) {
    DUET_REQUIRE(owner.contains(Rank{r}),
                 "{}rank {} is in no instance; every rank but the coordinator's (0) must be in one",
                 kPrefix, r);
  }
  DUET_ASSERT(false, "a spec with gaps in its ranks always leaves one out");
}

std::string ClusterSpec::describe() const {
  std::string out = fmt::format("{} mode, coordinator on rank 0, {} instance(s)",
                                cluster_mode_name(mode), instances.size());
  for (const InstanceSpec& instance : instances) {
    out += fmt::format("\n  {}: tp {}, ranks {}", instance_name(instance), instance.tp,
                       rank_list(instance.ranks));
  }
  return out;
}

ClusterMode parse_cluster_mode(std::string_view name) {
  if (name == "disaggregated") return ClusterMode::kDisaggregated;
  if (name == "colocated") return ClusterMode::kColocated;
  throw Error(
      ErrorKind::kInvalidArgument,
      fmt::format("{}mode must be \"disaggregated\" or \"colocated\", got \"{}\"", kPrefix, name));
}

InstanceRole parse_instance_role(std::string_view name) {
  if (name == "prefill") return InstanceRole::kPrefill;
  if (name == "decode") return InstanceRole::kDecode;
  if (name == "both") return InstanceRole::kBoth;
  throw Error(ErrorKind::kInvalidArgument,
              fmt::format("role must be \"prefill\", \"decode\" or \"both\", got \"{}\"", name));
}

ClusterSpec parse_cluster_flags(int prefill, int decode, int tp, ClusterMode mode) {
  DUET_REQUIRE(tp >= 1, "{}--tp must be at least 1, got {}", kPrefix, tp);
  return parse_cluster_flags(prefill, decode, tp, tp, mode);
}

ClusterSpec parse_cluster_flags(int prefill, int decode, int prefill_tp, int decode_tp,
                                ClusterMode mode) {
  DUET_REQUIRE(prefill >= 0, "{}--prefill must not be negative, got {}", kPrefix, prefill);
  DUET_REQUIRE(decode >= 0, "{}--decode must not be negative, got {}", kPrefix, decode);
  DUET_REQUIRE(prefill_tp >= 1, "{}--prefill-tp must be at least 1, got {}", kPrefix, prefill_tp);
  DUET_REQUIRE(decode_tp >= 1, "{}--decode-tp must be at least 1, got {}", kPrefix, decode_tp);
  ClusterSpec spec;
  spec.mode = mode;
  int next_rank = 1;
  auto add = [&](InstanceRole role, int n, int tp) {
    for (int i = 0; i < n; ++i) {
      InstanceSpec instance;
      instance.id = static_cast<int>(spec.instances.size());
      instance.role = mode == ClusterMode::kColocated ? InstanceRole::kBoth : role;
      instance.tp = tp;
      for (int r = 0; r < tp; ++r) instance.ranks.push_back(Rank{next_rank++});
      spec.instances.push_back(std::move(instance));
    }
  };
  add(InstanceRole::kPrefill, prefill, prefill_tp);
  add(InstanceRole::kDecode, decode, decode_tp);
  return spec;
}

ClusterSpec parse_cluster_json(std::string_view text, std::string_view origin) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("{}: not valid JSON: {}", origin, e.what()));
  }
  DUET_REQUIRE(root.is_object(), "{}: must be a JSON object with \"instances\"", origin);
  require_known_keys(root, {"mode", "instances"}, origin);

  ClusterSpec spec;
  if (root.contains("mode")) {
    DUET_REQUIRE(root["mode"].is_string(), "{}: \"mode\" must be a string", origin);
    try {
      spec.mode = parse_cluster_mode(root["mode"].get<std::string>());
    } catch (const Error& e) {
      throw Error(ErrorKind::kInvalidArgument, fmt::format("{}: {}", origin, e.what()));
    }
  }
  DUET_REQUIRE(root.contains("instances") && root["instances"].is_array(),
               "{}: \"instances\" must be a list of instances", origin);
  for (const nlohmann::json& item : root["instances"]) {
    const std::string where = fmt::format("{}: instances[{}]", origin, spec.instances.size());
    DUET_REQUIRE(item.is_object(), "{}: must be an object with \"role\" and \"ranks\"", where);
    require_known_keys(item, {"role", "tp", "ranks"}, where);
    InstanceSpec instance;
    instance.id = static_cast<int>(spec.instances.size());
    DUET_REQUIRE(item.contains("role") && item["role"].is_string(),
                 "{}: \"role\" (a string) is missing", where);
    instance.role = parse_role(item["role"].get<std::string>(), where);
    DUET_REQUIRE(item.contains("ranks") && item["ranks"].is_array(),
                 "{}: \"ranks\" (a list of ranks) is missing", where);
    for (const nlohmann::json& rank : item["ranks"]) {
      instance.ranks.push_back(Rank{json_int(rank, where + ".ranks")});
    }
    DUET_REQUIRE(!instance.ranks.empty(), "{}: \"ranks\" is empty", where);
    instance.tp = item.contains("tp") ? json_int(item["tp"], where + ".tp")
                                      : static_cast<int>(instance.ranks.size());
    spec.instances.push_back(std::move(instance));
  }
  return spec;
}

ClusterSpec parse_cluster_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorKind::kNotFound, fmt::format("cannot open cluster file {}", path));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_cluster_json(text.str(), path);
}

namespace {

// How many instances of `tp` ranks fill `n_ranks` exactly; nullopt if none or
// not whole.
std::optional<int> instances_filling(int n_ranks, int tp) {
  if (n_ranks < tp || n_ranks % tp != 0) return std::nullopt;
  return n_ranks / tp;
}

// One instance size from its --*-tp and --*-ep flags (EP = TP: equal when both are given).
std::optional<int> ranks_per_instance(const std::optional<int>& tp, const std::optional<int>& ep,
                                      std::string_view prefix) {
  DUET_REQUIRE(!tp || !ep || *tp == *ep,
               "{}--{}ep {} and --{}tp {} differ: expert parallelism spreads the experts over "
               "the instance's tensor-parallel ranks (EP = TP)",
               kPrefix, prefix, *ep, prefix, *tp);
  return tp ? tp : ep;
}

}  // namespace

ClusterSpec cluster_spec_from_flags(const ClusterFlags& flags, int world_size) {
  DUET_ASSERT(flags.any());
  if (flags.file) {
    DUET_REQUIRE(!flags.prefill && !flags.decode && !flags.tp && !flags.prefill_tp &&
                     !flags.decode_tp && !flags.any_ep() && !flags.mode,
                 "{}--cluster FILE and --prefill/--decode/--tp/--prefill-tp/--decode-tp/--ep/"
                 "--mode are exclusive: the file names the whole layout",
                 kPrefix);
    return parse_cluster_file(*flags.file);
  }
  const ClusterMode mode =
      flags.mode ? parse_cluster_mode(*flags.mode) : ClusterMode::kDisaggregated;
  const int tp = ranks_per_instance(flags.tp, flags.ep, "").value_or(1);
  DUET_REQUIRE(tp >= 1, "{}--tp must be at least 1, got {}", kPrefix, tp);
  const int prefill_tp =
      ranks_per_instance(flags.prefill_tp, flags.prefill_ep, "prefill-").value_or(tp);
  const int decode_tp =
      ranks_per_instance(flags.decode_tp, flags.decode_ep, "decode-").value_or(tp);
  DUET_REQUIRE(prefill_tp >= 1 && decode_tp >= 1, "{}--{}-tp must be at least 1, got {}", kPrefix,
               prefill_tp < 1 ? "prefill" : "decode", std::min(prefill_tp, decode_tp));
  const int n_ranks = world_size - 1;  // every rank but the coordinator's
  int prefill = flags.prefill.value_or(0), decode = flags.decode.value_or(0);
  if (mode == ClusterMode::kColocated && !flags.prefill && !flags.decode) {
    const std::optional<int> n = instances_filling(n_ranks, decode_tp);
    DUET_REQUIRE(n.has_value(),
                 "{}-np {} leaves {} instance rank(s), not a whole number of colocated instances "
                 "of tp {}: run -np {} or give --decode D",
                 kPrefix, world_size, n_ranks, decode_tp,
                 1 + std::max(1, n_ranks / decode_tp) * decode_tp);
    decode = *n;
  } else if (mode == ClusterMode::kDisaggregated && (!flags.prefill || !flags.decode)) {
    // One count given (or none: one prefill instance): the other fills the rest.
    if (!flags.prefill && !flags.decode) prefill = 1;
    const bool fill_decode = !flags.decode;
    const int rest = n_ranks - (fill_decode ? prefill * prefill_tp : decode * decode_tp);
    const std::optional<int> n = instances_filling(rest, fill_decode ? decode_tp : prefill_tp);
    DUET_REQUIRE(n.has_value(),
                 "{}-np {} leaves {} instance rank(s); {} prefill instance(s) of tp {} and "
                 "decode instances of tp {} do not fill them: give --prefill P --decode D with "
                 "P x {} + D x {} = {}",
                 kPrefix, world_size, n_ranks,
                 fill_decode ? std::to_string(prefill) : std::string("some"), prefill_tp, decode_tp,
                 prefill_tp, decode_tp, n_ranks);
    (fill_decode ? decode : prefill) = *n;
  }
  return parse_cluster_flags(prefill, decode, prefill_tp, decode_tp, mode);
}

}  // namespace duet
