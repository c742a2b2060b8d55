#include "loadgen/report.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>

#include "common/error.h"

namespace duet::loadgen {
namespace {

using json = nlohmann::json;

json optional_json(const std::optional<double>& value, double scale = 1) {
  return value ? json(*value * scale) : json(nullptr);
}

json distribution_ms(const Distribution& d) {
  return {{"n", d.n},           {"mean", d.mean * 1e3}, {"p50", d.p50 * 1e3},
          {"p90", d.p90 * 1e3}, {"p99", d.p99 * 1e3},   {"max", d.max * 1e3}};
}

json rate_json(const std::optional<double>& rate) {
  if (!rate) return nullptr;
  if (std::isinf(*rate)) return "inf";
  return *rate;
}

std::string slo_text(const Slo& slo) {
  std::string text;
  if (slo.ttft) text += fmt::format("TTFT <= {:g} ms", *slo.ttft * 1e3);
  if (slo.tpot) text += fmt::format("{}TPOT <= {:g} ms", text.empty() ? "" : ", ", *slo.tpot * 1e3);
  return text.empty() ? "no SLO given: every ok request counts" : text;
}

}  // namespace

json summary_json(const Summary& s, std::span<const RequestRecord> records) {
  int64_t n_short = 0;
  for (const RequestRecord& r : records) n_short += r.ok && r.received_tokens < r.output_tokens;
  return {{"n_requests", s.n_requests},
          {"n_ok", s.n_ok},
          {"errors", s.errors},
          {"duration_s", s.duration},
          {"request_rate", s.request_rate},
          {"output_token_rate", s.output_token_rate},
          {"total_token_rate", s.total_token_rate},
          {"goodput", s.goodput},
          {"goodput_fraction", s.goodput_fraction},
          {"ttft_ms", distribution_ms(s.ttft)},
          {"tpot_ms", distribution_ms(s.tpot)},
          {"itl_ms", distribution_ms(s.itl)},
          {"e2e_ms", distribution_ms(s.e2e)},
          {"short_requests", n_short}};
}

json record_json(const RequestRecord& r, const Slo& slo) {
  return {{"index", r.index},
          {"scheduled_s", r.scheduled},
          {"sent_s", r.sent},
          {"first_token_s", optional_json(r.first_token)},
          {"finished_s", r.finished},
          {"token_times_s", r.token_times},
          {"prompt_tokens", r.prompt_tokens},
          {"output_tokens", r.output_tokens},
          {"received_tokens", r.received_tokens},
          {"ok", r.ok},
          {"error_kind", r.error_kind},
          {"error_message", r.error_message},
          {"server_ttft_s", optional_json(r.server_ttft)},
          {"server_tpot_s", optional_json(r.server_tpot)},
          {"server_e2e_s", optional_json(r.server_e2e)},
          {"meets_slo", meets_slo(r, slo)}};
}

json report_json(const json& config, const Slo& slo, const std::vector<RunResult>& runs) {
  json out = {
      {"tool", "duet-bench"},
      {"version", 1},
      {"config", config},
      {"slo",
       {{"ttft_ms", optional_json(slo.ttft, 1e3)}, {"tpot_ms", optional_json(slo.tpot, 1e3)}}},
      {"runs", json::array()}};
  for (const RunResult& run : runs) {
    json requests = json::array();
    for (const RequestRecord& r : run.records) requests.push_back(record_json(r, slo));
    out["runs"].push_back(
        {{"label", run.label},
         {"rate", rate_json(run.rate)},
         {"concurrency", run.concurrency ? json(*run.concurrency) : json(nullptr)},
         {"summary", summary_json(run.summary, run.records)},
         {"requests", std::move(requests)}});
  }
  return out;
}

void write_json(const std::filesystem::path& path, const json& report) {
  std::ofstream file(path);
  DUET_REQUIRE(file.good(), "cannot write {}", path.string());
  // Error messages from servers may hold any bytes: replaced, not refused.
  file << report.dump(1, ' ', false, json::error_handler_t::replace) << "\n";
  DUET_REQUIRE(file.good(), "cannot write {}", path.string());
}

void print_run(std::ostream& out, const RunResult& run, const Slo& slo) {
  const Summary& s = run.summary;
  out << fmt::format("\n==================== {} ====================\n", run.label);
  out << fmt::format("{:<24}{} ok of {}\n", "requests", s.n_ok, s.n_requests);
  for (const auto& [kind, n] : s.errors) out << fmt::format("{:<24}{} {}\n", "  failed", n, kind);
  out << fmt::format("{:<24}{:.2f} s\n", "duration", s.duration);
  out << fmt::format("{:<24}{:.2f} req/s\n", "request throughput", s.request_rate);
  out << fmt::format("{:<24}{:.1f} tok/s\n", "output throughput", s.output_token_rate);
  out << fmt::format("{:<24}{:.1f} tok/s\n", "total throughput", s.total_token_rate);
  out << fmt::format("{:<24}{:.2f} req/s ({:.1f}% of requests; {})\n", "goodput", s.goodput,
                     100 * s.goodput_fraction, slo_text(slo));
  int64_t n_short = 0;
  for (const RequestRecord& r : run.records) n_short += r.ok && r.received_tokens < r.output_tokens;
  if (n_short > 0) {
    out << fmt::format(
        "{:<24}{} ok requests got fewer tokens than asked (ignore_eos unsupported?)\n", "warning",
        n_short);
  }
  out << fmt::format("{:<10}{:>6}{:>10}{:>10}{:>10}{:>10}{:>10}\n", "(ms)", "n", "mean", "p50",
                     "p90", "p99", "max");
  const auto row = [&](const char* name, const Distribution& d) {
    out << fmt::format("{:<10}{:>6}{:>10.1f}{:>10.1f}{:>10.1f}{:>10.1f}{:>10.1f}\n", name, d.n,
                       d.mean * 1e3, d.p50 * 1e3, d.p90 * 1e3, d.p99 * 1e3, d.max * 1e3);
  };
  row("TTFT", s.ttft);
  row("TPOT", s.tpot);
  row("ITL", s.itl);
  row("E2E", s.e2e);
}

void print_sweep(std::ostream& out, const std::vector<RunResult>& runs) {
  out << "\n| run | ok/n | req/s | out tok/s | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | "
         "TPOT p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const RunResult& run : runs) {
    const Summary& s = run.summary;
    out << fmt::format(
        "| {} | {}/{} | {:.2f} | {:.1f} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n",
        run.label, s.n_ok, s.n_requests, s.request_rate, s.output_token_rate, s.goodput,
        s.ttft.p50 * 1e3, s.ttft.p99 * 1e3, s.tpot.p50 * 1e3, s.tpot.p99 * 1e3);
  }
  out << "(latencies in ms)\n";
}

}  // namespace duet::loadgen
