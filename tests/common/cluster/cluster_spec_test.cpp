// The cluster spec: layouts from flags and from JSON, and every refusal of
// validate() with its message. No MPI.
#include "common/cluster/cluster_spec.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "common/error.h"

namespace duet {
namespace {

// The message validate() (or a parser) throws, or "" when it does not throw.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<Rank> ranks(std::initializer_list<int> values) {
  std::vector<Rank> out;
  for (int v : values) out.push_back(Rank{v});
  return out;
}

TEST(ClusterSpec, FlagsLayOutPrefillThenDecodeFromRankOne) {
  const ClusterSpec spec = parse_cluster_flags(2, 1, 2, ClusterMode::kDisaggregated);
  ASSERT_EQ(spec.instances.size(), 3u);
  EXPECT_EQ(spec.instances[0].role, InstanceRole::kPrefill);
  EXPECT_EQ(spec.instances[0].ranks, ranks({1, 2}));
  EXPECT_EQ(spec.instances[1].role, InstanceRole::kPrefill);
  EXPECT_EQ(spec.instances[1].ranks, ranks({3, 4}));
  EXPECT_EQ(spec.instances[2].role, InstanceRole::kDecode);
  EXPECT_EQ(spec.instances[2].ranks, ranks({5, 6}));
  EXPECT_EQ(spec.instances[2].id, 2);
  EXPECT_EQ(spec.required_world_size(), 7);
  EXPECT_NO_THROW(spec.validate(7));

  EXPECT_EQ(spec.leaders(), ranks({1, 3, 5}));
  EXPECT_TRUE(spec.is_leader(Rank{3}));
  EXPECT_FALSE(spec.is_leader(Rank{4}));
  EXPECT_FALSE(spec.is_leader(kCoordinatorRank));
  EXPECT_EQ(spec.instance_of(Rank{4})->id, 1);
  EXPECT_EQ(spec.instance_of(kCoordinatorRank), nullptr);
  EXPECT_EQ(spec.count(InstanceRole::kPrefill), 2);
  EXPECT_EQ(spec.count(InstanceRole::kDecode), 1);
}

TEST(ClusterSpec, PrefillAndDecodeInstancesTakeTheirOwnTpSizes) {
  ClusterFlags flags;
  flags.prefill = 1;
  flags.decode = 1;
  flags.tp = 2;
  flags.decode_tp = 3;
  const ClusterSpec spec = cluster_spec_from_flags(flags, 6);
  ASSERT_EQ(spec.instances.size(), 2u);
  EXPECT_EQ(spec.instances[0].tp, 2);  // --tp
  EXPECT_EQ(spec.instances[0].ranks, ranks({1, 2}));
  EXPECT_EQ(spec.instances[1].tp, 3);  // --decode-tp overrides it
  EXPECT_EQ(spec.instances[1].ranks, ranks({3, 4, 5}));
  EXPECT_NO_THROW(spec.validate(6));

  flags.prefill_tp = 0;
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(flags, 6); }),
            "cluster spec: --prefill-tp must be at least 1, got 0");
}

// Expert parallelism shares the tensor-parallel ranks: --ep sizes instances as --tp does, and
// the two must agree when both are given.
TEST(ClusterSpec, EpFlagsSizeInstancesAsTpDoes) {
  ClusterFlags flags;
  flags.prefill = 1;
  flags.decode = 1;
  flags.prefill_ep = 1;
  flags.decode_ep = 2;
  const ClusterSpec spec = cluster_spec_from_flags(flags, 4);
  ASSERT_EQ(spec.instances.size(), 2u);
  EXPECT_EQ(spec.instances[0].tp, 1);
  EXPECT_EQ(spec.instances[1].tp, 2);
  EXPECT_EQ(spec.instances[1].ranks, ranks({2, 3}));
  EXPECT_TRUE(flags.any_ep());

  ClusterFlags both;
  both.ep = 2;
  both.tp = 2;
  both.mode = "colocated";
  EXPECT_EQ(cluster_spec_from_flags(both, 3).instances[0].tp, 2);
  both.tp = 1;
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(both, 3); }),
            "cluster spec: --ep 2 and --tp 1 differ: expert parallelism spreads the experts over "
            "the instance's tensor-parallel ranks (EP = TP)");
}

TEST(ClusterSpec, ColocatedFlagsMakeEveryInstanceDoBoth) {
  const ClusterSpec spec = parse_cluster_flags(1, 1, 1, ClusterMode::kColocated);
  ASSERT_EQ(spec.instances.size(), 2u);
  for (const InstanceSpec& instance : spec.instances) {
    EXPECT_EQ(instance.role, InstanceRole::kBoth);
  }
  EXPECT_NO_THROW(spec.validate(3));
  // Colocated needs no decode instance: one instance does it all.
  EXPECT_NO_THROW(parse_cluster_flags(1, 0, 1, ClusterMode::kColocated).validate(2));
}

TEST(ClusterSpec, BadFlagsAreRefused) {
  EXPECT_EQ(error_of([] { parse_cluster_flags(-1, 1, 1, ClusterMode::kDisaggregated); }),
            "cluster spec: --prefill must not be negative, got -1");
  EXPECT_EQ(error_of([] { parse_cluster_flags(1, -2, 1, ClusterMode::kDisaggregated); }),
            "cluster spec: --decode must not be negative, got -2");
  EXPECT_EQ(error_of([] { parse_cluster_flags(1, 1, 0, ClusterMode::kDisaggregated); }),
            "cluster spec: --tp must be at least 1, got 0");
  EXPECT_EQ(error_of([] { parse_cluster_mode("split"); }),
            "cluster spec: mode must be \"disaggregated\" or \"colocated\", got \"split\"");
}

TEST(ClusterSpec, WorldSizeMismatchNamesBothCounts) {
  const ClusterSpec spec = parse_cluster_flags(1, 2, 1, ClusterMode::kDisaggregated);
  EXPECT_EQ(error_of([&] { spec.validate(3); }),
            "cluster spec: the spec needs 4 processes (1 coordinator + 3 instance ranks) but "
            "mpirun started 3 (mpirun -np 4)");
  EXPECT_NE(error_of([&] { spec.validate(5); }).find("mpirun started 5"), std::string::npos);
}

TEST(ClusterSpec, DisaggregatedNeedsBothKinds) {
  EXPECT_EQ(error_of([] { parse_cluster_flags(0, 2, 1, ClusterMode::kDisaggregated).validate(3); }),
            "cluster spec: disaggregated mode needs at least one prefill instance, got 0 (and 2 "
            "decode)");
  EXPECT_EQ(error_of([] { parse_cluster_flags(2, 0, 1, ClusterMode::kDisaggregated).validate(3); }),
            "cluster spec: disaggregated mode needs at least one decode instance, got 0 (and 2 "
            "prefill)");
  EXPECT_EQ(error_of([] { parse_cluster_flags(0, 0, 1, ClusterMode::kColocated).validate(1); }),
            "cluster spec: no instance: at least one is needed");
}

ClusterSpec two_instances(std::vector<Rank> prefill, std::vector<Rank> decode) {
  ClusterSpec spec;
  spec.instances.push_back({0, InstanceRole::kPrefill, static_cast<int>(prefill.size()), prefill});
  spec.instances.push_back({1, InstanceRole::kDecode, static_cast<int>(decode.size()), decode});
  return spec;
}

TEST(ClusterSpec, ImpossibleLayoutsAreRefused) {
  EXPECT_EQ(error_of([] {
              two_instances(ranks({1, 2}), ranks({2, 3})).validate(4);
            }),
            "cluster spec: rank 2 is in two instances: instance 0 (prefill) and instance 1 "
            "(decode)");
  EXPECT_EQ(error_of([] { two_instances(ranks({0}), ranks({1})).validate(2); }),
            "cluster spec: instance 0 (prefill) names rank 0, which is the coordinator's; "
            "instances use ranks 1 and up");
  EXPECT_EQ(error_of([] { two_instances(ranks({-1}), ranks({1})).validate(3); }),
            "cluster spec: instance 0 (prefill) names rank -1; ranks are not negative");
  EXPECT_EQ(error_of([] { two_instances(ranks({1}), ranks({3})).validate(3); }),
            "cluster spec: instance 1 (decode) names rank 3, outside the world of 3 ranks (0-2) "
            "mpirun started");
  EXPECT_EQ(error_of([] { two_instances(ranks({1}), ranks({3})).validate(4); }),
            "cluster spec: rank 2 is in no instance; every rank but the coordinator's (0) must be "
            "in one");

  ClusterSpec tp_mismatch = two_instances(ranks({1}), ranks({2, 3}));
  tp_mismatch.instances[1].tp = 4;
  EXPECT_EQ(error_of([&] { tp_mismatch.validate(4); }),
            "cluster spec: instance 1 (decode) has tp 4 but 2 rank(s) [2, 3]; an instance needs "
            "exactly tp ranks");
  tp_mismatch.instances[1].tp = 0;
  EXPECT_EQ(error_of([&] { tp_mismatch.validate(4); }),
            "cluster spec: instance 1 (decode) has tp 0; tp must be at least 1");

  ClusterSpec both = two_instances(ranks({1}), ranks({2}));
  both.instances[1].role = InstanceRole::kBoth;
  EXPECT_EQ(error_of([&] { both.validate(3); }),
            "cluster spec: instance 1 (both): role \"both\" needs mode \"colocated\"; "
            "disaggregated instances are \"prefill\" or \"decode\"");
  both.mode = ClusterMode::kColocated;
  EXPECT_EQ(error_of([&] { both.validate(3); }),
            "cluster spec: instance 0 (prefill): in colocated mode every instance has role "
            "\"both\"");
}

TEST(ClusterSpec, JsonNamesRanksExplicitly) {
  const ClusterSpec spec = parse_cluster_json(R"({
    "mode": "disaggregated",
    "instances": [
      {"role": "decode", "tp": 2, "ranks": [3, 1]},
      {"role": "prefill", "ranks": [2]}
    ]})");
  ASSERT_EQ(spec.instances.size(), 2u);
  EXPECT_EQ(spec.instances[0].role, InstanceRole::kDecode);
  EXPECT_EQ(spec.instances[0].ranks, ranks({3, 1}));
  EXPECT_EQ(spec.instances[0].leader(), Rank{3});
  EXPECT_EQ(spec.instances[1].tp, 1);  // from the rank count
  EXPECT_NO_THROW(spec.validate(4));
  EXPECT_EQ(parse_cluster_json(R"({"instances": [{"role": "both", "ranks": [1]}]})").mode,
            ClusterMode::kDisaggregated);
}

TEST(ClusterSpec, MalformedJsonIsRefusedWithItsPlace) {
  EXPECT_NE(error_of([] { parse_cluster_json("{", "c.json"); }).find("c.json: not valid JSON"),
            std::string::npos);
  EXPECT_EQ(error_of([] { parse_cluster_json("[]", "c.json"); }),
            "c.json: must be a JSON object with \"instances\"");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"instance": []})", "c.json"); }),
            "c.json: unknown key \"instance\" (allowed: \"mode\", \"instances\")");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"mode": "colocated"})", "c.json"); }),
            "c.json: \"instances\" must be a list of instances");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"mode": 3, "instances": []})", "c.json"); }),
            "c.json: \"mode\" must be a string");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"mode": "x", "instances": []})", "c.json"); }),
            "c.json: cluster spec: mode must be \"disaggregated\" or \"colocated\", got \"x\"");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"instances": [3]})", "c.json"); }),
            "c.json: instances[0]: must be an object with \"role\" and \"ranks\"");
  EXPECT_EQ(error_of([] {
              parse_cluster_json(R"({"instances": [{"role": "decode", "rank": [1]}]})", "c.json");
            }),
            "c.json: instances[0]: unknown key \"rank\" (allowed: \"role\", \"tp\", \"ranks\")");
  EXPECT_EQ(error_of([] { parse_cluster_json(R"({"instances": [{"ranks": [1]}]})", "c.json"); }),
            "c.json: instances[0]: \"role\" (a string) is missing");
  EXPECT_EQ(
      error_of([] {
        parse_cluster_json(R"({"instances": [{"role": "verify", "ranks": [1]}]})", "c.json");
      }),
      "c.json: instances[0]: role must be \"prefill\", \"decode\" or \"both\", got \"verify\"");
  EXPECT_EQ(
      error_of([] { parse_cluster_json(R"({"instances": [{"role": "decode"}]})", "c.json"); }),
      "c.json: instances[0]: \"ranks\" (a list of ranks) is missing");
  EXPECT_EQ(error_of([] {
              parse_cluster_json(R"({"instances": [{"role": "decode", "ranks": []}]})", "c.json");
            }),
            "c.json: instances[0]: \"ranks\" is empty");
  EXPECT_EQ(error_of([] {
              parse_cluster_json(R"({"instances": [{"role": "decode", "ranks": ["1"]}]})",
                                 "c.json");
            }),
            "c.json: instances[0].ranks: must be an integer, got \"1\"");
  EXPECT_EQ(error_of([] {
              parse_cluster_json(R"({"instances": [{"role": "decode", "tp": 1.5, "ranks": [1]}]})",
                                 "c.json");
            }),
            "c.json: instances[0].tp: must be an integer, got 1.5");
}

TEST(ClusterSpec, FileAndFlagsAreExclusive) {
  const std::string path = ::testing::TempDir() + "cluster_spec_test.json";
  {
    std::ofstream out(path);
    out << R"({"mode": "colocated", "instances": [{"role": "both", "ranks": [1, 2]}]})";
  }
  ClusterFlags flags;
  flags.file = path;
  const ClusterSpec spec = cluster_spec_from_flags(flags, 6);
  EXPECT_EQ(spec.mode, ClusterMode::kColocated);
  EXPECT_EQ(spec.instances[0].tp, 2);
  EXPECT_NO_THROW(spec.validate(3));

  flags.decode = 1;
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(flags, 6); }),
            "cluster spec: --cluster FILE and --prefill/--decode/--tp/--prefill-tp/--decode-tp/"
            "--ep/--mode are exclusive: the file names the whole layout");
  std::remove(path.c_str());

  ClusterFlags missing;
  missing.file = path;
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(missing, 6); }),
            "cannot open cluster file " + path);

  ClusterFlags plain;
  EXPECT_FALSE(plain.any());
  plain.prefill = 1;
  plain.decode = 1;
  EXPECT_TRUE(plain.any());
  const ClusterSpec from_flags = cluster_spec_from_flags(plain, 6);
  EXPECT_EQ(from_flags.mode, ClusterMode::kDisaggregated);
  EXPECT_EQ(from_flags.required_world_size(), 3);
  plain.mode = "colocated";
  EXPECT_EQ(cluster_spec_from_flags(plain, 6).instances[1].role, InstanceRole::kBoth);
}

// Counts not given fill the world: `mpirun -np 4 duet serve --mode colocated
// --tp 3` needs no arithmetic, and where the ranks do not divide, the error
// says what would run.
TEST(ClusterSpec, CountsNotGivenFillTheWorld) {
  ClusterFlags colocated;
  colocated.mode = "colocated";
  colocated.tp = 3;
  ClusterSpec spec = cluster_spec_from_flags(colocated, 4);
  ASSERT_EQ(spec.instances.size(), 1u);
  EXPECT_EQ(spec.instances[0].ranks, ranks({1, 2, 3}));
  EXPECT_NO_THROW(spec.validate(4));
  EXPECT_EQ(cluster_spec_from_flags(colocated, 7).instances.size(), 2u);
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(colocated, 6); }),
            "cluster spec: -np 6 leaves 5 instance rank(s), not a whole number of colocated "
            "instances of tp 3: run -np 4 or give --decode D");
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(colocated, 2); }),
            "cluster spec: -np 2 leaves 1 instance rank(s), not a whole number of colocated "
            "instances of tp 3: run -np 4 or give --decode D");

  // Disaggregated: one prefill instance, the rest decode (or the given count's
  // kind, the other filling).
  ClusterFlags disaggregated;
  disaggregated.tp = 1;
  spec = cluster_spec_from_flags(disaggregated, 5);
  EXPECT_EQ(spec.count(InstanceRole::kPrefill), 1);
  EXPECT_EQ(spec.count(InstanceRole::kDecode), 3);
  EXPECT_NO_THROW(spec.validate(5));
  disaggregated.decode_tp = 2;
  spec = cluster_spec_from_flags(disaggregated, 6);
  EXPECT_EQ(spec.count(InstanceRole::kDecode), 2);
  EXPECT_EQ(spec.instances[2].ranks, ranks({4, 5}));
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(disaggregated, 5); }),
            "cluster spec: -np 5 leaves 4 instance rank(s); 1 prefill instance(s) of tp 1 and "
            "decode instances of tp 2 do not fill them: give --prefill P --decode D with P x 1 "
            "+ D x 2 = 4");
  ClusterFlags decode_only;
  decode_only.decode = 1;
  spec = cluster_spec_from_flags(decode_only, 5);
  EXPECT_EQ(spec.count(InstanceRole::kPrefill), 3);
  EXPECT_EQ(spec.count(InstanceRole::kDecode), 1);
  EXPECT_EQ(error_of([&] { cluster_spec_from_flags(decode_only, 2); }),
            "cluster spec: -np 2 leaves 1 instance rank(s); some prefill instance(s) of tp 1 "
            "and decode instances of tp 1 do not fill them: give --prefill P --decode D with P "
            "x 1 + D x 1 = 1");
}

TEST(ClusterSpec, DescribeListsEveryInstance) {
  EXPECT_EQ(parse_cluster_flags(1, 1, 2, ClusterMode::kDisaggregated).describe(),
            "disaggregated mode, coordinator on rank 0, 2 instance(s)\n"
            "  instance 0 (prefill): tp 2, ranks [1, 2]\n"
            "  instance 1 (decode): tp 2, ranks [3, 4]");
}

}  // namespace
}  // namespace duet
