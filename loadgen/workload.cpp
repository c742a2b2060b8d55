#include "loadgen/workload.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <string_view>
#include <type_traits>

#include "common/error.h"
#include "loadgen/command_line.h"

namespace duet::loadgen {
namespace {

std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\r\n";
  const size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  const size_t end = s.find_last_not_of(kSpace);
  return s.substr(begin, end - begin + 1);
}

// Fields of one CSV line, trimmed, with surrounding double quotes removed
// (no quoted commas: the traces this reads never have them).
std::vector<std::string_view> split_csv(std::string_view line) {
  std::vector<std::string_view> fields;
  while (true) {
    const size_t comma = line.find(',');
    std::string_view field = trim(line.substr(0, comma));
    if (field.size() >= 2 && field.front() == '"' && field.back() == '"') {
      field = trim(field.substr(1, field.size() - 2));
    }
    fields.push_back(field);
    if (comma == std::string_view::npos) return fields;
    line.remove_prefix(comma + 1);
  }
}

// The whole of `s` as a T, or nothing.
template <typename T>
std::optional<T> parse_number(std::string_view s) {
  T value{};
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(s.data(), end, value);
  if (s.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value)) return std::nullopt;
  }
  return value;
}

bool is_whole(double x) { return x == std::floor(x); }

// ---- Timestamps -----------------------------------------------------------

// A trace row's time: seconds as a number, or a calendar date-time kept as
// integer 100 ns ticks since 1970 (a double would lose the 7th fractional
// digit at today's epoch seconds).
struct Timestamp {
  bool calendar = false;
  double seconds = 0;
  int64_t ticks = 0;
};

// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
int64_t days_from_civil(int64_t y, int64_t m, int64_t d) {
  y -= m <= 2 ? 1 : 0;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

int64_t days_in_month(int64_t y, int64_t m) {
  static constexpr int64_t kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  return m == 2 && leap ? 29 : kDays[m - 1];
}

// "YYYY-MM-DD HH:MM:SS[.f{1,7}]" (a 'T' separator is accepted too).
std::optional<Timestamp> parse_calendar(std::string_view s) {
  if (s.size() < 19 || s[4] != '-' || s[7] != '-' || (s[10] != ' ' && s[10] != 'T') ||
      s[13] != ':' || s[16] != ':') {
    return std::nullopt;
  }
  const auto field = [&](size_t at, size_t len) -> std::optional<int64_t> {
    const std::string_view digits = s.substr(at, len);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::nullopt;
    }
    return parse_number<int64_t>(digits);
  };
  const auto year = field(0, 4), month = field(5, 2), day = field(8, 2);
  const auto hour = field(11, 2), minute = field(14, 2), second = field(17, 2);
  if (!year || !month || !day || !hour || !minute || !second) return std::nullopt;
  if (*month < 1 || *month > 12 || *day < 1 || *day > days_in_month(*year, *month) || *hour > 23 ||
      *minute > 59 || *second > 59) {
    return std::nullopt;
  }
  int64_t fraction_ticks = 0;
  if (s.size() > 19) {
    const size_t n_digits = s.size() - 20;
    if (s[19] != '.' || n_digits < 1 || n_digits > 7) return std::nullopt;
    const auto fraction = field(20, n_digits);
    if (!fraction) return std::nullopt;
    fraction_ticks = *fraction;
    for (size_t i = n_digits; i < 7; ++i) fraction_ticks *= 10;
  }
  const int64_t whole_seconds =
      days_from_civil(*year, *month, *day) * 86400 + *hour * 3600 + *minute * 60 + *second;
  Timestamp t;
  t.calendar = true;
  t.ticks = whole_seconds * 10'000'000 + fraction_ticks;
  return t;
}

std::optional<Timestamp> parse_timestamp(std::string_view s) {
  if (const std::optional<double> seconds = parse_number<double>(s)) {
    Timestamp t;
    t.seconds = *seconds;
    return t;
  }
  return parse_calendar(s);
}

// Seconds from `origin` to `t`; both of the same kind.
double seconds_between(const Timestamp& origin, const Timestamp& t) {
  if (t.calendar) return static_cast<double>(t.ticks - origin.ticks) * 1e-7;
  return t.seconds - origin.seconds;
}

}  // namespace

std::vector<double> arrival_times(int64_t n, double rate, double burstiness, std::mt19937_64& rng) {
  DUET_REQUIRE(n >= 0, "the number of arrivals must be >= 0, got {}", n);
  DUET_REQUIRE(std::isfinite(rate) && rate > 0, "the arrival rate must be > 0, got {}", rate);
  DUET_REQUIRE(std::isfinite(burstiness) && burstiness > 0, "burstiness must be > 0, got {}",
               burstiness);
  // The first request goes at time 0 (as vLLM's benchmark sends it); each
  // later one after a gap drawn independently.
  std::vector<double> times;
  times.reserve(static_cast<size_t>(n));
  std::exponential_distribution<double> exponential(rate);
  std::gamma_distribution<double> gamma(burstiness, 1.0 / (rate * burstiness));
  double t = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) t += burstiness == 1.0 ? exponential(rng) : gamma(rng);
    times.push_back(t);
  }
  return times;
}

// Fixed and uniform lengths are whole numbers >= 1 (uniform: min <= max);
// a normal length has a finite mean and a standard deviation >= 0.
LengthSpec parse_length_spec(const std::string& text) {
  const std::vector<std::string_view> parts = [&] {
    std::vector<std::string_view> out;
    std::string_view rest = text;
    while (true) {
      const size_t colon = rest.find(':');
      out.push_back(rest.substr(0, colon));
      if (colon == std::string_view::npos) return out;
      rest.remove_prefix(colon + 1);
    }
  }();
  const auto number = [&](std::string_view s) {
    const std::optional<double> value = parse_number<double>(s);
    DUET_REQUIRE(value.has_value(), "length spec '{}': '{}' is not a number", text, s);
    return *value;
  };
  const auto require_length = [&](double x) {
    DUET_REQUIRE(x >= 1 && is_whole(x), "length spec '{}': {} is not a whole number >= 1", text, x);
  };

  LengthSpec spec;
  if (parts.size() == 1) {
    spec.kind = LengthSpec::Kind::kFixed;
    spec.a = number(parts[0]);
    require_length(spec.a);
  } else if (parts.size() == 3 && parts[0] == "uniform") {
    spec.kind = LengthSpec::Kind::kUniform;
    spec.a = number(parts[1]);
    spec.b = number(parts[2]);
    require_length(spec.a);
    require_length(spec.b);
    DUET_REQUIRE(spec.a <= spec.b, "length spec '{}': min {} > max {}", text, spec.a, spec.b);
  } else if (parts.size() == 3 && parts[0] == "normal") {
    spec.kind = LengthSpec::Kind::kNormal;
    spec.a = number(parts[1]);
    spec.b = number(parts[2]);
    DUET_REQUIRE(spec.b >= 0, "length spec '{}': standard deviation {} < 0", text, spec.b);
  } else {
    DUET_REQUIRE(false, "length spec '{}' is none of N, uniform:MIN:MAX, normal:MEAN:STD", text);
  }
  return spec;
}

// Fixed: a; uniform: an integer in [a, b]; normal: a draw rounded to the
// nearest integer. Every result is clamped to >= 1.
int64_t draw_length(const LengthSpec& spec, std::mt19937_64& rng) {
  switch (spec.kind) {
    case LengthSpec::Kind::kFixed:
      return std::max<int64_t>(1, std::llround(spec.a));
    case LengthSpec::Kind::kUniform: {
      DUET_REQUIRE(spec.a <= spec.b, "uniform length: min {} > max {}", spec.a, spec.b);
      std::uniform_int_distribution<int64_t> uniform(std::llround(spec.a), std::llround(spec.b));
      return std::max<int64_t>(1, uniform(rng));
    }
    case LengthSpec::Kind::kNormal: {
      DUET_REQUIRE(spec.b >= 0, "normal length: standard deviation {} < 0", spec.b);
      if (spec.b == 0) return std::max<int64_t>(1, std::llround(spec.a));
      std::normal_distribution<double> normal(spec.a, spec.b);
      return std::max<int64_t>(1, std::llround(normal(rng)));
    }
  }
  DUET_ASSERT(false, "unknown length kind");
  return 1;
}

// Blank lines are skipped. Times are made relative to the earliest row (the
// first one once sorted; the sort is stable). Token counts are integers >= 0;
// a count of 0 is raised to 1, since a request asks for at least one token.
std::vector<PlannedRequest> read_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorKind::kNotFound, fmt::format("cannot open trace {}", path.string()));
  const std::string name = path.string();

  std::string line;
  int64_t line_no = 0;
  // The header: the first non-blank line.
  std::vector<std::string> header;
  while (header.empty() && std::getline(in, line)) {
    ++line_no;
    std::string_view text = line;
    if (line_no == 1 && text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);  // UTF-8 BOM
    if (trim(text).empty()) continue;
    for (const std::string_view field : split_csv(text)) header.emplace_back(field);
  }
  DUET_REQUIRE(!header.empty(), "{}: empty trace (no header line)", name);
  const auto column = [&](std::string_view wanted) {
    const auto it = std::find(header.begin(), header.end(), wanted);
    DUET_REQUIRE(it != header.end(), "{}:{}: the header has no {} column", name, line_no, wanted);
    return static_cast<size_t>(it - header.begin());
  };
  const size_t time_col = column("TIMESTAMP");
  const size_t context_col = column("ContextTokens");
  const size_t generated_col = column("GeneratedTokens");
  // Optional: each prompt's token ids.
  const auto ids_it = std::find(header.begin(), header.end(), "TokenIds");
  const bool has_ids = ids_it != header.end();
  const auto ids_col = static_cast<size_t>(ids_it - header.begin());
  const size_t n_needed =
      std::max({time_col, context_col, generated_col, has_ids ? ids_col : size_t{0}}) + 1;

  std::vector<Timestamp> times;
  std::vector<PlannedRequest> rows;
  while (std::getline(in, line)) {
    ++line_no;
    if (trim(line).empty()) continue;
    const std::vector<std::string_view> fields = split_csv(line);
    DUET_REQUIRE(fields.size() >= n_needed, "{}:{}: {} fields, the header needs {}", name, line_no,
                 fields.size(), n_needed);
    const std::optional<Timestamp> time = parse_timestamp(fields[time_col]);
    DUET_REQUIRE(time.has_value(),
                 "{}:{}: TIMESTAMP '{}' is neither seconds nor YYYY-MM-DD HH:MM:SS[.fraction]",
                 name, line_no, fields[time_col]);
    DUET_REQUIRE(times.empty() || times.front().calendar == time->calendar,
                 "{}:{}: TIMESTAMP '{}' mixes seconds and date-times", name, line_no,
                 fields[time_col]);
    const auto tokens = [&](size_t col, std::string_view what) {
      const std::optional<int64_t> count = parse_number<int64_t>(fields[col]);
      DUET_REQUIRE(count.has_value() && *count >= 0, "{}:{}: {} '{}' is not an integer >= 0", name,
                   line_no, what, fields[col]);
      return std::max<int64_t>(1, *count);
    };
    PlannedRequest request;
    request.prompt_tokens = tokens(context_col, "ContextTokens");
    request.output_tokens = tokens(generated_col, "GeneratedTokens");
    if (has_ids && !trim(fields[ids_col]).empty()) {
      std::istringstream ids{std::string(fields[ids_col])};
      for (std::string id; ids >> id;) {
        const std::optional<int64_t> value = parse_number<int64_t>(id);
        DUET_REQUIRE(value.has_value() && *value >= 0 && *value <= INT32_MAX,
                     "{}:{}: TokenIds holds '{}', not a token id", name, line_no, id);
        request.prompt_ids.push_back(static_cast<int32_t>(*value));
      }
      DUET_REQUIRE(static_cast<int64_t>(request.prompt_ids.size()) == request.prompt_tokens,
                   "{}:{}: ContextTokens is {} but TokenIds holds {} ids", name, line_no,
                   request.prompt_tokens, request.prompt_ids.size());
    }
    times.push_back(*time);
    rows.push_back(request);
  }
  if (rows.empty()) return rows;

  // Every time relative to one origin; then sorted.
  const Timestamp origin = times.front();
  for (size_t i = 0; i < rows.size(); ++i) rows[i].at = seconds_between(origin, times[i]);
  std::stable_sort(rows.begin(), rows.end(),
                   [](const PlannedRequest& x, const PlannedRequest& y) { return x.at < y.at; });
  const double earliest = rows.front().at;
  for (PlannedRequest& r : rows) r.at -= earliest;
  return rows;
}

// TIMESTAMP in seconds with microsecond precision, rows in the given order.
void write_trace(const std::filesystem::path& path, const std::vector<PlannedRequest>& requests) {
  std::ofstream out(path);
  if (!out) {
    throw Error(ErrorKind::kNotFound, fmt::format("cannot write trace {}", path.string()));
  }
  const bool with_ids = std::any_of(requests.begin(), requests.end(),
                                    [](const PlannedRequest& r) { return !r.prompt_ids.empty(); });
  out << (with_ids ? "TIMESTAMP,ContextTokens,GeneratedTokens,TokenIds\n"
                   : "TIMESTAMP,ContextTokens,GeneratedTokens\n");
  for (const PlannedRequest& r : requests) {
    out << fmt::format("{:.6f},{},{}", r.at, r.prompt_tokens, r.output_tokens);
    if (with_ids) out << fmt::format(",{}", fmt::join(r.prompt_ids, " "));
    out << "\n";
  }
  out.flush();
  if (!out) {
    throw Error(ErrorKind::kNotFound, fmt::format("writing trace {} failed", path.string()));
  }
}

std::vector<PlannedRequest> scale_trace(std::vector<PlannedRequest> trace, double time_scale) {
  DUET_REQUIRE(std::isfinite(time_scale) && time_scale > 0, "time scale must be > 0, got {}",
               time_scale);
  for (PlannedRequest& r : trace) r.at /= time_scale;
  return trace;
}

// Draw order (part of the determinism contract): all arrival times first,
// then per request its kind (mixed only), prompt length, output length.
std::vector<PlannedRequest> make_trace(const std::string& mix, int64_t n, double rate,
                                       uint64_t seed) {
  const LengthSpec chat_prompt{LengthSpec::Kind::kNormal, 200, 100};
  const LengthSpec chat_output{LengthSpec::Kind::kNormal, 150, 80};
  const LengthSpec long_prompt{LengthSpec::Kind::kUniform, 1500, 3500};
  const LengthSpec long_output{LengthSpec::Kind::kUniform, 50, 200};
  const LengthSpec pages_prompt{LengthSpec::Kind::kUniform, 600, 1400};
  const LengthSpec pages_output{LengthSpec::Kind::kUniform, 8, 32};
  constexpr double kMixedLongFraction = 0.2;
  constexpr double kMixedBurstiness = 0.3;

  const bool is_chat = mix == "chat", is_long = mix == "long", is_mixed = mix == "mixed",
             is_pages = mix == "pages";
  DUET_REQUIRE(is_chat || is_long || is_mixed || is_pages,
               "unknown trace mix '{}' (chat, long, mixed, pages)", mix);
  std::mt19937_64 rng(seed);
  const std::vector<double> times = arrival_times(n, rate, is_mixed ? kMixedBurstiness : 1.0, rng);
  std::bernoulli_distribution pick_long(kMixedLongFraction);
  std::vector<PlannedRequest> trace;
  trace.reserve(times.size());
  for (const double at : times) {
    const bool long_one = is_long || (is_mixed && pick_long(rng));
    PlannedRequest r;
    r.at = at;
    r.prompt_tokens = draw_length(is_pages   ? pages_prompt
                                  : long_one ? long_prompt
                                             : chat_prompt,
                                  rng);
    r.output_tokens = draw_length(is_pages   ? pages_output
                                  : long_one ? long_output
                                             : chat_output,
                                  rng);
    trace.push_back(r);
  }
  return trace;
}

std::vector<TracePhase> parse_trace_phases(std::string_view text) {
  std::vector<TracePhase> phases;
  for (const std::string& part : split(std::string(text), ',')) {
    const std::vector<std::string> fields = split(part, ':');
    DUET_REQUIRE(fields.size() == 3, "trace phase '{}' is not MIX:SECONDS:RATE (e.g. chat:60:1)",
                 part);
    TracePhase phase{fields[0], parse_number(fields[1], "a phase's seconds"),
                     parse_number(fields[2], "a phase's rate")};
    DUET_REQUIRE(phase.seconds > 0 && phase.rate > 0 && std::isfinite(phase.seconds) &&
                     std::isfinite(phase.rate),
                 "trace phase '{}': seconds and rate must be positive", part);
    phases.push_back(std::move(phase));
  }
  DUET_REQUIRE(!phases.empty(), "no trace phases in '{}'", text);
  return phases;
}

std::vector<PlannedRequest> make_phased_trace(std::span<const TracePhase> phases, uint64_t seed) {
  std::vector<PlannedRequest> trace;
  double start = 0;
  for (size_t i = 0; i < phases.size(); ++i) {
    const TracePhase& phase = phases[i];
    // Enough draws to pass the phase's end (the mean count and 5 standard
    // deviations, almost always), then cut there.
    const double mean = phase.seconds * phase.rate;
    auto n = static_cast<int64_t>(std::ceil(mean + 5 * std::sqrt(mean))) + 16;
    std::vector<PlannedRequest> drawn = make_trace(phase.mix, n, phase.rate, seed + i);
    while (drawn.back().at < phase.seconds) {
      n *= 2;
      drawn = make_trace(phase.mix, n, phase.rate, seed + i);
    }
    for (PlannedRequest r : drawn) {
      if (r.at >= phase.seconds) break;
      r.at += start;
      trace.push_back(r);
    }
    start += phase.seconds;
  }
  return trace;
}

}  // namespace duet::loadgen
