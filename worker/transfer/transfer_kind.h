// Which way KV goes between a prefill rank and a decode rank, chosen per pair
// from where each runs its engine (disaggregated serving): both on the CPU,
// MPI over host memory; one on a GPU, MPI, the GPU side staging its rows
// through host memory; both on one GPU, CUDA IPC (NCCL refuses two ranks on
// one GPU); two GPUs of one host, CUDA IPC (default) or NCCL; GPUs of two
// hosts, NCCL.
//
// Every rank learns every rank's placement at start (one all-gather of
// encode_placement's fixed-size records) and computes the same kinds, so
// both sides of a pair agree without asking each other. NCCL pairs get one
// two-rank communicator each, made at start in the order nccl_pairs gives
// on every rank (creating communicators is collective: one order everywhere
// cannot deadlock), never one per request.
//
// Values, no MPI and no CUDA: usable (and tested) in a single process.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/cluster/cluster_spec.h"

namespace duet {

// Where one rank runs its engine. The coordinator and CPU instances have
// device -1.
struct RankPlacement {
  std::string host;      // the host's name as MPI reports it
  int device = -1;       // -1: the CPU; else the CUDA device index this rank uses
  std::string gpu_uuid;  // the GPU's UUID; empty on the CPU. Two ranks with one
                         // UUID share a GPU, whatever CUDA_VISIBLE_DEVICES each sees

  bool on_gpu() const { return device >= 0; }
  bool operator==(const RankPlacement&) const = default;
};

enum class TransferKind {
  kMpi,        // both on the CPU
  kMpiStaged,  // one side on a GPU: MPI over its host staging copy of the KV
  kCudaIpc,    // GPUs of one host (or one GPU): device to device, CUDA IPC
  kNccl,       // GPUs of different hosts (or of one host, by choice): NCCL
};

std::string_view transfer_kind_name(TransferKind kind);  // "mpi", "mpi-staged", "cuda-ipc", "nccl"

// How two different GPUs of one host exchange KV.
enum class SameHostGpus {
  kCudaIpc,  // a copy between the GPUs (NVLink or PCIe peer access), no communicator
  kNccl,
};

// "ipc" or "nccl" (the --kv-same-host option); throws kInvalidArgument otherwise.
SameHostGpus parse_same_host_gpus(std::string_view name);

// Whether two GPU placements are one GPU: the same host and, when both know
// theirs, the same UUID, else the same device index. False when either is
// on the CPU.
bool same_gpu(const RankPlacement& a, const RankPlacement& b);

// Throws duet::Error (kUnsupported) when two ranks of `instance` (of two
// ranks or more, on GPUs) share one GPU: its tensor-parallel collectives
// run on an NCCL communicator of its ranks, and NCCL refuses two ranks on
// one device. `placements`: every world rank's, by rank.
void require_gpu_per_rank(const InstanceSpec& instance, std::span<const RankPlacement> placements);

// The kind of transfer KV takes from `prefill` to `decode` (or back: it is symmetric).
TransferKind select_transfer_kind(const RankPlacement& prefill, const RankPlacement& decode,
                                  SameHostGpus same_host = SameHostGpus::kCudaIpc);

// The (lower rank, higher rank) pairs of `spec` whose KV goes over NCCL, in
// the order every rank creates their communicators: each prefill rank of
// each prefill instance with each decode rank of each decode instance whose
// kind is kNccl, sorted, no pair twice. `placements` holds every world rank's
// placement, by rank. Empty in colocated mode (no KV moves).
std::vector<std::pair<Rank, Rank>> nccl_pairs(const ClusterSpec& spec,
                                              std::span<const RankPlacement> placements,
                                              SameHostGpus same_host = SameHostGpus::kCudaIpc);

// The fixed-size record of a placement for an all-gather. Throws
// kInvalidArgument for a host name or UUID too long for it.
inline constexpr size_t kPlacementRecordBytes = 128;
using PlacementRecord = std::array<std::byte, kPlacementRecordBytes>;
PlacementRecord encode_placement(const RankPlacement& placement);
// Throws kInvalidArgument ("rank placement: ...") for a record that is not
// one encode_placement made (bad magic, unterminated strings, bad device).
RankPlacement decode_placement(std::span<const std::byte> record);

// One line for logs: "host-a cuda:1 (GPU-5e2a...)" or "host-a cpu".
std::string describe_placement(const RankPlacement& placement);

}  // namespace duet
