// duet-bench: drives a Duet deployment (Cap'n Proto, by default) or any
// OpenAI-compatible server (--http URL) with open-loop (--rate, a sweep of
// rates) or closed-loop (--concurrency) traffic and reports TTFT, TPOT, ITL,
// E2E, throughput and goodput; `duet-bench make-trace` writes a synthetic
// trace. Wiring only: the work is in loadgen/.
//
//   duet-bench --rate 2,4,8 -n 200 --input-len uniform:64:512 --output-len 128
//              --slo ttft=500,tpot=50 --json out.json --plot out.png
//   duet-bench --http http://127.0.0.1:8080 --concurrency 16 --trace chat.csv
//   duet-bench make-trace --phases chat:60:0.75,pages:90:0.4,chat:60:0.75 -o shift.csv
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "loadgen/command_line.h"
#include "loadgen/http_client.h"
#include "loadgen/prompts.h"
#include "loadgen/report.h"
#include "loadgen/rpc_client.h"
#include "loadgen/runner.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace {

using namespace duet::loadgen;

struct Flags {
  std::string connect = "127.0.0.1:7433";
  std::string http;
  std::string api_key;
  std::string model;
  std::string rates;
  std::string concurrencies;
  double burstiness = 1;
  int64_t n_requests = 100;
  std::string input_len = "128";
  std::string output_len = "128";
  std::string trace;
  double time_scale = 1;
  uint64_t seed = 0;
  std::string corpus = DUET_BENCH_CORPUS;
  bool no_stream = false;
  std::string slo;
  std::string json;
  std::string plot;
  double timeout_s = 600;
  bool no_progress = false;
  int64_t warmup = 0;
};

struct MakeTraceFlags {
  std::string mix = "chat";
  int64_t n = 1000;
  double rate = 1;
  uint64_t seed = 0;
  std::string phases;
  std::string output;
};

int make_trace_command(const MakeTraceFlags& flags) {
  const std::vector<PlannedRequest> trace =
      flags.phases.empty() ? make_trace(flags.mix, flags.n, flags.rate, flags.seed)
                           : make_phased_trace(parse_trace_phases(flags.phases), flags.seed);
  write_trace(flags.output, trace);
  std::cerr << "duet-bench: wrote " << trace.size() << " requests ("
            << (flags.phases.empty() ? fmt::format("{}, {} req/s", flags.mix, flags.rate)
                                     : flags.phases)
            << ") to " << flags.output << "\n";
  return 0;
}

int bench_command(const Flags& flags) {
  const Slo slo = parse_slo(flags.slo);
  const std::vector<double> rates = parse_rates(flags.rates);
  std::vector<int64_t> concurrencies;
  for (const std::string& part : split(flags.concurrencies, ','))
    concurrencies.push_back(static_cast<int64_t>(parse_number(part, "--concurrency")));
  const bool from_trace = !flags.trace.empty();
  DUET_REQUIRE(from_trace || !rates.empty() || !concurrencies.empty(),
               "say how to send: --rate R[,R...], --concurrency C[,C...] or --trace FILE");
  DUET_REQUIRE(flags.n_requests >= 1, "--num-requests must be at least 1");
  if (flags.no_stream && slo.ttft)
    std::cerr << "duet-bench: warning: --no-stream requests have no TTFT; none meets a TTFT SLO\n";

  // The workload: lengths (and, from a trace, arrival times), the same for every run.
  const std::vector<PlannedRequest> workload =
      make_workload({flags.trace, flags.n_requests, flags.input_len, flags.output_len, flags.seed});

  std::unique_ptr<Client> client;
  try {
    if (!flags.http.empty()) {
      client = make_http_client({flags.http, flags.api_key, flags.model, flags.timeout_s});
    } else {
      client = make_rpc_client({flags.connect, flags.api_key, flags.timeout_s});
    }
  } catch (const duet::Error& e) {
    std::cerr << "duet-bench: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "duet-bench: " << client->describe() << "; tokenizing the corpus\n";
  const std::string corpus = read_corpus(flags.corpus);
  std::vector<int32_t> corpus_tokens;
  try {
    corpus_tokens = client->tokenize(corpus);
  } catch (const duet::Error& e) {
    std::cerr << "duet-bench: " << e.what() << "\n";
    return 1;
  }
  const PromptSource prompts(std::move(corpus_tokens));
  std::cerr << "duet-bench: corpus of " << prompts.size() << " tokens\n";

  const ArrivalOptions arrivals{from_trace, flags.time_scale, flags.burstiness, flags.seed};
  // Runs: every rate (open loop), then every concurrency (closed loop).
  std::vector<std::pair<RunOptions, RunResult>> plans;
  const auto add = [&](RunOptions options, RunResult result) {
    options.stream = !flags.no_stream;
    options.progress = !flags.no_progress;
    options.label = result.label;
    plans.emplace_back(std::move(options), std::move(result));
  };
  for (const double rate : rates) {
    add({open_loop_plan(workload, rate, arrivals)}, {format_rate(rate), rate});
  }
  for (const int64_t c : concurrencies) {
    RunOptions options{workload, c};
    add(std::move(options), {fmt::format("concurrency {}", c), std::nullopt, c});
  }
  if (from_trace && plans.empty()) {
    add({open_loop_plan(workload, std::nullopt, arrivals)},
        {fmt::format("trace x{:g}", flags.time_scale)});
  }

  std::mt19937_64 prompt_rng(flags.seed ^ 0x9e3779b97f4a7c15ULL);  // fresh windows every run
  if (flags.warmup > 0) {
    // Unrecorded: lets the server allocate and the client open its connections.
    RunOptions warmup{
        {workload.begin(), workload.begin() + std::min<int64_t>(flags.warmup, workload.size())},
        flags.warmup};
    warmup.stream = !flags.no_stream;
    warmup.progress = false;
    const std::vector<RequestRecord> records = run(*client, prompts, prompt_rng, warmup);
    const auto n_ok = std::count_if(records.begin(), records.end(), [](auto& r) { return r.ok; });
    std::cerr << "duet-bench: warm-up: " << n_ok << " of " << records.size() << " ok\n";
  }
  std::vector<RunResult> results;
  for (auto& [options, result] : plans) {
    result.records = run(*client, prompts, prompt_rng, options);
    result.summary = summarize(result.records, slo);
    print_run(std::cout, result, slo);
    results.push_back(std::move(result));
  }
  if (results.size() > 1) print_sweep(std::cout, results);
  std::cout.flush();

  const nlohmann::json config = {{"server", client->describe()},
                                 {"protocol", flags.http.empty() ? "rpc" : "http"},
                                 {"model", flags.model},
                                 {"rates", flags.rates},
                                 {"concurrency", flags.concurrencies},
                                 {"burstiness", flags.burstiness},
                                 {"num_requests", flags.n_requests},
                                 {"input_len", from_trace ? "trace" : flags.input_len},
                                 {"output_len", from_trace ? "trace" : flags.output_len},
                                 {"trace", flags.trace},
                                 {"time_scale", flags.time_scale},
                                 {"seed", flags.seed},
                                 {"stream", !flags.no_stream},
                                 {"warmup", flags.warmup},
                                 {"corpus_tokens", prompts.size()}};
  std::string json_path = flags.json;
  if (json_path.empty() && !flags.plot.empty())
    json_path = (std::filesystem::temp_directory_path() /
                 fmt::format("duet-bench-{}.json", static_cast<long>(getpid())))
                    .string();
  if (!json_path.empty()) {
    write_json(json_path, report_json(config, slo, results));
    if (!flags.json.empty()) std::cerr << "duet-bench: wrote " << json_path << "\n";
  }
  if (!flags.plot.empty()) plot("duet-bench", DUET_BENCH_PLOT_SCRIPT, json_path, flags.plot);
  if (flags.json.empty() && !json_path.empty()) std::filesystem::remove(json_path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"duet-bench: serving benchmark (TTFT, TPOT, throughput, goodput)"};
  Flags flags;
  app.add_option("--connect", flags.connect, "Duet's Cap'n Proto endpoint, HOST:PORT")
      ->capture_default_str();
  app.add_option("--http", flags.http,
                 "Drive an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000");
  app.add_option("--api-key", flags.api_key, "API key, when the server requires one");
  app.add_option("--model", flags.model,
                 "The request's model field (HTTP; default: the "
                 "first of GET /v1/models)");
  app.add_option("--rate", flags.rates,
                 "Open loop: requests/s, a list for a sweep (2,4,8), "
                 "or inf (all at once)");
  app.add_option("--burstiness", flags.burstiness, "Gamma arrivals' shape: 1 Poisson, < 1 burstier")
      ->capture_default_str();
  app.add_option("--concurrency", flags.concurrencies,
                 "Closed loop: requests kept in flight, or a list for a sweep");
  app.add_option("-n,--num-requests", flags.n_requests, "Requests per run (a trace: its first N)")
      ->capture_default_str();
  app.add_option("--input-len", flags.input_len,
                 "Prompt tokens: N, uniform:MIN:MAX or normal:MEAN:SD")
      ->capture_default_str();
  app.add_option("--output-len", flags.output_len, "Generated tokens, as --input-len")
      ->capture_default_str();
  app.add_option("--trace", flags.trace,
                 "CSV trace (TIMESTAMP,ContextTokens,GeneratedTokens) instead of the lengths; "
                 "replayed at its times, or scaled to --rate");
  app.add_option("--time-scale", flags.time_scale, "Replay a trace this many times faster")
      ->capture_default_str();
  app.add_option("--seed", flags.seed, "Seed of lengths, arrivals and prompts")
      ->capture_default_str();
  app.add_option("--corpus", flags.corpus, "Text the prompts are cut from");
  app.add_flag("--no-stream", flags.no_stream, "Whole responses: latency and throughput only");
  app.add_option("--slo", flags.slo, "Goodput's bounds, ttft=MS,tpot=MS");
  app.add_option("--json", flags.json, "Write the summary and every request here");
  app.add_option("--plot", flags.plot, "Write latency CDFs (and sweep curves) to this PNG");
  app.add_option("--timeout", flags.timeout_s, "Per-request timeout, seconds")
      ->capture_default_str();
  app.add_flag("--no-progress", flags.no_progress, "No progress line on stderr");
  app.add_option("--warmup", flags.warmup,
                 "Requests sent all at once before the runs, not recorded")
      ->capture_default_str();

  MakeTraceFlags trace_flags;
  CLI::App* make_trace_cmd = app.add_subcommand("make-trace", "Write a synthetic trace file");
  CLI::Option* mix =
      make_trace_cmd->add_option("--mix", trace_flags.mix, "chat, long, mixed or pages")
          ->capture_default_str();
  CLI::Option* n =
      make_trace_cmd->add_option("-n", trace_flags.n, "Requests")->capture_default_str();
  CLI::Option* rate = make_trace_cmd->add_option("--rate", trace_flags.rate, "Mean requests/s")
                          ->capture_default_str();
  make_trace_cmd
      ->add_option("--phases", trace_flags.phases,
                   "A shifting load instead: MIX:SECONDS:RATE,... one after another "
                   "(e.g. chat:60:0.75,pages:90:0.4,chat:60:0.75)")
      ->excludes(mix, n, rate);
  make_trace_cmd->add_option("--seed", trace_flags.seed, "Seed")->capture_default_str();
  make_trace_cmd->add_option("-o,--output", trace_flags.output, "Trace file to write")->required();
  app.require_subcommand(0, 1);

  CLI11_PARSE(app, argc, argv);
  try {
    if (*make_trace_cmd) return make_trace_command(trace_flags);
    return bench_command(flags);
  } catch (const duet::Error& e) {
    std::cerr << "duet-bench: " << e.what() << "\n";
    return 2;
  }
}
