// The Llama family's other shapes: qwen2 (Q/K/V biases, NeoX RoPE), qwen3 (a head
// size of its own, RMS norm of each Q and K head), gemma3 (qwen3's heads,
// post-norms, GEGLU, a scaled embedding, a sliding-window layer), the
// mixtures of experts (qwen3moe, Mixtral's llama), Llama 3.1's
// rope_freqs, linear RoPE scaling, large vocabularies, and the refusals (Mistral's
// sliding window, YaRN, other architectures, tensors the forward pass would not
// use). Logits of tiny random models against llama.cpp's
// (tests/golden/make_tiny_shape_models.py) on every ISA path this CPU runs;
// metadata cases on GGUF files written here.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/model/gguf.h"
#include "common/model/model_config.h"
#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "tests/worker/model/tiny_model_golden.h"
#include "worker/generator.h"
#include "worker/kv/kv_cache.h"
#include "worker/model/cpu_forward.h"

namespace duet {
namespace {

constexpr float kLogitTolerance = 0.02f;

nlohmann::json golden() {
  return testing::read_golden(testing::fixture_path("golden/tiny_shapes.json"));
}

std::filesystem::path model_dir(const nlohmann::json& g) {
  return testing::source_dir() / g["model_dir"].get<std::string>();
}

// The error `body` throws: its kind and message (kInternal and "" when it throws none).
template <typename F>
std::pair<ErrorKind, std::string> error_of(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    return {e.kind(), e.what()};
  }
  return {ErrorKind::kInternal, ""};
}

TEST(TinyShapes, TeacherForcedLogitsMatchReferenceOnEveryIsa) {
  const nlohmann::json g = golden();
  cpu::ThreadPool pool(2);
  ASSERT_FALSE(g["models"].empty());
  for (const auto& m : g["models"]) {
    const std::string file = m["file"];
    auto model = LlamaModel::load(model_dir(g) / file);
    const ModelConfig& c = model->config();
    EXPECT_EQ(c.architecture, m["architecture"].get<std::string>()) << file;
    EXPECT_EQ(c.rope_neox, m["rope_style"] == "halves") << file;
    EXPECT_EQ(c.tied_embeddings, m["tied_embeddings"].get<bool>()) << file;
    EXPECT_EQ(model->layer(0).bq.empty(), !m["qkv_biases"].get<bool>()) << file;
    EXPECT_EQ(c.head_dim, m["head_dim"].get<int64_t>()) << file;
    EXPECT_EQ(c.qk_norm, m["qk_norm"].get<bool>()) << file;
    EXPECT_EQ(model->layer(0).q_norm.empty(), !c.qk_norm) << file;
    EXPECT_EQ(c.rope_freq_base, m["rope_freq_base"].get<float>()) << file;
    const float scale =
        m["rope_scaling"].is_null() ? 1.0f : 1.0f / m["rope_scaling"]["factor"].get<float>();
    EXPECT_EQ(c.rope_freq_scale, scale) << file;
    const auto freqs = m["rope_freqs"].is_null() ? std::vector<float>{}
                                                 : m["rope_freqs"].get<std::vector<float>>();
    EXPECT_EQ(model->rope_freqs(), freqs) << file;
    EXPECT_EQ(c.post_norms, m.value("post_norms", false)) << file;
    EXPECT_EQ(model->layer(0).attn_post_norm.empty(), !c.post_norms) << file;
    EXPECT_EQ(c.ffn_activation == FfnActivation::kGeluTanh,
              m.value("ffn_activation", "silu") == "gelu_tanh")
        << file;
    EXPECT_EQ(c.sliding_window, m.value("sliding_window", int64_t{0})) << file;
    for (int64_t il = 0; il < c.n_layers; ++il) {
      const bool windowed = c.sliding_window > 0 && m["swa_layers"][il].get<bool>();
      EXPECT_EQ(c.is_swa(il), windowed) << file << " layer " << il;
    }
    EXPECT_EQ(c.n_experts, m.value("n_experts", int64_t{0})) << file;
    EXPECT_EQ(c.n_experts_used, m.value("n_experts_used", int64_t{0})) << file;
    EXPECT_EQ(c.n_ff_exp, m.value("n_ff_exp", int64_t{0})) << file;
    EXPECT_EQ(model->layer(0).experts.size(), static_cast<size_t>(c.n_experts)) << file;

    const auto ids = m["ids"].get<std::vector<int32_t>>();
    for (const auto& [feature, effect] : m["feature_effect"].items()) {
      // The fixture tells its feature apart: without it, llama.cpp's logits move this much.
      EXPECT_GT(effect.get<float>(), 10 * kLogitTolerance) << file << " " << feature;
    }
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const float worst =
          testing::max_logit_diff(generator.logits_all(ids), m["logits"], c.n_vocab);
      std::printf("  %-30s %-7s max |dlogit| %.1e\n", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      EXPECT_LE(worst, kLogitTolerance) << file << " on " << cpu::isa_name(isa);
    }
  }
}

// Decode steps through a sliding window: the golden ids fed one token per
// step (each in the one-token order, most of them past the window of 8) give
// llama.cpp's logits too, on every ISA.
TEST(TinyShapes, SlidingWindowDecodeStepsMatchReference) {
  const nlohmann::json g = golden();
  cpu::ThreadPool pool(2);
  int checked = 0;
  for (const auto& m : g["models"]) {
    if (m.value("sliding_window", int64_t{0}) == 0) continue;
    const std::string file = m["file"];
    auto model = LlamaModel::load(model_dir(g) / file);
    const int64_t n_vocab = model->config().n_vocab;
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    for (cpu::Isa isa : cpu::supported_isas()) {
      CpuForward forward(*model, cpu::kernel_table(isa), pool);
      KvCache cache(model->kv_layout(4));
      const std::vector<int32_t> table = {3, 0, 2, 1};
      std::vector<float> logits(static_cast<size_t>(ids.size() * n_vocab));
      const int64_t row = 0;
      for (size_t p = 0; p < ids.size(); ++p) {
        const auto pos = static_cast<int64_t>(p);
        const ForwardSequence step{table, pos, 1, pos};
        forward.run({&ids[p], 1}, {&step, 1}, cache, {&row, 1}, logits.data() + pos * n_vocab);
      }
      const float worst = testing::max_logit_diff(logits, m["logits"], n_vocab);
      std::printf("  %-30s %-7s decode steps, max |dlogit| %.1e\n", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      EXPECT_LE(worst, kLogitTolerance) << file << " on " << cpu::isa_name(isa);
    }
    ++checked;
  }
  EXPECT_GT(checked, 0) << "no fixture with a sliding window";
}

TEST(TinyShapes, SlidingWindowModelIsRefused) {
  const nlohmann::json g = golden();
  ASSERT_FALSE(g["refused"].empty());
  for (const auto& r : g["refused"]) {
    const auto [kind, message] =
        error_of([&] { LlamaModel::load(model_dir(g) / r["file"].get<std::string>()); });
    EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
    EXPECT_NE(message.find(r["error"]["message_contains"].get<std::string>()), std::string::npos)
        << message;
    EXPECT_NE(message.find("llama.attention.sliding_window = 4096"), std::string::npos) << message;
  }
}

// A GGUF v3 file built in memory: metadata and F32 tensors.
class GgufBuilder {
 public:
  GgufBuilder& str(const std::string& key, const std::string& value) {
    key_header(key, 8);
    string(value);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& u32(const std::string& key, uint32_t value) {
    key_header(key, 4);
    pod(kv_, value);
    ++n_kv_;
    return *this;
  }
  GgufBuilder& f32(const std::string& key, float value) {
    key_header(key, 6);
    pod(kv_, value);
    ++n_kv_;
    return *this;
  }
  // An F32 tensor of shape ne (ne[0] the row length) holding `values` (zeros when empty).
  GgufBuilder& tensor(const std::string& name, std::vector<uint64_t> ne,
                      std::vector<float> values = {}) {
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    values.resize(n, 0.0f);
    pod(infos_, static_cast<uint64_t>(name.size()));
    infos_.insert(infos_.end(), name.begin(), name.end());
    pod(infos_, static_cast<uint32_t>(ne.size()));
    for (uint64_t d : ne) pod(infos_, d);
    pod(infos_, static_cast<uint32_t>(0));  // F32
    pod(infos_, static_cast<uint64_t>(data_.size()));
    const size_t at = data_.size();
    data_.resize(at + n * sizeof(float));
    std::memcpy(data_.data() + at, values.data(), n * sizeof(float));
    data_.resize((data_.size() + 31) / 32 * 32, 0);
    ++n_tensors_;
    return *this;
  }

  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
    pod(out, static_cast<uint32_t>(3));
    pod(out, n_tensors_);
    pod(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    out.resize((out.size() + 31) / 32 * 32, 0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }
  GgufFile file(const std::string& name) const { return GgufFile::from_bytes(name, bytes()); }
  std::filesystem::path write(const std::string& name) const {
    const std::filesystem::path path = std::filesystem::path(::testing::TempDir()) / name;
    const std::vector<uint8_t> b = bytes();
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return path;
  }

 private:
  template <typename T>
  static void pod(std::vector<uint8_t>& out, T value) {
    const auto raw = std::bit_cast<std::array<uint8_t, sizeof(T)>>(value);
    out.insert(out.end(), raw.begin(), raw.end());
  }
  void key_header(const std::string& key, uint32_t type) {
    pod(kv_, static_cast<uint64_t>(key.size()));
    kv_.insert(kv_.end(), key.begin(), key.end());
    pod(kv_, type);
  }
  void string(const std::string& s) {
    pod(kv_, static_cast<uint64_t>(s.size()));
    kv_.insert(kv_.end(), s.begin(), s.end());
  }

  std::vector<uint8_t> kv_, infos_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

// A complete model of architecture `arch`: n_embd 32, 2 heads of 16, n_ff 32, one layer, tied
// head; every weight zero except the embeddings (`embd`, n_vocab rows) and norms (ones).
GgufBuilder tiny_model(const std::string& arch, int64_t n_vocab, std::vector<float> embd = {}) {
  constexpr uint64_t kEmbd = 32, kFf = 32;
  GgufBuilder b;
  b.str("general.architecture", arch)
      .u32(arch + ".block_count", 1)
      .u32(arch + ".embedding_length", kEmbd)
      .u32(arch + ".feed_forward_length", kFf)
      .u32(arch + ".attention.head_count", 2)
      .u32(arch + ".context_length", 64);
  const std::vector<float> ones(kEmbd, 1.0f);
  b.tensor("token_embd.weight", {kEmbd, static_cast<uint64_t>(n_vocab)}, std::move(embd))
      .tensor("blk.0.attn_norm.weight", {kEmbd}, ones)
      .tensor("blk.0.attn_q.weight", {kEmbd, kEmbd})
      .tensor("blk.0.attn_k.weight", {kEmbd, kEmbd})
      .tensor("blk.0.attn_v.weight", {kEmbd, kEmbd})
      .tensor("blk.0.attn_output.weight", {kEmbd, kEmbd})
      .tensor("blk.0.ffn_norm.weight", {kEmbd}, ones)
      .tensor("blk.0.ffn_gate.weight", {kEmbd, kFf})
      .tensor("blk.0.ffn_up.weight", {kEmbd, kFf})
      .tensor("blk.0.ffn_down.weight", {kFf, kEmbd})
      .tensor("output_norm.weight", {kEmbd}, ones);
  return b;
}

ModelConfig config_of(const GgufBuilder& b) { return ModelConfig::from_gguf(b.file("test.gguf")); }

TEST(TinyShapes, OtherArchitecturesAreRefusedByName) {
  for (const std::string arch : {"gemma", "phi3", "mistral3"}) {
    const auto [kind, message] = error_of([&] { config_of(tiny_model(arch, 8)); });
    EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
    EXPECT_NE(message.find("'" + arch + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("supported: llama, qwen2"), std::string::npos) << message;
  }
  EXPECT_TRUE(config_of(tiny_model("qwen2", 8)).rope_neox);
  EXPECT_FALSE(config_of(tiny_model("llama", 8)).rope_neox);
}

TEST(TinyShapes, HeadSizeComesFromKeyLengthAndQwen3NormsEachHead) {
  // Two heads of 32 over n_embd 32 (Qwen3's heads are wider than n_embd / n_heads).
  const ModelConfig wide = config_of(tiny_model("qwen3", 8)
                                         .u32("qwen3.attention.key_length", 32)
                                         .u32("qwen3.attention.value_length", 32));
  EXPECT_EQ(wide.head_dim, 32);
  EXPECT_EQ(wide.n_rot, 32);
  EXPECT_TRUE(wide.qk_norm);
  EXPECT_TRUE(wide.rope_neox);
  const ModelConfig plain = config_of(tiny_model("llama", 8).u32("llama.attention.key_length", 16));
  EXPECT_EQ(plain.head_dim, 16);
  EXPECT_FALSE(plain.qk_norm);

  struct Case {
    GgufBuilder builder;
    std::string expected;
  };
  std::vector<Case> cases;
  cases.push_back({tiny_model("qwen3", 8)
                       .u32("qwen3.attention.key_length", 16)
                       .u32("qwen3.attention.value_length", 32),
                   "value_length 32 differs from attention.key_length 16"});
  cases.push_back({tiny_model("qwen3", 8).u32("qwen3.rope.dimension_count", 8),
                   "rope.dimension_count 8 differs from the head size 16"});
  for (const Case& c : cases) {
    const auto [kind, message] = error_of([&] { config_of(c.builder); });
    EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
  }

  // qwen3 needs both norms of every layer; llama takes none.
  const auto bare =
      tiny_model("qwen3", 8).tensor("blk.0.attn_k_norm.weight", {16}, std::vector<float>(16, 1.0f));
  const std::filesystem::path missing = bare.write("qwen3_no_q_norm.gguf");
  const auto [missing_kind, missing_message] = error_of([&] { LlamaModel::load(missing); });
  EXPECT_EQ(missing_kind, ErrorKind::kNotFound) << missing_message;
  EXPECT_NE(missing_message.find("blk.0.attn_q_norm.weight"), std::string::npos) << missing_message;
  std::filesystem::remove(missing);
  const std::filesystem::path extra =
      tiny_model("llama", 8)
          .tensor("blk.0.attn_q_norm.weight", {16}, std::vector<float>(16, 1.0f))
          .write("llama_q_norm.gguf");
  const auto [extra_kind, extra_message] = error_of([&] { LlamaModel::load(extra); });
  EXPECT_EQ(extra_kind, ErrorKind::kUnsupported) << extra_message;
  EXPECT_NE(extra_message.find("blk.0.attn_q_norm.weight"), std::string::npos) << extra_message;
  std::filesystem::remove(extra);
}

TEST(TinyShapes, SlidingWindowYarnAndOtherExpertsAreRefused) {
  struct Case {
    GgufBuilder builder;
    std::string expected;
  };
  std::vector<Case> cases;
  cases.push_back({tiny_model("llama", 8).u32("llama.attention.sliding_window", 4096), "sliding"});
  cases.push_back({tiny_model("qwen2", 8).u32("qwen2.attention.sliding_window", 32768), "sliding"});
  cases.push_back({tiny_model("llama", 8)
                       .str("llama.rope.scaling.type", "yarn")
                       .f32("llama.rope.scaling.factor", 4),
                   "'yarn'"});
  cases.push_back(
      {tiny_model("qwen2", 8).str("qwen2.rope.scaling.type", "longrope"), "'longrope'"});
  cases.push_back({tiny_model("qwen2", 8).u32("qwen2.expert_count", 8), "no mixture of experts"});
  for (const Case& c : cases) {
    const auto [kind, message] = error_of([&] { config_of(c.builder); });
    EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
  }
}

// llama.cpp's reading of the scaling keys: the type defaults to linear, the factor may sit
// under the old key, type none never scales.
TEST(TinyShapes, LinearRopeScalingFollowsLlamaCpp) {
  EXPECT_EQ(config_of(tiny_model("llama", 8)).rope_freq_scale, 1.0f);
  EXPECT_EQ(config_of(tiny_model("llama", 8).f32("llama.rope.scaling.factor", 4)).rope_freq_scale,
            0.25f);
  EXPECT_EQ(config_of(tiny_model("llama", 8).f32("llama.rope.scale_linear", 2)).rope_freq_scale,
            0.5f);
  EXPECT_EQ(config_of(tiny_model("qwen2", 8)
                          .str("qwen2.rope.scaling.type", "linear")
                          .f32("qwen2.rope.scaling.factor", 8))
                .rope_freq_scale,
            0.125f);
  EXPECT_EQ(config_of(tiny_model("llama", 8)
                          .str("llama.rope.scaling.type", "none")
                          .f32("llama.rope.scaling.factor", 4))
                .rope_freq_scale,
            1.0f);
  EXPECT_EQ(config_of(tiny_model("llama", 8).f32("llama.rope.scaling.factor", 0)).rope_freq_scale,
            1.0f);
  const auto [kind, message] =
      error_of([] { config_of(tiny_model("llama", 8).f32("llama.rope.scaling.factor", -2)); });
  EXPECT_EQ(kind, ErrorKind::kCorruptFile) << message;
}

TEST(TinyShapes, TensorsTheForwardPassWouldNotUseAreRefused) {
  struct Case {
    GgufBuilder builder;
    std::string tensor;
  };
  std::vector<Case> cases;
  cases.push_back(
      {tiny_model("llama", 8).tensor("blk.0.attn_output.bias", {32}), "blk.0.attn_output.bias"});
  cases.push_back({tiny_model("llama", 8).tensor("blk.0.ffn_up.bias", {32}), "blk.0.ffn_up.bias"});
  cases.push_back({tiny_model("qwen2", 8).tensor("output.bias", {8}), "output.bias"});
  cases.push_back(
      {tiny_model("qwen2", 8).tensor("rope_freqs.weight", {8}, std::vector<float>(8, 1.0f)),
       "rope_freqs.weight"});
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::filesystem::path path =
        cases[i].builder.write("unused_" + std::to_string(i) + ".gguf");
    const auto [kind, message] = error_of([&] { LlamaModel::load(path); });
    EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
    EXPECT_NE(message.find("tensor " + cases[i].tensor + " "), std::string::npos) << message;
    std::filesystem::remove(path);
  }
}

TEST(TinyShapes, OptionalTensorsLoadAndBadRopeFreqsAreRefused) {
  // llama allows Q/K/V biases; rope_freqs needs n_rot / 2 positive divisors.
  {
    const auto path = tiny_model("llama", 8)
                          .tensor("blk.0.attn_q.bias", {32})
                          .tensor("blk.0.attn_k.bias", {32})
                          .tensor("blk.0.attn_v.bias", {32})
                          .tensor("rope_freqs.weight", {8}, {1, 2, 3, 4, 5, 6, 7, 8})
                          .write("optional.gguf");
    auto model = LlamaModel::load(path);
    EXPECT_EQ(model->layer(0).bk.size(), 32u);
    EXPECT_EQ(model->rope_freqs(), (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}));
    std::filesystem::remove(path);
  }
  for (const std::vector<float>& freqs :
       {std::vector<float>{1, 2, 3, 0, 5, 6, 7, 8}, std::vector<float>(4, 1.0f)}) {
    const auto path = tiny_model("llama", 8)
                          .tensor("rope_freqs.weight", {static_cast<uint64_t>(freqs.size())}, freqs)
                          .write("bad_rope_freqs.gguf");
    const auto [kind, message] = error_of([&] { LlamaModel::load(path); });
    EXPECT_EQ(kind, ErrorKind::kCorruptFile) << message;
    EXPECT_NE(message.find("rope_freqs.weight"), std::string::npos) << message;
    std::filesystem::remove(path);
  }
}

// Llama 3's 128256-token vocabulary: every weight but the embeddings is zero, so the residual
// stream stays the token's embedding and logits[v] = rmsnorm(e_token) . e_v over the tied head.
TEST(TinyShapes, LargeVocabularyHeadCoversEveryToken) {
  constexpr int64_t kVocab = 128256, kEmbd = 32;
  std::vector<float> embd(static_cast<size_t>(kVocab * kEmbd));
  for (size_t i = 0; i < embd.size(); ++i)
    embd[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  const auto path = tiny_model("llama", kVocab, embd).write("large_vocab.gguf");
  auto model = LlamaModel::load(path);
  std::filesystem::remove(path);
  ASSERT_EQ(model->config().n_vocab, kVocab);
  cpu::ThreadPool pool(2);
  Generator generator(*model, cpu::kernel_table(cpu::best_isa()), pool);
  const std::vector<int32_t> ids = {0, kVocab - 1, 70000};
  const std::vector<float> logits = generator.logits_all(ids);
  ASSERT_EQ(logits.size(), ids.size() * kVocab);
  for (size_t r = 0; r < ids.size(); ++r) {
    const float* e = embd.data() + static_cast<size_t>(ids[r]) * kEmbd;
    double ss = 0.0;
    for (int64_t i = 0; i < kEmbd; ++i) ss += static_cast<double>(e[i]) * e[i];
    const double inv_rms = 1.0 / std::sqrt(ss / kEmbd + 1e-5);
    float worst = 0.0f;
    for (int64_t v = 0; v < kVocab; ++v) {
      double dot = 0.0;
      for (int64_t i = 0; i < kEmbd; ++i)
        dot += e[i] * inv_rms * embd[static_cast<size_t>(v * kEmbd + i)];
      worst = std::max(
          worst, std::fabs(logits[r * kVocab + static_cast<size_t>(v)] - static_cast<float>(dot)));
    }
    EXPECT_LT(worst, 1e-3f) << "token " << ids[r];
  }
}

}  // namespace
}  // namespace duet
