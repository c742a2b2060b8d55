#include "tools/profile_command.h"

#include <fmt/format.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "sim/link/rig.h"
#include "sim/link_measure.h"
#include "sim/profile_measure.h"
#include "sim/roofline.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tools/device_option.h"
#include "tools/serve_command.h"

namespace duet::tools {
namespace {

sim::HardwareSpec hardware_of(const std::string& name_or_file) {
  if (!std::filesystem::path(name_or_file).has_extension())
    return sim::named_hardware(name_or_file);
  std::ifstream in(name_or_file);
  DUET_REQUIRE(in.good(), "--hardware: cannot read {}", name_or_file);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(ErrorKind::kInvalidArgument, fmt::format("{}: {}", name_or_file, e.what()));
  }
  return sim::hardware_from_json(json, name_or_file);
}

int run_roofline(const ProfileArgs& args) {
  DUET_REQUIRE(!args.hardware.empty(), "--roofline needs --hardware (a name or a JSON file)");
  DUET_REQUIRE(args.model.empty() != args.model_shape.empty(),
               "--roofline needs one of --model (a GGUF file) or --model-shape (a name)");
  const sim::HardwareSpec hardware = hardware_of(args.hardware);
  sim::ModelShape shape;
  if (!args.model_shape.empty()) {
    shape = sim::named_model_shape(args.model_shape);
  } else {
    const auto model = LlamaModel::load(args.model);
    shape = sim::model_shape(model->config(), static_cast<double>(model->weight_bytes()),
                             std::filesystem::path(args.model).stem().string());
  }
  const sim::Profile profile = sim::roofline_profile(hardware, shape, args.tp);
  sim::write_profile(args.out, profile);
  std::fprintf(stderr, "roofline profile of %s on %s (tp %s) written to %s\n", shape.name.c_str(),
               hardware.name.c_str(), fmt::format("{}", fmt::join(args.tp, ",")).c_str(),
               args.out.c_str());
  return 0;
}

// Transferred prompts that move in whole chunks of the step budget.
std::vector<int64_t> transfer_prompts(int64_t step_tokens) {
  std::vector<int64_t> prompts;
  for (const int64_t n : sim::LinkMeasureOptions{}.prompt_tokens) {
    if (n <= step_tokens || n % step_tokens == 0) prompts.push_back(n);
  }
  return prompts;
}

// The CPUs this process may run on (its affinity mask; mpirun may bind it).
int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0)
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return CPU_COUNT(&set);
}

void print_summary(const sim::Profile& profile) {
  const sim::InstanceProfile& instance = profile.instance(1);
  const sim::FitQuality& q = instance.quality;
  std::fprintf(stderr,
               "%s: %lld step samples; fit relative error median %.1f%%, p90 %.1f%%, max %.1f%%\n",
               profile.device.c_str(), static_cast<long long>(q.n_samples),
               100 * q.median_rel_error, 100 * q.p90_rel_error, 100 * q.max_rel_error);
  std::string knots;
  for (size_t i = 0; i < instance.step.token_knots.size(); ++i) {
    knots += fmt::format(" {}:{:.2f}ms", instance.step.token_knots[i],
                         1e3 * instance.step.knot_seconds[i]);
  }
  std::fprintf(stderr, "weights by tokens:%s\n", knots.c_str());
  std::fprintf(stderr,
               "per sequence %.3g s, per decode attention pair %.3g s, per prefill pair %.3g s, "
               "per logit row %.3g s\n",
               instance.step.per_sequence, instance.step.per_decode_attention,
               instance.step.per_prefill_attention, instance.step.per_logit_row);
  for (const sim::TransferProfile& t : profile.transfers) {
    std::fprintf(stderr, "transfer %s: latency %.1f us, %.2f GB/s\n", t.path.c_str(),
                 1e6 * t.cost.latency_s, t.cost.bytes_per_s / 1e9);
  }
  for (const sim::CollectiveProfile& c : profile.collectives) {
    std::fprintf(stderr, "%s over %d ranks: latency %.1f us, %.2f GB/s\n", c.op.c_str(), c.ranks,
                 1e6 * c.cost.latency_s, c.cost.bytes_per_s / 1e9);
  }
  if (!profile.host.samples.empty()) {
    std::fprintf(stderr, "a neighbour instance on this host slows a step by %.3fx\n",
                 profile.host.neighbour_slowdown);
  }
}

int run_measured(const ProfileArgs& args) {
  DUET_REQUIRE(!args.model.empty(), "give the model to measure (--model)");
  DUET_REQUIRE(args.model_shape.empty() && args.hardware.empty(),
               "--model-shape and --hardware describe a roofline profile (--roofline)");
  const int device = parse_device(args.device);
  require_device(device);  // before the slow model load
  ServeArgs serve_args;
  serve_args.threads = args.threads;
  serve_args.kv_cache_mem = args.kv_cache_mem;
  serve_args.max_running = args.max_running;
  serve_args.step_tokens = args.step_tokens;
  const int n_threads = serve::compute_threads(serve_args);
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  const auto model = LlamaModel::load(args.model, {}, device < 0 ? &kernels : nullptr);

  // Under mpirun, both ranks time transfers and collectives first; then rank
  // 0 measures steps while rank 1 waits without a core.
  std::unique_ptr<MpiRuntime> mpi;
  sim::LinkMeasurement links;
  if (launched_by_mpirun()) {
    mpi = std::make_unique<MpiRuntime>();
    sim::LinkMeasureOptions options;
    options.prompt_tokens = transfer_prompts(serve_args.step_tokens);
    options.chunk_tokens = serve_args.step_tokens;
    options.seed = args.seed;
    try {
      links = sim::measure_links(*mpi, model->config(), options);
    } catch (const std::exception& e) {
      // The other rank may wait for this one in MPI: end the whole job.
      std::fprintf(stderr, "duet: rank %d: %s\n", mpi->rank().value, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (mpi->rank().value != 0) {
      kv_bench::barrier_quietly(MPI_COMM_WORLD);
      return 0;
    }
  }

  cpu::ThreadPool pool(n_threads);
  sim::MeasureOptions options;
  options.engine = serve::engine_config(serve_args, *model, {}, device);
  options.budget_s = args.budget_s;
  options.reps = args.reps;
  options.max_context = args.max_context;
  options.seed = args.seed;
  // GPU instances of one host each have a device of their own.
  options.neighbour_rounds = device >= 0 ? 0 : args.neighbour_rounds;
  // The neighbour needs cores of its own: otherwise the figure is time
  // sharing, which duet-sim --host-cores counts apart. mpirun binds each of
  // two ranks to one core unless told --bind-to none.
  const int usable = usable_cpus();
  std::string host_note;
  if (options.neighbour_rounds > 0 && 2 * n_threads > usable) {
    host_note = fmt::format(
        "host sharing not measured: two instances of {} thread(s) need {} CPUs, this process may "
        "use {} (under mpirun: --bind-to none).",
        n_threads, 2 * n_threads, usable);
    spdlog::warn("{}", host_note);
    options.neighbour_rounds = 0;
  }
  sim::Profile profile;
  try {
    profile = sim::measure_profile(*model, kernels, pool, options);
  } catch (...) {
    if (mpi) kv_bench::barrier_quietly(MPI_COMM_WORLD);  // rank 1 may end
    throw;
  }
  if (device >= 0) profile.device = fmt::format("cuda:{}", device);
  profile.model.name = std::filesystem::path(args.model).stem().string();
  profile.transfers = std::move(links.transfers);
  profile.collectives = std::move(links.collectives);
  profile.note =
      "steps: the real engine with duet serve's configuration; each decoding sequence has KV "
      "blocks of its own, imported (sim/profile_measure.h). ";
  profile.note += mpi ? "transfers and all_reduce: two ranks of one mpirun job on this machine. "
                      : "transfers and collectives not measured (run under mpirun -np 2 to "
                        "measure them). ";
  if (!host_note.empty()) {
    profile.note += host_note;
  } else {
    profile.note += profile.host.samples.empty()
                        ? "host sharing not measured."
                        : "host: steps timed alone and beside a second instance of the same "
                          "threads (sim/profile_measure.h measure_neighbour).";
  }
  sim::write_profile(args.out, profile);
  print_summary(profile);
  std::fprintf(stderr, "profile written to %s\n", args.out.c_str());
  if (mpi) kv_bench::barrier_quietly(MPI_COMM_WORLD);
  return 0;
}

}  // namespace

void add_profile_command(CLI::App& app, ProfileArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "profile",
      "Measure (or, with --roofline, derive) the cost model of the cluster simulator: steps, "
      "KV transfers and collectives (under mpirun -np 2)");
  cmd->add_option("-o,--out", args.out, "The profile's JSON file")->required();
  cmd->add_option("-m,--model", args.model, "Path of a GGUF model");
  cmd->add_option("--device", args.device, "Where the model runs: cpu, cuda or cuda:N")
      ->capture_default_str()
      ->check(device_validator());
  cmd->add_option("-t,--threads", args.threads, "Compute threads (default: all cores)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--kv-cache-mem", args.kv_cache_mem,
                  "KV cache size as duet serve takes it: bytes (512MiB, 2GiB) or a fraction of "
                  "free memory")
      ->capture_default_str();
  cmd->add_option("--max-running", args.max_running, "Sequences decoded at once")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--step-tokens", args.step_tokens, "Token budget of one engine step")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--budget", args.budget_s, "Seconds the step measurement may take")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--reps", args.reps, "Repetitions of the step plan (fewer if over budget)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--max-context", args.max_context, "Longest context the plan measures")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  cmd->add_option("--seed", args.seed, "Seed of the random prompts");
  cmd->add_option("--neighbour-rounds", args.neighbour_rounds,
                  "Rounds timing steps beside a second instance on this host (0: none; CPU only)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100));
  cmd->add_flag("--roofline", args.roofline,
                "Derive the profile from --hardware and a model instead of measuring");
  cmd->add_option("--hardware", args.hardware,
                  "Roofline: a named device (h200, ...) or a JSON file");
  cmd->add_option("--model-shape", args.model_shape,
                  "Roofline: a named model shape (llama-3-70b, ...) instead of --model");
  cmd->add_option("--tp", args.tp, "Roofline: tensor-parallel sizes (1,2,4,8)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
}

int run_profile(const ProfileArgs& args) {
  return args.roofline ? run_roofline(args) : run_measured(args);
}

}  // namespace duet::tools
