// `duet generate --prompts-file F`: every line of F is a prompt; all of them
// go through the batching engine at once. Completions go to stdout as JSON
// lines in input order; requests/s, output tokens/s, the KV cache's size and
// peak memory go to stderr.
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/error.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "tools/generate_command.h"
#include "tools/memory_size.h"
#include "worker/engine.h"
#include "worker/generator.h"

namespace duet::tools {
namespace {

std::string finish_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEndOfGeneration:
      return "end of generation";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "stopped";
  }
  return "unknown";
}

}  // namespace

int run_batch_generate(const GenerateArgs& args, const GenerateOptions& options) {
  std::ifstream in(args.prompts_file);
  DUET_REQUIRE(in.good(), "cannot read the prompts file {}", args.prompts_file);
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) prompts.push_back(line);
  }
  DUET_REQUIRE(!prompts.empty(), "the prompts file {} has no prompt", args.prompts_file);
  const int64_t kv_budget = parse_memory_size(args.kv_cache_mem, "--kv-cache-mem");

  const cpu::Isa isa = cpu::isa_from_environment();
  const int n_threads = args.threads > 0
                            ? args.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int device = parse_device(args.device);
  std::unique_ptr<LlamaModel> model =
      LlamaModel::load(args.model, {}, device < 0 ? &cpu::kernel_table(isa) : nullptr);
  const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
  std::optional<ChatTemplateKind> chat;
  if (args.chat) chat = model_chat_template(model->file(), args.chat_template);

  std::vector<std::vector<int32_t>> prompt_ids;
  int64_t needed_tokens = 0;
  for (const std::string& p : prompts) {
    prompt_ids.push_back(chat ? encode_chat(tokenizer, *chat, {{"user", p}})
                              : tokenizer.encode(p, /*add_special=*/true, /*parse_special=*/false));
    needed_tokens += static_cast<int64_t>(prompt_ids.back().size()) + options.max_tokens + 16;
  }

  // The KV cache: the budget, but no more than all prompts at once need.
  const KvLayout probe = make_kv_layout(model->config(), 1);
  const int64_t block_bytes = static_cast<int64_t>(probe.bytes_per_block());
  const int64_t n_blocks =
      std::max<int64_t>(1, std::min(kv_budget / block_bytes, (needed_tokens + 15) / 16));
  spdlog::info("KV cache: {} bytes per token, {} blocks of 16 = {} tokens ({:.1f} MiB)",
               probe.bytes_per_token(), n_blocks, n_blocks * 16,
               static_cast<double>(n_blocks * block_bytes) / (1 << 20));

  cpu::ThreadPool pool(n_threads);
  EngineConfig config;
  config.n_kv_blocks = n_blocks;
  config.scheduler.max_running = args.max_running;
  config.scheduler.max_step_tokens = std::max(args.step_tokens, args.max_running);
  config.scheduler.recompute = !options.use_kv_cache;
  config.end_of_generation = tokenizer.end_of_generation_ids();
  config.device = device;
  Engine engine(*model, cpu::kernel_table(isa), pool, config);

  struct Output {
    std::vector<int32_t> tokens;
    FinishReason finish = FinishReason::kLength;
  };
  std::vector<Output> outputs(prompts.size());
  RequestOptions request;
  request.max_tokens = options.max_tokens;
  request.sampling = options.sampling;
  request.ignore_eos = args.ignore_eos;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < prompt_ids.size(); ++i) {
    engine.submit(prompt_ids[i], request, [&outputs, i](const TokenEvent& e) {
      if (e.token >= 0) outputs[i].tokens.push_back(e.token);
      if (e.finished) outputs[i].finish = e.reason;
    });
  }
  engine.run_until_idle();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  int64_t n_output = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::vector<int32_t> text_ids;
    for (int32_t id : outputs[i].tokens) {
      if (!tokenizer.is_end_of_generation(id)) text_ids.push_back(id);
    }
    n_output += static_cast<int64_t>(outputs[i].tokens.size());
    const nlohmann::json line = {{"index", i},
                                 {"text", tokenizer.decode(text_ids, /*skip_special=*/true)},
                                 {"completion_tokens", outputs[i].tokens.size()},
                                 {"token_ids", outputs[i].tokens},
                                 {"finish", finish_name(outputs[i].finish)}};
    std::printf("%s\n",
                line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
  std::fflush(stdout);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const EngineStats stats = engine.stats();
  std::fprintf(
      stderr,
      "batch: %zu requests in %.3f s (%.2f requests/s); %lld output tokens (%.1f tokens/s); "
      "%lld steps; prefix-cache hits %lld of %lld prompt tokens; %lld preemptions; "
      "peak RSS %.1f MiB\n",
      prompts.size(), seconds, prompts.size() / seconds, static_cast<long long>(n_output),
      n_output / seconds, static_cast<long long>(stats.steps),
      static_cast<long long>(stats.prefix_hit_tokens), static_cast<long long>(stats.prompt_tokens),
      static_cast<long long>(stats.preemptions), static_cast<double>(usage.ru_maxrss) / 1024.0);
  return 0;
}

}  // namespace duet::tools
