#include "loadgen/prompts.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "common/error.h"

namespace duet::loadgen {

// The whole file as is; throws duet::Error when it cannot be read or is empty.
std::string read_corpus(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::kNotFound, fmt::format("cannot open corpus {}", path.string()));
  std::ostringstream text;
  text << in.rdbuf();
  DUET_REQUIRE(!text.str().empty(), "corpus {} is empty", path.string());
  return text.str();
}

PromptSource::PromptSource(std::vector<int32_t> corpus_tokens) : tokens_(std::move(corpus_tokens)) {
  DUET_REQUIRE(!tokens_.empty(), "the prompt corpus has no tokens");
}

// Draws one offset and nothing else from `rng`. A window longer than the
// corpus wraps around as many times as it needs.
std::vector<int32_t> PromptSource::draw(int64_t n, std::mt19937_64& rng) const {
  DUET_REQUIRE(n >= 1, "a prompt needs at least one token, asked for {}", n);
  std::uniform_int_distribution<size_t> pick_offset(0, tokens_.size() - 1);
  size_t at = pick_offset(rng);
  std::vector<int32_t> prompt;
  prompt.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    prompt.push_back(tokens_[at]);
    if (++at == tokens_.size()) at = 0;
  }
  return prompt;
}

}  // namespace duet::loadgen
