// duet-logits: the top log-probabilities Duet gives each position of a token
// sequence, teacher-forced in one forward pass (Generator::logits_all): the
// first --prompt tokens as a prompt, the rest computed as generated tokens
// are, so that a greedy path fed back gives the logits its generation saw.
// bench/greedy_margins.py sets them beside llama.cpp's along one greedy
// path, to weigh the top-two margins against the engines' rounding
// differences.
//
//   duet-logits -m MODEL --ids '[1, 2, 3, ...]' --prompt P [--from I] [--top K] [-t N]
//
// Prints one JSON object: {"rows": [[[id, logprob], ...], ...]}, a row for
// each position from --from on (row i predicting token i + 1), its K most
// probable tokens in decreasing order (ties: the lower id).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/generator.h"
#include "worker/model/llama_model.h"

namespace {

// The k most probable entries of one row of logits, as (id, log-probability).
nlohmann::json top_logprobs(const float* logits, int64_t n_vocab, int64_t k) {
  const float max = *std::max_element(logits, logits + n_vocab);
  double sum = 0.0;
  for (int64_t i = 0; i < n_vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
  const double log_sum = static_cast<double>(max) + std::log(sum);
  std::vector<int32_t> ids(static_cast<size_t>(n_vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  nlohmann::json row = nlohmann::json::array();
  for (int64_t j = 0; j < k; ++j) {
    const int32_t id = ids[static_cast<size_t>(j)];
    row.push_back({id, static_cast<double>(logits[id]) - log_sum});
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"duet-logits: top log-probabilities at every position of a token sequence"};
  std::string model_path, ids_json;
  int64_t n_prompt = 0, from = 0, top = 2;
  int threads = 2;
  app.add_option("-m,--model", model_path, "GGUF model")->required();
  app.add_option("--ids", ids_json, "The token ids, a JSON array")->required();
  app.add_option("--prompt", n_prompt, "How many of the ids are the prompt (default: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--from", from, "First position printed")->check(CLI::NonNegativeNumber);
  app.add_option("--top", top, "Entries per row")->check(CLI::Range(1, 100));
  app.add_option("-t,--threads", threads, "Compute threads")->check(CLI::Range(1, 1024));
  CLI11_PARSE(app, argc, argv);
  try {
    const auto ids = nlohmann::json::parse(ids_json).get<std::vector<int32_t>>();
    DUET_REQUIRE(from < static_cast<int64_t>(ids.size()), "--from {} is past the {} ids", from,
                 ids.size());  // before the slow load
    const duet::cpu::KernelTable& kernels =
        duet::cpu::kernel_table(duet::cpu::isa_from_environment());
    const auto model = duet::LlamaModel::load(model_path, {}, &kernels);
    const int64_t n_vocab = model->config().n_vocab;
    duet::cpu::ThreadPool pool(threads);
    duet::Generator generator(*model, kernels, pool);
    const std::vector<float> logits =
        generator.logits_all(ids, n_prompt > 0 ? std::optional<int64_t>(n_prompt) : std::nullopt);
    nlohmann::json rows = nlohmann::json::array();
    for (auto i = static_cast<size_t>(from); i < ids.size(); ++i)
      rows.push_back(top_logprobs(logits.data() + i * static_cast<size_t>(n_vocab), n_vocab,
                                  std::min(top, n_vocab)));
    std::printf("%s\n", nlohmann::json{{"rows", rows}}.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-logits: %s\n", e.what());
    return 1;
  }
  return 0;
}
