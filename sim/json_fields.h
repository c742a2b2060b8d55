// Reading a profile's JSON (and a hardware description) field by field, so
// that every error names the field it is about: "instances[1].step.knot_seconds[3]:
// expected a number, got a string".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace duet::sim {

// A JSON object at `path` (empty path: the document). Every accessor throws
// duet::Error (kInvalidArgument) naming the field when it is missing or of
// the wrong type. The object is borrowed: it must outlive this view.
class JsonFields {
 public:
  // Throws unless `json` is an object.
  JsonFields(const nlohmann::json& json, std::string path);

  bool has(std::string_view key) const;
  const nlohmann::json& at(std::string_view key) const;
  std::string field_path(std::string_view key) const;

  double number(std::string_view key) const;  // also "inf" (see json_number)
  int64_t integer(std::string_view key) const;
  std::string string(std::string_view key) const;
  JsonFields object(std::string_view key) const;
  const nlohmann::json& array(std::string_view key) const;  // a JSON array
  std::vector<int64_t> integers(std::string_view key) const;
  std::vector<double> numbers(std::string_view key) const;

  // Throws naming the first key not in `known`.
  void only(std::initializer_list<std::string_view> known) const;

 private:
  const nlohmann::json& json_;
  std::string path_;
};

// A double as JSON: a number, or the string "inf" for +infinity (JSON has
// no infinity). NaN is refused (duet::Error kInvalidArgument).
nlohmann::json json_number(double value);
// Reads json_number's output at `path`.
double read_json_number(const nlohmann::json& json, const std::string& path);
int64_t read_json_integer(const nlohmann::json& json, const std::string& path);

}  // namespace duet::sim
