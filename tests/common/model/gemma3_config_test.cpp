// gemma3's hyper-parameters as llama.cpp's loader reads them
// (src/models/gemma3.cpp, load_swa_pattern): which layers are windowed, their
// RoPE, the Q scale (the 62-layer 27B's own), and what is refused. Metadata
// only, on GGUF files written here; the forward pass is checked against
// llama.cpp's logits in tiny_shapes_test.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/model/model_config.h"
#include "tests/common/model/gguf_builder.h"

namespace duet {
namespace {

using gguf_testing::GgufBuilder;

// n_layers layers of 4 heads of 64 over n_embd 128 (Gemma 3's heads are wider than n_embd /
// n_heads), 2 KV heads; `extra` adds keys.
template <typename Extra>
ModelConfig gemma3(uint32_t n_layers, Extra&& extra) {
  GgufBuilder b;
  b.string("general.architecture", "gemma3")
      .scalar("gemma3.block_count", GgufType::kU32, n_layers)
      .scalar("gemma3.embedding_length", GgufType::kU32, uint32_t{128})
      .scalar("gemma3.feed_forward_length", GgufType::kU32, uint32_t{256})
      .scalar("gemma3.attention.head_count", GgufType::kU32, uint32_t{4})
      .scalar("gemma3.attention.head_count_kv", GgufType::kU32, uint32_t{2})
      .scalar("gemma3.attention.key_length", GgufType::kU32, uint32_t{64})
      .scalar("gemma3.attention.value_length", GgufType::kU32, uint32_t{64})
      .scalar("gemma3.attention.layer_norm_rms_epsilon", GgufType::kF32, 1e-6f)
      .scalar("gemma3.rope.freq_base", GgufType::kF32, 1e6f);
  extra(b);
  b.tensor(gguf_testing::spec("token_embd.weight", DType::kF32, {128, 8}, 1));
  return ModelConfig::from_gguf(gguf_testing::parse(b.build()));
}
ModelConfig gemma3(uint32_t n_layers) {
  return gemma3(n_layers, [](GgufBuilder&) {});
}

GgufBuilder& window(GgufBuilder& b, uint32_t size) {
  return b.scalar("gemma3.attention.sliding_window", GgufType::kU32, size);
}

std::vector<bool> windowed_layers(const ModelConfig& c) {
  std::vector<bool> out;
  for (int64_t il = 0; il < c.n_layers; ++il) out.push_back(c.is_swa(il));
  return out;
}

TEST(Gemma3Config, HardCodedParts) {
  const ModelConfig c = gemma3(2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_rot, 64);
  EXPECT_TRUE(c.rope_neox);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.post_norms);
  EXPECT_EQ(c.ffn_activation, FfnActivation::kGeluTanh);
  EXPECT_EQ(c.embed_scale, std::sqrt(128.0f));
  EXPECT_EQ(c.q_scale, 1.0f / std::sqrt(64.0f));  // 1 / sqrt(head size)
  EXPECT_EQ(c.rms_eps, 1e-6f);
  EXPECT_EQ(c.sliding_window, 0);  // no window key: no layer windowed
  EXPECT_EQ(windowed_layers(c), std::vector<bool>(2, false));

  // The 27B (62 layers) scales Q by 1 / sqrt(n_embd / n_heads) instead.
  EXPECT_EQ(gemma3(62).q_scale, 1.0f / std::sqrt(32.0f));

  const ModelConfig llama_like = gemma3(2);
  EXPECT_EQ(llama_like.rope_freq_base, 1e6f);
}

TEST(Gemma3Config, OneLayerInSixIsGlobalByDefault) {
  const ModelConfig c = gemma3(13, [](GgufBuilder& b) { window(b, 512); });
  EXPECT_EQ(c.sliding_window, 512);
  std::vector<bool> expected;
  for (int il = 0; il < 13; ++il) expected.push_back(il % 6 != 5);
  EXPECT_EQ(windowed_layers(c), expected);
  // The windowed layers' RoPE: base 10000, unscaled, whatever the global one.
  EXPECT_EQ(c.rope_freq_base_swa, 10000.0f);
  EXPECT_EQ(c.rope_freq_scale_swa, 1.0f);
  EXPECT_EQ(c.rope_freq_base, 1e6f);
}

TEST(Gemma3Config, PatternKeysAndSwaBase) {
  const ModelConfig period = gemma3(4, [](GgufBuilder& b) {
    window(b, 8).scalar("gemma3.attention.sliding_window_pattern", GgufType::kU32, uint32_t{2});
  });
  EXPECT_EQ(windowed_layers(period), (std::vector<bool>{true, false, true, false}));

  const ModelConfig all = gemma3(3, [](GgufBuilder& b) {
    window(b, 8).scalar("gemma3.attention.sliding_window_pattern", GgufType::kU32, uint32_t{0});
  });
  EXPECT_EQ(windowed_layers(all), std::vector<bool>(3, true));

  const ModelConfig flags = gemma3(3, [](GgufBuilder& b) {
    window(b, 8).array("gemma3.attention.sliding_window_pattern", GgufType::kBool,
                       std::vector<uint8_t>{0, 1, 1});
  });
  EXPECT_EQ(windowed_layers(flags), (std::vector<bool>{false, true, true}));

  const ModelConfig base = gemma3(2, [](GgufBuilder& b) {
    window(b, 8).scalar("gemma3.rope.freq_base_swa", GgufType::kF32, 5000.0f);
  });
  EXPECT_EQ(base.rope_freq_base_swa, 5000.0f);
}

TEST(Gemma3Config, RefusalsNameTheKey) {
  struct Case {
    std::function<void(GgufBuilder&)> extra;
    ErrorKind kind;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](GgufBuilder& b) { b.scalar("gemma3.final_logit_softcapping", GgufType::kF32, 30.0f); },
       ErrorKind::kUnsupported, "final_logit_softcapping = 30"},
      {[](GgufBuilder& b) {
         window(b, 8).array("gemma3.attention.sliding_window_pattern", GgufType::kBool,
                            std::vector<uint8_t>{1});
       },
       ErrorKind::kCorruptFile, "holds 1 flags for 2 layers"},
  };
  for (const Case& c : cases) {
    try {
      gemma3(2, c.extra);
      ADD_FAILURE() << "accepted: " << c.expected;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), c.kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.expected), std::string::npos) << e.what();
    }
  }
  // llama.cpp requires the norm epsilon of gemma3.
  GgufBuilder b;
  b.string("general.architecture", "gemma3")
      .scalar("gemma3.block_count", GgufType::kU32, uint32_t{1})
      .scalar("gemma3.embedding_length", GgufType::kU32, uint32_t{128})
      .scalar("gemma3.feed_forward_length", GgufType::kU32, uint32_t{256})
      .scalar("gemma3.attention.head_count", GgufType::kU32, uint32_t{4})
      .tensor(gguf_testing::spec("token_embd.weight", DType::kF32, {128, 8}, 1));
  try {
    ModelConfig::from_gguf(gguf_testing::parse(b.build()));
    ADD_FAILURE() << "accepted a gemma3 file without layer_norm_rms_epsilon";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer_norm_rms_epsilon"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace duet
