// Outside mpirun, MPI is never initialized: MpiRuntime refuses with a clear
// message before touching MPI (a singleton init would fork a daemon).
#include "common/control_plane/mpi_runtime.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "common/error.h"

namespace duet {
namespace {

TEST(MpiRuntime, RefusesOutsideMpirunWithoutInitializingMpi) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) unsetenv(name);
  EXPECT_FALSE(launched_by_mpirun());
  try {
    MpiRuntime mpi;
    FAIL() << "MpiRuntime started outside mpirun";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("was not started by mpirun"), std::string::npos)
        << e.what();
  }
  int initialized = 1;
  ASSERT_EQ(MPI_Initialized(&initialized), MPI_SUCCESS);
  EXPECT_EQ(initialized, 0);
}

TEST(MpiRuntime, DetectsTheLaunchersEnvironment) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMIX_RANK");
    unsetenv("PMI_RANK");
    setenv(name, "1", 1);
    EXPECT_TRUE(launched_by_mpirun()) << name;
    unsetenv(name);
  }
}

}  // namespace
}  // namespace duet
