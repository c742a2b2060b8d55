// `duet serve`: the Cap'n Proto and HTTP fronts over the coordinator's
// service, in one of two shapes:
// - single process (no mpirun, no cluster flags): one colocated instance on
//   an engine thread of this process; MPI is never initialized;
// - a cluster under mpirun (tools/serve_cluster.cpp): the coordinator on rank
//   0, one instance per other rank, laid out by the cluster flags or file.
#pragma once

#include <signal.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "common/cluster/cluster_spec.h"
#include "common/model/gguf.h"
#include "common/net/cluster_auth.h"
#include "common/text/chat_template.h"
#include "coordinator/cluster_admin.h"
#include "coordinator/service.h"
#include "worker/engine.h"
#include "worker/model/llama_model.h"

namespace duet::tools {

struct ServeArgs {
  std::string model;
  std::string model_name;     // the id clients name; default: the file's stem
  std::string chat_template;  // --chat-template: a name or template text; empty: the model's
  std::string reasoning_format = "auto";  // --reasoning-format: auto or none
  std::string host = "127.0.0.1";
  int rpc_port = 7433;         // 0: any free port (printed)
  int http_port = 8000;        // 0: any free port (printed)
  std::string api_key;         // empty: none; else both fronts require it
  std::string api_key_file;    // the key's file (first line), instead of --api-key
  int threads = 0;             // 0: all hardware threads
  std::string device = "cpu";  // every instance's engine: cpu, cuda or cuda:N
  std::string kv_cache_mem = "1GiB";
  int64_t max_running = 64;
  int64_t step_tokens = 512;
  int64_t max_waiting = 256;
  int64_t max_prompt_tokens = 0;  // 0: the model's context
  int64_t max_tokens = 0;         // 0: the model's context
  int64_t default_max_tokens = 256;
  size_t max_body_bytes = 1 << 20;
  size_t max_connections = 1024;  // per front
  double http_idle_timeout_s = 60.0;
  double rpc_idle_timeout_s = 300.0;  // 0: never
  int http_threads = 2;               // parse and tokenize HTTP requests
  ClusterFlags cluster;               // any() or mpirun: serve as a cluster
  // Disaggregated: checksum every KV rows message; the longest a decode
  // instance waits for a prompt's KV (prefill queue included).
  bool kv_checksums = false;
  double kv_transfer_timeout_s = 120.0;
  // How KV moves between two GPUs of one host: ipc (CUDA IPC) or nccl.
  std::string kv_same_host = "ipc";
  // How KV moves between instances: mpi, tcp (sockets of Duet's own; CPU
  // instances only), or auto (tcp when the ranks span hosts, else mpi).
  std::string kv_transport = "auto";
  // Over MPI, between ranks of one host: auto (the receiver reads each
  // payload out of the sender's memory, cross-memory attach, where the
  // kernel allows it) or off (every payload an MPI message).
  std::string kv_cma = "auto";
  // How the coordinator's control messages move: mpi, tcp (sockets of Duet's
  // own, CPU or GPU instances alike), or auto (tcp when the ranks span hosts).
  std::string control_transport = "auto";
  // Failure domains: an instance silent (or stuck in one step) this long is
  // lost; its requests are re-run at most max_retries times.
  double instance_lease_s = 3.0;
  int max_retries = 2;
  // A re-run that no live instance can take waits this long for one (a
  // replacement that joins, a rank that rejoins): clusters with a join port.
  double rerun_wait_s = 30.0;
  // Stopping (SIGTERM/SIGINT): the longest running requests may take to
  // finish while new ones are refused; those left then end `unavailable`.
  double drain_timeout_s = 30.0;
  // Membership (coordinator/cluster/join_listener.h). The coordinator: the
  // port instances may join on (-1: none). An instance: join the cluster
  // at HOST:PORT with `role`. Both: the cluster key's file.
  int join_port = -1;
  std::string join;
  std::string role = "both";
  std::string cluster_key_file;
  // Online rebalancing of a disaggregated cluster's roles
  // (coordinator/rebalancer.h): "off" or "auto", against `slo`
  // ("ttft=MS,tpot=MS").
  std::string rebalance = "off";
  std::string slo;
};

void add_serve_command(CLI::App& app, ServeArgs& args);

// Serves until SIGINT or SIGTERM; returns the process exit code.
int run_serve(const ServeArgs& args);

// The pieces both shapes share.
namespace serve {

inline std::chrono::milliseconds instance_lease(const ServeArgs& args) {
  return std::chrono::milliseconds(static_cast<int64_t>(args.instance_lease_s * 1000.0));
}

// Blocks SIGINT and SIGTERM in this thread and every thread started after it
// (they are taken by sigwait) and ignores SIGPIPE. Call first, before any
// thread exists. Returns the blocked set.
sigset_t block_stop_signals();
std::string model_name(const ServeArgs& args);
int compute_threads(const ServeArgs& args);
// The chat template of `args.chat_template`, or else the model's; nullopt (chat
// requests refused, with a warning) when the model's is not one Duet takes.
// Throws kUnsupported for a --chat-template Duet does not take.
std::optional<ChatTemplateKind> chat_template(const GgufFile& file, const ServeArgs& args);
// Whether chat replies' <think> blocks go to reasoning_content: with
// --reasoning-format auto (the default) when the chat template (--chat-template's
// text, else the model's) writes "<think>", as Qwen3's and DeepSeek-R1's do;
// never with none.
bool split_reasoning(const GgufFile& file, const ServeArgs& args);
// The engine's configuration for `model` (KV size from --kv-cache-mem, logged).
// `device`: -1 for the CPU, else the CUDA device the engine runs on (refused,
// kUnsupported, where there is none).
EngineConfig engine_config(const ServeArgs& args, const LlamaModel& model,
                           std::vector<int32_t> end_of_generation, int device);
ServiceLimits service_limits(const ServeArgs& args);
// The API key of a run: --api-key, else the first line of --api-key-file
// (kNotFound if unreadable, kInvalidArgument if empty), else the environment's
// DUET_API_KEY, else none (empty). A key in a file or the environment is not
// on the command line, where `ps` shows it to every user.
std::string resolve_api_key(const ServeArgs& args);
// Starts both fronts over `service`, prints their `... listening on` lines,
// waits for a signal in `signals`, then drains (drain()) and stops the fronts.
// `admin` (a cluster's, outliving the fronts) takes the RPC front's admin
// calls from clients that prove `admin_key`.
void run_fronts_until_signal(Service& service, const ServeArgs& args, const sigset_t& signals,
                             bool split_reasoning, ClusterAdmin* admin = nullptr,
                             std::optional<ClusterKey> admin_key = std::nullopt);
// The drain after the first stop signal: new requests are refused (503,
// `unavailable`) while the running ones finish, for up to `timeout`; those
// still running then, or when a second signal of `signals` comes, end with an
// `unavailable` error ("the server is shutting down"). Returns once every
// request has had its final update (or a few seconds after the cut).
void drain(Service& service, std::chrono::milliseconds timeout, const sigset_t& signals);

}  // namespace serve

// The cluster shape (tools/serve_cluster.cpp): every rank of the mpirun job
// runs it. Returns the exit code; errors that every rank meets alike (a bad
// spec) throw duet::Error on every rank.
int run_cluster_serve(const ServeArgs& args, const sigset_t& signals);

// An instance that joins a running cluster (tools/serve_join.cpp).
int run_join_serve(const ServeArgs& args, const sigset_t& signals);

// A rank of the mpirun job whose one-rank instance was counted lost while
// it lives: joins the cluster at `address` (the coordinator's join port,
// with --cluster-key) as a new member of `role` with `model`, trying for up
// to a minute, and serves as members do (tools/serve_join.cpp). Returns the
// exit code.
int rejoin_as_member(const ServeArgs& args, const std::string& address, InstanceRole role,
                     const LlamaModel& model, const EngineConfig& config, const sigset_t& signals);

}  // namespace duet::tools
