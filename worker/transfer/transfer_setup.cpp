#include "worker/transfer/transfer_setup.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "common/error.h"
#include "common/net/tcp_connect.h"
#include "worker/model/model_forward.h"
#ifdef DUET_HAVE_CUDA
#include "kernels/cuda/device.h"
#include "worker/transfer/device/cuda_ipc_kv_link.h"
#include "worker/transfer/device/mixed_device_kv_link.h"
#include "worker/transfer/device/nccl_kv_link.h"
#endif

namespace duet {
namespace {

#ifdef DUET_HAVE_CUDA
// The rank's index among the job's ranks on its host (Open MPI says it).
int local_rank() {
  const char* value = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  return value != nullptr ? std::atoi(value) : 0;
}
#endif

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

// Collective: every rank says whether it made its device transfer (`failure` empty)
// before any waits on a peer's; every rank throws if one could not, the
// one that failed with its reason.
void agree_transfer_ready(const MpiRuntime& mpi, const std::string& failure, const char* kind) {
  const std::byte ready{static_cast<unsigned char>(failure.empty() ? 1 : 0)};
  const std::vector<std::byte> all = mpi.all_gather(std::span(&ready, 1));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == std::byte{1}) continue;
    throw Error(ErrorKind::kInternal,
                failure.empty() ? format("rank {} could not set up its {} KV transfers", r, kind)
                                : format("the {} KV transfers: {}", kind, failure));
  }
}

#ifdef DUET_HAVE_CUDA
// The CUDA IPC transfer of this rank, its handles exchanged with every rank
// (all call this when the cluster has any IPC pair).
std::unique_ptr<DeviceKvLink> make_cuda_ipc_transfer(
    const MpiRuntime& mpi, std::span<const RankPlacement> placements,
    const std::vector<std::pair<Rank, Rank>>& ipc) {
  const Rank self = mpi.rank();
  bool sends = false, receives = false;
  for (const auto& [p, d] : ipc) {
    sends = sends || p == self;
    receives = receives || d == self;
  }
  std::unique_ptr<CudaIpcKvLink> transfer;
  std::vector<std::byte> mine(CudaIpcKvLink::kExportBytes);
  std::string failure;
  if (sends || receives) {
    try {
      transfer = std::make_unique<CudaIpcKvLink>(placements[static_cast<size_t>(self.value)].device,
                                                 sends, receives, CudaIpcKvLink::Options{});
      if (sends) mine = transfer->exported();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_transfer_ready(mpi, failure, "CUDA IPC");
  const std::vector<std::byte> all = mpi.all_gather(mine);
  for (const auto& [p, d] : ipc) {
    if (p == self) transfer->add_receiver(d.value);
    if (d == self) {
      const auto at = static_cast<size_t>(p.value) * CudaIpcKvLink::kExportBytes;
      transfer->add_sender(p.value, std::span(all).subspan(at, CudaIpcKvLink::kExportBytes));
    }
  }
  return transfer;
}

// The NCCL transfer of this rank: a two-rank communicator per pair it is in,
// joined in `pairs`' order (the same on every rank, so no rank waits in a
// cycle); the lower rank makes the id and sends it to the higher.
std::unique_ptr<DeviceKvLink> make_nccl_transfer(const MpiRuntime& mpi, const ClusterSpec& spec,
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
  // The device transfer (its staging) first, on every rank in a pair, and all agree
  // that every one has it before any rank waits on a peer in the pairing.
  std::unique_ptr<NcclKvLink> transfer;
  const int device = placements[static_cast<size_t>(self.value)].device;
  const bool paired = std::any_of(pairs.begin(), pairs.end(), [&](const auto& pair) {
    return pair.first == self || pair.second == self;
  });
  std::string failure;
  if (paired) {
    try {
      transfer = std::make_unique<NcclKvLink>(device, sends, receives, NcclKvLink::Options{});
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_transfer_ready(mpi, failure, "NCCL");
  MPI_Comm comm = MPI_COMM_NULL;
  DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm));
  try {
    for (const auto& [lo, hi] : pairs) {
      if (self != lo && self != hi) continue;
      std::vector<std::byte> id;
      if (self == lo) {
        id = NcclKvLink::unique_id();
        DUET_MPI_CHECK(
            MPI_Send(id.data(), static_cast<int>(id.size()), MPI_BYTE, hi.value, 0, comm));
      } else {
        id.resize(NcclKvLink::kUniqueIdBytes);
        DUET_MPI_CHECK(MPI_Recv(id.data(), static_cast<int>(id.size()), MPI_BYTE, lo.value, 0, comm,
                                MPI_STATUS_IGNORE));
      }
      const int in_pair = self == lo ? 0 : 1;
      void* nccl = NcclKvLink::join(id, 2, in_pair, device);
      const int peer = self == lo ? hi.value : lo.value;
      transfer->add_peer(peer, nccl, 1 - in_pair);
      transfer->connect(peer);  // both ranks, now: the pair's connection is set up here
    }
  } catch (...) {
    MPI_Comm_free(&comm);
    throw;
  }
  MPI_Comm_free(&comm);
  return transfer;
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

std::unique_ptr<DeviceKvLink> make_device_kv_link(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                  std::span<const RankPlacement> placements,
                                                  SameHostGpus same_host) {
  DUET_ASSERT(static_cast<int>(placements.size()) == mpi.world_size());
  const Rank self = mpi.rank();
  std::vector<std::pair<Rank, Rank>> ipc;
  bool any_gpu = false;
  for (const auto& [p, d] : kv_pairs(spec)) {
    const TransferKind kind =
        select_transfer_kind(placements[static_cast<size_t>(p.value)],
                             placements[static_cast<size_t>(d.value)], same_host);
    if (kind == TransferKind::kCudaIpc) ipc.push_back({p, d});
    any_gpu = any_gpu || kind != TransferKind::kMpi;
    if (self == kCoordinatorRank) {
      spdlog::info("kv transfer: rank {} ({}) -> rank {} ({}): {}", p.value,
                   describe_placement(placements[static_cast<size_t>(p.value)]), d.value,
                   describe_placement(placements[static_cast<size_t>(d.value)]),
                   transfer_kind_name(kind));
    }
  }
  if (!any_gpu) return nullptr;  // every rank knows it: nobody exchanges anything
  // Every rank's GPU must answer before any rank waits on another's transfer.
  const std::byte usable{static_cast<unsigned char>(
      gpu_usable(placements[static_cast<size_t>(self.value)].device) ? 1 : 0)};
  const std::vector<std::byte> all_usable = mpi.all_gather(std::span(&usable, 1));
  for (std::byte u : all_usable) {
    if (u == std::byte{0}) return nullptr;  // that rank's instance reports why it cannot start
  }
#ifdef DUET_HAVE_CUDA
  std::vector<std::unique_ptr<DeviceKvLink>> kinds;
  if (!ipc.empty()) {
    if (auto transfer = make_cuda_ipc_transfer(mpi, placements, ipc))
      kinds.push_back(std::move(transfer));
  }
  const std::vector<std::pair<Rank, Rank>> nccl = nccl_pairs(spec, placements, same_host);
  if (!nccl.empty()) {
    if (auto transfer = make_nccl_transfer(mpi, spec, placements, nccl))
      kinds.push_back(std::move(transfer));
  }
  if (kinds.empty()) return nullptr;
  if (kinds.size() == 1) return std::move(kinds.front());
  return std::make_unique<MixedDeviceKvLink>(std::move(kinds));
#else
  return nullptr;
#endif
}

std::unique_ptr<TcpKvTransfer> make_tcp_kv_transfer(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                    std::span<const RankPlacement> placements,
                                                    TcpKvTransferOptions options) {
  const Rank self = mpi.rank();
  std::vector<int> peers;  // the ranks this one exchanges KV with
  for (const auto& [p, d] : kv_pairs(spec)) {
    if (p == self) peers.push_back(d.value);
    if (d == self) peers.push_back(p.value);
  }
  return make_tcp_kv_transfer(mpi, peers, placements, options);
}

std::unique_ptr<TcpKvTransfer> make_tcp_kv_transfer(const MpiRuntime& mpi,
                                                    std::span<const int> peers,
                                                    std::span<const RankPlacement> placements,
                                                    TcpKvTransferOptions options) {
  // How long every pair has to connect (the ranks are all up: they passed
  // the all-gather).
  constexpr auto kConnectTimeout = std::chrono::seconds(60);
  const Rank self = mpi.rank();
  std::optional<TcpListener> listener;
  std::string failure;
  if (!peers.empty()) {
    try {
      listener.emplace();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_transfer_ready(mpi, failure, "TCP");
  const TcpAddress own = listener ? listener->address() : TcpAddress{};
  const std::vector<std::byte> all = mpi.all_gather(own.encode());
  std::map<int, int> sockets;
  if (!peers.empty()) {
    std::vector<TcpPeer> to;
    for (int rank : peers) {
      const auto at = static_cast<size_t>(rank) * TcpAddress::kRecordBytes;
      // The lower rank of each pair dials the higher.
      to.push_back({rank, TcpAddress::decode(std::span(all).subspan(at, TcpAddress::kRecordBytes)),
                    placements[static_cast<size_t>(rank)].host ==
                        placements[static_cast<size_t>(self.value)].host,
                    rank > self.value});
    }
    try {
      sockets = connect_tcp_peers(self.value, &*listener, to, kKvPurpose,
                                  std::chrono::steady_clock::now() + kConnectTimeout);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree_transfer_ready(mpi, failure, "TCP");
  if (peers.empty()) return nullptr;
  return std::make_unique<TcpKvTransfer>(self.value, std::move(sockets), options);
}

}  // namespace duet
