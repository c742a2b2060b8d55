// Where tests find models and fixtures. Tests that need a model skip, with a
// printed reason, when it is absent (a fresh clone before launch/setup.sh).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

namespace duet::testing {

inline std::filesystem::path source_dir() { return DUET_SOURCE_DIR; }

inline std::filesystem::path fixture_path(const std::string& relative) {
  return source_dir() / "tests" / relative;
}

// The default model as launch/setup.sh places it (or $DUET_MODEL).
inline std::optional<std::filesystem::path> default_model_path() {
  if (const char* env = std::getenv("DUET_MODEL")) return std::filesystem::path(env);
  auto path = source_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf";
  if (std::filesystem::exists(path)) return path;
  return std::nullopt;
}

// A parameterized model test's model: "default" (nullopt when it has not
// been fetched) or the name of a tiny model in tests/fixtures/tiny/.
inline std::optional<std::filesystem::path> model_for_param(const std::string& param) {
  if (param == "default") return default_model_path();
  return fixture_path("fixtures/tiny/" + param);
}

// A model from the shared test-model folder beside the checkout, when present.
inline std::optional<std::filesystem::path> shared_model_path(const std::string& name) {
  auto path = source_dir().parent_path() / "shared" / "models" / name;
  if (std::filesystem::exists(path)) return path;
  return std::nullopt;
}

}  // namespace duet::testing

#define DUET_SKIP_WITHOUT_DEFAULT_MODEL(var)                                                  \
  auto var##_opt = ::duet::testing::default_model_path();                                     \
  if (!var##_opt) GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it"; \
  const std::filesystem::path var = *var##_opt
