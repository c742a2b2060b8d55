// Prompts of an exact token length, made of real text.
//
// A corpus of natural-language text is tokenized once by the server under
// test (so lengths are exact for its tokenizer); each prompt is a window of
// consecutive corpus tokens starting at a random offset, wrapping around.
// Requests are sent as token ids, which OpenAI-compatible servers (Duet,
// llama-server, vLLM) accept as `prompt`, so nothing re-tokenizes them.
// Random offsets keep prompts from sharing prefixes by accident (a shared
// prefix would turn into prefix-cache hits and flatter the server).
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace duet::loadgen {

// The corpus shipped with the benchmark (bench/data/corpus.txt), read from
// `path` when given.
std::string read_corpus(const std::filesystem::path& path);

class PromptSource {
 public:
  // Throws duet::Error when `corpus_tokens` is empty.
  explicit PromptSource(std::vector<int32_t> corpus_tokens);
  // `n` consecutive corpus tokens from a uniformly random offset (n >= 1).
  std::vector<int32_t> draw(int64_t n, std::mt19937_64& rng) const;
  size_t size() const { return tokens_.size(); }

 private:
  std::vector<int32_t> tokens_;
};

}  // namespace duet::loadgen
