// The choice of device transfer per pair of ranks (worker/transfer/transfer_kind.h): every case of
// where two ranks run, the NCCL pairs of whole clusters, and the placement
// record every rank all-gathers at start.
#include "worker/transfer/transfer_kind.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

RankPlacement cpu(const std::string& host) { return {host, -1, ""}; }
RankPlacement gpu(const std::string& host, int device, const std::string& uuid) {
  return {host, device, uuid};
}

TEST(TransferKind, BothOnTheCpuIsMpi) {
  EXPECT_EQ(select_transfer_kind(cpu("a"), cpu("a")), TransferKind::kMpi);
  EXPECT_EQ(select_transfer_kind(cpu("a"), cpu("b")), TransferKind::kMpi);
}

TEST(TransferKind, OneSideOnTheCpuIsStagedMpi) {
  EXPECT_EQ(select_transfer_kind(cpu("a"), gpu("a", 0, "GPU-0")), TransferKind::kMpiStaged);
  EXPECT_EQ(select_transfer_kind(gpu("a", 0, "GPU-0"), cpu("b")), TransferKind::kMpiStaged);
}

TEST(TransferKind, OneGpuIsIpcEvenWhenNcclIsPreferred) {
  // Two ranks with one UUID share a GPU, even under different device indices
  // (each sees its own CUDA_VISIBLE_DEVICES).
  const RankPlacement p = gpu("a", 0, "GPU-aa"), d = gpu("a", 1, "GPU-aa");
  EXPECT_EQ(select_transfer_kind(p, d), TransferKind::kCudaIpc);
  EXPECT_EQ(select_transfer_kind(p, d, SameHostGpus::kNccl), TransferKind::kCudaIpc);
  // Without UUIDs, the device index decides.
  EXPECT_EQ(select_transfer_kind(gpu("a", 0, ""), gpu("a", 0, ""), SameHostGpus::kNccl),
            TransferKind::kCudaIpc);
}

TEST(TransferKind, TwoGpusOfOneHostFollowThePolicy) {
  const RankPlacement p = gpu("a", 0, "GPU-aa"), d = gpu("a", 1, "GPU-bb");
  EXPECT_EQ(select_transfer_kind(p, d), TransferKind::kCudaIpc);
  EXPECT_EQ(select_transfer_kind(p, d, SameHostGpus::kNccl), TransferKind::kNccl);
}

TEST(TransferKind, GpusOfTwoHostsAreNccl) {
  // Equal device indices and even equal UUID strings on two hosts are two GPUs.
  EXPECT_EQ(select_transfer_kind(gpu("a", 0, "GPU-aa"), gpu("b", 0, "GPU-bb")),
            TransferKind::kNccl);
  EXPECT_EQ(select_transfer_kind(gpu("a", 0, ""), gpu("b", 0, "")), TransferKind::kNccl);
}

TEST(TransferKind, IsSymmetric) {
  const std::vector<RankPlacement> all = {cpu("a"),          cpu("b"),          gpu("a", 0, "G0"),
                                          gpu("a", 1, "G1"), gpu("b", 0, "G2"), gpu("a", 0, "G0"),
                                          gpu("a", 0, ""),   gpu("a", 1, "")};
  for (const auto& x : all) {
    for (const auto& y : all) {
      for (SameHostGpus policy : {SameHostGpus::kCudaIpc, SameHostGpus::kNccl})
        EXPECT_EQ(select_transfer_kind(x, y, policy), select_transfer_kind(y, x, policy));
    }
  }
}

TEST(TransferKind, NamesAndPolicyOption) {
  EXPECT_EQ(transfer_kind_name(TransferKind::kMpi), "mpi");
  EXPECT_EQ(transfer_kind_name(TransferKind::kMpiStaged), "mpi-staged");
  EXPECT_EQ(transfer_kind_name(TransferKind::kCudaIpc), "cuda-ipc");
  EXPECT_EQ(transfer_kind_name(TransferKind::kNccl), "nccl");
  EXPECT_EQ(parse_same_host_gpus("ipc"), SameHostGpus::kCudaIpc);
  EXPECT_EQ(parse_same_host_gpus("nccl"), SameHostGpus::kNccl);
  EXPECT_THROW(parse_same_host_gpus("shm"), Error);
}

// 1 prefill (TP 2 on ranks 1, 2) and 2 decode instances (ranks 3 and 4).
ClusterSpec two_by_two() { return parse_cluster_flags(1, 2, 2, 1, ClusterMode::kDisaggregated); }

TEST(TransferKindPairs, GpusOnTwoHostsPairEveryPrefillRankWithEveryDecodeRank) {
  const ClusterSpec spec = two_by_two();
  spec.validate(5);
  const std::vector<RankPlacement> placements = {cpu("a"), gpu("a", 0, "G0"), gpu("a", 1, "G1"),
                                                 gpu("b", 0, "G2"), gpu("b", 1, "G3")};
  const auto pairs = nccl_pairs(spec, placements);
  const std::vector<std::pair<Rank, Rank>> want = {
      {Rank{1}, Rank{3}}, {Rank{1}, Rank{4}}, {Rank{2}, Rank{3}}, {Rank{2}, Rank{4}}};
  EXPECT_EQ(pairs, want);
}

TEST(TransferKindPairs, OnlyTheNcclPairsOfAMixedCluster) {
  const ClusterSpec spec = two_by_two();
  // Rank 3 on the prefill ranks' host (IPC by default), rank 4 on the CPU.
  const std::vector<RankPlacement> placements = {cpu("a"), gpu("a", 0, "G0"), gpu("a", 1, "G1"),
                                                 gpu("a", 2, "G2"), cpu("b")};
  EXPECT_TRUE(nccl_pairs(spec, placements).empty());
  const auto pairs = nccl_pairs(spec, placements, SameHostGpus::kNccl);
  const std::vector<std::pair<Rank, Rank>> want = {{Rank{1}, Rank{3}}, {Rank{2}, Rank{3}}};
  EXPECT_EQ(pairs, want);
}

TEST(TransferKindPairs, ColocatedMovesNoKv) {
  const ClusterSpec spec = parse_cluster_flags(1, 1, 1, ClusterMode::kColocated);
  const std::vector<RankPlacement> placements = {cpu("a"), gpu("a", 0, "G0"), gpu("b", 0, "G1")};
  EXPECT_TRUE(nccl_pairs(spec, placements).empty());
}

TEST(TransferKindPairs, APlacementTableTooShortIsRefused) {
  const ClusterSpec spec = two_by_two();
  const std::vector<RankPlacement> placements = {cpu("a"), gpu("a", 0, "G0")};
  EXPECT_THROW(nccl_pairs(spec, placements), Error);
}

// A tensor-parallel instance's NCCL communicator needs one GPU per rank.
InstanceSpec tp_instance(std::vector<int> ranks) {
  InstanceSpec instance;
  instance.id = 1;
  instance.tp = static_cast<int>(ranks.size());
  for (int r : ranks) instance.ranks.push_back(Rank{r});
  return instance;
}

TEST(GpuPerRank, DistinctGpusAndCpuRanksPass) {
  const std::vector<RankPlacement> placements = {
      cpu("a"), gpu("a", 0, "G0"), gpu("a", 1, "G1"), gpu("b", 0, "G2"), cpu("a"), cpu("a")};
  EXPECT_NO_THROW(require_gpu_per_rank(tp_instance({1, 2, 3}), placements));
  EXPECT_NO_THROW(require_gpu_per_rank(tp_instance({4, 5}), placements));  // the CPU
  EXPECT_NO_THROW(require_gpu_per_rank(tp_instance({1}), placements));
}

TEST(GpuPerRank, TwoRanksOnOneGpuAreRefusedByName) {
  // Ranks 1 and 3 see one GPU under different indices (CUDA_VISIBLE_DEVICES).
  const std::vector<RankPlacement> placements = {cpu("a"), gpu("a", 0, "G0"), gpu("a", 1, "G1"),
                                                 gpu("a", 2, "G0")};
  try {
    require_gpu_per_rank(tp_instance({1, 2, 3}), placements);
    FAIL() << "two ranks on GPU G0 passed";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    const std::string what = e.what();
    EXPECT_NE(what.find("ranks 1 and 3"), std::string::npos) << what;
    EXPECT_NE(what.find("one GPU per rank"), std::string::npos) << what;
  }
  // Without UUIDs the device index decides, on one host only.
  const std::vector<RankPlacement> bare = {cpu("a"), gpu("a", 0, ""), gpu("a", 0, ""),
                                           gpu("b", 0, "")};
  EXPECT_THROW(require_gpu_per_rank(tp_instance({1, 2}), bare), Error);
  EXPECT_NO_THROW(require_gpu_per_rank(tp_instance({2, 3}), bare));
}

TEST(GpuPerRank, SameGpuNeedsOneHostAndTwoGpuSides) {
  EXPECT_TRUE(same_gpu(gpu("a", 0, "G0"), gpu("a", 3, "G0")));
  EXPECT_FALSE(same_gpu(gpu("a", 0, "G0"), gpu("a", 0, "G1")));
  EXPECT_FALSE(same_gpu(gpu("a", 0, ""), gpu("b", 0, "")));
  EXPECT_FALSE(same_gpu(cpu("a"), cpu("a")));
  EXPECT_FALSE(same_gpu(cpu("a"), gpu("a", 0, "G0")));
}

TEST(PlacementRecord, RoundTrips) {
  for (const RankPlacement& p :
       {cpu("node-17.cluster"), gpu("h", 3, "GPU-5e2a1c3d-0f4b-7a6e-9c8d-112233445566"), cpu(""),
        gpu(std::string(63, 'x'), 0, "")}) {
    const PlacementRecord record = encode_placement(p);
    EXPECT_EQ(decode_placement(record), p) << describe_placement(p);
  }
}

TEST(PlacementRecord, RefusesWhatDoesNotFitOrIsNotARecord) {
  EXPECT_THROW(encode_placement(cpu(std::string(64, 'x'))), Error);
  EXPECT_THROW(encode_placement(gpu("h", 0, std::string(56, 'u'))), Error);
  EXPECT_THROW(encode_placement(cpu(std::string("a\0b", 3))), Error);
  PlacementRecord record = encode_placement(gpu("h", 1, "G"));
  PlacementRecord bad = record;
  bad[0] = std::byte{0};
  EXPECT_THROW(decode_placement(bad), Error);
  bad = record;
  for (size_t i = 8; i < 72; ++i) bad[i] = std::byte{'x'};  // no terminator in the host name
  EXPECT_THROW(decode_placement(bad), Error);
  EXPECT_THROW(decode_placement(std::span<const std::byte>(record).first(64)), Error);
  record = encode_placement(cpu("h"));
  record[72] = std::byte{'G'};  // a UUID on the CPU
  EXPECT_THROW(decode_placement(record), Error);
}

TEST(PlacementRecord, Describes) {
  EXPECT_EQ(describe_placement(cpu("a")), "a cpu");
  EXPECT_EQ(describe_placement(gpu("a", 1, "GPU-1")), "a cuda:1 (GPU-1)");
}

}  // namespace
}  // namespace duet
