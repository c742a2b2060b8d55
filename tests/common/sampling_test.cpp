// The sampler (each control against a hand-computed distribution, then
// against a plain full-sort reference on random logits), its counter-based
// random stream, and the stop-string matcher.
#include "common/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/text/stop_matcher.h"

namespace duet {
namespace {

constexpr double kExact = 1e-6;

std::vector<float> log_of(const std::vector<double>& probabilities) {
  std::vector<float> logits;
  for (double p : probabilities) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

void expect_distribution(const std::vector<double>& actual, const std::vector<double>& expected,
                         double tolerance = kExact) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "token " << i;
  }
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  const float max = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i)
    total += p[i] = std::exp((logits[i] - max) / temperature);
  for (double& x : p) x /= total;
  return p;
}

SamplingParams at_temperature(float temperature) {
  SamplingParams params;
  params.temperature = temperature;
  return params;
}

// --- the random stream ---------------------------------------------------

TEST(Sampling, UniformIsAPureFunctionOfSeedAndPosition) {
  EXPECT_EQ(uniform_at(7, 100), uniform_at(7, 100));
  std::set<double> draws;
  for (uint64_t position = 0; position < 1000; ++position) {
    const double u = uniform_at(7, position);
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    draws.insert(u);
  }
  EXPECT_EQ(draws.size(), 1000u) << "different positions must give different draws";
  EXPECT_NE(uniform_at(7, 5), uniform_at(8, 5));
}

TEST(Sampling, SameSeedAndPositionGiveTheSameToken) {
  const std::vector<float> logits(64, 0.0f);  // uniform: every draw is informative
  SamplingParams params = at_temperature(1.0f);
  params.seed = 42;
  Sampler a(params);
  Sampler b(params);
  std::set<int32_t> seen;
  for (uint64_t position = 0; position < 200; ++position) {
    const int32_t token = a.sample(logits, position);
    EXPECT_EQ(token, b.sample(logits, position));
    EXPECT_EQ(token, sample_token(logits, params, position));
    seen.insert(token);
  }
  // A fresh sampler at a later position agrees: the draw depends on nothing else.
  EXPECT_EQ(Sampler(params).sample(logits, 150), a.sample(logits, 150));
  EXPECT_GT(seen.size(), 40u) << "different positions must give different draws";
}

TEST(Sampling, EmpiricalFrequenciesMatchSoftmax) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f};
  const std::vector<double> expected = softmax(logits);
  Sampler sampler(at_temperature(1.0f));
  std::vector<int> counts(logits.size(), 0);
  constexpr int kDraws = 20000;
  for (uint64_t position = 0; position < kDraws; ++position)
    ++counts[sampler.sample(logits, position)];
  for (size_t i = 0; i < logits.size(); ++i) {
    EXPECT_NEAR(static_cast<double>(counts[i]) / kDraws, expected[i], 0.02) << "token " << i;
  }
}

// --- greedy ----------------------------------------------------------------

TEST(Sampling, GreedyIsArgmaxWithTheLowestIdOnTies) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(argmax(logits), 1);
  SamplingParams params;  // temperature 0
  params.top_k = 1;
  params.top_p = 0.1f;
  params.min_p = 0.9f;
  for (uint64_t position = 0; position < 10; ++position) {
    EXPECT_EQ(sample_token(logits, SamplingParams{}, position), 1);
    EXPECT_EQ(sample_token(logits, params, position), 1);
  }
  expect_distribution(Sampler(SamplingParams{}).distribution(logits), {0, 1, 0, 0});
}

TEST(Sampling, GreedyWithPenaltiesTakesThePenalizedArgmax) {
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
  SamplingParams params;
  params.repetition_penalty = 4.0f;  // 2 -> 0.5
  Sampler sampler(params);
  EXPECT_EQ(sampler.sample(logits, 0), 0);
  sampler.accept(0);
  EXPECT_EQ(sampler.sample(logits, 1), 3);
}

// --- each filter against a hand-computed example ---------------------------

TEST(Sampling, TemperatureScalesTheLogits) {
  const std::vector<float> logits = log_of({1.0 / 3, 2.0 / 3});
  // At 0.5 the weights square: 1 and 4.
  expect_distribution(Sampler(at_temperature(0.5f)).distribution(logits), {0.2, 0.8});
  // At 2 they are square roots: 1 and sqrt 2.
  expect_distribution(Sampler(at_temperature(2.0f)).distribution(logits),
                      {1 / (1 + std::sqrt(2.0)), std::sqrt(2.0) / (1 + std::sqrt(2.0))});
}

TEST(Sampling, TopKKeepsTheKMostLikely) {
  SamplingParams params = at_temperature(1.0f);
  params.top_k = 2;
  const double e = std::exp(1.0);
  expect_distribution(Sampler(params).distribution(std::vector<float>{1, 3, 2, 0}),
                      {0, e / (e + 1), 1 / (e + 1), 0});
  // Ties at the cut go to the lower ids.
  expect_distribution(Sampler(params).distribution(std::vector<float>{2, 1, 2, 2}),
                      {0.5, 0, 0.5, 0});
  // k >= the vocabulary is off.
  params.top_k = 10;
  expect_distribution(Sampler(params).distribution(std::vector<float>{1, 3, 2, 0}),
                      softmax({1, 3, 2, 0}));
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingTheMass) {
  // Ids in scrambled order of probability: 0.15, 0.5, 0.05, 0.3.
  const std::vector<float> logits = log_of({0.15, 0.5, 0.05, 0.3});
  SamplingParams params = at_temperature(1.0f);
  params.top_p = 0.75f;  // 0.5 + 0.3 = 0.8 >= 0.75
  expect_distribution(Sampler(params).distribution(logits), {0, 0.625, 0, 0.375});
  params.top_p = 0.85f;  // 0.5 + 0.3 + 0.15 = 0.95
  expect_distribution(Sampler(params).distribution(logits),
                      {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95});
  params.top_p = 0.4f;  // the top token alone
  expect_distribution(Sampler(params).distribution(logits), {0, 1, 0, 0});
}

TEST(Sampling, MinPKeepsTokensNearTheTopOne) {
  const std::vector<float> logits = log_of({0.15, 0.5, 0.05, 0.3});
  SamplingParams params = at_temperature(1.0f);
  params.min_p = 0.2f;  // keeps p >= 0.1
  expect_distribution(Sampler(params).distribution(logits),
                      {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95});
  params.min_p = 0.5f;  // keeps p >= 0.25
  expect_distribution(Sampler(params).distribution(logits), {0, 0.5 / 0.8, 0, 0.3 / 0.8});
}

TEST(Sampling, FiltersSeeProbabilitiesBeforeTheTemperature) {
  // At temperature 2 the probabilities flatten to ~0.38, 0.29, 0.21, 0.12, whose
  // first two sum under 0.75; llama.cpp's order applies top-p at temperature 1.
  const std::vector<float> logits = log_of({0.5, 0.3, 0.15, 0.05});
  SamplingParams params = at_temperature(2.0f);
  params.top_p = 0.75f;
  const double a = std::sqrt(0.5), b = std::sqrt(0.3);
  expect_distribution(Sampler(params).distribution(logits), {a / (a + b), b / (a + b), 0, 0});
}

TEST(Sampling, FiltersCompose) {
  // top-k 3 keeps 0.5, 0.3, 0.15 (renormalized /0.95: .526, .316, .158); top-p
  // 0.8 then keeps .526 + .316 = .842; min-p 0.7 then drops 0.3 < 0.7 * 0.5.
  const std::vector<float> logits = log_of({0.05, 0.3, 0.5, 0.15});
  SamplingParams params = at_temperature(1.0f);
  params.top_k = 3;
  params.top_p = 0.8f;
  expect_distribution(Sampler(params).distribution(logits), {0, 0.375, 0.625, 0});
  params.min_p = 0.7f;
  expect_distribution(Sampler(params).distribution(logits), {0, 0, 1, 0});
}

TEST(Sampling, DrawsOnlyKeptTokens) {
  std::vector<float> logits(1000);
  for (size_t i = 0; i < logits.size(); ++i)
    logits[i] = static_cast<float>((i * 37) % 1000) * 0.001f;
  SamplingParams params = at_temperature(1.5f);
  params.top_k = 5;
  Sampler sampler(params);
  const std::vector<double> p = sampler.distribution(logits);
  std::set<int32_t> seen;
  for (uint64_t position = 0; position < 500; ++position) {
    const int32_t token = sampler.sample(logits, position);
    EXPECT_GT(p[static_cast<size_t>(token)], 0.0);
    seen.insert(token);
  }
  EXPECT_EQ(seen.size(), 5u);
}

// A plain reference: every filter by a full sort (llama.cpp's order), then
// the temperature.
std::vector<double> reference_distribution(const std::vector<float>& logits,
                                           const SamplingParams& params) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  size_t n = order.size();
  if (params.top_k > 0) n = std::min(n, static_cast<size_t>(params.top_k));
  const float max = logits[order[0]];
  if (params.top_p < 1.0f) {
    double z = 0.0;
    for (size_t i = 0; i < n; ++i) z += std::exp(static_cast<double>(logits[order[i]] - max));
    double cumulative = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cumulative += std::exp(static_cast<double>(logits[order[i]] - max)) / z;
      if (cumulative >= params.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  std::vector<double> p(logits.size(), 0.0);
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const float logit = logits[order[i]];
    if (params.min_p > 0.0f && logit < max + std::log(params.min_p)) continue;
    total += p[order[i]] = std::exp(static_cast<double>(logit - max) / params.temperature);
  }
  for (double& x : p) x /= total;
  return p;
}

TEST(Sampling, MatchesAFullSortReferenceOnALargeVocabulary) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> smooth(49152);
  for (float& x : smooth) x = normal(rng);
  smooth[77] = smooth[78] = 14.0f;                             // a tie at the top
  for (size_t i = 1000; i < 1100; ++i) smooth[i] = -INFINITY;  // masked tokens
  std::vector<float> coarse = smooth;                          // many ties, wherever a cut falls
  for (float& x : coarse) x = std::round(x * 2.0f) / 2.0f;
  struct Case {
    int32_t top_k;
    float top_p;
    float min_p;
    float temperature;
  };
  const Case cases[] = {
      {40, 1.0f, 0.0f, 0.8f},    {0, 0.9f, 0.0f, 1.0f},   {0, 0.999f, 0.0f, 0.7f},
      {0, 0.3f, 0.0f, 1.0f},     {0, 0.05f, 0.0f, 1.0f},  {0, 1.0f, 0.05f, 1.3f},
      {100, 0.95f, 0.01f, 0.9f}, {1, 1.0f, 0.0f, 1.0f},   {2, 1.0f, 0.0f, 1.0f},
      {5000, 0.5f, 0.0f, 2.0f},  {300, 1.0f, 0.0f, 1.0f}, {0, 0.99999f, 0.0f, 1.0f}};
  for (const std::vector<float>* logits : {&smooth, &coarse}) {
    for (const Case& c : cases) {
      SamplingParams params = at_temperature(c.temperature);
      params.top_k = c.top_k;
      params.top_p = c.top_p;
      params.min_p = c.min_p;
      Sampler sampler(params);
      SCOPED_TRACE(::testing::Message() << (logits == &smooth ? "smooth" : "coarse") << " top_k "
                                        << c.top_k << " top_p " << c.top_p << " min_p " << c.min_p);
      expect_distribution(sampler.distribution(*logits), reference_distribution(*logits, params),
                          1e-9);
    }
  }
}

// --- penalties -------------------------------------------------------------

TEST(Sampling, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
  SamplingParams params = at_temperature(1.0f);
  params.repetition_penalty = 2.0f;
  Sampler sampler(params);
  for (int32_t token : {0, 1, 0}) sampler.accept(token);  // counts do not matter here
  expect_distribution(sampler.distribution(logits), softmax({1.0f, -2.0f, 0.5f, 1.0f}));
}

TEST(Sampling, FrequencyAndPresencePenaltiesSubtractByCount) {
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 1.0f};
  SamplingParams params = at_temperature(1.0f);
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 0.5f;
  params.presence_penalty = 0.25f;
  Sampler sampler(params);
  for (int32_t token : {0, 1, 0}) sampler.accept(token);
  // token 0 (count 2): 2 / 2 - 2 * 0.5 - 0.25; token 1 (count 1): -1 * 2 - 0.5 - 0.25.
  expect_distribution(sampler.distribution(logits), softmax({-0.25f, -2.75f, 0.5f, 1.0f}));
}

TEST(Sampling, PenaltiesLookOnlyAtTheLastNTokens) {
  const std::vector<float> logits = {1.0f, 1.0f, 1.0f, 1.0f};
  SamplingParams params = at_temperature(1.0f);
  params.presence_penalty = 1.0f;
  params.frequency_penalty = 0.5f;
  params.penalty_last_n = 2;
  Sampler sampler(params);
  for (int32_t token : {0, 1, 2, 2}) sampler.accept(token);  // window: 2, 2
  expect_distribution(sampler.distribution(logits), softmax({1.0f, 1.0f, -1.0f, 1.0f}));
  sampler.accept(3);  // window: 2, 3
  expect_distribution(sampler.distribution(logits), softmax({1.0f, 1.0f, -0.5f, -0.5f}));
  sampler.reset();
  expect_distribution(sampler.distribution(logits), softmax(logits));

  params.penalty_last_n = -1;  // the whole sequence
  Sampler whole(params);
  for (int32_t token : {0, 1, 2, 2, 0, 0}) whole.accept(token);
  expect_distribution(whole.distribution(logits), softmax({-1.5f, -0.5f, -1.0f, 1.0f}));

  params.penalty_last_n = 0;  // no window
  Sampler none(params);
  for (int32_t token : {0, 1, 2}) none.accept(token);
  expect_distribution(none.distribution(logits), softmax(logits));
}

TEST(Sampling, PenaltiesComeBeforeTheFilters) {
  // Token 0 leads until penalized, then top-k 1 keeps token 1.
  const std::vector<float> logits = {3.0f, 2.0f, 0.0f};
  SamplingParams params = at_temperature(1.0f);
  params.top_k = 1;
  params.frequency_penalty = 2.0f;
  Sampler sampler(params);
  EXPECT_EQ(sampler.sample(logits, 0), 0);
  sampler.accept(0);
  EXPECT_EQ(sampler.sample(logits, 1), 1);
}

TEST(Sampling, NaNAndAllMaskedLogitsAreRejected) {
  Sampler sampler(at_temperature(1.0f));
  EXPECT_THROW(sampler.sample(std::vector<float>{1.0f, NAN}, 0), Error);
  EXPECT_THROW(sampler.sample(std::vector<float>{-INFINITY, -INFINITY}, 0), Error);
  EXPECT_EQ(sampler.sample(std::vector<float>{-INFINITY, 0.0f, -INFINITY}, 0), 1);
}

TEST(Sampling, ATokenOutsideTheVocabularyIsRejected) {
  SamplingParams params = at_temperature(1.0f);
  params.presence_penalty = 1.0f;
  Sampler sampler(params);
  sampler.accept(9);
  EXPECT_THROW(sampler.sample(std::vector<float>{1, 2, 3}, 0), Error);
  EXPECT_THROW(sampler.accept(-1), Error);
}

// --- validation ------------------------------------------------------------

std::string validation_message(const SamplingParams& params) {
  try {
    validate_sampling_params(params);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(Sampling, ValidatesParameters) {
  EXPECT_EQ(validation_message(SamplingParams{}), "");
  SamplingParams p;
  p.top_p = 1.5f;
  EXPECT_EQ(validation_message(p), "top_p must be in (0, 1], got 1.5");
  p = {};
  p.top_p = 0.0f;
  EXPECT_EQ(validation_message(p), "top_p must be in (0, 1], got 0");
  p = {};
  p.top_k = -1;
  EXPECT_EQ(validation_message(p), "top_k must be >= 0 (0: off), got -1");
  p = {};
  p.min_p = 2.0f;
  EXPECT_EQ(validation_message(p), "min_p must be in [0, 1], got 2");
  p = {};
  p.temperature = -0.5f;
  EXPECT_EQ(validation_message(p), "temperature must be a finite number >= 0, got -0.5");
  p = {};
  p.temperature = NAN;
  EXPECT_NE(validation_message(p), "");
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_EQ(validation_message(p),
            "repetition_penalty must be a finite number > 0 (1: off), got 0");
  p = {};
  p.frequency_penalty = INFINITY;
  EXPECT_EQ(validation_message(p), "frequency_penalty must be finite, got inf");
  p = {};
  p.presence_penalty = NAN;
  EXPECT_EQ(validation_message(p), "presence_penalty must be finite, got nan");
  p = {};
  p.penalty_last_n = -2;
  EXPECT_EQ(validation_message(p),
            "penalty_last_n must be >= -1 (-1: whole sequence, 0: off), got -2");
  p.top_p = 7.0f;
  EXPECT_THROW(Sampler{p}, Error);
}

// --- stop strings ----------------------------------------------------------

// Feeds `pieces` and returns everything released, flush included.
std::string stream(StopMatcher& matcher, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& piece : pieces) out += matcher.push(piece);
  return out + matcher.flush();
}

TEST(StopMatcher, NoStopStringsPassEverythingThrough) {
  StopMatcher matcher({});
  EXPECT_EQ(matcher.push("hello"), "hello");
  EXPECT_EQ(matcher.push(""), "");
  EXPECT_FALSE(matcher.stopped());
  EXPECT_EQ(matcher.matched(), nullptr);
}

TEST(StopMatcher, StopSplitAcrossThreePieces) {
  StopMatcher matcher({"<END>"});
  EXPECT_EQ(matcher.push("abc<E"), "abc");  // "<E" could begin the stop string
  EXPECT_EQ(matcher.push("N"), "");
  EXPECT_FALSE(matcher.stopped());
  EXPECT_EQ(matcher.push("D>tail"), "");
  EXPECT_TRUE(matcher.stopped());
  ASSERT_NE(matcher.matched(), nullptr);
  EXPECT_EQ(*matcher.matched(), "<END>");
  EXPECT_EQ(matcher.push("more"), "");
  EXPECT_EQ(matcher.flush(), "");
}

TEST(StopMatcher, FalsePrefixIsReleased) {
  StopMatcher matcher({"<END>"});
  EXPECT_EQ(matcher.push("a<EN"), "a");
  EXPECT_EQ(matcher.push("X"), "<ENX");  // can no longer become "<END>"
  EXPECT_EQ(matcher.push("<"), "");
  EXPECT_EQ(matcher.push("<E"), "<");  // the second '<' may still start it
  EXPECT_FALSE(matcher.stopped());
  EXPECT_EQ(matcher.flush(), "<E");  // the stream ended: nothing can complete
}

TEST(StopMatcher, StopAtTheStart) {
  StopMatcher matcher({"###"});
  EXPECT_EQ(matcher.push("###"), "");
  EXPECT_TRUE(matcher.stopped());
  StopMatcher split({"###"});
  EXPECT_EQ(stream(split, {"#", "#", "# text"}), "");
  EXPECT_TRUE(split.stopped());
}

TEST(StopMatcher, EndOfOneStopAndMoreTextInOnePiece) {
  StopMatcher matcher({"\nUser:"});
  EXPECT_EQ(matcher.push("Sure.\nUs"), "Sure.");
  EXPECT_EQ(matcher.push("er: next question"), "");
  EXPECT_TRUE(matcher.stopped());
}

TEST(StopMatcher, TextAfterTheStopIsDiscarded) {
  StopMatcher matcher({"STOP"});
  EXPECT_EQ(matcher.push("one STOP two STOP three"), "one ");
  EXPECT_EQ(matcher.push("four"), "");
  EXPECT_EQ(matcher.flush(), "");
}

TEST(StopMatcher, OverlappingStopStringsTheFirstToCompleteWins) {
  // "abcd" and "bc" overlap; "bc" completes first, whatever the cut.
  for (const std::vector<std::string>& pieces :
       {std::vector<std::string>{"xabcdy"}, {"x", "a", "b", "c", "d", "y"}, {"xab", "cdy"}}) {
    StopMatcher matcher({"abcd", "bc"});
    EXPECT_EQ(stream(matcher, pieces), "xa");
    ASSERT_TRUE(matcher.stopped());
    EXPECT_EQ(*matcher.matched(), "bc");
  }
  // Two stop strings ending together: the longer one, so less text comes out.
  StopMatcher together({"cd", "abcd"});
  EXPECT_EQ(stream(together, {"xab", "cd"}), "x");
  EXPECT_EQ(*together.matched(), "abcd");
  // A prefix of one stop string held while another, overlapping it, completes.
  StopMatcher held({"aab", "ab"});
  EXPECT_EQ(held.push("xa"), "x");
  EXPECT_EQ(held.push("a"), "");
  EXPECT_EQ(held.push("b"), "");  // "aab" and "ab" end together: "aab" wins
  EXPECT_EQ(*held.matched(), "aab");
}

TEST(StopMatcher, ReleasesTheSameTextHoweverTheStreamIsCut) {
  const std::string text = "The answer is 42.\n\nQuestion: why?";
  for (size_t cut = 1; cut < text.size(); ++cut) {
    StopMatcher matcher({"\n\nQuestion:", "\nQ"});
    EXPECT_EQ(stream(matcher, {text.substr(0, cut), text.substr(cut)}), "The answer is 42.\n")
        << cut;
    EXPECT_EQ(*matcher.matched(), "\nQ");
  }
}

TEST(StopMatcher, RejectsAnEmptyStopString) { EXPECT_THROW(StopMatcher({"ok", ""}), Error); }

}  // namespace
}  // namespace duet
