// `duet-client`: a command-line client of a Duet server over Cap'n Proto RPC
// (common/duet.capnp). Wiring only: flags become requests (client_session.h
// runs them over client/), generated text goes to stdout, everything else to
// stderr.
//
//   duet-client --connect HOST:PORT [--api-key KEY] generate --prompt TEXT [-n N] ...
//   duet-client --connect HOST:PORT chat      (one user message per line; EOF ends)
//   duet-client --connect HOST:PORT stats | info | health
//   duet-client --connect HOST:PORT set-role --instance N --role decode --cluster-key FILE
//
// Errors print one line on stderr naming their kind; exit code 1 when the
// server cannot be reached, 2 for a refused request or bad flags, 130 after
// Ctrl-C (which first cancels the request on the server).
#include <poll.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "tools/client_session.h"
#include "tools/command_line.h"

namespace duet::client {
namespace {

struct GenerateFlags {
  std::string prompt;
  bool chat = false;  // send the prompt as a user message
  std::string system;
  GenerateOptions options;
};

struct SetRoleFlags {
  int instance = -1;
  std::string role;
  std::string key_file;
};

void add_sampling_flags(CLI::App& cmd, GenerateOptions& options) {
  cmd.add_option("-n,--n-tokens", options.max_tokens,
                 "Tokens to generate at most (0: the server's default)");
  cmd.add_option("--temp", options.temperature, "Sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0f, 100.0f));
  cmd.add_option("--seed", options.seed, "Seed of the sampling random stream");
  cmd.add_option("--top-p", options.top_p,
                 "Keep the most likely tokens up to this probability mass (1: off)");
  cmd.add_option("--top-k", options.top_k, "Keep the k most likely tokens (0: off)");
  cmd.add_option("--min-p", options.min_p,
                 "Keep tokens at least this fraction as likely as the top one (0: off)");
  cmd.add_option("--stop", options.stop, "Stop string (repeatable); the text ends before it");
  cmd.add_flag("--ignore-eos", options.ignore_eos, "Generate exactly --n-tokens tokens");
}

void print_text(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

void print_timings(const GenerateOutcome& outcome) {
  const Timings& t = outcome.finish.timings;
  std::fprintf(stderr,
               "finish: %s; prompt %u tokens (%u cached), completion %u tokens; "
               "TTFT %.1f ms, TPOT %.1f ms, E2E %.1f ms\n",
               std::string(finish_reason_name(outcome.finish.reason)).c_str(), t.prompt_tokens,
               t.cached_tokens, t.completion_tokens, t.ttft_ms, t.tpot_ms, t.e2e_ms);
}

void throw_if_failed(const GenerateOutcome& outcome) {
  const Finish& finish = outcome.finish;
  if (finish.reason == rpc::FinishReason::ERROR) {
    throw ClientError(kExitRefused, finish.error_kind, finish.error_message);
  }
  if (finish.reason == rpc::FinishReason::CANCELLED && !outcome.interrupted) {
    throw ClientError(kExitRefused, "cancelled", "the server ended the request (shutting down?)");
  }
}

int run_generate(Session& session, const GenerateFlags& flags) {
  Prompt prompt = flags.prompt;
  if (flags.chat) {
    std::vector<ChatTurn> turns;
    if (!flags.system.empty()) turns.push_back({"system", flags.system});
    turns.push_back({"user", flags.prompt});
    prompt = std::move(turns);
  }
  const GenerateOutcome outcome = session.generate(prompt, flags.options, print_text);
  print_text("\n");
  print_timings(outcome);
  throw_if_failed(outcome);
  return outcome.interrupted ? kExitInterrupted : 0;
}

// Reads stdin line by line. Waiting happens in the kj event loop, so a
// Ctrl-C (the captured SIGINT) ends it; a stdin that epoll cannot watch (a
// regular file, /dev/null) is read with plain blocking reads.
class LineReader {
 public:
  enum class Status { kLine, kEnd, kInterrupted };

  explicit LineReader(kj::UnixEventPort& port) : port_(port) {
    try {
      observer_ = kj::heap<kj::UnixEventPort::FdObserver>(
          port, STDIN_FILENO, kj::UnixEventPort::FdObserver::OBSERVE_READ);
    } catch (const kj::Exception&) {
      observer_ = nullptr;
    }
  }

  Status next(kj::WaitScope& wait_scope, std::string& line) {
    for (;;) {
      const size_t newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        return Status::kLine;
      }
      if (end_) {
        if (buffer_.empty()) return Status::kEnd;
        line = std::move(buffer_);
        buffer_.clear();
        return Status::kLine;
      }
      if (observer_.get() != nullptr && !readable_now()) {
        bool interrupted = false;
        observer_->whenBecomesReadable()
            .exclusiveJoin(port_.onSignal(SIGINT).then([&](siginfo_t) { interrupted = true; }))
            .wait(wait_scope);
        if (interrupted) return Status::kInterrupted;
      }
      char chunk[4096];
      const ssize_t n = ::read(STDIN_FILENO, chunk, sizeof chunk);
      if (n > 0) {
        buffer_.append(chunk, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        end_ = true;
      }
    }
  }

 private:
  // Edge-triggered epoll reports only new data: look first.
  static bool readable_now() {
    pollfd fd{STDIN_FILENO, POLLIN, 0};
    return ::poll(&fd, 1, 0) > 0;
  }

  kj::UnixEventPort& port_;
  kj::Own<kj::UnixEventPort::FdObserver> observer_;
  std::string buffer_;
  bool end_ = false;
};

int run_chat(Session& session, const GenerateFlags& flags) {
  std::vector<ChatTurn> history;
  if (!flags.system.empty()) history.push_back({"system", flags.system});
  LineReader reader(session.event_port());
  const bool interactive = ::isatty(STDIN_FILENO) != 0;
  for (;;) {
    if (interactive) {
      std::fputs("> ", stderr);
      std::fflush(stderr);
    }
    std::string line;
    const LineReader::Status status = reader.next(session.wait_scope(), line);
    if (status == LineReader::Status::kEnd) return 0;
    if (status == LineReader::Status::kInterrupted) {
      std::fputs("\n", stderr);
      return kExitInterrupted;
    }
    if (line.empty()) continue;
    history.push_back({"user", line});
    const GenerateOutcome outcome = session.generate(history, flags.options, print_text);
    print_text("\n");
    throw_if_failed(outcome);
    // A cancelled answer stays in the history as far as it got.
    history.push_back({"assistant", outcome.text});
  }
}

int run_stats(Session& session) {
  auto response = session.stats();
  const auto s = response.getStats();
  std::printf(
      "running_sequences %u\nwaiting_sequences %u\nactive_requests %u\nfinished_requests %llu\n"
      "refused_requests %llu\nkv_blocks_total %u\nkv_blocks_free %u\nkv_block_tokens %u\n"
      "prompt_tokens %llu\nprefix_hit_tokens %llu\ngenerated_tokens %llu\nsteps %llu\n"
      "preemptions %llu\n",
      s.getRunningSequences(), s.getWaitingSequences(), s.getActiveRequests(),
      static_cast<unsigned long long>(s.getFinishedRequests()),
      static_cast<unsigned long long>(s.getRefusedRequests()), s.getKvBlocksTotal(),
      s.getKvBlocksFree(), s.getKvBlockTokens(),
      static_cast<unsigned long long>(s.getPromptTokens()),
      static_cast<unsigned long long>(s.getPrefixHitTokens()),
      static_cast<unsigned long long>(s.getGeneratedTokens()),
      static_cast<unsigned long long>(s.getSteps()),
      static_cast<unsigned long long>(s.getPreemptions()));
  std::printf("kv_blocks_quarantined %u\n", s.getKvBlocksQuarantined());
  std::printf("draining %d\n", s.getDraining() ? 1 : 0);
  unsigned i = 0;
  for (auto instance : s.getInstances()) {
    const char* state = instance.getLost()       ? "lost"
                        : instance.getLeft()     ? "left"
                        : instance.getDraining() ? "draining"
                                                 : "live";
    const bool switching = instance.getSwitchingTo().size() > 0;
    std::printf("instance %u %s rank %d %s epoch %llu%s%s%s%s%s%s\n", i++,
                instance.getRole().cStr(), instance.getLeaderRank(), state,
                static_cast<unsigned long long>(instance.getEpoch()),
                instance.getLost() || instance.getLeft() ? ": " : "", instance.getReason().cStr(),
                instance.getJoined() ? " joined from " : "",
                instance.getJoined() ? instance.getHost().cStr() : "",
                switching ? " switching to " : "", instance.getSwitchingTo().cStr());
  }
  return 0;
}

// The server's health in the words of its HTTP front: ok, degraded (serving
// with instances lost), draining (stopping: running requests finish, new ones
// are refused), unavailable. Exit code 0 while it takes new requests, else 1.
int run_health(Session& session) {
  const rpc::HealthStatus status = session.health();
  const char* word = "unavailable";
  switch (status) {
    case rpc::HealthStatus::SERVING:
      word = "ok";
      break;
    case rpc::HealthStatus::DEGRADED:
      word = "degraded";
      break;
    case rpc::HealthStatus::DRAINING:
      word = "draining";
      break;
    case rpc::HealthStatus::SHUTTING_DOWN:
      break;
  }
  std::printf("%s\n", word);
  return status == rpc::HealthStatus::SERVING || status == rpc::HealthStatus::DEGRADED ? 0 : 1;
}

// Proves the cluster key (read from `key_file`) and asks the coordinator to
// turn one instance into another role; prints what will happen.
int run_set_role(Session& session, const SetRoleFlags& flags) {
  std::printf("%s\n", session.set_role(flags.key_file, flags.instance, flags.role).c_str());
  return 0;
}

int run_info(Session& session) {
  auto response = session.model_info();
  const auto info = response.getInfo();
  std::printf(
      "name %s\ncontext_length %u\nvocab_size %u\nkv_capacity_tokens %u\n"
      "max_prompt_tokens %u\nmax_tokens %u\n",
      info.getName().cStr(), info.getContextLength(), info.getVocabSize(),
      info.getKvCapacityTokens(), info.getMaxPromptTokens(), info.getMaxTokens());
  return 0;
}

}  // namespace
}  // namespace duet::client

int main(int argc, char** argv) {
  using namespace duet::client;
  CLI::App app{"duet-client: talk to a Duet server over Cap'n Proto RPC"};
  app.require_subcommand(1);
  std::string connect;
  std::string api_key;
  app.add_option("--connect", connect, "Server address, HOST:PORT")->required();
  app.add_option("--api-key", api_key, "API key, when the server requires one")
      ->envname("DUET_API_KEY");

  GenerateFlags generate_flags;
  CLI::App* generate = app.add_subcommand("generate", "Stream the continuation of one prompt");
  generate->add_option("-p,--prompt", generate_flags.prompt, "Prompt text")->required();
  generate->add_flag("--chat", generate_flags.chat,
                     "Send the prompt as a user message (the model's chat template applies)");
  generate->add_option("--system", generate_flags.system, "With --chat: a system message first");
  add_sampling_flags(*generate, generate_flags.options);

  GenerateFlags chat_flags;
  CLI::App* chat = app.add_subcommand("chat", "Chat: one user message per stdin line; EOF ends");
  chat->add_option("--system", chat_flags.system, "A system message first");
  add_sampling_flags(*chat, chat_flags.options);

  app.add_subcommand("stats", "Print the server's statistics");
  app.add_subcommand("info", "Print the served model's description");
  app.add_subcommand("health",
                     "Print the server's health: ok, degraded, draining or unavailable (exit 0 "
                     "while it takes new requests, else 1)");

  SetRoleFlags set_role_flags;
  CLI::App* set_role = app.add_subcommand(
      "set-role",
      "Turn a cluster's instance into prefill, decode or both while it serves (it finishes what "
      "it runs first); proves the cluster key");
  set_role->add_option("--instance", set_role_flags.instance, "The instance's index (see stats)")
      ->required()
      ->check(CLI::NonNegativeNumber);
  set_role->add_option("--role", set_role_flags.role, "Its new role")
      ->required()
      ->check(CLI::IsMember({"prefill", "decode", "both"}));
  set_role
      ->add_option("--cluster-key", set_role_flags.key_file,
                   "The cluster's key file (the coordinator's --cluster-key)")
      ->required();

  if (const auto exit_code = duet::tools::parse_command_line(app, argc, argv, "duet-client",
                                                             "invalid_argument", kExitRefused)) {
    return *exit_code;
  }

  // Before any thread exists and before the event loop: Ctrl-C becomes an
  // event (see Session::generate and LineReader), not the end of the process.
  kj::UnixEventPort::captureSignal(SIGINT);
  try {
    const Endpoint endpoint = parse_endpoint(connect);
    kj::AsyncIoContext io = kj::setupAsyncIo();
    Session session(io, endpoint, api_key);
    if (app.got_subcommand("generate")) return run_generate(session, generate_flags);
    if (app.got_subcommand("chat")) return run_chat(session, chat_flags);
    if (app.got_subcommand("stats")) return run_stats(session);
    if (app.got_subcommand("info")) return run_info(session);
    if (app.got_subcommand("health")) return run_health(session);
    if (app.got_subcommand("set-role")) return run_set_role(session, set_role_flags);
  } catch (const ClientError& e) {
    std::fprintf(stderr, "duet-client: %s: %s\n", e.kind().c_str(), e.what());
    return e.exit_code();
  } catch (const RpcError& e) {
    std::fprintf(stderr, "duet-client: %s: %s\n", e.kind().c_str(), e.what());
    return e.lost_connection() ? kExitConnection : kExitRefused;
  } catch (const kj::Exception& e) {
    std::fprintf(stderr, "duet-client: connection: %s\n", e.getDescription().cStr());
    return kExitConnection;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-client: internal: %s\n", e.what());
    return kExitConnection;
  }
  return 0;
}
