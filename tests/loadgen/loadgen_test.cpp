// duet-bench's load generator without a server: distributions and serving
// metrics on hand-made records (percentiles themselves are
// tests/common/stats_test.cpp's) and prompt windows. Workloads (arrivals,
// lengths, traces, mixes): workload_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "loadgen/prompts.h"
#include "loadgen/record.h"
#include "loadgen/stats.h"

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
