#include "tools/serve_command.h"

#include <fmt/format.h>
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "common/model/kv_layout.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/http/http_server.h"
#include "coordinator/rpc/rpc_server.h"
#include "coordinator/service.h"
#include "kernels/cpu/isa.h"
#include "tools/device_option.h"
#include "tools/memory_size.h"
#include "worker/local_instance.h"

namespace duet::tools {

void add_serve_command(CLI::App& app, ServeArgs& args) {
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve a model over Cap'n Proto RPC and OpenAI-compatible HTTP until SIGTERM or SIGINT, "
      "then drain (--drain-timeout) and exit 0");
  cmd->add_option("-m,--model", args.model, "Path of a GGUF model")->required();
  cmd->add_option("--model-name", args.model_name,
                  "The model id clients name (default: the file name without .gguf)");
  cmd->add_option("--chat-template", args.chat_template,
                  "Chat template instead of the model's (chatml, llama3, gemma, mistral-v1, "
                  "mistral-v3, mistral-v3-tekken, mistral-v7, mistral-v7-tekken)");
  cmd->add_option("--reasoning-format", args.reasoning_format,
                  "auto: a chat reply's leading <think> block comes back as reasoning_content when "
                  "the chat template thinks (Qwen3); none: always in the content")
      ->check(CLI::IsMember({"auto", "none"}))
      ->capture_default_str();
  cmd->add_option("--host", args.host, "Address both fronts bind")->capture_default_str();
  cmd->add_option("--rpc-port", args.rpc_port, "Cap'n Proto port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  cmd->add_option("--http-port", args.http_port, "HTTP port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  CLI::Option* key = cmd->add_option(
      "--api-key", args.api_key,
      "Require this key: HTTP bearer token, Cap'n Proto login (default: DUET_API_KEY, or none)");
  cmd->add_option("--api-key-file", args.api_key_file,
                  "Require the key on this file's first line (not shown by ps, as --api-key is)")
      ->excludes(key);
  cmd->add_option("-t,--threads", args.threads, "Compute threads (default: all cores)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--device", args.device,
                  "Where every instance's engine runs: cpu, cuda (GPU 0) or cuda:N (needs a "
                  "CUDA build)")
      ->capture_default_str()
      ->check(device_validator());
  cmd->add_option("--kv-cache-mem", args.kv_cache_mem,
                  "KV cache size, bytes (512MiB, 2GiB) or a fraction of free memory")
      ->capture_default_str();
  cmd->add_option("--max-running", args.max_running, "Sequences decoded at once")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  cmd->add_option("--step-tokens", args.step_tokens, "Token budget of one engine step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--max-waiting", args.max_waiting,
                  "Requests waiting for the engine before new ones are refused (overloaded)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--max-prompt-tokens", args.max_prompt_tokens,
                  "Longest prompt accepted (0: the model's context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  cmd->add_option("--max-tokens", args.max_tokens,
                  "Most tokens a request may ask for (0: the model's context)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 24));
  cmd->add_option("--default-max-tokens", args.default_max_tokens,
                  "Tokens generated when a request names no limit")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24))
      ->capture_default_str();
  cmd->add_option("--max-body-bytes", args.max_body_bytes, "Largest HTTP request body")
      ->check(CLI::Range(size_t{1024}, size_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--max-connections", args.max_connections,
                  "Connections each front holds open at once; past them HTTP answers 503 "
                  "(overloaded) and RPC closes at once")
      ->check(CLI::Range(size_t{1}, size_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--http-idle-timeout", args.http_idle_timeout_s,
                  "Seconds an HTTP connection may wait for its next request (keep-alive idle), "
                  "or for the rest of one")
      ->check(CLI::Range(0.01, 86400.0))
      ->capture_default_str();
  cmd->add_option("--rpc-idle-timeout", args.rpc_idle_timeout_s,
                  "Seconds a Cap'n Proto connection with no call and no stream running stays "
                  "open (0: forever)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("--http-threads", args.http_threads,
                  "Threads that parse, validate and tokenize HTTP requests, off the HTTP I/O "
                  "thread")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();

  // The cluster (under mpirun; see common/cluster/cluster_spec.h for the layout).
  const char* group = "Cluster (mpirun -np N duet serve ...)";
  cmd->add_option("--mode", args.cluster.mode,
                  "disaggregated (default: prefill and decode instances) or colocated "
                  "(every instance runs both phases)")
      ->group(group);
  cmd->add_option("--prefill", args.cluster.prefill,
                  "Prefill instances (colocated: instances, counted with --decode)")
      ->group(group);
  cmd->add_option("--decode", args.cluster.decode,
                  "Decode instances (colocated: instances, counted with --prefill)")
      ->group(group);
  cmd->add_option("--tp", args.cluster.tp,
                  "Ranks per instance: each holds 1/T of the weights and KV cache (tensor "
                  "parallel; at most the model's KV heads). With --join: the joining "
                  "instance's, as mpirun -np T")
      ->group(group);
  cmd->add_option("--prefill-tp", args.cluster.prefill_tp, "Ranks per prefill instance (--tp)")
      ->group(group);
  cmd->add_option("--decode-tp", args.cluster.decode_tp, "Ranks per decode instance (--tp)")
      ->group(group);
  cmd->add_option("--ep", args.cluster.ep,
                  "Expert parallelism for a mixture-of-experts model: each instance's experts "
                  "spread whole over its ranks. It shares the tensor-parallel ranks (EP = TP): "
                  "the same as --tp E, which it must equal if both are given")
      ->group(group);
  cmd->add_option("--prefill-ep", args.cluster.prefill_ep, "Ranks per prefill instance (--ep)")
      ->group(group);
  cmd->add_option("--decode-ep", args.cluster.decode_ep, "Ranks per decode instance (--ep)")
      ->group(group);
  cmd->add_option("--cluster", args.cluster.file,
                  "A cluster spec (JSON) instead of --mode/--prefill/--decode/--tp...")
      ->group(group);
  cmd->add_flag("--kv-checksums", args.kv_checksums,
                "Checksum every KV transfer message and verify it on arrival")
      ->group(group);
  cmd->add_option("--kv-transfer-timeout", args.kv_transfer_timeout_s,
                  "Seconds a decode instance waits for a prompt's KV (prefill queue included)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--instance-lease", args.instance_lease_s,
                  "Seconds an instance may be silent, or inside one engine step, before the "
                  "coordinator counts it lost and re-runs its requests elsewhere")
      ->check(CLI::Range(0.05, 3600.0))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--max-retries", args.max_retries,
                  "Re-runs of one request after the instances it was on were lost")
      ->check(CLI::Range(0, 100))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--rerun-wait", args.rerun_wait_s,
                  "With --join-port: seconds a request whose instances were lost waits for an "
                  "instance that can take it (a replacement that joins, a rank that rejoins) "
                  "before it fails")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--join-port", args.join_port,
                  "The coordinator (rank 0): instances may join the running cluster on this TCP "
                  "port (0: any free port, logged), proving --cluster-key; with a port number, "
                  "a one-rank CPU instance's rank that wakes after its loss rejoins there")
      ->check(CLI::Range(0, 65535))
      ->group(group);
  cmd->add_option("--join", args.join,
                  "Join the running cluster whose coordinator listens on HOST:PORT (its "
                  "--join-port) as one instance, instead of starting one; leaves on SIGTERM once "
                  "its requests are done")
      ->group(group);
  cmd->add_option("--role", args.role,
                  "With --join: the instance's role (both into a colocated cluster, prefill or "
                  "decode into a disaggregated one)")
      ->check(CLI::IsMember({"both", "prefill", "decode"}))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--cluster-key", args.cluster_key_file,
                  "With --join or --join-port, and for admin calls on a cluster's coordinator "
                  "(duet-client set-role): the file holding the cluster's shared key (at least 32 "
                  "bytes, mode 600; `head -c 32 /dev/urandom | base64 > FILE`); never sent, both "
                  "ends prove they hold it")
      ->group(group);
  cmd->add_option("--rebalance", args.rebalance,
                  "A cluster's coordinator: auto moves instances between prefill and decode "
                  "while serving, one at a time, when the latency of recent requests misses "
                  "--slo on one side and not the other, and publishes how many instances the "
                  "load wants (duet_cluster_instances_wanted, which launch/local.sh follows)")
      ->check(CLI::IsMember({"off", "auto"}))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--slo", args.slo,
                  "With --rebalance auto: the 90th-percentile targets, ttft=MS,tpot=MS (either "
                  "alone judges that side only)")
      ->group(group);
  cmd->add_option("--kv-same-host", args.kv_same_host,
                  "How KV moves between two GPUs of one host: ipc (CUDA IPC) or nccl "
                  "(one GPU shared by two ranks is always ipc; other hosts nccl)")
      ->check(CLI::IsMember({"ipc", "nccl"}))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--drain-timeout", args.drain_timeout_s,
                  "On SIGTERM or SIGINT (to this process, or under mpirun to rank 0 or to mpirun): "
                  "seconds running requests get to finish while new ones are refused (503, /health "
                  "says draining); then those left end with an `unavailable` error and the server "
                  "exits 0. A second signal cuts the drain short. Under mpirun give mpirun "
                  "`--mca odls_base_sigkill_timeout` of at least this plus 10 (README: stopping a "
                  "cluster)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_option("--kv-transport", args.kv_transport,
                  "How KV moves between instances: mpi, tcp (sockets of its own, which a dead "
                  "peer cannot wedge; CPU instances only), or auto (tcp when the ranks span "
                  "hosts and run on CPUs, else mpi)")
      ->check(CLI::IsMember({"auto", "mpi", "tcp"}))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--kv-cma", args.kv_cma,
                  "KV over MPI between ranks of one host: auto (the decode rank copies each "
                  "payload out of the prefill rank's memory, cross-memory attach, where the "
                  "kernel allows it) or off (every payload an MPI message)")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str()
      ->group(group);
  cmd->add_option("--control-transport", args.control_transport,
                  "How the coordinator's control messages move: mpi, tcp (sockets of its own, "
                  "which a dead peer cannot wedge; any device), or auto (tcp when the ranks span "
                  "hosts, else mpi)")
      ->check(CLI::IsMember({"auto", "mpi", "tcp"}))
      ->capture_default_str()
      ->group(group);
}

namespace serve {

sigset_t block_stop_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a vanished client is a write error, not a death
  return signals;
}

std::string model_name(const ServeArgs& args) {
  return args.model_name.empty() ? std::filesystem::path(args.model).stem().string()
                                 : args.model_name;
}

int compute_threads(const ServeArgs& args) {
  return args.threads > 0 ? args.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

std::optional<ChatTemplateKind> chat_template(const GgufFile& file, const ServeArgs& args) {
  if (!args.chat_template.empty()) return detect_chat_template(args.chat_template);
  if (const auto text = file.get_string("tokenizer.chat_template")) {
    try {
      return detect_chat_template(*text);
    } catch (const Error& e) {
      spdlog::warn("chat requests will be refused: {}", e.what());
    }
  }
  return std::nullopt;
}

bool split_reasoning(const GgufFile& file, const ServeArgs& args) {
  if (args.reasoning_format == "none") return false;
  const std::string text = !args.chat_template.empty()
                               ? args.chat_template
                               : file.get_string("tokenizer.chat_template").value_or("");
  return text.find("<think>") != std::string::npos;
}

EngineConfig engine_config(const ServeArgs& args, const LlamaModel& model,
                           std::vector<int32_t> end_of_generation, int device) {
  const int64_t kv_budget = parse_memory_size(args.kv_cache_mem, "--kv-cache-mem");
  // Every rank of a tensor-parallel instance must count the same blocks: size
  // them by the leader's shard, which has the most KV heads.
  KvLayout probe = make_kv_layout(model.config(), 1);
  probe.n_kv_heads = split_evenly(probe.n_kv_heads, 0, model.shard().size).second;
  const auto block_bytes = static_cast<int64_t>(probe.bytes_per_block());
  const int64_t n_blocks = std::max<int64_t>(1, kv_budget / block_bytes);
  spdlog::info("KV cache: {} bytes per token, {} blocks of {} = {} tokens ({:.1f} MiB)",
               probe.bytes_per_token(), n_blocks, KvLayout::kDefaultBlockSize,
               n_blocks * KvLayout::kDefaultBlockSize,
               static_cast<double>(n_blocks * block_bytes) / (1 << 20));
  EngineConfig config;
  config.n_kv_blocks = n_blocks;
  config.scheduler.max_running = args.max_running;
  config.scheduler.max_step_tokens = std::max(args.step_tokens, args.max_running);
  config.end_of_generation = std::move(end_of_generation);
  config.device = device;
  require_device(config.device);
  return config;
}

std::string resolve_api_key(const ServeArgs& args) {
  if (!args.api_key.empty()) return args.api_key;
  if (!args.api_key_file.empty()) {
    std::ifstream in(args.api_key_file);
    if (!in) {
      throw Error(ErrorKind::kNotFound,
                  fmt::format("--api-key-file: cannot read {}", args.api_key_file));
    }
    std::string key;
    std::getline(in, key);
    while (!key.empty() && std::isspace(static_cast<unsigned char>(key.back()))) key.pop_back();
    DUET_REQUIRE(!key.empty(), "--api-key-file: {} holds no key on its first line",
                 args.api_key_file);
    return key;
  }
  const char* from_environment = std::getenv("DUET_API_KEY");
  return from_environment != nullptr ? from_environment : "";
}

ServiceLimits service_limits(const ServeArgs& args) {
  ServiceLimits limits;
  limits.max_waiting = args.max_waiting;
  limits.max_prompt_tokens = args.max_prompt_tokens;
  limits.max_tokens = args.max_tokens;
  limits.default_max_tokens = args.default_max_tokens;
  return limits;
}

void run_fronts_until_signal(Service& service, const ServeArgs& args, const sigset_t& signals,
                             bool split_reasoning, ClusterAdmin* admin,
                             std::optional<ClusterKey> admin_key) {
  auto milliseconds = [](double seconds) {
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  };
  RpcServer rpc(service, {.host = args.host,
                          .port = static_cast<uint16_t>(args.rpc_port),
                          .api_key = args.api_key,
                          .max_connections = args.max_connections,
                          .idle_timeout = milliseconds(args.rpc_idle_timeout_s),
                          .admin = admin,
                          .admin_key = std::move(admin_key)});
  HttpServer http(service, {.host = args.host,
                            .port = static_cast<uint16_t>(args.http_port),
                            .api_key = args.api_key,
                            .max_body_bytes = args.max_body_bytes,
                            .max_connections = args.max_connections,
                            .idle_timeout = milliseconds(args.http_idle_timeout_s),
                            .worker_threads = args.http_threads,
                            .split_reasoning = split_reasoning});
  // Machine-readable lines on stdout (tests and scripts read the ports here).
  std::printf("rpc listening on %s:%u\nhttp listening on %s:%u\n", args.host.c_str(), rpc.port(),
              args.host.c_str(), http.port());
  std::fflush(stdout);
  spdlog::info("serving {}{}{}", service.model().name,
               args.api_key.empty() ? "" : ", API key required",
               split_reasoning ? ", <think> blocks as reasoning_content" : "");

  int signal = 0;
  sigwait(&signals, &signal);
  spdlog::info("{}: draining", signal == SIGINT ? "SIGINT" : "SIGTERM");
  drain(service, std::chrono::milliseconds(static_cast<int64_t>(args.drain_timeout_s * 1000.0)),
        signals);
  http.stop();
  rpc.stop();
}

namespace {

// Calls `on_signal` for each signal of `signals` that arrives while it
// exists, on a thread of its own (the signals are blocked in every thread
// and taken by sigwait). The destructor wakes that thread with a signal
// aimed at it alone, and joins it.
class SignalWatcher {
 public:
  SignalWatcher(const sigset_t& signals, std::function<void(int)> on_signal)
      : signals_(signals), on_signal_(std::move(on_signal)), thread_([this] { run(); }) {}
  ~SignalWatcher() {
    stopping_ = true;
    pthread_kill(thread_.native_handle(), SIGTERM);  // blocked: pending for sigwait
    thread_.join();
  }
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

 private:
  void run() {
    for (;;) {
      int signal = 0;
      sigwait(&signals_, &signal);
      if (stopping_) return;
      on_signal_(signal);
    }
  }

  const sigset_t signals_;
  const std::function<void(int)> on_signal_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;  // last: it starts once the members it reads exist
};

constexpr std::string_view kCutReason = "the server is shutting down";
// After a cut, how long the cut requests' final updates may take.
constexpr auto kCutGrace = std::chrono::seconds(5);

}  // namespace

void drain(Service& service, std::chrono::milliseconds timeout, const sigset_t& signals) {
  using Clock = std::chrono::steady_clock;
  service.begin_drain();
  const int64_t running = service.stats().active_requests;
  spdlog::info(
      "draining: new requests are refused; {} running get up to {:.1f} s to finish (signal "
      "again to cut them short)",
      running, std::chrono::duration<double>(timeout).count());
  bool idle = false;
  {
    SignalWatcher second(signals, [&service](int signal) {
      spdlog::warn("{} again: cutting the drain short", signal == SIGINT ? "SIGINT" : "SIGTERM");
      service.cut(std::string(kCutReason));
    });
    idle = service.wait_idle(Clock::now() + timeout);
  }
  if (!idle) {
    const int64_t left = service.stats().active_requests;
    if (left > 0) spdlog::warn("drain: ending {} requests still running: unavailable", left);
    service.cut(std::string(kCutReason));
    if (!service.wait_idle(Clock::now() + kCutGrace))
      spdlog::warn("drain: {} requests got no final update in time",
                   service.stats().active_requests);
  }
  spdlog::info("drained: stopping the fronts");
}

}  // namespace serve

int run_serve(const ServeArgs& given) {
  // Signals are taken by sigwait, so every thread started from here on
  // inherits the blocked mask and none is interrupted.
  const sigset_t signals = serve::block_stop_signals();
  ServeArgs args = given;
  args.api_key = serve::resolve_api_key(given);
  if (!args.join.empty()) return run_join_serve(args, signals);
  if (launched_by_mpirun() || args.cluster.any()) return run_cluster_serve(args, signals);
  if (args.join_port >= 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "--join-port needs a cluster (mpirun, or the cluster flags): instances join its "
                "coordinator");
  }
  if (args.rebalance != "off") {
    throw Error(ErrorKind::kInvalidArgument,
                "--rebalance auto needs a cluster (mpirun): it moves instances between prefill "
                "and decode, and tells a launcher how many instances the load wants");
  }

  const int n_threads = serve::compute_threads(args);
  const int device = parse_device(args.device);
  require_device(device);  // before the slow model load
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  std::unique_ptr<LlamaModel> model =
      LlamaModel::load(args.model, {}, device < 0 ? &kernels : nullptr);
  const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
  const std::optional<ChatTemplateKind> chat = serve::chat_template(model->file(), args);
  const bool split_reasoning = serve::split_reasoning(model->file(), args);
  const std::string model_name = serve::model_name(args);

  cpu::ThreadPool pool(n_threads);
  LocalInstance instance(
      *model, kernels, pool,
      serve::engine_config(args, *model, tokenizer.end_of_generation_ids(), device), model_name);
  Service service(instance, tokenizer, chat, model_name, serve::service_limits(args));
  spdlog::info("{} compute threads", n_threads);
  serve::run_fronts_until_signal(service, args, signals, split_reasoning);
  return 0;
}

}  // namespace duet::tools
