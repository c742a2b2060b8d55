// `duet profile`'s measured profile: the plan's steps cover decode, prefill
// and mixed shapes, the fit explains them within the noise of a shared
// machine, and the command writes profiles (measured and roofline) that read
// back; it refuses a GPU it does not have.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "sim/profile_measure.h"
#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"

namespace duet::sim {
namespace {

std::string tiny_model() {
  return testing::fixture_path("fixtures/tiny/tiny_q4_1_gqa_tied.gguf").string();
}

MeasureOptions small_options(int64_t step_tokens, double budget_s) {
  MeasureOptions options;
  options.engine.n_kv_blocks = 256;
  options.engine.scheduler = {.max_step_tokens = step_tokens, .max_running = 16};
  options.budget_s = budget_s;
  options.max_context = 256;
  return options;
}

bool is_decode(const StepShape& s) { return s.n_tokens == s.n_sequences && s.n_tokens > 1; }
bool is_prefill(const StepShape& s) { return s.n_sequences == 1 && s.n_tokens > 1; }
bool is_mixed(const StepShape& s) {
  return s.n_sequences > 1 && s.n_tokens > s.n_sequences && s.n_decode_attention > 0;
}

TEST(MeasureSteps, CoversDecodePrefillAndMixedSteps) {
  const auto model = LlamaModel::load(tiny_model());
  cpu::ThreadPool pool(1);
  const std::vector<StepSample> samples =
      measure_steps(*model, cpu::kernel_table(cpu::best_isa()), pool, small_options(32, 5));
  ASSERT_FALSE(samples.empty());
  auto any = [&](bool (*kind)(const StepShape&)) {
    return std::any_of(samples.begin(), samples.end(),
                       [&](const StepSample& s) { return kind(s.shape); });
  };
  EXPECT_TRUE(any(is_decode));
  EXPECT_TRUE(any(is_prefill));
  EXPECT_TRUE(any(is_mixed));
  for (const StepSample& s : samples) {
    EXPECT_GT(s.seconds, 0);
    EXPECT_LE(s.shape.n_tokens, 32);
  }
}

TEST(MeasureSteps, RefusesABadBudget) {
  const auto model = LlamaModel::load(tiny_model());
  cpu::ThreadPool pool(1);
  EXPECT_THROW(
      measure_steps(*model, cpu::kernel_table(cpu::best_isa()), pool, small_options(32, 0)), Error);
}

TEST(MeasureKnots, PowersOfTwoUpToTheStepBudget) {
  EXPECT_EQ(measure_knots(512), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}));
  EXPECT_EQ(measure_knots(100), (std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 100}));
  EXPECT_EQ(measure_knots(2048).back(), 2048);
}

// The default model's steps take milliseconds, which a fit can see through
// the noise (a tiny model's take microseconds).
TEST(MeasureProfile, FitsTheDefaultModelsSteps) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
  const auto model = LlamaModel::load(path);
  cpu::ThreadPool pool(2);
  MeasureOptions options = small_options(64, 6);
  options.reps = 2;
  options.neighbour_rounds = 3;
  const Profile profile =
      measure_profile(*model, cpu::kernel_table(cpu::best_isa()), pool, options);
  EXPECT_EQ(profile.source, "measured");
  EXPECT_EQ(profile.threads, 2);
  EXPECT_NE(profile.device.find("cpu: "), std::string::npos);
  const InstanceProfile& instance = profile.instance(1);
  EXPECT_EQ(instance.kv_capacity_tokens, 256 * 16);
  EXPECT_EQ(instance.step.token_knots, measure_knots(64));
  EXPECT_EQ(instance.quality.n_samples, static_cast<int64_t>(instance.residuals.size()));
  EXPECT_GT(instance.quality.n_samples, 20);
  EXPECT_LT(instance.quality.median_rel_error, 0.5);
  EXPECT_EQ(profile.model.n_layers, model->config().n_layers);
  EXPECT_EQ(profile.host.samples.size(), static_cast<size_t>(options.neighbour_rounds));
}

TEST(MeasureNeighbour, TimesStepsAloneAndBesideASecondInstance) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
  const auto model = LlamaModel::load(path);
  cpu::ThreadPool pool(1);
  MeasureOptions options = small_options(64, 6);
  options.neighbour_rounds = 3;
  const HostSharing host =
      measure_neighbour(*model, cpu::kernel_table(cpu::best_isa()), pool, options);
  ASSERT_EQ(host.samples.size(), 3u);
  std::vector<double> sorted = host.samples;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(host.neighbour_slowdown, sorted[1]);  // the median
  for (const double ratio : host.samples) {
    // Beside a second instance a step is never many times faster or slower
    // (the neighbour has a core of its own, or shares this one).
    EXPECT_GT(ratio, 0.5);
    EXPECT_LT(ratio, 4.0);
  }
  options.neighbour_rounds = 0;
  const HostSharing none =
      measure_neighbour(*model, cpu::kernel_table(cpu::best_isa()), pool, options);
  EXPECT_EQ(none.neighbour_slowdown, 1.0);
  EXPECT_TRUE(none.samples.empty());
}

// ---------------------------------------------------------------- the command

struct CommandRun {
  int exit_code = -1;
  std::string err;
};

CommandRun run_duet(const std::string& args) {
  const auto err = std::filesystem::temp_directory_path() /
                   ("duet-profile-" + std::to_string(::getpid()) + ".err");
  const std::string command =
      std::string(DUET_BINARY) + " " + args + " 2>" + err.string() + " >/dev/null </dev/null";
  const int status = std::system(command.c_str());
  std::ifstream in(err);
  CommandRun run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.err.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  std::filesystem::remove(err);
  return run;
}

std::filesystem::path temp_profile(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("duet-profile-" + std::to_string(::getpid()) + "-" + name + ".json");
}

TEST(ProfileCommand, WritesAMeasuredProfileThatReadsBack) {
  const auto out = temp_profile("measured");
  const CommandRun run = run_duet("profile --model " + tiny_model() +
                                  " --threads 1 --budget 2 --step-tokens 32 --max-running 8 "
                                  "--kv-cache-mem 1MiB --out " +
                                  out.string());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("median"), std::string::npos) << run.err;
  const Profile profile = read_profile(out);
  std::filesystem::remove(out);
  EXPECT_EQ(profile.source, "measured");
  EXPECT_EQ(profile.threads, 1);
  ASSERT_EQ(profile.instances.size(), 1u);
  EXPECT_FALSE(profile.instances[0].residuals.empty());
  EXPECT_TRUE(profile.transfers.empty());
  EXPECT_NE(profile.note.find("not measured"), std::string::npos) << profile.note;
}

TEST(ProfileCommand, WritesARooflineProfile) {
  const auto out = temp_profile("roofline");
  const CommandRun run = run_duet(
      "profile --roofline --hardware h200 --model-shape llama-3-70b --tp 2,4 "
      "--out " +
      out.string());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const Profile profile = read_profile(out);
  std::filesystem::remove(out);
  EXPECT_EQ(profile.source, "roofline");
  ASSERT_EQ(profile.instances.size(), 2u);
  EXPECT_EQ(profile.instances[0].tp, 2);
}

TEST(ProfileCommand, RooflineOfAGgufModel) {
  const auto out = temp_profile("roofline-gguf");
  const CommandRun run = run_duet("profile --roofline --hardware h200 --model " + tiny_model() +
                                  " --out " + out.string());
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const Profile profile = read_profile(out);
  std::filesystem::remove(out);
  EXPECT_EQ(profile.source, "roofline");
  EXPECT_EQ(profile.model.name, "tiny_q4_1_gqa_tied");
}

TEST(ProfileCommand, RefusesAGpuItDoesNotHave) {
  if (std::getenv("DUET_TEST_HAS_GPU") != nullptr) GTEST_SKIP() << "a GPU may be present";
  const CommandRun run = run_duet("profile --model " + tiny_model() + " --device cuda --out " +
                                  temp_profile("cuda").string());
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_NE(run.err.find("unsupported"), std::string::npos) << run.err;
}

}  // namespace
}  // namespace duet::sim
