// `mpirun -np 2 duet profile`: the two ranks time the KV transfers (MPI and
// TCP) and the all-reduce, and rank 0 writes them into the profile.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "sim/profile.h"
#include "tests/test_paths.h"

namespace duet::sim {
namespace {

TEST(ProfileCommandUnderMpirun, MeasuresTransfersAndAllReduce) {
  const auto out = std::filesystem::temp_directory_path() /
                   ("duet-profile-mpi-" + std::to_string(::getpid()) + ".json");
  const std::string model = testing::fixture_path("fixtures/tiny/tiny_q4_1_gqa_tied.gguf").string();
  const std::string command = std::string(DUET_MPIRUN) + " -np 2 " + DUET_BINARY +
                              " profile --model " + model +
                              " --threads 1 --budget 1 --step-tokens 32 --max-running 8 "
                              "--kv-cache-mem 1MiB --out " +
                              out.string() + " >/dev/null 2>&1 </dev/null";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command;
  const Profile profile = read_profile(out);
  std::filesystem::remove(out);
  ASSERT_EQ(profile.transfers.size(), 2u);
  EXPECT_EQ(profile.transfers[0].path, "mpi-shm");
  EXPECT_EQ(profile.transfers[1].path, "tcp");
  for (const TransferProfile& t : profile.transfers) {
    EXPECT_FALSE(t.samples.empty());
    EXPECT_GT(t.cost.bytes_per_s, 0);
  }
  ASSERT_EQ(profile.collectives.size(), 1u);
  EXPECT_EQ(profile.collectives[0].op, "all_reduce");
  EXPECT_EQ(profile.collectives[0].ranks, 2);
  EXPECT_EQ(profile.collectives[0].samples.size(), 10u * 5u);
}

}  // namespace
}  // namespace duet::sim
