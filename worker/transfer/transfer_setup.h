// Start-up of a cluster's KV transfers: where every rank runs (one all-gather of
// placements), and the device transfer of the GPU pairs (worker/transfer/transfer_kind.h):
// CUDA IPC handles exchanged with one more all-gather, one NCCL
// communicator per NCCL pair, made in the same order on every rank. Both
// functions are collective over MPI_COMM_WORLD: every rank calls them, in
// the same place, once.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/mpi_runtime.h"
#include "worker/transfer/device/device_kv_link.h"
#include "worker/transfer/tcp_kv_transfer.h"
#include "worker/transfer/transfer_kind.h"

namespace duet {

// This rank's placement: its host, and for an instance rank the device of
// `device` ("cpu", "cuda:N", or "cuda": the GPU of the rank's index among the
// job's ranks on its host, modulo the host's GPUs), with its UUID. Nothing
// is checked here (an instance refuses a missing GPU when it loads).
RankPlacement own_placement(const MpiRuntime& mpi, const ClusterSpec& spec,
                            const std::string& device);

// Every rank's placement, by rank.
std::vector<RankPlacement> gather_placements(const MpiRuntime& mpi, const RankPlacement& own);

// The device transfer for this rank's GPU pairs, or null when it has none (or
// when any rank's GPU is unusable: its instance then refuses to start, and
// no rank waits on it here). Logs every pair's transfer kind on the coordinator.
std::unique_ptr<DeviceKvLink> make_device_kv_link(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                  std::span<const RankPlacement> placements,
                                                  SameHostGpus same_host);

// The KV transfer over TCP of every rank that may exchange KV (a prefill
// rank or a decode rank of a disaggregated cluster), null for the others:
// those listen, every rank all-gathers the listeners' addresses, the pairs
// connect (common/net/tcp_connect.h) and all agree they did before
// any goes on. Collective over MPI_COMM_WORLD; throws on every rank alike
// when a pair could not connect.
std::unique_ptr<TcpKvTransfer> make_tcp_kv_transfer(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                    std::span<const RankPlacement> placements,
                                                    TcpKvTransferOptions options);
// The same for explicit pairs: this rank's `peers` (empty: none; the pairs
// must agree on both sides).
std::unique_ptr<TcpKvTransfer> make_tcp_kv_transfer(const MpiRuntime& mpi,
                                                    std::span<const int> peers,
                                                    std::span<const RankPlacement> placements,
                                                    TcpKvTransferOptions options);

}  // namespace duet
