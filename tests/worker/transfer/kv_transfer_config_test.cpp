// `duet serve`'s KV flags map to one KvTransferConfig in one place: auto
// picks TCP only for CPU instances on several hosts, TCP with GPU instances
// and values the flags do not take are refused with the flag's name.
#include "worker/transfer/kv_transfer_config.h"

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"

namespace duet {
namespace {

TEST(KvTransferConfig, AutoIsTcpForCpuInstancesOnSeveralHostsOnly) {
  EXPECT_EQ(kv_transfer_config({}, true, 1).transport, Transport::kMpi);
  EXPECT_EQ(kv_transfer_config({}, true, 2).transport, Transport::kTcp);
  EXPECT_EQ(kv_transfer_config({}, false, 2).transport, Transport::kMpi);
  EXPECT_EQ(kv_transfer_config({.transport = "mpi"}, true, 3).transport, Transport::kMpi);
  EXPECT_EQ(kv_transfer_config({.transport = "tcp"}, true, 1).transport, Transport::kTcp);
}

TEST(KvTransferConfig, TheOtherFlagsMapOneToOne) {
  const KvTransferConfig defaults = kv_transfer_config({}, true, 1);
  EXPECT_TRUE(defaults.cma);
  EXPECT_EQ(defaults.same_host, SameHostGpus::kCudaIpc);
  EXPECT_FALSE(defaults.checksums);
  const KvTransferConfig set =
      kv_transfer_config({.cma = "off", .same_host = "nccl", .checksums = true}, false, 1);
  EXPECT_FALSE(set.cma);
  EXPECT_EQ(set.same_host, SameHostGpus::kNccl);
  EXPECT_TRUE(set.checksums);
}

TEST(KvTransferConfig, RefusesTcpOnGpusAndUnknownValues) {
  try {
    kv_transfer_config({.transport = "tcp"}, false, 1);
    FAIL() << "tcp with GPU instances was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("--kv-transport tcp"), std::string::npos) << e.what();
  }
  for (const KvTransferFlags& bad : {KvTransferFlags{.transport = "carrier-pigeon"},
                                     KvTransferFlags{.cma = "on"},
                                     KvTransferFlags{.same_host = "pcie"}}) {
    EXPECT_THROW(kv_transfer_config(bad, true, 1), Error);
  }
}

TEST(Transport, NamesAndParsesAsTheFlagsDo) {
  EXPECT_EQ(transport_name(Transport::kMpi), "mpi");
  EXPECT_EQ(transport_name(Transport::kTcp), "tcp");
  EXPECT_EQ(parse_transport("auto", Transport::kTcp), Transport::kTcp);
  EXPECT_EQ(parse_transport("mpi", Transport::kTcp), Transport::kMpi);
  EXPECT_THROW(parse_transport("udp", Transport::kMpi), Error);
}

}  // namespace
}  // namespace duet
