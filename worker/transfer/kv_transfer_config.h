// How KV moves between a cluster's instances: one configuration, made from
// `duet serve`'s flags in one place (kv_transfer_config), and one factory
// that makes each rank's transfer from it (make_kv_transfer). Which way KV
// goes between two particular ranks (host memory, CMA, CUDA IPC, NCCL) then
// follows from where they run (worker/transfer/transfer_kind.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/transport.h"
#include "common/control_plane/control_channel.h"
#include "common/control_plane/mpi_runtime.h"
#include "worker/transfer/kv_transfer_adapter.h"
#include "worker/transfer/transfer_kind.h"

namespace duet {

// The flags, as `duet serve` takes them.
struct KvTransferFlags {
  std::string transport = "auto";  // --kv-transport: auto, mpi, tcp
  std::string cma = "auto";        // --kv-cma: auto, off
  std::string same_host = "ipc";   // --kv-same-host: ipc, nccl
  bool checksums = false;          // --kv-checksums
};

struct KvTransferConfig {
  Transport transport = Transport::kMpi;
  // Over MPI between ranks of one host, the decode rank reads each payload
  // out of the prefill rank's memory (cross-memory attach) where the kernel
  // allows it.
  bool cma = true;
  SameHostGpus same_host = SameHostGpus::kCudaIpc;  // two GPUs of one host
  // Every rows message checksummed by its sender and verified on arrival.
  bool checksums = false;
  // Tests only: this rank never sends the rows nor the handoff of this
  // request (0: none), so its import fails at its deadline.
  uint64_t drop_rows_of = 0;
};

// The configuration the flags give for instances on the CPU (`on_cpu`) or on
// GPUs, with ranks on `n_hosts` hosts: auto is TCP when the ranks span hosts
// and run on CPUs, else MPI. Throws kInvalidArgument for a value the flags do
// not take, kUnsupported for TCP with GPU instances.
KvTransferConfig kv_transfer_config(const KvTransferFlags& flags, bool on_cpu, size_t n_hosts);

// This rank's KV transfer: TCP (null on a rank that moves no KV) or MPI on
// `channel`, with the device transfer of its GPU pairs. Collective over
// MPI_COMM_WORLD: every rank calls it, in the same place, once.
std::unique_ptr<KvTransferAdapter> make_kv_transfer(const KvTransferConfig& config,
                                                    const MpiRuntime& mpi, ControlChannel& channel,
                                                    const ClusterSpec& spec,
                                                    std::span<const RankPlacement> placements);

}  // namespace duet
