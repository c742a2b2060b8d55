// The roofline profile: model shapes, built-in hardware, and the figures a
// stated H200 gives a Llama 3 (memory-bound decode, the compute-bound knee,
// the KV capacity).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/error.h"
#include "sim/roofline.h"
#include "worker/kv/kv_cache.h"

namespace duet::sim {
namespace {

std::string error_of(const auto& call) {
  try {
    call();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(RooflineModelTest, BuiltInLlamaShapes) {
  const ModelShape small = named_model_shape("llama-3-8b");
  EXPECT_NEAR(small.n_params, 8.03e9, 0.01e9);
  EXPECT_EQ(small.weight_bytes, 2 * small.n_params);
  EXPECT_EQ(small.kv_bytes_per_token, 32.0 * 2 * 8 * 128 * 2);
  EXPECT_EQ(small.n_ctx, 8192);

  const ModelShape large = named_model_shape("llama-3-70b");
  EXPECT_NEAR(large.n_params, 70.55e9, 0.01e9);
  EXPECT_EQ(large.kv_bytes_per_token, 80.0 * 2 * 8 * 128 * 2);
  EXPECT_EQ(large.n_layers, 80);
  EXPECT_EQ(large.n_vocab, 128256);

  const std::string message = error_of([] { named_model_shape("gpt-2"); });
  EXPECT_NE(message.find("llama-3-8b, llama-3-70b"), std::string::npos) << message;
}

// Qwen3-30B-A3B: 30.5B weights, 3.3B of them read by one token (config.json's shapes).
TEST(RooflineModelTest, MixtureOfExpertsCountsEveryExpertAndReadsThePickedOnes) {
  const ModelShape moe = named_model_shape("qwen3-30b-a3b");
  EXPECT_NEAR(moe.n_params, 30.5e9, 0.1e9);
  EXPECT_EQ(moe.n_experts, 128);
  EXPECT_EQ(moe.n_experts_used, 8);
  const double experts = 48.0 * 3 * 2048 * 768 * 128;
  EXPECT_NEAR(moe.expert_bytes, 2 * experts, 1.0);
  // One token reads 8 of 128 experts; 64 tokens almost all of them.
  EXPECT_DOUBLE_EQ(moe.experts_read(1), 8.0 / 128);
  EXPECT_NEAR(moe.experts_read(64), 1 - std::pow(120.0 / 128, 64), 1e-12);
  EXPECT_GT(moe.experts_read(64), 0.98);
  EXPECT_EQ(named_model_shape("llama-3-8b").experts_read(1), 1.0);

  // A decode step of one token reads the dense part and 1/16 of the experts: far less than a
  // step of 64 tokens, which reads them nearly all (on an H200, memory-bound at both).
  const HardwareSpec hw = named_hardware("h200");
  const double one = roofline_weights_seconds(hw, moe, 1, 1) - hw.step_overhead_s;
  const double many = roofline_weights_seconds(hw, moe, 1, 64) - hw.step_overhead_s;
  const double dense_bytes = moe.weight_bytes - moe.expert_bytes;
  EXPECT_NEAR(one, (dense_bytes + moe.expert_bytes / 16) / (4.8e12 * 0.8), 1e-12);
  EXPECT_GT(many, 5 * one);
  // The profile keeps the mixture through its JSON.
  const std::vector<int> tps = {1};
  const Profile profile = profile_from_json(profile_json(roofline_profile(hw, moe, tps)));
  EXPECT_EQ(profile.model.n_experts, 128);
  EXPECT_EQ(profile.model.n_ff_exp, 768);
  EXPECT_EQ(profile.model.expert_bytes, moe.expert_bytes);
}

TEST(RooflineModelTest, ShapeOfAConfigCountsTiedHeadsOnceAndUsesTheKvLayout) {
  ModelConfig config;
  config.architecture = "llama";
  config.n_vocab = 1000;
  config.n_embd = 64;
  config.n_layers = 3;
  config.n_heads = 4;
  config.n_kv_heads = 2;
  config.head_dim = 16;
  config.n_ff = 256;
  config.n_ctx_train = 2048;
  const double per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 256 + 2 * 64;
  const double untied = 2 * 1000 * 64 + 3 * per_layer + 64;
  EXPECT_EQ(parameter_count(config), untied);
  const ModelShape shape = model_shape(config, 1e6, "tiny");
  EXPECT_EQ(shape.kv_bytes_per_token,
            static_cast<double>(make_kv_layout(config, 1).bytes_per_token()));
  EXPECT_EQ(shape.n_ctx, 2048);
  config.tied_embeddings = true;
  EXPECT_EQ(parameter_count(config), untied - 1000 * 64);
  config.n_ff = 0;
  EXPECT_THROW(model_shape(config, 1e6, "broken"), Error);
}

TEST(RooflineHardwareTest, BuiltInsAndJson) {
  const HardwareSpec h200 = named_hardware("h200");
  EXPECT_EQ(h200.memory_bytes, 141e9);
  EXPECT_EQ(h200.memory_bytes_per_s, 4.8e12);
  EXPECT_EQ(named_hardware("h100").memory_bytes, 80e9);
  const std::string message = error_of([] { named_hardware("tpu"); });
  EXPECT_NE(message.find("h200"), std::string::npos) << message;

  const HardwareSpec back = hardware_from_json(hardware_json(h200));
  EXPECT_EQ(back.name, h200.name);
  EXPECT_EQ(back.flops_per_s, h200.flops_per_s);
  EXPECT_EQ(back.link_latency_s, h200.link_latency_s);
  EXPECT_EQ(back.compute_efficiency, h200.compute_efficiency);

  nlohmann::json json = hardware_json(h200);
  json.erase("memory_efficiency");  // optional: the default
  EXPECT_EQ(hardware_from_json(json).memory_efficiency, HardwareSpec{}.memory_efficiency);
  json["hbm_bytes"] = 1;
  EXPECT_NE(error_of([&] { hardware_from_json(json); }).find("hbm_bytes"), std::string::npos);
  json = hardware_json(h200);
  json.erase("flops_per_s");
  EXPECT_NE(error_of([&] { hardware_from_json(json); }).find("flops_per_s"), std::string::npos);
  json = hardware_json(h200);
  json["compute_efficiency"] = 1.5;
  EXPECT_NE(error_of([&] { hardware_from_json(json, "hw"); }).find("hw.compute_efficiency"),
            std::string::npos);
}

TEST(RooflineProfileTest, SeventyBDoesNotFitOneH200) {
  const std::vector<int> tps = {1, 8};
  const std::string message = error_of(
      [&] { roofline_profile(named_hardware("h200"), named_model_shape("llama-3-70b"), tps); });
  EXPECT_NE(message.find("does not fit in tp 1"), std::string::npos) << message;
}

TEST(RooflineProfileTest, SeventyBOnEightH200s) {
  const HardwareSpec hw = named_hardware("h200");
  const ModelShape model = named_model_shape("llama-3-70b");
  const std::vector<int> tps = {8, 2, 4};
  const Profile profile = roofline_profile(hw, model, tps);
  EXPECT_EQ(profile.source, "roofline");
  EXPECT_EQ(profile.device, "roofline: h200");
  EXPECT_NE(profile.note.find("not measured"), std::string::npos);
  EXPECT_NE(profile.note.find("uncalibrated"), std::string::npos);
  ASSERT_EQ(profile.instances.size(), 3u);
  EXPECT_EQ(profile.instances[0].tp, 2);  // ascending
  ASSERT_TRUE(profile.hardware.has_value());
  EXPECT_EQ(profile.transfer("nvlink").cost.bytes_per_s, hw.link_bytes_per_s);
  EXPECT_GT(profile.transfer("rdma").cost.bytes_per_s, 0);
  ASSERT_EQ(profile.collectives.size(), 3u);
  EXPECT_EQ(profile.collectives[2].ranks, 8);

  // Decode of one row: the weights' read, 141 GB / 8 / (4.8 TB/s * 0.8) =
  // 4.6 ms, plus the step overhead and 160 all-reduces of latency.
  const InstanceProfile& tp8 = profile.instance(8);
  const double read = model.weight_bytes / 8 / (4.8e12 * 0.8);
  EXPECT_NEAR(read, 4.59e-3, 0.01e-3);
  const double one_row = tp8.step.weights(1);
  const double all_reduces = 160 * ring_all_reduce_cost(hw, 8).seconds(8192 * 2);
  EXPECT_NEAR(one_row, read + hw.step_overhead_s + all_reduces, 1e-12);
  EXPECT_GT(one_row, 5e-3);
  EXPECT_LT(one_row, 7e-3);
  // A ring all-reduce: 2 (n - 1) / n of the bytes over the link.
  EXPECT_NEAR(ring_all_reduce_cost(hw, 8).seconds(1e9), 5e-6 + 1.75e9 / 450e9, 1e-12);

  // Decode attention reads a key's K and V of every layer, a tp'th per rank.
  EXPECT_DOUBLE_EQ(tp8.step.per_decode_attention, model.kv_bytes_per_token / 8 / (4.8e12 * 0.8));
  EXPECT_GT(tp8.step.per_prefill_attention, 0);
  EXPECT_GT(tp8.step.per_logit_row, 0);

  // Capacity: what 8 x 141 GB leaves after the weights, 90% of it, in tokens.
  const double expected = (8 * 141e9 - model.weight_bytes) * 0.9 / model.kv_bytes_per_token;
  EXPECT_NEAR(static_cast<double>(tp8.kv_capacity_tokens), expected, 1.0);
  EXPECT_GT(profile.instance(2).kv_capacity_tokens, 0);
  EXPECT_LT(profile.instance(2).kv_capacity_tokens, profile.instance(4).kv_capacity_tokens);
  EXPECT_LT(profile.instance(4).kv_capacity_tokens, tp8.kv_capacity_tokens);

  // A roofline profile survives JSON.
  const Profile back = profile_from_json(profile_json(profile));
  EXPECT_EQ(back.instance(8).step.knot_seconds, tp8.step.knot_seconds);
  EXPECT_EQ(back.hardware->name, "h200");
}

TEST(RooflineProfileTest, DecodeIsFlatUntilTheComputeKnee) {
  // One H200 and an 8B: no all-reduces, so the weights' term is the
  // overhead plus max(read, compute). The knee is where 2 * (layer
  // weights) * n FLOPs at 60% of 989 TFLOP/s outlast reading 16 GB at 80%
  // of 4.8 TB/s: about 178 rows.
  const HardwareSpec hw = named_hardware("h200");
  const ModelShape model = named_model_shape("llama-3-8b");
  const std::vector<int> tps = {1};
  const StepCost step = roofline_profile(hw, model, tps).instance(1).step;
  ASSERT_EQ(step.token_knots.front(), 1);
  ASSERT_EQ(step.token_knots.back(), 8192);
  const double layer_params = 32.0 * (2 * 4096.0 * 4096 + 2 * 4096.0 * 1024 + 3 * 4096.0 * 14336);
  const double knee = model.weight_bytes * (989e12 * 0.6) / (2 * layer_params * 4.8e12 * 0.8);
  EXPECT_NEAR(knee, 178, 1);
  for (size_t i = 0; i < step.token_knots.size(); ++i) {
    if (step.token_knots[i] <= 128) {
      EXPECT_EQ(step.knot_seconds[i], step.knot_seconds[0]) << step.token_knots[i];
    } else {
      EXPECT_GT(step.knot_seconds[i], step.knot_seconds[i - 1]) << step.token_knots[i];
    }
  }
  // Past the knee each row costs its FLOPs; past the last knot the slope goes on.
  const double per_row = 2 * layer_params / (989e12 * 0.6);
  EXPECT_NEAR(step.weights(8192) - step.weights(4096), 4096 * per_row, 1e-12);
  EXPECT_NEAR(step.weights(16384) - step.weights(8192), 8192 * per_row, 1e-12);

  const double capacity = (141e9 - model.weight_bytes) * 0.9 / model.kv_bytes_per_token;
  EXPECT_NEAR(static_cast<double>(roofline_profile(hw, model, tps).instance(1).kv_capacity_tokens),
              capacity, 1.0);
  const std::vector<int> bad = {16};
  EXPECT_NE(error_of([&] { roofline_profile(hw, model, bad); }).find("tp 16"), std::string::npos);
  const std::vector<int> twice = {2, 2};
  EXPECT_THROW(roofline_profile(hw, model, twice), Error);
}

}  // namespace
}  // namespace duet::sim
