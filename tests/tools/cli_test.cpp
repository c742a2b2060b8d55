// `duet generate` as a user runs it: real processes, real files. Bad input
// must give one line on stderr and exit code 2; good input writes only the
// generated text to stdout.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tests/golden_file.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

struct ProcessResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs `duet ARGS` with stdout and stderr captured into files.
ProcessResult run_duet(const std::string& args) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("duet-cli-" + std::to_string(::getpid()) + "-" +
                    ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  const std::string command = std::string(DUET_BINARY) + " " + args + " >" +
                              (dir / "out").string() + " 2>" + (dir / "err").string() +
                              " </dev/null";
  const int status = std::system(command.c_str());
  ProcessResult run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.out = read_file(dir / "out");
  run.err = read_file(dir / "err");
  std::filesystem::remove_all(dir);
  return run;
}

int count_lines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

std::string tiny_model() {
  return testing::fixture_path("fixtures/tiny/tiny_q4_1_gqa_tied.gguf").string();
}

TEST(Cli, UnknownOptionIsOneLineAndExitTwo) {
  const ProcessResult run = run_duet("generate -m " + tiny_model() + " -p hi --no-such-option");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("--no-such-option"), std::string::npos) << run.err;
  EXPECT_TRUE(run.out.empty());
}

// An API key file that cannot be read, or holds no key, stops serve before
// it loads the model or listens: one line, exit 2.
TEST(Cli, UnusableApiKeyFileIsOneLineAndExitTwo) {
  const ProcessResult missing =
      run_duet("serve -m " + tiny_model() + " --api-key-file /nonexistent/key --http-port 0");
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(count_lines(missing.err), 1) << missing.err;
  EXPECT_NE(missing.err.find("--api-key-file: cannot read /nonexistent/key"), std::string::npos)
      << missing.err;
  EXPECT_TRUE(missing.out.empty());
  const ProcessResult empty =
      run_duet("serve -m " + tiny_model() + " --api-key-file /dev/null --http-port 0");
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_NE(empty.err.find("holds no key on its first line"), std::string::npos) << empty.err;
}

TEST(Cli, MissingModelIsOneLineAndExitTwo) {
  const ProcessResult run = run_duet("generate -m /nonexistent/model.gguf -p hi");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("/nonexistent/model.gguf"), std::string::npos) << run.err;
}

TEST(Cli, NonGgufFileIsOneLineAndExitTwo) {
  const ProcessResult run =
      run_duet("generate -m " + testing::fixture_path("CMakeLists.txt").string() + " -p hi");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("not a GGUF file"), std::string::npos) << run.err;
}

TEST(Cli, TruncatedModelIsOneLineAndExitTwo) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("duet-truncated-" + std::to_string(::getpid()) + ".gguf");
  const std::string bytes = read_file(tiny_model());
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  const ProcessResult run = run_duet("generate -m " + path.string() + " -p hi");
  std::filesystem::remove(path);
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
  EXPECT_NE(run.err.find("offset"), std::string::npos) << run.err;
}

TEST(Cli, GeneratesOnlyTextOnStdout) {
  const ProcessResult run = run_duet("generate -m " + tiny_model() + " -p hello -n 8 -t 1");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_FALSE(run.out.empty());
  EXPECT_EQ(run.out.find("tokens/s"), std::string::npos) << "statistics leaked into stdout";
  EXPECT_NE(run.err.find("tokens/s"), std::string::npos) << run.err;
}

TEST(Cli, GreedyTextOfTheDefaultModelMatchesLlamaCpp) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(model);
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/smollm2_greedy.json"));
  const auto& narrative = golden["cases"][0];
  ASSERT_EQ(narrative["name"], "narrative");
  const ProcessResult run = run_duet("generate -m " + model.string() + " -p \"" +
                                     narrative["prompt"].get<std::string>() + "\" -n 64 -t 2");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(run.out, narrative["generated_text"].get<std::string>() + "\n");
}

TEST(Cli, ChatAnswersAndStopsAtEndOfTurn) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(model);
  const ProcessResult run = run_duet("generate -m " + model.string() +
                                     " --chat -p \"What is the capital of France?\" -n 64 -t 2");
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("Paris"), std::string::npos) << run.out;
  EXPECT_NE(run.err.find("end of generation"), std::string::npos) << run.err;
}

TEST(Cli, CacheOffGivesTheSameTextAsCacheOn) {
  const ProcessResult on = run_duet("generate -m " + tiny_model() + " -p hello -n 12 -t 1");
  const ProcessResult off =
      run_duet("generate -m " + tiny_model() + " -p hello -n 12 -t 1 --no-kv-cache");
  EXPECT_EQ(on.exit_code, 0);
  EXPECT_EQ(off.exit_code, 0);
  EXPECT_EQ(on.out, off.out);
}

TEST(Cli, PromptsFileRunsEveryPromptThroughTheBatchingEngine) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("duet-prompts-" + std::to_string(::getpid()) + ".txt");
  std::ofstream(path) << "hello\nthe sea\n\nonce upon a time\n";  // the blank line is skipped
  const ProcessResult run =
      run_duet("generate -m " + tiny_model() + " --prompts-file " + path.string() + " -n 5 -t 2");
  std::filesystem::remove(path);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(count_lines(run.out), 3) << run.out;
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(run.out.find("\"index\":" + std::to_string(i)), std::string::npos) << run.out;
  }
  EXPECT_NE(run.err.find("requests/s"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("bytes per token"), std::string::npos) << run.err;
}

// A model without a chat template takes one by name; a name Duet does not
// know, or no template at all, is one clear error.
TEST(Cli, ChatTemplateOptionNamesATemplate) {
  const std::string base = "generate -m " + tiny_model() + " -p hi -n 2 -t 1 --chat";
  const ProcessResult none = run_duet(base);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("has no chat template (--chat-template NAME gives one)"),
            std::string::npos)
      << none.err;
  for (const char* name : {"chatml", "llama3", "gemma", "mistral-v7"}) {
    const ProcessResult named = run_duet(base + " --chat-template " + name);
    EXPECT_EQ(named.exit_code, 0) << name << ": " << named.err;
  }
  const ProcessResult unknown = run_duet(base + " --chat-template llama2");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("unsupported chat template"), std::string::npos) << unknown.err;
}

TEST(Cli, PromptAndPromptsFileAreExclusive) {
  const ProcessResult run = run_duet("generate -m " + tiny_model() + " -p hi --prompts-file x");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_EQ(count_lines(run.err), 1) << run.err;
}

TEST(Cli, UnknownDeviceIsOneLineAndExitTwo) {
  for (const char* device : {"gpu", "cuda:", "cuda:x1", "cuda:-1"}) {
    const ProcessResult run = run_duet("generate -m " + tiny_model() + " -p hi --device " + device);
    EXPECT_EQ(run.exit_code, 2) << device;
    EXPECT_EQ(count_lines(run.err), 1) << run.err;
    EXPECT_NE(run.err.find("--device"), std::string::npos) << run.err;
    EXPECT_TRUE(run.out.empty()) << run.out;
  }
}

TEST(Cli, CpuDeviceIsTheDefault) {
  const ProcessResult plain = run_duet("generate -m " + tiny_model() + " -p hello -n 8 -t 1");
  const ProcessResult cpu =
      run_duet("generate -m " + tiny_model() + " -p hello -n 8 -t 1 --device cpu");
  EXPECT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_EQ(plain.out, cpu.out);
}

// Without a GPU (or in a build without CUDA), asking for one is the only
// thing that fails, with one clear line; the CPU path above still works.
TEST(Cli, CudaDeviceWithoutAGpuIsOneLineAndExitTwo) {
  if (std::filesystem::exists("/dev/nvidia0")) GTEST_SKIP() << "this machine has a GPU";
  const auto prompts = std::filesystem::temp_directory_path() /
                       ("duet-device-prompts-" + std::to_string(::getpid()) + ".txt");
  std::ofstream(prompts) << "hello\n";
  for (const char* command :
       {"generate -m {} -p hi --device cuda", "generate -m {} --prompts-file {} --device cuda:1",
        "serve -m {} --rpc-port 0 --http-port 0 --device cuda"}) {
    std::string args = command;
    args.replace(args.find("{}"), 2, tiny_model());
    if (const size_t at = args.find("{}"); at != std::string::npos)
      args.replace(at, 2, prompts.string());
    const ProcessResult run = run_duet(args);
    EXPECT_EQ(run.exit_code, 2) << args << ": " << run.err;
    EXPECT_EQ(count_lines(run.err), 1) << run.err;
    EXPECT_NE(run.err.find("GPU"), std::string::npos) << run.err;
    EXPECT_TRUE(run.out.empty()) << run.out;
  }
  std::filesystem::remove(prompts);
}

}  // namespace
}  // namespace duet
