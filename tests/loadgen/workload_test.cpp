// The load generator's workloads (loadgen/workload.h) without a server:
// arrival processes, length specs, trace files, synthetic mixes and the
// phases of a shifting load.
#include "loadgen/workload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"

namespace duet::loadgen {
namespace {

constexpr double kEps = 1e-9;

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

}  // namespace
}  // namespace duet::loadgen
