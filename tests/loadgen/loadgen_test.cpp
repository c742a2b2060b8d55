// duet-bench's load generator without a server: distributions and serving
// metrics on hand-made records (percentiles themselves are
// tests/common/stats_test.cpp's), arrival processes, length specs, trace
// files, synthetic mixes and prompt windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "loadgen/prompts.h"
#include "loadgen/record.h"
#include "loadgen/stats.h"
#include "loadgen/workload.h"

namespace duet::loadgen {
namespace {

constexpr double kEps = 1e-9;

// ---- Distributions ---------------------------------------------------------

std::vector<double> one_to(int n) {
  std::vector<double> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 1.0);
  return v;
}

TEST(DistributionTest, KnownValues) {
  const Distribution d = distribution(one_to(100));
  EXPECT_EQ(d.n, 100);
  EXPECT_NEAR(d.mean, 50.5, kEps);
  EXPECT_NEAR(d.p50, 50.5, kEps);
  EXPECT_NEAR(d.p90, 90.1, kEps);
  EXPECT_NEAR(d.p99, 99.01, kEps);
  EXPECT_NEAR(d.max, 100.0, kEps);
}

TEST(DistributionTest, EmptyIsAllZero) {
  const Distribution d = distribution({});
  EXPECT_EQ(d.n, 0);
  EXPECT_EQ(d.mean, 0);
  EXPECT_EQ(d.p50, 0);
  EXPECT_EQ(d.p90, 0);
  EXPECT_EQ(d.p99, 0);
  EXPECT_EQ(d.max, 0);
}

// ---- Serving metrics ------------------------------------------------------

RequestRecord ok_record(int64_t index, double sent, std::vector<double> token_times,
                        int64_t prompt_tokens, int64_t received_tokens) {
  RequestRecord r;
  r.index = index;
  r.scheduled = sent;
  r.sent = sent;
  r.first_token = token_times.front();
  r.finished = token_times.back();
  r.token_times = std::move(token_times);
  r.prompt_tokens = prompt_tokens;
  r.output_tokens = received_tokens;
  r.received_tokens = received_tokens;
  r.ok = true;
  return r;
}

RequestRecord failed_record(int64_t index, double sent, double finished, std::string kind) {
  RequestRecord r;
  r.index = index;
  r.scheduled = r.sent = sent;
  r.finished = finished;
  r.prompt_tokens = 100;
  r.output_tokens = 50;
  r.ok = false;
  r.error_kind = std::move(kind);
  r.error_message = "refused";
  return r;
}

// Three successes and three failures over 5 s:
//   A: TTFT 0.5, TPOT 0.5/3, ITL 0.1 0.2 0.2, E2E 1.0
//   B: TTFT 0.2, TPOT 0.1,   ITL 0.1,         E2E 0.3
//   C: TTFT 0.1, one token (no TPOT, no ITL), E2E 0.1
std::vector<RequestRecord> hand_made_records() {
  std::vector<RequestRecord> records;
  records.push_back(ok_record(0, 0.0, {0.5, 0.6, 0.8, 1.0}, 10, 4));
  records.push_back(failed_record(1, 0.5, 0.6, "http_429"));
  records.push_back(ok_record(2, 1.0, {1.2, 1.3}, 20, 2));
  records.push_back(ok_record(3, 2.0, {2.1}, 5, 1));
  records.push_back(failed_record(4, 3.0, 3.5, "http_429"));
  RequestRecord dropped = failed_record(5, 4.0, 5.0, "connection");
  dropped.first_token = 4.2;  // streamed a little, then the connection broke
  dropped.token_times = {4.2, 4.9};
  records.push_back(dropped);
  return records;
}

TEST(SummarizeTest, CountsRatesAndLatencies) {
  const std::vector<RequestRecord> records = hand_made_records();
  const Summary s = summarize(records, Slo{});
  EXPECT_EQ(s.n_requests, 6);
  EXPECT_EQ(s.n_ok, 3);
  EXPECT_EQ(s.errors, (std::map<std::string, int64_t>{{"connection", 1}, {"http_429", 2}}));
  EXPECT_NEAR(s.duration, 5.0, kEps);
  EXPECT_NEAR(s.request_rate, 3 / 5.0, kEps);
  EXPECT_NEAR(s.output_token_rate, (4 + 2 + 1) / 5.0, kEps);
  EXPECT_NEAR(s.total_token_rate, (10 + 20 + 5 + 4 + 2 + 1) / 5.0, kEps);

  // Failed requests have no latency, even the one that streamed.
  EXPECT_EQ(s.ttft.n, 3);
  EXPECT_NEAR(s.ttft.mean, (0.5 + 0.2 + 0.1) / 3, kEps);
  EXPECT_NEAR(s.ttft.p50, 0.2, kEps);
  EXPECT_NEAR(s.ttft.p90, 0.2 + 0.8 * 0.3, kEps);  // rank 1.8 of {0.1, 0.2, 0.5}
  EXPECT_NEAR(s.ttft.max, 0.5, kEps);

  EXPECT_EQ(s.tpot.n, 2);
  EXPECT_NEAR(s.tpot.mean, (0.5 / 3 + 0.1) / 2, kEps);
  EXPECT_NEAR(s.tpot.max, 0.5 / 3, kEps);

  EXPECT_EQ(s.itl.n, 4);
  EXPECT_NEAR(s.itl.mean, (0.1 + 0.2 + 0.2 + 0.1) / 4, kEps);
  EXPECT_NEAR(s.itl.max, 0.2, kEps);

  EXPECT_EQ(s.e2e.n, 3);
  EXPECT_NEAR(s.e2e.mean, (1.0 + 0.3 + 0.1) / 3, kEps);
  EXPECT_NEAR(s.e2e.max, 1.0, kEps);

  // No SLO: every ok request is good; the denominator counts the failures.
  EXPECT_NEAR(s.goodput, 3 / 5.0, kEps);
  EXPECT_NEAR(s.goodput_fraction, 3 / 6.0, kEps);
}

TEST(SummarizeTest, GoodputWithBothBounds) {
  // A misses TTFT (0.5 > 0.3); B meets both; C has no TPOT and meets TTFT.
  const Summary s = summarize(hand_made_records(), Slo{.ttft = 0.3, .tpot = 0.15});
  EXPECT_NEAR(s.goodput, 2 / 5.0, kEps);
  EXPECT_NEAR(s.goodput_fraction, 2 / 6.0, kEps);
}

TEST(SummarizeTest, GoodputWithTpotOnly) {
  // A misses TPOT (0.1667 > 0.12); B (0.1) and C (none) meet it.
  const Summary tight = summarize(hand_made_records(), Slo{.tpot = 0.12});
  EXPECT_NEAR(tight.goodput_fraction, 2 / 6.0, kEps);
  // B misses too at 0.05; C still meets it.
  const Summary tighter = summarize(hand_made_records(), Slo{.tpot = 0.05});
  EXPECT_NEAR(tighter.goodput_fraction, 1 / 6.0, kEps);
  EXPECT_NEAR(tighter.goodput, 1 / 5.0, kEps);
}

TEST(SummarizeTest, BoundsAreInclusive) {
  const RequestRecord b = ok_record(0, 1.0, {1.25, 1.5}, 20, 2);  // TTFT 0.25, TPOT 0.25
  EXPECT_TRUE(meets_slo(b, Slo{.ttft = 0.25, .tpot = 0.25}));
  EXPECT_FALSE(meets_slo(b, Slo{.ttft = 0.24}));
  EXPECT_FALSE(meets_slo(b, Slo{.tpot = 0.24}));
}

TEST(SummarizeTest, FailedOrTokenlessRequestsMissSlo) {
  EXPECT_FALSE(meets_slo(failed_record(0, 0, 1, "overloaded"), Slo{}));
  RequestRecord silent = ok_record(0, 0, {1.0}, 10, 0);
  silent.first_token.reset();
  silent.token_times.clear();
  EXPECT_TRUE(meets_slo(silent, Slo{}));
  EXPECT_TRUE(meets_slo(silent, Slo{.tpot = 0.01}));
  EXPECT_FALSE(meets_slo(silent, Slo{.ttft = 10.0}));  // cannot show a first token in time
}

TEST(SummarizeTest, TpotFallsBackToStreamedChunks) {
  // No server count: 5 chunks over 0.4 s after the first.
  RequestRecord r = ok_record(0, 0, {1.0, 1.1, 1.2, 1.3, 1.4}, 10, 0);
  const Summary s = summarize(std::vector<RequestRecord>{r}, Slo{});
  EXPECT_NEAR(s.tpot.mean, 0.1, kEps);
  EXPECT_NEAR(s.output_token_rate, 5 / 1.4, kEps);
  // The server's count wins when given (chunks may carry several tokens).
  r.received_tokens = 9;
  EXPECT_NEAR(summarize(std::vector<RequestRecord>{r}, Slo{}).tpot.mean, 0.05, kEps);
}

TEST(SummarizeTest, EmptyAndAllFailed) {
  const Summary empty = summarize({}, Slo{});
  EXPECT_EQ(empty.n_requests, 0);
  EXPECT_EQ(empty.duration, 0);
  EXPECT_EQ(empty.goodput_fraction, 0);

  const std::vector<RequestRecord> failed = {failed_record(0, 0, 1, "overloaded"),
                                             failed_record(1, 1, 2, "")};
  const Summary s = summarize(failed, Slo{.ttft = 1.0});
  EXPECT_EQ(s.n_requests, 2);
  EXPECT_EQ(s.n_ok, 0);
  EXPECT_EQ(s.errors, (std::map<std::string, int64_t>{{"overloaded", 1}, {"unknown", 1}}));
  EXPECT_NEAR(s.duration, 2.0, kEps);
  EXPECT_EQ(s.request_rate, 0);
  EXPECT_EQ(s.goodput, 0);
  EXPECT_EQ(s.ttft.n, 0);
}

// ---- Arrivals -------------------------------------------------------------

struct GapStats {
  double rate = 0;  // arrivals per second
  double cv = 0;    // standard deviation / mean of the gaps
};

GapStats gap_stats(const std::vector<double>& times) {
  std::vector<double> gaps;
  for (size_t i = 1; i < times.size(); ++i) gaps.push_back(times[i] - times[i - 1]);
  const double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / gaps.size();
  double var = 0;
  for (const double g : gaps) var += (g - mean) * (g - mean);
  var /= gaps.size() - 1;
  return {1.0 / mean, std::sqrt(var) / mean};
}

TEST(ArrivalTest, PoissonRateAndUnitCv) {
  std::mt19937_64 rng(7);
  const std::vector<double> times = arrival_times(20'001, 40.0, 1.0, rng);
  ASSERT_EQ(times.size(), 20'001u);
  EXPECT_EQ(times.front(), 0.0);
  EXPECT_TRUE(std::is_sorted(times.begin(), times.end()));
  const GapStats g = gap_stats(times);
  EXPECT_NEAR(g.rate, 40.0, 40.0 * 0.02);
  EXPECT_NEAR(g.cv, 1.0, 0.05);
}

TEST(ArrivalTest, GammaBurstinessSetsCvKeepsRate) {
  // shape k: CV = 1 / sqrt(k). 100k gaps: the heavy tail of k = 0.25 needs them.
  for (const double burstiness : {0.25, 4.0}) {
    std::mt19937_64 rng(11);
    const GapStats g = gap_stats(arrival_times(100'001, 40.0, burstiness, rng));
    const double cv = 1.0 / std::sqrt(burstiness);
    EXPECT_NEAR(g.rate, 40.0, 40.0 * 0.02) << "burstiness " << burstiness;
    EXPECT_NEAR(g.cv, cv, cv * 0.05) << "burstiness " << burstiness;
  }
}

TEST(ArrivalTest, DeterministicPerSeed) {
  std::mt19937_64 a(3), b(3), c(4);
  const std::vector<double> x = arrival_times(100, 5.0, 0.5, a);
  EXPECT_EQ(x, arrival_times(100, 5.0, 0.5, b));
  EXPECT_NE(x, arrival_times(100, 5.0, 0.5, c));
  EXPECT_TRUE(arrival_times(0, 5.0, 1.0, a).empty());
}

TEST(ArrivalTest, RejectsBadParameters) {
  std::mt19937_64 rng(1);
  EXPECT_THROW(arrival_times(-1, 1.0, 1.0, rng), Error);
  EXPECT_THROW(arrival_times(10, 0.0, 1.0, rng), Error);
  EXPECT_THROW(arrival_times(10, -2.0, 1.0, rng), Error);
  EXPECT_THROW(arrival_times(10, 1.0, 0.0, rng), Error);
  EXPECT_THROW(arrival_times(10, INFINITY, 1.0, rng), Error);
}

// ---- Lengths --------------------------------------------------------------

TEST(LengthSpecTest, Parses) {
  const LengthSpec fixed = parse_length_spec("128");
  EXPECT_EQ(fixed.kind, LengthSpec::Kind::kFixed);
  EXPECT_EQ(fixed.a, 128);
  const LengthSpec uniform = parse_length_spec("uniform:64:512");
  EXPECT_EQ(uniform.kind, LengthSpec::Kind::kUniform);
  EXPECT_EQ(uniform.a, 64);
  EXPECT_EQ(uniform.b, 512);
  const LengthSpec normal = parse_length_spec("normal:256:64");
  EXPECT_EQ(normal.kind, LengthSpec::Kind::kNormal);
  EXPECT_EQ(normal.a, 256);
  EXPECT_EQ(normal.b, 64);
  EXPECT_EQ(parse_length_spec("normal:100.5:0.5").a, 100.5);
  EXPECT_EQ(parse_length_spec("uniform:7:7").b, 7);
}

TEST(LengthSpecTest, RejectsMalformed) {
  for (const char* bad : {"", "0", "-5", "12.5", "abc", "128 ", "uniform", "uniform:5",
                          "uniform:10:5", "uniform:0:5", "uniform:a:b", "uniform:1:2:3",
                          "normal:1:-1", "normal:x:1", "gamma:1:2", "Uniform:1:2", "nan"}) {
    EXPECT_THROW(parse_length_spec(bad), Error) << "'" << bad << "'";
  }
}

TEST(LengthSpecTest, DrawsWithinBounds) {
  std::mt19937_64 rng(5);
  EXPECT_EQ(draw_length(parse_length_spec("128"), rng), 128);

  const LengthSpec uniform = parse_length_spec("uniform:3:6");
  std::set<int64_t> seen;
  for (int i = 0; i < 1000; ++i) {
    const int64_t n = draw_length(uniform, rng);
    ASSERT_GE(n, 3);
    ASSERT_LE(n, 6);
    seen.insert(n);
  }
  EXPECT_EQ(seen, (std::set<int64_t>{3, 4, 5, 6}));  // both ends inclusive

  const LengthSpec normal = parse_length_spec("normal:256:64");
  double sum = 0;
  for (int i = 0; i < 10'000; ++i) sum += static_cast<double>(draw_length(normal, rng));
  EXPECT_NEAR(sum / 10'000, 256.0, 3.0);

  // Mostly below zero before clamping.
  const LengthSpec clamped = parse_length_spec("normal:-50:20");
  for (int i = 0; i < 1000; ++i) ASSERT_GE(draw_length(clamped, rng), 1);
  EXPECT_EQ(draw_length(parse_length_spec("normal:42:0"), rng), 42);
}

// ---- Trace files ----------------------------------------------------------

class TraceTest : public ::testing::Test {
 protected:
  std::filesystem::path path(const std::string& name) const {
    return std::filesystem::path(::testing::TempDir()) /
           (std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            name);
  }
  std::filesystem::path write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = path(name);
    std::ofstream(p) << text;
    return p;
  }
  // The message read_trace throws for `text`, or "" when it does not throw.
  std::string error_of(const std::string& text) const {
    try {
      read_trace(write("bad.csv", text));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(TraceTest, RoundTrip) {
  const std::vector<PlannedRequest> trace = {
      {0.0, 120, 30}, {0.25, 3000, 100}, {0.2500015, 7, 1}, {1234.5, 1, 4096}};
  const std::filesystem::path p = path("trace.csv");
  write_trace(p, trace);
  const std::vector<PlannedRequest> back = read_trace(p);
  ASSERT_EQ(back.size(), trace.size());
  for (size_t i = 0; i < trace.size(); ++i) {
    EXPECT_NEAR(back[i].at, trace[i].at, 1e-6) << i;
    EXPECT_EQ(back[i].prompt_tokens, trace[i].prompt_tokens) << i;
    EXPECT_EQ(back[i].output_tokens, trace[i].output_tokens) << i;
  }
  std::ifstream in(p);
  std::string header, row;
  std::getline(in, header);
  std::getline(in, row);
  EXPECT_EQ(header, "TIMESTAMP,ContextTokens,GeneratedTokens");
  EXPECT_EQ(row, "0.000000,120,30");
}

TEST_F(TraceTest, AzureTimestamps) {
  // The public Azure LLM inference traces' format, across a month boundary.
  const std::vector<PlannedRequest> trace =
      read_trace(write("azure.csv",
                       "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                       "2023-11-30 23:59:58.6805900,4808,10\n"
                       "2023-11-30 23:59:59.1,3180,8\n"
                       "2023-12-01 00:00:02.0000001,91,2\n"
                       "2023-12-01 00:00:02,17,0\n"));
  ASSERT_EQ(trace.size(), 4u);
  EXPECT_NEAR(trace[0].at, 0.0, kEps);
  EXPECT_NEAR(trace[1].at, 0.41941, kEps);
  EXPECT_NEAR(trace[2].at, 3.31941, kEps);  // sorted by time
  EXPECT_NEAR(trace[3].at, 3.3194101, kEps);
  EXPECT_EQ(trace[0].prompt_tokens, 4808);
  EXPECT_EQ(trace[0].output_tokens, 10);
  EXPECT_EQ(trace[2].prompt_tokens, 17);
  EXPECT_EQ(trace[2].output_tokens, 1);  // 0 asks for one token
  EXPECT_EQ(trace[3].prompt_tokens, 91);
}

TEST_F(TraceTest, ColumnsInAnyOrderExtrasIgnored) {
  const std::vector<PlannedRequest> trace =
      read_trace(write("cols.csv",
                       "GeneratedTokens, Model ,TIMESTAMP,ContextTokens\r\n"
                       "5,a,10.5,100\r\n"
                       "\r\n"
                       "6,b,12.0,200\r\n"));
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_NEAR(trace[0].at, 0.0, kEps);
  EXPECT_NEAR(trace[1].at, 1.5, kEps);
  EXPECT_EQ(trace[1].prompt_tokens, 200);
  EXPECT_EQ(trace[1].output_tokens, 6);
}

TEST_F(TraceTest, SortsRowsAndStartsAtZero) {
  const std::vector<PlannedRequest> trace = read_trace(
      write("unsorted.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,1\n3,2,2\n4,3,3\n"));
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_NEAR(trace[0].at, 0.0, kEps);
  EXPECT_EQ(trace[0].prompt_tokens, 2);
  EXPECT_NEAR(trace[1].at, 1.0, kEps);
  EXPECT_NEAR(trace[2].at, 2.0, kEps);
  EXPECT_EQ(trace[2].prompt_tokens, 1);
}

TEST_F(TraceTest, MalformedRowsNameFileAndLine) {
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  const std::string good = "0.5,10,10\n";
  for (const std::string& bad :
       {std::string("1.0,10\n"), std::string("x,10,10\n"), std::string("1.0,ten,10\n"),
        std::string("1.0,10,-3\n"), std::string("1.0,10,2.5\n"),
        std::string("2023-11-16 18:15:46,10,10\n"),  // mixes date-times into seconds
        std::string("2023-13-16 18:15:46,10,10\n"), std::string("2023-02-29 10:00:00,10,10\n"),
        std::string("2023-11-16 18:15:46.12345678,10,10\n"), std::string("1.0,,10\n")}) {
    const std::string message = error_of(header + good + bad);
    EXPECT_NE(message.find("bad.csv:3"), std::string::npos) << bad << " -> " << message;
  }
}

TEST_F(TraceTest, MissingColumnOrFile) {
  EXPECT_NE(error_of("TIMESTAMP,ContextTokens\n1,2\n").find("GeneratedTokens"), std::string::npos);
  EXPECT_NE(error_of("").find("bad.csv"), std::string::npos);
  EXPECT_THROW(read_trace(path("does_not_exist.csv")), Error);
  EXPECT_TRUE(
      read_trace(write("header_only.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")).empty());
}

TEST_F(TraceTest, TokenIdsRoundTripAndMustMatchTheirCount) {
  const std::vector<PlannedRequest> trace = {{0.0, 3, 5, {7, 8, 9}}, {0.5, 2, 1, {7, 8}}};
  const std::filesystem::path p = path("ids.csv");
  write_trace(p, trace);
  const std::vector<PlannedRequest> back = read_trace(p);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].prompt_ids, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(back[1].prompt_ids, (std::vector<int32_t>{7, 8}));
  // A trace without the column, or a row with it empty, has no ids.
  EXPECT_TRUE(read_trace(write("no_ids.csv",
                               "TIMESTAMP,ContextTokens,GeneratedTokens,TokenIds\n"
                               "0,4,1,\n"))[0]
                  .prompt_ids.empty());
  EXPECT_NE(error_of("TIMESTAMP,ContextTokens,GeneratedTokens,TokenIds\n0,4,1,1 2 3\n")
                .find("ContextTokens is 4 but TokenIds holds 3 ids"),
            std::string::npos);
  EXPECT_NE(error_of("TIMESTAMP,ContextTokens,GeneratedTokens,TokenIds\n0,2,1,1 x\n")
                .find("not a token id"),
            std::string::npos);
}

TEST(ScaleTraceTest, DividesTimes) {
  const std::vector<PlannedRequest> scaled =
      scale_trace({{0.0, 1, 2}, {1.0, 3, 4}, {3.0, 5, 6}}, 2.0);
  ASSERT_EQ(scaled.size(), 3u);
  EXPECT_NEAR(scaled[1].at, 0.5, kEps);
  EXPECT_NEAR(scaled[2].at, 1.5, kEps);
  EXPECT_EQ(scaled[2].prompt_tokens, 5);
  EXPECT_NEAR(scale_trace({{3.0, 1, 1}}, 0.5)[0].at, 6.0, kEps);
  EXPECT_THROW(scale_trace({}, 0.0), Error);
  EXPECT_THROW(scale_trace({}, -1.0), Error);
}

// ---- Synthetic mixes ------------------------------------------------------

TEST(MakeTraceTest, DeterministicPerSeed) {
  const auto same = [](const std::vector<PlannedRequest>& x, const std::vector<PlannedRequest>& y) {
    return x.size() == y.size() &&
           std::equal(x.begin(), x.end(), y.begin(), [](const auto& a, const auto& b) {
             return a.at == b.at && a.prompt_tokens == b.prompt_tokens &&
                    a.output_tokens == b.output_tokens;
           });
  };
  for (const char* mix : {"chat", "long", "mixed", "pages"}) {
    EXPECT_TRUE(same(make_trace(mix, 300, 4.0, 42), make_trace(mix, 300, 4.0, 42))) << mix;
    EXPECT_FALSE(same(make_trace(mix, 300, 4.0, 42), make_trace(mix, 300, 4.0, 43))) << mix;
  }
  EXPECT_THROW(make_trace("sharegpt", 10, 1.0, 1), Error);
}

TEST(MakeTraceTest, MixShapes) {
  constexpr int64_t kN = 5000;
  const auto mean = [](const std::vector<PlannedRequest>& t, auto field) {
    double sum = 0;
    for (const PlannedRequest& r : t) sum += static_cast<double>(field(r));
    return sum / static_cast<double>(t.size());
  };
  const auto prompt = [](const PlannedRequest& r) { return r.prompt_tokens; };
  const auto output = [](const PlannedRequest& r) { return r.output_tokens; };
  const auto times = [](const std::vector<PlannedRequest>& t) {
    std::vector<double> at;
    for (const PlannedRequest& r : t) at.push_back(r.at);
    return at;
  };

  const std::vector<PlannedRequest> chat = make_trace("chat", kN, 10.0, 1);
  EXPECT_NEAR(mean(chat, prompt), 200, 10);  // clamping at 1 lifts it a little
  EXPECT_NEAR(mean(chat, output), 150, 8);
  EXPECT_NEAR(gap_stats(times(chat)).cv, 1.0, 0.05);
  EXPECT_NEAR(gap_stats(times(chat)).rate, 10.0, 0.5);

  const std::vector<PlannedRequest> long_docs = make_trace("long", kN, 10.0, 1);
  for (const PlannedRequest& r : long_docs) {
    ASSERT_GE(r.prompt_tokens, 1500);
    ASSERT_LE(r.prompt_tokens, 3500);
    ASSERT_GE(r.output_tokens, 50);
    ASSERT_LE(r.output_tokens, 200);
  }
  EXPECT_NEAR(mean(long_docs, prompt), 2500, 50);

  const std::vector<PlannedRequest> mixed = make_trace("mixed", kN, 10.0, 1);
  const auto n_long = std::count_if(
      mixed.begin(), mixed.end(), [](const PlannedRequest& r) { return r.prompt_tokens >= 1500; });
  EXPECT_NEAR(static_cast<double>(n_long) / kN, 0.2, 0.02);
  const GapStats g = gap_stats(times(mixed));
  EXPECT_NEAR(g.rate, 10.0, 10.0 * 0.05);
  EXPECT_GT(g.cv, 1.5);  // burstiness 0.3: 1 / sqrt(0.3) = 1.83
}

TEST(MakeTraceTest, PhasesFollowOneAnother) {
  const std::vector<TracePhase> phases = parse_trace_phases("chat:100:4,pages:200:0.5,chat:50:8");
  ASSERT_EQ(phases.size(), 3u);
  EXPECT_EQ(phases[1].mix, "pages");
  EXPECT_EQ(phases[1].seconds, 200);
  EXPECT_EQ(phases[1].rate, 0.5);
  const std::vector<PlannedRequest> trace = make_phased_trace(phases, 9);
  size_t i = 0;
  std::vector<int64_t> count(3);
  for (; i < trace.size() && trace[i].at < 100; ++i, ++count[0])
    ASSERT_LE(trace[i].prompt_tokens, 600);
  for (; i < trace.size() && trace[i].at < 300; ++i, ++count[1]) {
    ASSERT_GE(trace[i].prompt_tokens, 600);
    ASSERT_LE(trace[i].prompt_tokens, 1400);
    ASSERT_GE(trace[i].output_tokens, 8);
    ASSERT_LE(trace[i].output_tokens, 32);
  }
  for (; i < trace.size(); ++i, ++count[2]) {
    ASSERT_GE(trace[i].at, 300);
    ASSERT_LT(trace[i].at, 350);
  }
  // Poisson counts: 400 +- 60, 100 +- 30, 400 +- 60.
  EXPECT_NEAR(static_cast<double>(count[0]), 400, 60);
  EXPECT_NEAR(static_cast<double>(count[1]), 100, 30);
  EXPECT_NEAR(static_cast<double>(count[2]), 400, 60);
  // The phases' draws are the one-phase mixes' own, seeded seed + i.
  EXPECT_EQ(trace[0].prompt_tokens, make_trace("chat", 516, 4, 9)[0].prompt_tokens);
  const std::vector<PlannedRequest> again = make_phased_trace(phases, 9);
  ASSERT_EQ(again.size(), trace.size());
  EXPECT_EQ(again.back().at, trace.back().at);

  for (const char* bad : {"", "chat:60", "chat:0:1", "chat:60:-1", "chat:x:1", "chat:60:1:2"})
    EXPECT_THROW(parse_trace_phases(bad), Error) << bad;
  EXPECT_THROW(make_phased_trace(parse_trace_phases("sharegpt:60:1"), 1), Error);
}

TEST(MakeTraceTest, CommittedExampleIsTheMixedMix) {
  const std::vector<PlannedRequest> example =
      read_trace(std::filesystem::path(DUET_SOURCE_DIR) / "bench" / "traces" / "example_mixed.csv");
  ASSERT_EQ(example.size(), 200u);
  EXPECT_EQ(example.front().at, 0.0);
#if defined(__GLIBCXX__)
  // The distributions' algorithms are the standard library's own: the file
  // was made with libstdc++ (bench/traces/README.md).
  const std::vector<PlannedRequest> made = make_trace("mixed", 200, 2.0, 1);
  for (size_t i = 0; i < made.size(); ++i) {
    EXPECT_NEAR(example[i].at, made[i].at, 1e-6) << i;
    EXPECT_EQ(example[i].prompt_tokens, made[i].prompt_tokens) << i;
    EXPECT_EQ(example[i].output_tokens, made[i].output_tokens) << i;
  }
#endif
}

// ---- Prompts --------------------------------------------------------------

std::vector<int32_t> iota_tokens(int32_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), 0);
  return tokens;
}

TEST(PromptSourceTest, ExactLengthsOfConsecutiveTokens) {
  const PromptSource source(iota_tokens(1000));
  EXPECT_EQ(source.size(), 1000u);
  std::mt19937_64 rng(9);
  for (const int64_t n : {1, 17, 999, 1000, 1001, 4000}) {
    const std::vector<int32_t> prompt = source.draw(n, rng);
    ASSERT_EQ(static_cast<int64_t>(prompt.size()), n);
    for (size_t i = 1; i < prompt.size(); ++i) {
      ASSERT_EQ(prompt[i], (prompt[i - 1] + 1) % 1000) << "n " << n << " at " << i;
    }
  }
}

TEST(PromptSourceTest, WrapsAroundTheEnd) {
  const PromptSource source(iota_tokens(5));
  std::mt19937_64 rng(2);
  const std::vector<int32_t> prompt = source.draw(12, rng);
  for (size_t i = 0; i < prompt.size(); ++i) EXPECT_EQ(prompt[i], (prompt[0] + i) % 5);
}

TEST(PromptSourceTest, DifferentOffsetsAndDeterministic) {
  const PromptSource source(iota_tokens(10'000));
  std::mt19937_64 rng(4), again(4);
  std::set<int32_t> starts;
  for (int i = 0; i < 50; ++i) {
    const std::vector<int32_t> prompt = source.draw(64, rng);
    EXPECT_EQ(prompt, source.draw(64, again));
    starts.insert(prompt.front());
  }
  EXPECT_GE(starts.size(), 45u);
}

TEST(PromptSourceTest, RejectsEmptyCorpusAndEmptyPrompt) {
  EXPECT_THROW(PromptSource({}), Error);
  std::mt19937_64 rng(1);
  EXPECT_THROW(PromptSource(iota_tokens(3)).draw(0, rng), Error);
}

TEST(CorpusTest, ShippedCorpusIsProse) {
  const std::string corpus =
      read_corpus(std::filesystem::path(DUET_SOURCE_DIR) / "bench" / "data" / "corpus.txt");
  EXPECT_GE(corpus.size(), 40'000u);
  EXPECT_LE(corpus.size(), 70'000u);
  // Plain printable ASCII text and line breaks: every tokenizer takes it.
  for (const char c : corpus) {
    ASSERT_TRUE(c == '\n' || (c >= ' ' && c <= '~')) << "byte " << static_cast<int>(c);
  }
  EXPECT_THROW(read_corpus(std::filesystem::path(::testing::TempDir()) / "no_corpus.txt"), Error);
}

}  // namespace
}  // namespace duet::loadgen
