// `duet profile`: the profile of the cluster simulator's cost model
// (sim/profile.h), written as JSON, in one of two ways:
// - measured on this machine: the real engine, configured as `duet serve`
//   configures it, runs a plan of steps that are timed and fitted
//   (sim/profile_measure.h); under `mpirun -np 2` the two ranks also
//   time KV transfers (MPI, TCP) and the tensor-parallel all-reduce
//   (sim/link_measure.h), else the profile's note says they are not;
// - --roofline: derived from a stated hardware description and a model shape
//   (sim/roofline.h), for hardware not at hand.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace duet::tools {

struct ProfileArgs {
  std::string out;  // the profile's JSON file
  // Measured.
  std::string model;           // GGUF (also a roofline's model)
  std::string device = "cpu";  // cpu, cuda or cuda:N
  int threads = 0;             // 0: all hardware threads, as `duet serve`
  std::string kv_cache_mem = "1GiB";
  int64_t max_running = 64;
  int64_t step_tokens = 512;
  double budget_s = 60;
  int reps = 3;
  int64_t max_context = 4096;
  uint64_t seed = 1;
  int neighbour_rounds = 9;  // host sharing (sim::measure_neighbour); 0: not measured
  // Roofline.
  bool roofline = false;
  std::string hardware;     // a named accelerator (h200, ...) or a JSON file
  std::string model_shape;  // a named model shape (llama-3-70b, ...), instead of --model
  std::vector<int> tp = {1};
};

void add_profile_command(CLI::App& app, ProfileArgs& args);

// Returns the process exit code.
int run_profile(const ProfileArgs& args);

}  // namespace duet::tools
