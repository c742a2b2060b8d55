#include "worker/transfer/kv_link_setup.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "common/error.h"
#include "worker/model/model_forward.h"
#ifdef DUET_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "worker/transfer/cuda_ipc_kv_links.h"
#include "worker/transfer/mixed_device_kv_links.h"
#include "worker/transfer/nccl_kv_links.h"
#endif

namespace duet {
namespace {

// The rank's index among the job's ranks on its host (Open MPI says it).
int local_rank() {
  const char* value = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return value != nullptr ? std::atoi(value) : 0;
}

bool gpu_usable(int device) {
  if (device < 0) return true;
#ifdef DUET_HAVE_CUDA
  return device < static_cast<int>(cuda::list_devices().size());
#else
  return false;
#endif
}

// Every (prefill rank, decode rank) pair that may move KV.
std::vector<std::pair<Rank, Rank>> kv_pairs(const ClusterSpec& spec) {
  std::vector<std::pair<Rank, Rank>> pairs;
  if (spec.mode != ClusterMode::kDisaggregated) return pairs;
  for (const InstanceSpec& prefill : spec.instances) {
    if (prefill.role != InstanceRole::kPrefill) continue;
    for (const InstanceSpec& decode : spec.instances) {
      if (decode.role != InstanceRole::kDecode) continue;
      for (Rank p : prefill.ranks) {
        for (Rank d : decode.ranks) pairs.push_back({p, d});
      }
    }
  }
  return pairs;
}

#ifdef DUET_HAVE_CUDA
// Collective: every rank says whether it made its links (`failure` empty)
// before any waits on a peer's; every rank throws if one could not, the
// one that failed with its reason.
void agree_links_ready(const MpiRuntime& mpi, const std::string& failure, const char* kind) {
  const std::byte ready{static_cast<unsigned char>(failure.empty() ? 1 : 0)};
  const std::vector<std::byte> all = mpi.all_gather(std::span(&ready, 1));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == std::byte{1}) continue;
    throw Error(ErrorKind::kInternal,
                failure.empty() ? format("rank {} could not set up its {} KV links", r, kind)
                                : format("the {} KV links: {}", kind, failure));
  }
}

// The CUDA IPC links of this rank, its handles exchanged with every rank
// (all call this when the cluster has any IPC pair).
std::unique_ptr<DeviceKvLinks> make_ipc_links(const MpiRuntime& mpi,
                                              std::span<const RankPlacement> placements,
                                              const std::vector<std::pair<Rank, Rank>>& ipc) {
  const Rank self = mpi.rank();
  bool sends = false, receives = false;
  for (const auto& [p, d] : ipc) {
    sends = sends || p == self;
    receives = receives || d == self;
  }
  std::unique_ptr<CudaIpcKvLinks> links;
  std::vector<std::byte> mine(CudaIpcKvLinks::kExportBytes);
  std::string failure;
  if (sends || receives) {
    try {
      links = std::make_unique<CudaIpcKvLinks>(placements[static_cast<size_t>(self.value)].device,
                                               sends, receives, CudaIpcKvLinks::Options{});
      if (sends) mine = links->exported();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_links_ready(mpi, failure, "CUDA IPC");
  const std::vector<std::byte> all = mpi.all_gather(mine);
  for (const auto& [p, d] : ipc) {
    if (p == self) links->add_receiver(d.value);
    if (d == self) {
      const auto at = static_cast<size_t>(p.value) * CudaIpcKvLinks::kExportBytes;
      links->add_sender(p.value, std::span(all).subspan(at, CudaIpcKvLinks::kExportBytes));
    }
  }
  return links;
}

// The NCCL links of this rank: a two-rank communicator per pair it is in,
// joined in `pairs`' order (the same on every rank, so no rank waits in a
// cycle); the lower rank makes the id and sends it to the higher.
std::unique_ptr<DeviceKvLinks> make_nccl_links(const MpiRuntime& mpi, const ClusterSpec& spec,
                                               std::span<const RankPlacement> placements,
                                               const std::vector<std::pair<Rank, Rank>>& pairs) {
  const Rank self = mpi.rank();
  bool sends = false, receives = false;  // a prefill rank sends, a decode rank receives
  for (const InstanceSpec& instance : spec.instances) {
    for (Rank r : instance.ranks) {
      if (r != self) continue;
      sends = instance.role == InstanceRole::kPrefill;
      receives = instance.role == InstanceRole::kDecode;
    }
  }
  // The links (their staging) first, on every rank in a pair, and all agree
  // that every one has it before any rank waits on a peer in the pairing.
  std::unique_ptr<NcclKvLinks> links;
  const int device = placements[static_cast<size_t>(self.value)].device;
  const bool paired = std::any_of(pairs.begin(), pairs.end(), [&](const auto& pair) {
    return pair.first == self || pair.second == self;
  });
  std::string failure;
  if (paired) {
    try {
      links = std::make_unique<NcclKvLinks>(device, sends, receives, NcclKvLinks::Options{});
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_links_ready(mpi, failure, "NCCL");
  MPI_Comm comm = MPI_COMM_NULL;
  DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  try {
    for (const auto& [lo, hi] : pairs) {
      if (self != lo && self != hi) continue;
      std::vector<std::byte> id;
      if (self == lo) {
        id = NcclKvLinks::unique_id();
        DUET_MPI_CHECK(
            MPI_Send(id.data(), static_cast<int>(id.size()), MPI_BYTE, hi.value, 0, comm));
      } else {
        id.resize(NcclKvLinks::kUniqueIdBytes);
        DUET_MPI_CHECK(MPI_Recv(id.data(), static_cast<int>(id.size()), MPI_BYTE, lo.value, 0, comm,
                                MPI_STATUS_IGNORE));
      }
      const int in_pair = self == lo ? 0 : 1;
      void* nccl = NcclKvLinks::join(id, 2, in_pair, device);
      const int peer = self == lo ? hi.value : lo.value;
      links->add_peer(peer, nccl, 1 - in_pair);
      links->connect(peer);  // both ranks, now: the pair's connection is set up here
    }
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
  MPI_Comm_free(&comm);
  return links;
}
#endif

}  // namespace

RankPlacement own_placement(const MpiRuntime& mpi, const ClusterSpec& spec,
                            const std::string& device) {
  RankPlacement own;
  own.host = mpi.processor_name();
  if (spec.instance_of(mpi.rank()) == nullptr) return own;  // the coordinator runs no model
  own.device = parse_device(device);
#ifdef DUET_HAVE_CUDA
  const std::vector<cuda::DeviceInfo> devices = cuda::list_devices();
  if (device == "cuda" && !devices.empty())
    own.device = local_rank() % static_cast<int>(devices.size());
  if (own.device >= 0 && own.device < static_cast<int>(devices.size()))
    own.gpu_uuid = devices[static_cast<size_t>(own.device)].uuid;
#endif
  return own;
}

std::vector<RankPlacement> gather_placements(const MpiRuntime& mpi, const RankPlacement& own) {
  const PlacementRecord record = encode_placement(own);
  const std::vector<std::byte> all = mpi.all_gather(record);
  std::vector<RankPlacement> placements;
  for (int r = 0; r < mpi.world_size(); ++r) {
    placements.push_back(decode_placement(std::span(all).subspan(
        static_cast<size_t>(r) * kPlacementRecordBytes, kPlacementRecordBytes)));
  }
  return placements;
}

std::unique_ptr<DeviceKvLinks> make_device_kv_links(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                    std::span<const RankPlacement> placements,
                                                    SameHostGpus same_host) {
  DUET_ASSERT(static_cast<int>(placements.size()) == mpi.world_size());
  const Rank self = mpi.rank();
  std::vector<std::pair<Rank, Rank>> ipc;
  bool any_gpu = false;
  for (const auto& [p, d] : kv_pairs(spec)) {
    const KvLink link = select_kv_link(placements[static_cast<size_t>(p.value)],
                                       placements[static_cast<size_t>(d.value)], same_host);
    if (link == KvLink::kCudaIpc) ipc.push_back({p, d});
    any_gpu = any_gpu || link != KvLink::kMpi;
    if (self == kCoordinatorRank) {
      spdlog::info("kv link: rank {} ({}) -> rank {} ({}): {}", p.value,
                   describe_placement(placements[static_cast<size_t>(p.value)]), d.value,
                   describe_placement(placements[static_cast<size_t>(d.value)]),
                   kv_link_name(link));
    }
  }
  if (!any_gpu) return nullptr;  // every rank knows it: nobody exchanges anything
  // Every rank's GPU must answer before any rank waits on another's links.
  const std::byte usable{static_cast<unsigned char>(
      gpu_usable(placements[static_cast<size_t>(self.value)].device) ? 1 : 0)};
  const std::vector<std::byte> all_usable = mpi.all_gather(std::span(&usable, 1));
  for (std::byte u : all_usable) {
    if (u == std::byte{0}) return nullptr;  // that rank's instance reports why it cannot start
  }
#ifdef DUET_HAVE_CUDA
  std::vector<std::unique_ptr<DeviceKvLinks>> kinds;
  if (!ipc.empty()) {
    if (auto links = make_ipc_links(mpi, placements, ipc)) kinds.push_back(std::move(links));
  }
  const std::vector<std::pair<Rank, Rank>> nccl = nccl_pairs(spec, placements, same_host);
  if (!nccl.empty()) {
    if (auto links = make_nccl_links(mpi, spec, placements, nccl))
      kinds.push_back(std::move(links));
  }
  if (kinds.empty()) return nullptr;
  if (kinds.size() == 1) return std::move(kinds.front());
  return std::make_unique<MixedDeviceKvLinks>(std::move(kinds));
#else
  return nullptr;
#endif
}

}  // namespace duet
