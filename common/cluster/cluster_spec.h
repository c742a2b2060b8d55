// The cluster spec: which MPI ranks form which instances, and what each does.
//
// One MPI job runs a whole deployment (docs/ARCHITECTURE.md). Rank 0 is the
// coordinator; every other rank belongs to exactly one instance, a group of `tp`
// ranks that together hold one copy of the model (tensor parallel), whose first
// rank is its leader, the only one that talks to the coordinator. A spec comes
// from flags (`--prefill P --decode D --tp T --mode M`; `--prefill-tp` and
// `--decode-tp` give the two kinds of instances their own sizes, overriding `--tp`,
// and the KV cache is re-sharded on its way) or from a JSON file (`--cluster FILE`,
// parse_cluster_json).
//
// Every rank parses and validates the same spec itself: an impossible layout or a
// spec that does not match the MPI world is the same clear error on every rank,
// before any control message is exchanged, so nothing can hang on it. Values, no
// MPI: this file is usable (and tested) in a single process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

enum class ClusterMode {
  kDisaggregated,  // prefill instances and decode instances
  kColocated,      // every instance runs both phases (the baseline)
};

enum class InstanceRole {
  kPrefill,  // runs prompts, samples the first token, ships the KV
  kDecode,   // receives KV, decodes in one continuous batch
  kBoth,     // colocated: prefill and decode in one instance
};

std::string_view cluster_mode_name(ClusterMode mode);    // "disaggregated", "colocated"
std::string_view instance_role_name(InstanceRole role);  // "prefill", "decode", "both"

// An MPI rank in MPI_COMM_WORLD.
struct Rank {
  int value = 0;
  auto operator<=>(const Rank&) const = default;
};

inline constexpr Rank kCoordinatorRank{0};

struct InstanceSpec {
  int id = 0;  // index in ClusterSpec::instances
  InstanceRole role = InstanceRole::kBoth;
  int tp = 1;               // tensor-parallel size; equals ranks.size() once validated
  std::vector<Rank> ranks;  // ranks.front() is the leader

  Rank leader() const { return ranks.front(); }
};

struct ClusterSpec {
  ClusterMode mode = ClusterMode::kDisaggregated;
  std::vector<InstanceSpec> instances;

  // The processes the spec needs: the coordinator plus every instance's ranks.
  int required_world_size() const;
  // The instance `rank` belongs to; nullptr for the coordinator (or a rank in
  // none, which validate() refuses).
  const InstanceSpec* instance_of(Rank rank) const;
  bool is_leader(Rank rank) const;
  std::vector<Rank> leaders() const;  // in instance order
  int count(InstanceRole role) const;

  // Throws duet::Error (kInvalidArgument) with a message that starts with
  // "cluster spec: " and names the first problem: no instance, a tp that does
  // not match an instance's rank count, a role the mode does not allow, zero
  // prefill or zero decode instances in disaggregated mode, the coordinator's
  // rank inside an instance, a rank in two instances, a world of another size
  // than the spec needs, a rank outside the world, a rank in no instance.
  void validate(int world_size) const;

  // One line per instance, for start-up logs.
  std::string describe() const;
};

// The cluster flags of `duet serve`. Unset optionals were not given.
struct ClusterFlags {
  std::optional<int> prefill;     // --prefill P
  std::optional<int> decode;      // --decode D
  std::optional<int> tp;          // --tp T (default 1)
  std::optional<int> prefill_tp;  // --prefill-tp T (default --tp)
  std::optional<int> decode_tp;   // --decode-tp T (default --tp)
  // Expert parallelism shares the instance's ranks (EP = TP): --ep E sizes instances as --tp E
  // does, and names the intent (a mixture of experts spread whole over them); given with --tp
  // it must be equal.
  std::optional<int> ep;            // --ep E
  std::optional<int> prefill_ep;    // --prefill-ep E
  std::optional<int> decode_ep;     // --decode-ep E
  std::optional<std::string> mode;  // --mode disaggregated|colocated
  std::optional<std::string> file;  // --cluster FILE

  // Whether any cluster flag was given (a serve without one is single-process).
  bool any() const {
    return prefill || decode || tp || prefill_tp || decode_tp || ep || prefill_ep || decode_ep ||
           mode || file;
  }
  bool any_ep() const { return ep || prefill_ep || decode_ep; }
};

ClusterMode parse_cluster_mode(std::string_view name);    // throws on an unknown name
InstanceRole parse_instance_role(std::string_view name);  // "prefill", "decode", "both"

// P prefill then D decode instances of `tp` ranks each on ranks 1, 2, ... in
// order. In colocated mode the same P + D instances all get role kBoth.
// Throws on negative counts or tp < 1; validate() judges the rest.
ClusterSpec parse_cluster_flags(int prefill, int decode, int tp, ClusterMode mode);
// The same with the prefill instances of `prefill_tp` ranks and the decode
// ones of `decode_tp`.
ClusterSpec parse_cluster_flags(int prefill, int decode, int prefill_tp, int decode_tp,
                                ClusterMode mode);

// The JSON form (`origin`, a file name, prefixes every error message):
//
//   {
//     "mode": "disaggregated",            // or "colocated"; default disaggregated
//     "instances": [                       // instance id = index in this list
//       {"role": "prefill", "tp": 1, "ranks": [1]},
//       {"role": "decode",  "tp": 2, "ranks": [2, 3]}
//     ]
//   }
//
// "tp" may be left out (it is then the number of ranks). Unknown keys are an
// error, so a typo is never silently ignored.
ClusterSpec parse_cluster_json(std::string_view text, std::string_view origin = "cluster spec");
// Reads and parses a JSON file; a missing file is kNotFound.
ClusterSpec parse_cluster_file(const std::string& path);

// --cluster FILE or the flags (exclusive: both is an error); not validated.
// Requires flags.any(). Instance counts not given fill the `world_size` - 1
// instance ranks: colocated, (world_size - 1) / tp instances; disaggregated,
// one prefill instance (or --prefill P) and as many decode instances as the
// rest holds (or --decode D, and as many prefill instances as the rest
// holds). Where the ranks do not divide so, the error names the flags (or
// the -np) that would make it run.
ClusterSpec cluster_spec_from_flags(const ClusterFlags& flags, int world_size);

}  // namespace duet
