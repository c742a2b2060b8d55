// MPI for one process of a Duet job: initialization, the world, error checks.
//
// MPI is initialized only in processes that mpirun started: a single-process
// run (`duet generate`, `duet serve` without cluster flags, every unit test)
// never constructs an MpiRuntime, and the constructor refuses to initialize
// outside mpirun, because Open MPI's singleton init forks a daemon.
//
// Thread level: MPI_THREAD_MULTIPLE, checked. The control channel's
// communication thread, a KV transfer and TP collectives may all call MPI
// from their own threads, each on its own communicator.
//
// Every MPI call of Duet goes through DUET_MPI_CHECK: MPI_COMM_WORLD (and so
// every communicator duplicated from it) returns errors instead of aborting,
// and the check turns them into duet::Error naming the call, file and line.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"

namespace duet {

// Whether mpirun (or another PMI/PMIx launcher) started this process; reads
// the environment only, never calls MPI.
bool launched_by_mpirun();

// Throws duet::Error (kInternal) for a failed MPI call: "MPI_Isend failed at
// file:line: <MPI's error string>".
void throw_mpi_error(int code, const char* call, const char* file, int line);

// Owns MPI for the process: MPI_Init_thread in the constructor, MPI_Finalize
// in the destructor. One per process (MPI can be initialized once), made in
// main() and passed by reference to what needs it. Construct and destroy it on
// the main thread, after every thread that uses MPI has been joined.
class MpiRuntime final {
 public:
  // Throws duet::Error: kInvalidArgument when not started by mpirun (MPI is
  // then left alone), kUnsupported when the library cannot give
  // MPI_THREAD_MULTIPLE (after finalizing, so the process can exit cleanly).
  MpiRuntime();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  Rank rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // The host name MPI reports for this rank (logs, and which ranks share a host).
  const std::string& processor_name() const { return processor_name_; }

  // After a rank of the job was lost: MPI_Finalize waits on every rank and
  // may never return (tests/mpi/failure_probe_main.cpp), so the destructor
  // leaves MPI as it is and the process exits without it. Any thread.
  void leave_without_finalize() { leave_without_finalize_ = true; }

  // Every rank's `mine` (the same size on all), in rank order: a collective
  // over MPI_COMM_WORLD, for start-up exchanges (placements, handles).
  std::vector<std::byte> all_gather(std::span<const std::byte> mine) const;

 private:
  Rank rank_;
  int world_size_ = 0;
  std::string processor_name_;
  std::atomic<bool> leave_without_finalize_{false};
};

}  // namespace duet

// Checks an MPI call's return code: `DUET_MPI_CHECK(MPI_Barrier(comm));`.
#define DUET_MPI_CHECK(call)                                              \
  do {                                                                    \
    const int duet_mpi_code_ = (call);                                    \
    if (duet_mpi_code_ != MPI_SUCCESS) [[unlikely]]                       \
      ::duet::throw_mpi_error(duet_mpi_code_, #call, __FILE__, __LINE__); \
  } while (0)
