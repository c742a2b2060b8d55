#include "worker/transfer/kv_transfer_config.h"

#include "common/error.h"
#include "worker/transfer/mpi_kv_transfer.h"
#include "worker/transfer/tcp_kv_transfer.h"
#include "worker/transfer/transfer_setup.h"

namespace duet {

KvTransferConfig kv_transfer_config(const KvTransferFlags& flags, bool on_cpu, size_t n_hosts) {
  KvTransferConfig config;
  config.transport =
      parse_transport(flags.transport, n_hosts > 1 && on_cpu ? Transport::kTcp : Transport::kMpi);
  if (config.transport == Transport::kTcp && !on_cpu) {
    throw Error(ErrorKind::kUnsupported,
                "--kv-transport tcp moves KV between CPU instances only, not GPU ones "
                "(use mpi, or auto)");
  }
  DUET_REQUIRE(flags.cma == "auto" || flags.cma == "off", "--kv-cma is auto or off, not '{}'",
               flags.cma);
  config.cma = flags.cma == "auto";
  config.same_host = parse_same_host_gpus(flags.same_host);
  config.checksums = flags.checksums;
  return config;
}

std::unique_ptr<KvTransferAdapter> make_kv_transfer(const KvTransferConfig& config,
                                                    const MpiRuntime& mpi, ControlChannel& channel,
                                                    const ClusterSpec& spec,
                                                    std::span<const RankPlacement> placements) {
  if (config.transport == Transport::kTcp) {
    return make_tcp_kv_transfer(mpi, spec, placements,
                                TcpKvTransferOptions{config.checksums, config.drop_rows_of});
  }
  MpiKvTransferOptions options{config.checksums, config.drop_rows_of};
  if (!config.cma) options.cma_staging_bytes = 0;
  return std::make_unique<MpiKvTransfer>(
      channel, options, make_device_kv_link(mpi, spec, placements, config.same_host));
}

}  // namespace duet
