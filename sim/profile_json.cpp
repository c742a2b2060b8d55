// A profile as JSON: every field of every struct under its own name, doubles
// at full precision (nlohmann writes the shortest form that reads back
// exactly), so write_profile then read_profile gives the same profile.
#include <cmath>
#include <fstream>

#include "common/error.h"
#include "sim/json_fields.h"
#include "sim/profile.h"
#include "sim/roofline.h"

namespace duet::sim {
namespace {

constexpr std::string_view kFormat = "duet-profile";
constexpr int64_t kVersion = 1;

std::string element_path(const JsonFields& parent, std::string_view key, size_t i) {
  return duet::format("{}[{}]", parent.field_path(key), i);
}

int to_int(int64_t value, const std::string& path) {
  DUET_REQUIRE(value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max(),
               "{}: {} is out of range", path, value);
  return static_cast<int>(value);
}

nlohmann::json shape_json(const StepShape& shape) {
  return {{"n_tokens", shape.n_tokens},
          {"n_sequences", shape.n_sequences},
          {"n_attention", shape.n_attention},
          {"n_decode_attention", shape.n_decode_attention},
          {"n_logit_rows", shape.n_logit_rows}};
}

StepShape read_shape(const JsonFields& f) {
  return {.n_tokens = f.integer("n_tokens"),
          .n_sequences = f.integer("n_sequences"),
          .n_attention = f.integer("n_attention"),
          .n_decode_attention = f.integer("n_decode_attention"),
          .n_logit_rows = f.integer("n_logit_rows")};
}

nlohmann::json step_json(const StepCost& step) {
  nlohmann::json seconds = nlohmann::json::array();
  for (double s : step.knot_seconds) seconds.push_back(json_number(s));
  return {{"token_knots", step.token_knots},
          {"knot_seconds", seconds},
          {"per_sequence", json_number(step.per_sequence)},
          {"per_decode_attention", json_number(step.per_decode_attention)},
          {"per_prefill_attention", json_number(step.per_prefill_attention)},
          {"per_logit_row", json_number(step.per_logit_row)}};
}

StepCost read_step(const JsonFields& f) {
  f.only({"token_knots", "knot_seconds", "per_sequence", "per_decode_attention",
          "per_prefill_attention", "per_logit_row"});
  StepCost step;
  step.token_knots = f.integers("token_knots");
  step.knot_seconds = f.numbers("knot_seconds");
  DUET_REQUIRE(step.token_knots.size() == step.knot_seconds.size(),
               "{}: {} token_knots but {} knot_seconds", f.field_path("knot_seconds"),
               step.token_knots.size(), step.knot_seconds.size());
  step.per_sequence = f.number("per_sequence");
  step.per_decode_attention = f.number("per_decode_attention");
  step.per_prefill_attention = f.number("per_prefill_attention");
  step.per_logit_row = f.number("per_logit_row");
  return step;
}

nlohmann::json residual_json(const FitResidual& r) {
  nlohmann::json json = shape_json(r.shape);
  json["measured_s"] = json_number(r.measured_s);
  json["fitted_s"] = json_number(r.fitted_s);
  return json;
}

FitResidual read_residual(const JsonFields& f) {
  f.only({"n_tokens", "n_sequences", "n_attention", "n_decode_attention", "n_logit_rows",
          "measured_s", "fitted_s"});
  return {read_shape(f), f.number("measured_s"), f.number("fitted_s")};
}

nlohmann::json quality_json(const FitQuality& q) {
  return {{"n_samples", q.n_samples},
          {"median_rel_error", json_number(q.median_rel_error)},
          {"p90_rel_error", json_number(q.p90_rel_error)},
          {"max_rel_error", json_number(q.max_rel_error)}};
}

FitQuality read_quality(const JsonFields& f) {
  f.only({"n_samples", "median_rel_error", "p90_rel_error", "max_rel_error"});
  return {f.integer("n_samples"), f.number("median_rel_error"), f.number("p90_rel_error"),
          f.number("max_rel_error")};
}

nlohmann::json link_json(const LinkCost& cost) {
  return {{"latency_s", json_number(cost.latency_s)},
          {"bytes_per_s", json_number(cost.bytes_per_s)}};
}

LinkCost read_link(const JsonFields& f) {
  f.only({"latency_s", "bytes_per_s"});
  return {f.number("latency_s"), f.number("bytes_per_s")};
}

nlohmann::json link_samples_json(const std::vector<LinkSample>& samples) {
  nlohmann::json out = nlohmann::json::array();
  for (const LinkSample& s : samples) {
    out.push_back({{"bytes", json_number(s.bytes)}, {"seconds", json_number(s.seconds)}});
  }
  return out;
}

std::vector<LinkSample> read_link_samples(const JsonFields& f, std::string_view key) {
  const nlohmann::json& array = f.array(key);
  std::vector<LinkSample> out;
  for (size_t i = 0; i < array.size(); ++i) {
    const JsonFields s(array[i], element_path(f, key, i));
    s.only({"bytes", "seconds"});
    out.push_back({s.number("bytes"), s.number("seconds")});
  }
  return out;
}

nlohmann::json model_json(const ModelShape& m) {
  return {{"name", m.name},
          {"n_layers", m.n_layers},
          {"n_embd", m.n_embd},
          {"n_heads", m.n_heads},
          {"n_kv_heads", m.n_kv_heads},
          {"head_dim", m.head_dim},
          {"n_ff", m.n_ff},
          {"n_vocab", m.n_vocab},
          {"n_ctx", m.n_ctx},
          {"n_params", json_number(m.n_params)},
          {"weight_bytes", json_number(m.weight_bytes)},
          {"kv_bytes_per_token", json_number(m.kv_bytes_per_token)},
          {"n_experts", m.n_experts},
          {"n_experts_used", m.n_experts_used},
          {"n_ff_exp", m.n_ff_exp},
          {"expert_bytes", json_number(m.expert_bytes)}};
}

ModelShape read_model(const JsonFields& f) {
  f.only({"name", "n_layers", "n_embd", "n_heads", "n_kv_heads", "head_dim", "n_ff", "n_vocab",
          "n_ctx", "n_params", "weight_bytes", "kv_bytes_per_token", "n_experts", "n_experts_used",
          "n_ff_exp", "expert_bytes"});
  ModelShape m;
  m.name = f.string("name");
  m.n_layers = f.integer("n_layers");
  m.n_embd = f.integer("n_embd");
  m.n_heads = f.integer("n_heads");
  m.n_kv_heads = f.integer("n_kv_heads");
  m.head_dim = f.integer("head_dim");
  m.n_ff = f.integer("n_ff");
  m.n_vocab = f.integer("n_vocab");
  m.n_ctx = f.integer("n_ctx");
  m.n_params = f.number("n_params");
  m.weight_bytes = f.number("weight_bytes");
  m.kv_bytes_per_token = f.number("kv_bytes_per_token");
  // A mixture of experts' (older profiles have none: dense).
  if (f.has("n_experts")) {
    m.n_experts = f.integer("n_experts");
    m.n_experts_used = f.integer("n_experts_used");
    m.n_ff_exp = f.integer("n_ff_exp");
    m.expert_bytes = f.number("expert_bytes");
  }
  return m;
}

nlohmann::json instance_json(const InstanceProfile& instance) {
  nlohmann::json residuals = nlohmann::json::array();
  for (const FitResidual& r : instance.residuals) residuals.push_back(residual_json(r));
  return {{"tp", instance.tp},
          {"step", step_json(instance.step)},
          {"kv_capacity_tokens", instance.kv_capacity_tokens},
          {"residuals", residuals},
          {"quality", quality_json(instance.quality)}};
}

InstanceProfile read_instance(const JsonFields& f) {
  f.only({"tp", "step", "kv_capacity_tokens", "residuals", "quality"});
  InstanceProfile instance;
  instance.tp = to_int(f.integer("tp"), f.field_path("tp"));
  instance.step = read_step(f.object("step"));
  instance.kv_capacity_tokens = f.integer("kv_capacity_tokens");
  const nlohmann::json& residuals = f.array("residuals");
  for (size_t i = 0; i < residuals.size(); ++i) {
    instance.residuals.push_back(
        read_residual(JsonFields(residuals[i], element_path(f, "residuals", i))));
  }
  instance.quality = read_quality(f.object("quality"));
  return instance;
}

}  // namespace

nlohmann::json profile_json(const Profile& profile) {
  nlohmann::json instances = nlohmann::json::array();
  for (const InstanceProfile& instance : profile.instances) {
    instances.push_back(instance_json(instance));
  }
  nlohmann::json transfers = nlohmann::json::array();
  for (const TransferProfile& t : profile.transfers) {
    transfers.push_back(
        {{"path", t.path}, {"cost", link_json(t.cost)}, {"samples", link_samples_json(t.samples)}});
  }
  nlohmann::json collectives = nlohmann::json::array();
  for (const CollectiveProfile& c : profile.collectives) {
    collectives.push_back({{"op", c.op},
                           {"ranks", c.ranks},
                           {"cost", link_json(c.cost)},
                           {"samples", link_samples_json(c.samples)}});
  }
  nlohmann::json json = {{"format", kFormat},
                         {"version", kVersion},
                         {"source", profile.source},
                         {"device", profile.device},
                         {"threads", profile.threads},
                         {"note", profile.note},
                         {"model", model_json(profile.model)},
                         {"instances", instances},
                         {"transfers", transfers},
                         {"collectives", collectives},
                         {"host",
                          {{"neighbour_slowdown", profile.host.neighbour_slowdown},
                           {"samples", profile.host.samples}}}};
  json["hardware"] = profile.hardware ? hardware_json(*profile.hardware) : nlohmann::json(nullptr);
  return json;
}

Profile profile_from_json(const nlohmann::json& json) {
  const JsonFields f(json, "");
  f.only({"format", "version", "source", "device", "threads", "note", "model", "instances",
          "transfers", "collectives", "host", "hardware"});
  const std::string format = f.string("format");
  DUET_REQUIRE(format == kFormat, "format: '{}', expected '{}'", format, kFormat);
  const int64_t version = f.integer("version");
  DUET_REQUIRE(version == kVersion, "version: {}, this build reads version {}", version, kVersion);

  Profile profile;
  profile.source = f.string("source");
  profile.device = f.string("device");
  profile.threads = to_int(f.integer("threads"), "threads");
  profile.note = f.string("note");
  profile.model = read_model(f.object("model"));
  const nlohmann::json& instances = f.array("instances");
  for (size_t i = 0; i < instances.size(); ++i) {
    profile.instances.push_back(
        read_instance(JsonFields(instances[i], element_path(f, "instances", i))));
  }
  const nlohmann::json& transfers = f.array("transfers");
  for (size_t i = 0; i < transfers.size(); ++i) {
    const JsonFields t(transfers[i], element_path(f, "transfers", i));
    t.only({"path", "cost", "samples"});
    profile.transfers.push_back(
        {t.string("path"), read_link(t.object("cost")), read_link_samples(t, "samples")});
  }
  const nlohmann::json& collectives = f.array("collectives");
  for (size_t i = 0; i < collectives.size(); ++i) {
    const JsonFields c(collectives[i], element_path(f, "collectives", i));
    c.only({"op", "ranks", "cost", "samples"});
    profile.collectives.push_back({c.string("op"),
                                   to_int(c.integer("ranks"), c.field_path("ranks")),
                                   read_link(c.object("cost")), read_link_samples(c, "samples")});
  }
  if (f.has("host")) {
    const JsonFields h = f.object("host");
    h.only({"neighbour_slowdown", "samples"});
    profile.host.neighbour_slowdown = h.number("neighbour_slowdown");
    DUET_REQUIRE(
        profile.host.neighbour_slowdown > 0 && std::isfinite(profile.host.neighbour_slowdown),
        "host.neighbour_slowdown: {}, expected a positive number", profile.host.neighbour_slowdown);
    profile.host.samples = h.numbers("samples");
  }
  // "hardware" may be absent or null: a measured profile has none.
  if (f.has("hardware") && !f.at("hardware").is_null()) {
    profile.hardware = hardware_from_json(f.at("hardware"), "hardware");
  }
  return profile;
}

void write_profile(const std::filesystem::path& path, const Profile& profile) {
  std::ofstream out(path);
  DUET_REQUIRE(out.good(), "cannot write the profile {}", path.string());
  out << profile_json(profile).dump(2) << "\n";
  out.close();
  DUET_REQUIRE(out.good(), "writing the profile {} failed", path.string());
}

Profile read_profile(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in.good()) {
    throw Error(ErrorKind::kNotFound, duet::format("cannot read the profile {}", path.string()));
  }
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(ErrorKind::kInvalidArgument,
                duet::format("{} is not JSON: {}", path.string(), e.what()));
  }
  try {
    return profile_from_json(json);
  } catch (const Error& e) {
    throw Error(e.kind(), duet::format("{}: {}", path.string(), e.what()));
  }
}

}  // namespace duet::sim
