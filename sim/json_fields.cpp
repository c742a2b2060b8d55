#include "sim/json_fields.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace duet::sim {
namespace {

[[noreturn]] void malformed(const std::string& path, std::string_view expected,
                            const nlohmann::json& got) {
  throw Error(ErrorKind::kInvalidArgument,
              duet::format("{}: expected {}, got {}", path.empty() ? "the document" : path,
                           expected, got.type_name()));
}

}  // namespace

nlohmann::json json_number(double value) {
  DUET_REQUIRE(!std::isnan(value), "a NaN has no JSON form");
  if (std::isinf(value)) {
    DUET_REQUIRE(value > 0, "-infinity has no JSON form here");
    return "inf";
  }
  return value;
}

double read_json_number(const nlohmann::json& json, const std::string& path) {
  if (json.is_number()) return json.get<double>();
  if (json.is_string() && json.get<std::string>() == "inf") {
    return std::numeric_limits<double>::infinity();
  }
  malformed(path, "a number", json);
}

int64_t read_json_integer(const nlohmann::json& json, const std::string& path) {
  if (json.is_number_integer()) return json.get<int64_t>();
  malformed(path, "an integer", json);
}

JsonFields::JsonFields(const nlohmann::json& json, std::string path)
    : json_(json), path_(std::move(path)) {
  if (!json_.is_object()) malformed(path_, "an object", json_);
}

std::string JsonFields::field_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

bool JsonFields::has(std::string_view key) const { return json_.contains(key); }

const nlohmann::json& JsonFields::at(std::string_view key) const {
  const auto it = json_.find(key);
  if (it == json_.end()) {
    throw Error(ErrorKind::kInvalidArgument, duet::format("{}: missing", field_path(key)));
  }
  return *it;
}

double JsonFields::number(std::string_view key) const {
  return read_json_number(at(key), field_path(key));
}

int64_t JsonFields::integer(std::string_view key) const {
  return read_json_integer(at(key), field_path(key));
}

std::string JsonFields::string(std::string_view key) const {
  const nlohmann::json& value = at(key);
  if (!value.is_string()) malformed(field_path(key), "a string", value);
  return value.get<std::string>();
}

JsonFields JsonFields::object(std::string_view key) const {
  return JsonFields(at(key), field_path(key));
}

const nlohmann::json& JsonFields::array(std::string_view key) const {
  const nlohmann::json& value = at(key);
  if (!value.is_array()) malformed(field_path(key), "an array", value);
  return value;
}

std::vector<int64_t> JsonFields::integers(std::string_view key) const {
  const nlohmann::json& values = array(key);
  std::vector<int64_t> out;
  for (size_t i = 0; i < values.size(); ++i) {
    out.push_back(read_json_integer(values[i], duet::format("{}[{}]", field_path(key), i)));
  }
  return out;
}

std::vector<double> JsonFields::numbers(std::string_view key) const {
  const nlohmann::json& values = array(key);
  std::vector<double> out;
  for (size_t i = 0; i < values.size(); ++i) {
    out.push_back(read_json_number(values[i], duet::format("{}[{}]", field_path(key), i)));
  }
  return out;
}

void JsonFields::only(std::initializer_list<std::string_view> known) const {
  for (const auto& [key, value] : json_.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      throw Error(
          ErrorKind::kInvalidArgument,
          duet::format("{}: unknown field (known: {})", field_path(key), duet::join(known, ", ")));
    }
  }
}

}  // namespace duet::sim
