// The profile's step-cost fit (recovering a known cost exactly, within the
// noise when noisy, never negative), link costs, and its JSON form.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>

#include "sim/nnls.h"
#include "sim/profile.h"
#include "common/error.h"

namespace duet::sim {
namespace {

StepCost known_cost() {
  StepCost cost;
  cost.token_knots = {1, 8, 64, 512};
  cost.knot_seconds = {0.010, 0.012, 0.030, 0.200};
  cost.per_sequence = 1e-4;
  cost.per_decode_attention = 2e-8;
  cost.per_prefill_attention = 5e-9;
  cost.per_logit_row = 3e-5;
  return cost;
}

// Shapes of every kind (decode batches, prefill chunks, mixed steps) with
// the terms varied independently, so every coefficient is identifiable.
std::vector<StepShape> varied_shapes(int n, bool prefill, uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<StepShape> shapes;
  for (int i = 0; i < n; ++i) {
    StepShape s;
    // Log-uniform rows, so that every knot's segment has samples.
    s.n_tokens = std::llround(std::exp(std::uniform_real_distribution<double>(0, 7.3)(rng)));
    s.n_sequences = uniform(1, s.n_tokens);
    s.n_logit_rows = uniform(0, s.n_sequences);
    s.n_decode_attention = uniform(0, 4000) * std::min<int64_t>(s.n_sequences, 64);
    s.n_attention = s.n_decode_attention + (prefill ? uniform(0, s.n_tokens * 4000) : 0);
    shapes.push_back(s);
  }
  return shapes;
}

std::vector<StepSample> samples_of(const StepCost& cost, const std::vector<StepShape>& shapes) {
  std::vector<StepSample> samples;
  for (const StepShape& s : shapes) samples.push_back({s, cost(s)});
  return samples;
}

void expect_relative(double actual, double expected, double tolerance, const char* what) {
  EXPECT_NEAR(actual, expected, tolerance * std::abs(expected)) << what;
}

TEST(StepCostTest, WeightsInterpolateAndExtendTheLastSegment) {
  StepCost cost;
  cost.token_knots = {1, 4, 16};
  cost.knot_seconds = {1.0, 2.0, 5.0};
  EXPECT_DOUBLE_EQ(cost.weights(0), 1.0);  // below the first knot: its value
  EXPECT_DOUBLE_EQ(cost.weights(1), 1.0);
  EXPECT_DOUBLE_EQ(cost.weights(2), 1.0 + 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(cost.weights(4), 2.0);
  EXPECT_DOUBLE_EQ(cost.weights(10), 3.5);
  EXPECT_DOUBLE_EQ(cost.weights(16), 5.0);
  EXPECT_DOUBLE_EQ(cost.weights(28), 8.0);  // slope 3/12 carried on

  StepCost one;
  one.token_knots = {8};
  one.knot_seconds = {0.25};
  EXPECT_DOUBLE_EQ(one.weights(1), 0.25);
  EXPECT_DOUBLE_EQ(one.weights(1000), 0.25);

  EXPECT_DOUBLE_EQ(StepCost{}.weights(5), 0.0);
  StepCost mismatched;
  mismatched.token_knots = {1, 2};
  mismatched.knot_seconds = {1.0};
  EXPECT_THROW(mismatched.weights(1), Error);
}

TEST(StepCostTest, CostAddsEveryTerm) {
  const StepCost cost = known_cost();
  const StepShape shape{.n_tokens = 36,
                        .n_sequences = 5,
                        .n_attention = 1000,
                        .n_decode_attention = 400,
                        .n_logit_rows = 4};
  const double expected = 0.021 + 5 * 1e-4 + 400 * 2e-8 + 600 * 5e-9 + 4 * 3e-5;
  EXPECT_NEAR(cost(shape), expected, 1e-15);
}

TEST(NnlsTest, ClampsTheNegativeUnknownAndRefitsTheRest) {
  // Unconstrained: x = (2, -1); with x >= 0: (1.5, 0).
  DenseMatrix a(3, 3);
  a(0, 0) = 1, a(1, 1) = 1, a(2, 0) = 1, a(2, 1) = 1;  // column 2 all zero
  const std::vector<double> b = {2, -1, 1};
  const std::vector<double> x = nonnegative_least_squares(a, b);
  EXPECT_NEAR(x[0], 1.5, 1e-12);
  EXPECT_EQ(x[1], 0.0);
  EXPECT_EQ(x[2], 0.0);
}

TEST(FitStepCostTest, RecoversAKnownCostExactly) {
  const StepCost truth = known_cost();
  const auto samples = samples_of(truth, varied_shapes(200, true, 1));
  const StepCost fit = fit_step_cost(samples, truth.token_knots);
  ASSERT_EQ(fit.token_knots, truth.token_knots);
  for (size_t i = 0; i < truth.knot_seconds.size(); ++i) {
    expect_relative(fit.knot_seconds[i], truth.knot_seconds[i], 1e-8, "knot_seconds");
  }
  expect_relative(fit.per_sequence, truth.per_sequence, 1e-8, "per_sequence");
  expect_relative(fit.per_decode_attention, truth.per_decode_attention, 1e-8,
                  "per_decode_attention");
  expect_relative(fit.per_prefill_attention, truth.per_prefill_attention, 1e-8,
                  "per_prefill_attention");
  expect_relative(fit.per_logit_row, truth.per_logit_row, 1e-8, "per_logit_row");

  const FitQuality quality = fit_quality(fit_residuals(fit, samples));
  EXPECT_EQ(quality.n_samples, 200);
  EXPECT_LT(quality.max_rel_error, 1e-9);
}

TEST(FitStepCostTest, ATermTheSamplesNeverShowIsZero) {
  StepCost truth = known_cost();
  const auto samples = samples_of(truth, varied_shapes(100, false, 2));
  const StepCost fit = fit_step_cost(samples, truth.token_knots);
  EXPECT_EQ(fit.per_prefill_attention, 0.0);
  expect_relative(fit.per_decode_attention, truth.per_decode_attention, 1e-8,
                  "per_decode_attention");
  expect_relative(fit.knot_seconds[2], truth.knot_seconds[2], 1e-8, "knot_seconds[2]");
}

TEST(FitStepCostTest, NoisySamplesFitWithinTheNoise) {
  const StepCost truth = known_cost();
  auto samples = samples_of(truth, varied_shapes(400, true, 3));
  std::mt19937 rng(4);
  std::uniform_real_distribution<double> noise(-0.02, 0.02);
  for (StepSample& s : samples) s.seconds *= 1 + noise(rng);
  const StepCost fit = fit_step_cost(samples, truth.token_knots);
  const FitQuality quality = fit_quality(fit_residuals(fit, samples));
  EXPECT_LT(quality.median_rel_error, 0.015);
  EXPECT_LE(quality.median_rel_error, quality.p90_rel_error);
  EXPECT_LE(quality.p90_rel_error, quality.max_rel_error);
  EXPECT_LT(quality.max_rel_error, 0.035);
  for (size_t i = 0; i < truth.knot_seconds.size(); ++i) {
    expect_relative(fit.knot_seconds[i], truth.knot_seconds[i], 0.02, "knot_seconds");
  }
  // The attention terms are a small share of a step, near the noise: loose.
  expect_relative(fit.per_decode_attention, truth.per_decode_attention, 0.25,
                  "per_decode_attention");
  expect_relative(fit.per_prefill_attention, truth.per_prefill_attention, 0.25,
                  "per_prefill_attention");
}

TEST(FitStepCostTest, CoefficientsStayNonNegative) {
  // Steps that get faster with more logit rows: an unconstrained fit would
  // give per_logit_row < 0.
  std::vector<StepSample> samples;
  for (int64_t rows = 1; rows <= 64; ++rows) {
    const StepShape shape{.n_tokens = 64, .n_sequences = 64, .n_logit_rows = rows};
    samples.push_back({shape, 0.01 - 1e-5 * static_cast<double>(rows)});
  }
  const StepCost fit = fit_step_cost(samples, {1, 32, 128});
  EXPECT_EQ(fit.per_logit_row, 0.0);
  for (double s : fit.knot_seconds) EXPECT_GE(s, 0.0);
  EXPECT_GE(fit.per_sequence, 0.0);
  EXPECT_GT(fit(samples[0].shape), 0.0);
}

TEST(FitStepCostTest, RefusesBadInput) {
  const auto good = samples_of(known_cost(), varied_shapes(10, true, 5));
  EXPECT_THROW(fit_step_cost({}, {1, 8}), Error);
  EXPECT_THROW(fit_step_cost(good, {}), Error);
  EXPECT_THROW(fit_step_cost(good, {0, 8}), Error);
  EXPECT_THROW(fit_step_cost(good, {8, 8}), Error);
  EXPECT_THROW(fit_step_cost(good, {8, 4}), Error);
  for (double seconds : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    auto bad = good;
    bad[3].seconds = seconds;
    EXPECT_THROW(fit_step_cost(bad, {1, 8}), Error) << seconds;
  }
  auto bad = good;
  bad[0].shape.n_decode_attention = bad[0].shape.n_attention + 1;
  try {
    fit_step_cost(bad, {1, 8});
    FAIL() << "a sample with more decode pairs than pairs was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("sample 0"), std::string::npos) << e.what();
  }
}

TEST(FitLinkCostTest, RecoversALineAndClampsItsTerms) {
  const LinkCost truth{5e-6, 10e9};
  std::vector<LinkSample> samples;
  for (double bytes : {1e3, 1e5, 1e6, 1e7, 1e8}) samples.push_back({bytes, truth.seconds(bytes)});
  const LinkCost fit = fit_link_cost(samples);
  EXPECT_NEAR(fit.latency_s, truth.latency_s, 1e-12);
  expect_relative(fit.bytes_per_s, truth.bytes_per_s, 1e-9, "bytes_per_s");

  const LinkCost one = fit_link_cost(std::vector<LinkSample>{{1e6, 1e-3}});
  EXPECT_EQ(one.latency_s, 0.0);
  EXPECT_DOUBLE_EQ(one.bytes_per_s, 1e9);

  // A line with a negative intercept goes through the origin instead.
  const LinkCost origin = fit_link_cost(std::vector<LinkSample>{{1e6, 1e-4}, {2e6, 3e-4}});
  EXPECT_EQ(origin.latency_s, 0.0);
  EXPECT_GT(origin.bytes_per_s, 0.0);

  // Time that does not grow with bytes: latency only.
  const LinkCost flat = fit_link_cost(std::vector<LinkSample>{{1e3, 2e-3}, {1e6, 2e-3}});
  EXPECT_DOUBLE_EQ(flat.latency_s, 2e-3);
  EXPECT_TRUE(std::isinf(flat.bytes_per_s));
  EXPECT_DOUBLE_EQ(flat.seconds(1e9), 2e-3);

  EXPECT_THROW(fit_link_cost({}), Error);
  EXPECT_THROW(fit_link_cost(std::vector<LinkSample>{{1e3, 0.0}}), Error);
  EXPECT_THROW(LinkCost{}.seconds(1.0), Error);
}

Profile measured_profile() {
  Profile p;
  p.source = "measured";
  p.device = "cpu: test model, 2 threads";
  p.threads = 2;
  p.note = "synthetic";
  p.model = {.name = "tiny",
             .n_layers = 2,
             .n_embd = 64,
             .n_heads = 4,
             .n_kv_heads = 2,
             .head_dim = 16,
             .n_ff = 128,
             .n_vocab = 256,
             .n_ctx = 512,
             .n_params = 1.0 / 3.0 * 1e6,
             .weight_bytes = 123456.789,
             .kv_bytes_per_token = 256};
  const auto samples = samples_of(known_cost(), varied_shapes(5, true, 6));
  for (int tp : {1, 2}) {
    InstanceProfile instance;
    instance.tp = tp;
    instance.step = known_cost();
    instance.step.per_sequence = 0.1 / 3 / tp;
    instance.kv_capacity_tokens = 4096 / tp;
    instance.residuals = fit_residuals(instance.step, samples);
    instance.residuals[1].fitted_s *= 1.1;
    instance.quality = fit_quality(instance.residuals);
    p.instances.push_back(instance);
  }
  p.transfers.push_back({"mpi-shm", {3.3e-6, 7.7e9}, {{1e3, 3.4e-6}, {1e6, 1.3e-4}}});
  p.transfers.push_back({"tcp", {1e-5, std::numeric_limits<double>::infinity()}, {}});
  p.collectives.push_back({"all_reduce", 2, {1.1e-6, 2.2e10}, {{4096, 1.3e-6}}});
  p.host = {.neighbour_slowdown = 1.0 + 1.0 / 7, .samples = {1.1, 1.0 + 1.0 / 7, 1.2}};
  return p;
}

void expect_same(const StepShape& a, const StepShape& b) {
  EXPECT_EQ(a.n_tokens, b.n_tokens);
  EXPECT_EQ(a.n_sequences, b.n_sequences);
  EXPECT_EQ(a.n_attention, b.n_attention);
  EXPECT_EQ(a.n_decode_attention, b.n_decode_attention);
  EXPECT_EQ(a.n_logit_rows, b.n_logit_rows);
}

void expect_same(const LinkCost& a, const LinkCost& b) {
  EXPECT_EQ(a.latency_s, b.latency_s);
  EXPECT_EQ(a.bytes_per_s, b.bytes_per_s);
}

void expect_same(const std::vector<LinkSample>& a, const std::vector<LinkSample>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].bytes, b[i].bytes);
    EXPECT_EQ(a[i].seconds, b[i].seconds);
  }
}

void expect_same(const Profile& a, const Profile& b) {
  EXPECT_EQ(a.source, b.source);
  EXPECT_EQ(a.host.neighbour_slowdown, b.host.neighbour_slowdown);
  EXPECT_EQ(a.host.samples, b.host.samples);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.threads, b.threads);
  EXPECT_EQ(a.note, b.note);
  const ModelShape &ma = a.model, &mb = b.model;
  EXPECT_EQ(ma.name, mb.name);
  EXPECT_EQ(ma.n_layers, mb.n_layers);
  EXPECT_EQ(ma.n_embd, mb.n_embd);
  EXPECT_EQ(ma.n_heads, mb.n_heads);
  EXPECT_EQ(ma.n_kv_heads, mb.n_kv_heads);
  EXPECT_EQ(ma.head_dim, mb.head_dim);
  EXPECT_EQ(ma.n_ff, mb.n_ff);
  EXPECT_EQ(ma.n_vocab, mb.n_vocab);
  EXPECT_EQ(ma.n_ctx, mb.n_ctx);
  EXPECT_EQ(ma.n_params, mb.n_params);
  EXPECT_EQ(ma.weight_bytes, mb.weight_bytes);
  EXPECT_EQ(ma.kv_bytes_per_token, mb.kv_bytes_per_token);
  ASSERT_EQ(a.instances.size(), b.instances.size());
  for (size_t i = 0; i < a.instances.size(); ++i) {
    const InstanceProfile &ia = a.instances[i], &ib = b.instances[i];
    EXPECT_EQ(ia.tp, ib.tp);
    EXPECT_EQ(ia.step.token_knots, ib.step.token_knots);
    EXPECT_EQ(ia.step.knot_seconds, ib.step.knot_seconds);
    EXPECT_EQ(ia.step.per_sequence, ib.step.per_sequence);
    EXPECT_EQ(ia.step.per_decode_attention, ib.step.per_decode_attention);
    EXPECT_EQ(ia.step.per_prefill_attention, ib.step.per_prefill_attention);
    EXPECT_EQ(ia.step.per_logit_row, ib.step.per_logit_row);
    EXPECT_EQ(ia.kv_capacity_tokens, ib.kv_capacity_tokens);
    ASSERT_EQ(ia.residuals.size(), ib.residuals.size());
    for (size_t r = 0; r < ia.residuals.size(); ++r) {
      expect_same(ia.residuals[r].shape, ib.residuals[r].shape);
      EXPECT_EQ(ia.residuals[r].measured_s, ib.residuals[r].measured_s);
      EXPECT_EQ(ia.residuals[r].fitted_s, ib.residuals[r].fitted_s);
    }
    EXPECT_EQ(ia.quality.n_samples, ib.quality.n_samples);
    EXPECT_EQ(ia.quality.median_rel_error, ib.quality.median_rel_error);
    EXPECT_EQ(ia.quality.p90_rel_error, ib.quality.p90_rel_error);
    EXPECT_EQ(ia.quality.max_rel_error, ib.quality.max_rel_error);
  }
  ASSERT_EQ(a.transfers.size(), b.transfers.size());
  for (size_t i = 0; i < a.transfers.size(); ++i) {
    EXPECT_EQ(a.transfers[i].path, b.transfers[i].path);
    expect_same(a.transfers[i].cost, b.transfers[i].cost);
    expect_same(a.transfers[i].samples, b.transfers[i].samples);
  }
  ASSERT_EQ(a.collectives.size(), b.collectives.size());
  for (size_t i = 0; i < a.collectives.size(); ++i) {
    EXPECT_EQ(a.collectives[i].op, b.collectives[i].op);
    EXPECT_EQ(a.collectives[i].ranks, b.collectives[i].ranks);
    expect_same(a.collectives[i].cost, b.collectives[i].cost);
    expect_same(a.collectives[i].samples, b.collectives[i].samples);
  }
  ASSERT_EQ(a.hardware.has_value(), b.hardware.has_value());
  if (a.hardware) {
    const HardwareSpec &ha = *a.hardware, &hb = *b.hardware;
    EXPECT_EQ(ha.name, hb.name);
    EXPECT_EQ(ha.memory_bytes, hb.memory_bytes);
    EXPECT_EQ(ha.memory_bytes_per_s, hb.memory_bytes_per_s);
    EXPECT_EQ(ha.flops_per_s, hb.flops_per_s);
    EXPECT_EQ(ha.link_bytes_per_s, hb.link_bytes_per_s);
    EXPECT_EQ(ha.link_latency_s, hb.link_latency_s);
    EXPECT_EQ(ha.step_overhead_s, hb.step_overhead_s);
    EXPECT_EQ(ha.memory_efficiency, hb.memory_efficiency);
    EXPECT_EQ(ha.compute_efficiency, hb.compute_efficiency);
    EXPECT_EQ(ha.kv_memory_fraction, hb.kv_memory_fraction);
  }
}

TEST(ProfileJsonTest, RoundTripsEveryFieldExactly) {
  Profile profile = measured_profile();
  expect_same(profile_from_json(profile_json(profile)), profile);

  profile.hardware = HardwareSpec{.name = "made-up",
                                  .memory_bytes = 1e10 / 3,
                                  .memory_bytes_per_s = 2e11,
                                  .flops_per_s = 3e12,
                                  .link_bytes_per_s = 4e9,
                                  .link_latency_s = 1e-6 / 7,
                                  .step_overhead_s = 1e-4,
                                  .memory_efficiency = 0.7,
                                  .compute_efficiency = 0.55,
                                  .kv_memory_fraction = 0.85};
  const std::filesystem::path path =
      std::filesystem::path(testing::TempDir()) / "sim_profile_test.json";
  write_profile(path, profile);
  expect_same(read_profile(path), profile);
  std::filesystem::remove(path);

  const nlohmann::json json = profile_json(profile);
  EXPECT_EQ(json["format"], "duet-profile");
  EXPECT_EQ(json["version"], 1);
  EXPECT_EQ(json["instances"][0]["residuals"][0].size(), 7u);
  EXPECT_TRUE(json["instances"][0]["residuals"][0].contains("n_decode_attention"));
}

// What profile_from_json says of `json`, or "" when it reads it.
std::string read_error(const nlohmann::json& json) {
  try {
    profile_from_json(json);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(ProfileJsonTest, ErrorsNameTheField) {
  const nlohmann::json good = profile_json(measured_profile());
  auto expect_names = [&](nlohmann::json bad, const std::string& field) {
    const std::string message = read_error(bad);
    EXPECT_NE(message.find(field), std::string::npos) << "'" << message << "' lacks " << field;
  };
  nlohmann::json bad = good;
  bad["instances"][1]["step"].erase("knot_seconds");
  expect_names(bad, "instances[1].step.knot_seconds");
  bad = good;
  bad["instances"][0]["step"]["knot_seconds"][2] = "fast";
  expect_names(bad, "instances[0].step.knot_seconds[2]");
  bad = good;
  bad["threads"] = 1.5;
  expect_names(bad, "threads");
  bad = good;
  bad["transfers"][0]["cost"].erase("latency_s");
  expect_names(bad, "transfers[0].cost.latency_s");
  bad = good;
  bad["model"]["n_layer"] = 3;
  expect_names(bad, "model.n_layer");
  bad = good;
  bad["format"] = "something-else";
  expect_names(bad, "format");
  bad = good;
  bad["version"] = 2;
  expect_names(bad, "version");
  bad = good;
  bad["host"]["neighbour_slowdown"] = -1;
  expect_names(bad, "host.neighbour_slowdown");
  bad = good;
  bad["host"]["samples"][1] = "slow";
  expect_names(bad, "host.samples[1]");
  // A file from before host sharing was measured reads, with no slowdown.
  bad = good;
  bad.erase("host");
  EXPECT_EQ(read_error(bad), "");
  EXPECT_EQ(profile_from_json(bad).host.neighbour_slowdown, 1.0);
  EXPECT_NE(read_error(nlohmann::json::array()), "");
  EXPECT_THROW(read_profile(std::filesystem::path(testing::TempDir()) / "no-such-profile.json"),
               Error);
}

TEST(ProfileTest, LookupsNameWhatTheProfileHas) {
  const Profile profile = measured_profile();
  EXPECT_EQ(profile.instance(2).tp, 2);
  EXPECT_EQ(profile.transfer("tcp").path, "tcp");
  try {
    profile.instance(4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("[1, 2]"), std::string::npos) << e.what();
  }
  try {
    profile.transfer("nccl");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("mpi-shm, tcp"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace duet::sim
