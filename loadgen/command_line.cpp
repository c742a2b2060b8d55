#include "loadgen/command_line.h"

#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>

#include "common/error.h"

extern char** environ;

namespace duet::loadgen {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, separator);)
    if (!part.empty()) parts.push_back(part);
  return parts;
}

double parse_number(const std::string& text, const char* what) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DUET_REQUIRE(used == text.size() && used > 0, "{}: '{}' is not a number", what, text);
  return value;
}

std::vector<double> parse_rates(const std::string& text) {
  std::vector<double> rates;
  for (const std::string& part : split(text, ',')) {
    const double rate =
        part == "inf" ? std::numeric_limits<double>::infinity() : parse_number(part, "--rate");
    DUET_REQUIRE(rate > 0, "--rate must be positive, got {}", part);
    rates.push_back(rate);
  }
  return rates;
}

Slo parse_slo(const std::string& text) {
  Slo slo;
  for (const std::string& part : split(text, ',')) {
    const size_t eq = part.find('=');
    DUET_REQUIRE(eq != std::string::npos, "--slo {}: expected ttft=MS,tpot=MS", text);
    const std::string key = part.substr(0, eq);
    const double ms = parse_number(part.substr(eq + 1), "--slo");
    DUET_REQUIRE(ms > 0, "--slo {}: bounds must be positive", text);
    DUET_REQUIRE(key == "ttft" || key == "tpot", "--slo {}: unknown bound '{}'", text, key);
    (key == "ttft" ? slo.ttft : slo.tpot) = ms / 1e3;
  }
  return slo;
}

std::string format_rate(double rate) {
  return std::isinf(rate) ? "rate inf" : fmt::format("rate {:g} req/s", rate);
}

std::vector<PlannedRequest> make_workload(const WorkloadOptions& options) {
  std::vector<PlannedRequest> workload;
  if (!options.trace.empty()) {
    workload = read_trace(options.trace);
    DUET_REQUIRE(!workload.empty(), "{} holds no requests", options.trace);
    if (static_cast<int64_t>(workload.size()) > options.n_requests)
      workload.resize(static_cast<size_t>(options.n_requests));
    return workload;
  }
  const LengthSpec input = parse_length_spec(options.input_len);
  const LengthSpec output = parse_length_spec(options.output_len);
  std::mt19937_64 rng(options.seed);
  for (int64_t i = 0; i < options.n_requests; ++i) {
    const int64_t prompt_tokens = draw_length(input, rng);
    workload.push_back({0, prompt_tokens, draw_length(output, rng)});
  }
  return workload;
}

std::vector<PlannedRequest> open_loop_plan(const std::vector<PlannedRequest>& workload,
                                           std::optional<double> rate,
                                           const ArrivalOptions& options) {
  const bool from_trace = options.from_trace;
  std::vector<PlannedRequest> plan = workload;
  if (from_trace) {
    if (!rate) return scale_trace(std::move(plan), options.time_scale);
    const double span = plan.back().at - plan.front().at;
    if (std::isinf(*rate) || span <= 0) {
      for (PlannedRequest& p : plan) p.at = 0;
      return plan;
    }
    // Scaled so that its mean rate is `rate`.
    const double recorded = static_cast<double>(plan.size() - 1) / span;
    return scale_trace(std::move(plan), *rate / recorded);
  }
  if (std::isinf(*rate)) {
    for (PlannedRequest& p : plan) p.at = 0;
    return plan;
  }
  // The same seed for every rate: one arrival pattern, stretched.
  std::mt19937_64 rng(options.seed + 1);
  const std::vector<double> at =
      arrival_times(static_cast<int64_t>(plan.size()), *rate, options.burstiness, rng);
  for (size_t i = 0; i < plan.size(); ++i) plan[i].at = at[i];
  return plan;
}

void plot(const std::string& tool, const std::string& default_script, const std::string& json_path,
          const std::string& png_path) {
  const char* script_env = std::getenv("DUET_BENCH_PLOT_SCRIPT");
  const std::string script = script_env != nullptr ? script_env : default_script;
  const char* python_env = std::getenv("DUET_PYTHON");
  const std::string python = python_env != nullptr ? python_env : "python3";
  std::vector<std::string> args = {python, script, json_path, png_path};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int status = 0;
  if (posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ) != 0 ||
      waitpid(pid, &status, 0) < 0) {
    std::cerr << tool << ": no plot: cannot run " << python << "\n";
    return;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << tool << ": no plot written (" << script << " failed; see above)\n";
    return;
  }
  std::cerr << tool << ": wrote " << png_path << "\n";
}

}  // namespace duet::loadgen
