// SPDX-License-Identifier: Apache-2.0
//! @file json.hpp  Result files of prox's tools: nlohmann::ordered_json documents (fields in the
//! order they are set) written one record per line, and figures rounded to the digits they carry.
//! Not part of the library.
#pragma once

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace prox_support::json {

using Json = nlohmann::ordered_json;

//! v rounded to `decimals` digits after the point, so that a file holds no more digits than a
//! measurement carries ("14.3333", not "14.333312034606934"). Not finite stays as it is (null in JSON).
inline double rounded(double v, int decimals) {
  if (!std::isfinite(v)) return v;
  const double scale = std::pow(10.0, decimals);
  return std::round(v * scale) / scale;
}

namespace detail {
inline std::string dump_value(const Json& j) {
  // Invalid UTF-8 (a GPU name, a command line) is replaced rather than thrown about.
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

inline void dump_records(const Json& j, int indent, std::string* out) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  if (j.is_object() && !j.empty()) {
    *out += "{\n";
    std::size_t k = 0;
    for (auto it = j.begin(); it != j.end(); ++it, ++k) {
      *out += pad + "  " + dump_value(Json(it.key())) + ": ";
      dump_records(it.value(), indent + 2, out);
      *out += k + 1 < j.size() ? ",\n" : "\n";
    }
    *out += pad + "}";
  } else if (j.is_array() && !j.empty()) {
    *out += "[\n";
    for (std::size_t k = 0; k < j.size(); ++k)
      *out += pad + "  " + dump_value(j[k]) + (k + 1 < j.size() ? ",\n" : "\n");
    *out += pad + "]";
  } else {
    *out += dump_value(j);
  }
}
}  // namespace detail

/**
 * @brief The document as text: objects indented, each element of an array on one line (a table of
 * results reads, and diffs, a row per line).
 */
inline std::string dump_records(const Json& doc) {
  std::string out;
  detail::dump_records(doc, 0, &out);
  return out + "\n";
}

//! Write dump_records(doc) to `path`; throws std::runtime_error when the file cannot be written.
inline void write_file(const std::string& path, const Json& doc) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << dump_records(doc);
  f.close();
  if (!f) throw std::runtime_error("error writing " + path);
}

}  // namespace prox_support::json
