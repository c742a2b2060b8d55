#include "tools/generate_command.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/error.h"
#include "common/sampling.h"
#include "common/text/chat_template.h"
#include "common/text/incremental_decoder.h"
#include "common/text/stop_matcher.h"
#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "tools/device_option.h"
#include "worker/generator.h"

namespace duet::tools {
namespace {

double peak_rss_mib() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// kCancelled comes only from a stop string here; the decoder's final flush may
// also complete one after the generator finished for another reason.
const char* finish_name(FinishReason finish, bool stop_string_matched) {
  if (finish == FinishReason::kCancelled || stop_string_matched) return "stop string";
  return finish == FinishReason::kEndOfGeneration ? "end of generation" : "length";
}

}  // namespace

void add_generate_command(CLI::App& app, GenerateArgs& args) {
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt on the CPU, streaming text");
  cmd->add_option("-m,--model", args.model, "Path of a GGUF model")->required();
  CLI::Option* prompt = cmd->add_option("-p,--prompt", args.prompt, "Prompt text");
  CLI::Option* prompts = cmd->add_option(
      "--prompts-file", args.prompts_file,
      "Run every line of this file as a prompt through the batching engine (JSON lines out)");
  prompt->excludes(prompts);
  prompts->excludes(prompt);
  cmd->add_option("--kv-cache-mem", args.kv_cache_mem,
                  "Batch mode: KV cache size, bytes (512MiB, 2GiB) or a fraction of free memory");
  cmd->add_option("--max-running", args.max_running, "Batch mode: sequences decoded at once")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--step-tokens", args.step_tokens,
                  "Token budget of one engine step (longer prompts are computed in chunks)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_flag("--chat", args.chat, "Wrap the prompt as a user turn in the model's chat template");
  cmd->add_option("--chat-template", args.chat_template,
                  "With --chat: this template instead of the model's (chatml, llama3, gemma, "
                  "mistral-v1, mistral-v3, mistral-v3-tekken, mistral-v7, mistral-v7-tekken)");
  cmd->add_option("-n,--n-tokens", args.n_tokens, "Tokens to generate at most")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--temp", args.temperature, "Sampling temperature (0: greedy)")
      ->check(CLI::Range(0.0f, 100.0f));
  cmd->add_option("--seed", args.seed, "Seed of the sampling random stream");
  cmd->add_option("--top-k", args.top_k, "Keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", args.top_p,
                  "Keep the most likely tokens up to this probability mass (1: off)");
  cmd->add_option("--min-p", args.min_p,
                  "Keep tokens at least this fraction as likely as the top one (0: off)");
  cmd->add_option(
      "--repeat-penalty", args.repeat_penalty,
      "Divide positive logits, multiply negative ones, of recent tokens by this (1: off)");
  cmd->add_option("--repeat-last-n", args.repeat_last_n,
                  "Recent tokens the penalties look at (-1: the whole context, 0: off)");
  cmd->add_option("--frequency-penalty", args.frequency_penalty,
                  "Subtract this times a recent token's count from its logit (0: off)");
  cmd->add_option("--presence-penalty", args.presence_penalty,
                  "Subtract this from the logit of every recent token (0: off)");
  cmd->add_option("--stop", args.stop,
                  "Stop when the text contains this string, not printed (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("-t,--threads", args.threads, "Compute threads (default: all cores)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--device", args.device,
                  "Where the model runs: cpu, cuda (GPU 0) or cuda:N (needs a CUDA build)")
      ->capture_default_str()
      ->check(device_validator());
  cmd->add_flag("--no-kv-cache", args.no_kv_cache,
                "Recompute the whole context at every step (to measure what the cache saves)");
  cmd->add_flag("--ignore-eos", args.ignore_eos,
                "Generate exactly --n-tokens: end-of-generation tokens do not end the text "
                "(and are not part of it), as serving's ignore_eos");
  cmd->add_flag("--token-ids", args.token_ids,
                "Also print the generated token ids on stderr, as 'token_ids: [...]' (JSON)");
}

int run_generate(const GenerateArgs& args) {
  GenerateOptions options;
  options.max_tokens = args.n_tokens;
  options.sampling.temperature = args.temperature;
  options.sampling.seed = args.seed;
  options.sampling.top_k = args.top_k;
  options.sampling.top_p = args.top_p;
  options.sampling.min_p = args.min_p;
  options.sampling.repetition_penalty = args.repeat_penalty;
  options.sampling.penalty_last_n = args.repeat_last_n;
  options.sampling.frequency_penalty = args.frequency_penalty;
  options.sampling.presence_penalty = args.presence_penalty;
  options.use_kv_cache = !args.no_kv_cache;
  options.step_tokens = args.step_tokens;
  validate_sampling_params(options.sampling);  // before the slow model load
  require_device(parse_device(args.device));
  DUET_REQUIRE(!args.prompt.empty() || !args.prompts_file.empty(),
               "give a prompt (--prompt) or a file of prompts (--prompts-file)");
  if (!args.prompts_file.empty()) return run_batch_generate(args, options);
  StopMatcher stop_matcher(args.stop);

  const cpu::Isa isa = cpu::isa_from_environment();
  const cpu::KernelTable& kernels = cpu::kernel_table(isa);
  const int n_threads = args.threads > 0
                            ? args.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  const int device = parse_device(args.device);
  std::unique_ptr<LlamaModel> model =
      LlamaModel::load(args.model, {}, device < 0 ? &kernels : nullptr);
  const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
  const ModelConfig& c = model->config();
  spdlog::info(
      "model {}: {} layers, {} heads ({} KV), embedding {}, vocabulary {}, {:.1f} MiB of weights",
      c.name, c.n_layers, c.n_heads, c.n_kv_heads, c.n_embd, c.n_vocab,
      static_cast<double>(model->weight_bytes()) / (1 << 20));
  spdlog::info("kernels: {}, threads: {}, KV cache: {}", cpu::isa_name(isa), n_threads,
               args.no_kv_cache ? "off (recompute)" : "on");

  std::vector<TokenId> prompt_ids;
  if (args.chat) {
    // Special-token text is parsed only where the template put it.
    prompt_ids = encode_chat(tokenizer, model_chat_template(model->file(), args.chat_template),
                             {{"user", args.prompt}});
  } else {
    prompt_ids = tokenizer.encode(args.prompt, /*add_special=*/true, /*parse_special=*/false);
  }

  cpu::ThreadPool pool(n_threads);
  Generator generator(*model, kernels, pool, device);
  // Special tokens are no text, as the server streams it: one prompt, one answer.
  IncrementalDecoder decoder(tokenizer, /*skip_special=*/true);

  // Text goes token -> decoder (whole UTF-8 characters) -> stop matcher (holds
  // back what may begin a stop string) -> stdout.
  auto print = [](const std::string& text) {
    if (text.empty()) return;
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  auto emit = [&](TokenId id) {
    if (tokenizer.is_end_of_generation(id)) return true;  // not part of the text
    print(stop_matcher.push(decoder.push(id)));
    return !stop_matcher.stopped();
  };
  auto is_end = [&](TokenId id) { return !args.ignore_eos && tokenizer.is_end_of_generation(id); };
  const GenerateResult result = generator.generate(prompt_ids, options, emit, is_end);
  if (!stop_matcher.stopped()) {
    print(stop_matcher.push(decoder.flush()));
    print(stop_matcher.flush());
  }
  print("\n");
  if (args.token_ids) {
    std::fprintf(stderr, "token_ids: %s\n", nlohmann::json(result.tokens).dump().c_str());
  }

  const int64_t n_decoded = std::max<int64_t>(0, static_cast<int64_t>(result.tokens.size()) - 1);
  std::fprintf(stderr,
               "prompt: %lld tokens in %.3f s (%.1f tokens/s); generation: %zu tokens, %lld decode "
               "steps in %.3f s (%.1f tokens/s); finish: %s; peak RSS %.1f MiB\n",
               static_cast<long long>(result.n_prompt), result.prompt_seconds,
               result.n_prompt / std::max(result.prompt_seconds, 1e-9), result.tokens.size(),
               static_cast<long long>(n_decoded), result.generate_seconds,
               n_decoded / std::max(result.generate_seconds, 1e-9),
               finish_name(result.finish, stop_matcher.stopped()), peak_rss_mib());
  return 0;
}

}  // namespace duet::tools
