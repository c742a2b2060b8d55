#include "common/control_plane/mpi_runtime.h"

#include <fmt/format.h>

#include <cstdlib>

#include "common/error.h"

namespace duet {
namespace {

std::string_view thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown thread level";
}

}  // namespace

bool launched_by_mpirun() {
  // Open MPI's mpirun sets OMPI_COMM_WORLD_SIZE; PMIx and PMI launchers
  // (srun, Hydra) set PMIX_RANK or PMI_RANK.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

void throw_mpi_error(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    fmt::format_to_n(text, sizeof(text) - 1, "MPI error code {}", code);
  }
  throw Error(ErrorKind::kInternal, fmt::format("{} failed at {}:{}: {}", call, file, line, text));
}

MpiRuntime::MpiRuntime() {
  DUET_REQUIRE(launched_by_mpirun(),
               "this run needs MPI but was not started by mpirun: start it as "
               "`mpirun -np N duet ...`, or leave out the cluster flags to run in one process");
  int initialized = 0;
  DUET_MPI_CHECK(MPI_Initialized(&initialized));
  DUET_ASSERT(!initialized, "MPI is already initialized: one MpiRuntime per process");

  int provided = MPI_THREAD_SINGLE;
  DUET_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    throw Error(ErrorKind::kUnsupported,
                fmt::format("the MPI library provides only {}; Duet needs MPI_THREAD_MULTIPLE "
                            "(an MPI built without thread support?)",
                            thread_level_name(provided)));
  }
  // Errors come back as codes (checked by DUET_MPI_CHECK) instead of aborting
  // the job; communicators duplicated from the world inherit this.
  DUET_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  DUET_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_.value));
  DUET_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_));
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  DUET_MPI_CHECK(MPI_Get_processor_name(name, &length));
  processor_name_.assign(name, static_cast<size_t>(length));
}

MpiRuntime::~MpiRuntime() {
  if (!leave_without_finalize_) MPI_Finalize();
}

std::vector<std::byte> MpiRuntime::all_gather(std::span<const std::byte> mine) const {
  std::vector<std::byte> all(mine.size() * static_cast<size_t>(world_size_));
  DUET_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(),
                               static_cast<int>(mine.size()), MPI_BYTE, MPI_COMM_WORLD));
  return all;
}

}  // namespace duet
