// SPDX-License-Identifier: Apache-2.0
//! @file cache_file.hpp  The tuning cache's file format, read side: the field encodings and number
//! formats, what a load found (FileState, LoadReport), the validation of an entry, the parser of a
//! file's text (parse_cache_text) and the reading of a whole file.
//!
//! Host-only C++17. Nothing here writes a file, warns, or reads the environment: the Cache
//! (tuning/cache.hpp) reports what a parse found, and the writer (format_cache_text, save()) is the
//! compiled prox_tuning library's (tools/tuning/src/store.cpp). docs/tuning.md describes the file.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#if !defined(_WIN32)
#include <fcntl.h>
#include <unistd.h>
#endif

#include "../core/config.hpp"
#include "cache_key.hpp"

PROX_NAMESPACE_BEGIN

namespace tuning {

// ---------------------------------------------------------------- encoding and number formats
namespace detail {

//! Percent-encode '%', TAB, LF, CR and every other control byte, so a field never breaks a row.
inline std::string percent_encode(const std::string& s) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (c == '%' || c < 0x20 || c == 0x7F) {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

inline int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

//! Inverse of percent_encode; false on a malformed escape.
inline bool percent_decode(const std::string& s, std::string* out) {
  std::string r;
  r.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      r += s[i];
      continue;
    }
    if (i + 2 >= s.size()) return false;  // needs two hex digits after '%'
    const int hi = hex_value(s[i + 1]);
    const int lo = hex_value(s[i + 2]);
    if (hi < 0 || lo < 0) return false;
    r += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  *out = std::move(r);
  return true;
}

//! Parse a non-negative decimal integer (digits only) within [lo, hi].
inline bool parse_int(const std::string& s, long long lo, long long hi, long long* out) noexcept {
  if (s.empty() || s.size() > 18) return false;
  long long v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

//! Parse a non-negative fixed-point decimal "123" or "123.456" (locale-independent).
inline bool parse_fixed(const std::string& s, double* out) noexcept {
  const std::size_t dot = s.find('.');
  const std::string ip = s.substr(0, dot);
  const std::string fp = dot == std::string::npos ? std::string() : s.substr(dot + 1);
  if (ip.empty() || ip.size() > 15 || (dot != std::string::npos && (fp.empty() || fp.size() > 9))) return false;
  double v = 0.0;
  for (char c : ip) {
    if (c < '0' || c > '9') return false;
    v = v * 10.0 + (c - '0');
  }
  double scale = 0.1;
  for (char c : fp) {
    if (c < '0' || c > '9') return false;
    v += (c - '0') * scale;
    scale *= 0.1;
  }
  *out = v;
  return true;
}

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t pos = s.find(sep, start);
    if (pos == std::string::npos) {
      out.push_back(s.substr(start));
      return out;
    }
    out.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

//! Canonical map key of a Key: its encoded fields joined by TAB (also the file's row order).
inline std::string key_string(const Key& k) {
  return percent_encode(k.op) + '\t' + percent_encode(k.dtype) + '\t' + percent_encode(k.weights) + '\t' +
         percent_encode(k.act) + '\t' + std::to_string(k.d_model) + '\t' + std::to_string(k.d_ff) + '\t' +
         std::to_string(k.density16) + '\t' + std::to_string(k.batch);
}

}  // namespace detail

// ---------------------------------------------------------------- file parsing
//! What happened to a cache file on the last load() (or the re-read of the last save).
enum class FileState : int {
  kNoPath = 0,          //!< no location: in-memory only
  kMissing,             //!< no file yet (not a problem)
  kLoaded,              //!< read; rows merged (some may have been skipped, see LoadReport)
  kCorrupt,             //!< not a prox_autotune file, empty, truncated in its header: ignored
  kVersionMismatch,     //!< another prox_autotune format version: ignored, never overwritten
  kSignatureMismatch,   //!< another device/build: ignored, never overwritten
  kUnreadable,          //!< I/O error: ignored
};

constexpr const char* to_string(FileState s) noexcept {
  switch (s) {
    case FileState::kNoPath: return "no path";
    case FileState::kMissing: return "missing";
    case FileState::kLoaded: return "loaded";
    case FileState::kCorrupt: return "corrupt";
    case FileState::kVersionMismatch: return "format version mismatch";
    case FileState::kSignatureMismatch: return "signature mismatch";
    case FileState::kUnreadable: return "unreadable";
  }
  return "unknown";
}

//! Counts of the last load (or the re-read inside the last save).
struct LoadReport {
  FileState state = FileState::kNoPath;
  std::size_t rows = 0;            //!< data rows seen
  std::size_t loaded = 0;          //!< rows accepted from the file
  std::size_t malformed = 0;       //!< rows skipped: wrong column count, bad number, bad escape, truncated
  std::size_t unknown_policy = 0;  //!< rows naming an op or policy not in the current table
  std::size_t duplicates = 0;      //!< later rows repeating a key (the first one is kept)
  std::size_t kept_in_memory = 0;  //!< file rows whose key was already in memory (memory wins)
  std::string problem;             //!< the first problem, for messages
};

namespace detail {

//! An entry with its key: the value of a Cache's map and of a parsed file's, keyed by key_string().
struct Stored {
  Key key;
  Entry entry;
};
using Map = std::map<std::string, Stored>;

//! Columns of the entry table, in the order written. Readers map columns by name.
inline const std::vector<std::string>& columns() {
  static const std::vector<std::string> kColumns = {"op",      "dtype",     "weights", "act",    "d_model",
                                                    "d_ff",    "density16", "batch",   "policy", "median_us",
                                                    "p20_us",  "p80_us",    "reps"};
  return kColumns;
}

//! Largest timing (µs) an entry may hold: the file stores nanoseconds as integers and reads at most 15
//! integer digits, so a larger value could be recorded and saved but not read back (11.6 days here).
constexpr double kMaxTimingUs = 1e12;

//! Validate an entry against the table and basic ranges; empty string if fine.
inline std::string check_entry(const Key& k, const Entry& e, const PolicyTable& table, bool* unknown_policy) {
  *unknown_policy = false;
  if (k.op.empty() || k.dtype.empty() || k.weights.empty() || k.act.empty()) return "empty key field";
  if (k.d_model < 1 || k.d_model > (1 << 24) || k.d_ff < 0 || k.d_ff > (1 << 24)) return "shape out of range";
  if (k.density16 < 0 || k.density16 > kDensityBuckets) return "density bucket out of range";
  if (k.batch < 1 || k.batch > (1 << 16)) return "batch out of range";
  if (!(std::isfinite(e.median_us) && std::isfinite(e.p20_us) && std::isfinite(e.p80_us)) || e.p20_us < 0.0 ||
      e.p20_us > e.median_us || e.median_us > e.p80_us)
    return "timings not finite or not ordered p20 <= median <= p80";
  if (e.p80_us > kMaxTimingUs) return "timing above kMaxTimingUs";
  if (e.reps < 1) return "reps < 1";
  const auto it = table.find(k.op);
  if (it == table.end()) {
    *unknown_policy = true;
    return "unknown op '" + k.op + "'";
  }
  if (std::find(it->second.begin(), it->second.end(), e.policy) == it->second.end()) {
    *unknown_policy = true;
    return "unknown policy '" + e.policy + "' for op '" + k.op + "'";
  }
  return std::string();
}

//! What parse_cache_text() found: the file's state, and its entries and row counts if it loaded.
struct ParsedFile {
  FileState state = FileState::kCorrupt;
  std::string problem;  // file-level problem (state != kLoaded)
  Map entries;
  LoadReport report;    // row counts (state == kLoaded)
};

//! One line of a cache file: its text (a trailing CR removed), whether a newline ended it, and its
//! number (from 1, for messages).
struct FileLine {
  std::string text;
  bool terminated;
  std::size_t number;
};

//! The lines of `text`; a last line without a newline is kept, unterminated. An empty text has none.
inline std::vector<FileLine> split_lines(const std::string& text) {
  std::vector<FileLine> lines;
  std::size_t start = 0;
  std::size_t number = 1;
  while (start < text.size()) {
    const std::size_t nl = text.find('\n', start);
    std::string t = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (!t.empty() && t.back() == '\r') t.pop_back();
    lines.push_back({std::move(t), nl != std::string::npos, number++});
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  return lines;
}

// The file-level steps of parse_cache_text, in file order. Each returns false when the file is to be
// ignored, with out->problem (and, for another version or signature, out->state) set.

//! The first line is this format's magic, ended by a newline. Another version's magic is a version
//! mismatch; anything else, or nothing, is corrupt.
inline bool check_magic(const std::vector<FileLine>& lines, ParsedFile* out) {
  if (lines.empty()) {
    out->problem = "empty file";
    return false;
  }
  const FileLine& first = lines[0];
  if (first.text != kMagic) {
    if (first.text.rfind(kMagicPrefix, 0) == 0 && first.terminated) {
      out->state = FileState::kVersionMismatch;
      out->problem = "format '" + first.text.substr(2) + "', this build reads '" + std::string(kMagic + 2) + "'";
    } else {
      out->problem = "first line is not '" + std::string(kMagic) + "'";
    }
    return false;
  }
  if (!first.terminated) {
    out->problem = "truncated after the first line";
    return false;
  }
  return true;
}

/**
 * @brief The signature lines "# key<TAB>value" (value percent-encoded) after the magic, up to the header
 * row, the first line that is neither blank nor starts with '#'; '#' lines of another form are comments.
 * *header is the header row's index. Corrupt: a cut or badly escaped signature line, no header row.
 */
inline bool read_signature(const std::vector<FileLine>& lines, std::map<std::string, std::string>* sig,
                           std::size_t* header, ParsedFile* out) {
  std::size_t i = 1;
  for (; i < lines.size(); ++i) {
    const FileLine& l = lines[i];
    if (l.text.empty()) continue;
    if (l.text[0] != '#') break;
    if (!l.terminated) {
      out->problem = "truncated in the signature (line " + std::to_string(l.number) + ")";
      return false;
    }
    const std::size_t tab = l.text.find('\t');
    if (l.text.rfind("# ", 0) != 0 || tab == std::string::npos) continue;  // a comment
    std::string value;
    if (!percent_decode(l.text.substr(tab + 1), &value)) {
      out->problem = "bad escape in signature line " + std::to_string(l.number);
      return false;
    }
    sig->emplace(l.text.substr(2, tab - 2), std::move(value));
  }
  if (i >= lines.size()) {
    out->problem = "no header row (truncated?)";
    return false;
  }
  *header = i;
  return true;
}

//! Every enforced field of `expected` is in the file with the same value; the first that is not makes
//! a signature mismatch.
inline bool check_signature(const std::map<std::string, std::string>& sig, const Signature& expected,
                            ParsedFile* out) {
  for (const auto& [k, v] : expected.enforced_fields()) {
    const auto it = sig.find(k);
    if (it == sig.end() || it->second != v) {
      out->state = FileState::kSignatureMismatch;
      out->problem = "written for another device or build (" + k + ": file '" +
                     (it == sig.end() ? std::string("<missing>") : it->second) + "', this process '" + v + "')";
      return false;
    }
  }
  return true;
}

//! Column name -> position in a row (the header row's columns, every one of columns() among them).
using ColumnIndex = std::map<std::string, std::size_t>;

//! The header row names every column of columns(), in any order, none twice (others are ignored).
inline bool read_header(const FileLine& header, ColumnIndex* col, ParsedFile* out) {
  if (!header.terminated) {
    out->problem = "truncated header row";
    return false;
  }
  const std::vector<std::string> names = split(header.text, '\t');
  for (std::size_t c = 0; c < names.size(); ++c) {
    if (!col->emplace(names[c], c).second) {
      out->problem = "duplicate column '" + names[c] + "'";
      return false;
    }
  }
  for (const std::string& need : columns()) {
    if (col->find(need) == col->end()) {
      out->problem = "header row lacks column '" + need + "'";
      return false;
    }
  }
  return true;
}

// The rows.

//! The key and entry of a data row's fields: text decoded, integers within the ranges check_entry()
//! enforces, timings fixed-point. False on a bad number or escape.
inline bool parse_row(const std::vector<std::string>& f, const ColumnIndex& col, Key* k, Entry* e) {
  const auto field = [&](const char* name) -> const std::string& { return f[col.find(name)->second]; };
  long long d_model = 0, d_ff = 0, bucket = 0, batch = 0, reps = 0;
  const bool ok = percent_decode(field("op"), &k->op) && percent_decode(field("dtype"), &k->dtype) &&
                  percent_decode(field("weights"), &k->weights) && percent_decode(field("act"), &k->act) &&
                  percent_decode(field("policy"), &e->policy) && parse_int(field("d_model"), 1, 1 << 24, &d_model) &&
                  parse_int(field("d_ff"), 0, 1 << 24, &d_ff) &&
                  parse_int(field("density16"), 0, kDensityBuckets, &bucket) &&
                  parse_int(field("batch"), 1, 1 << 16, &batch) && parse_int(field("reps"), 1, 1 << 30, &reps) &&
                  parse_fixed(field("median_us"), &e->median_us) && parse_fixed(field("p20_us"), &e->p20_us) &&
                  parse_fixed(field("p80_us"), &e->p80_us);
  if (!ok) return false;
  k->d_model = static_cast<int>(d_model);
  k->d_ff = static_cast<int>(d_ff);
  k->density16 = static_cast<int>(bucket);
  k->batch = static_cast<int>(batch);
  e->reps = static_cast<int>(reps);
  return true;
}

/**
 * @brief Take one data row into out->entries, or count why it is skipped in out->report (a cut row, a
 * wrong field count, a bad number or escape, a bad entry: malformed; an op or policy the table lacks:
 * unknown policy; a key already read: duplicate, the first row kept). The first problem is noted.
 */
inline void read_row(const FileLine& l, const ColumnIndex& col, const PolicyTable& table, ParsedFile* out) {
  LoadReport& rep = out->report;
  const auto skip = [&](std::size_t* count, const std::string& why) {
    ++*count;
    if (rep.problem.empty()) rep.problem = "line " + std::to_string(l.number) + ": " + why;
  };
  ++rep.rows;
  if (!l.terminated) return skip(&rep.malformed, "truncated row");
  const std::vector<std::string> f = split(l.text, '\t');
  if (f.size() != col.size())
    return skip(&rep.malformed,
                "expected " + std::to_string(col.size()) + " fields, found " + std::to_string(f.size()));
  Key k;
  Entry e;
  if (!parse_row(f, col, &k, &e)) return skip(&rep.malformed, "bad number or escape");
  bool unknown = false;
  const std::string why = check_entry(k, e, table, &unknown);
  if (!why.empty()) return skip(unknown ? &rep.unknown_policy : &rep.malformed, why);
  std::string ks = key_string(k);  // before k is moved from (argument order is unspecified)
  if (!out->entries.emplace(std::move(ks), Stored{std::move(k), std::move(e)}).second)
    return skip(&rep.duplicates, "duplicate key (the first row is kept)");
  ++rep.loaded;
}

/**
 * @brief Parse the text of a cache file against the expected signature and policy table: the magic
 * line, the signature lines, the header row, then the data rows (blank lines and '#' comments skipped).
 * Never throws except std::bad_alloc. Rows must end with a newline (a cut final row is malformed).
 */
inline ParsedFile parse_cache_text(const std::string& text, const Signature& expected, const PolicyTable& table) {
  ParsedFile out;
  const std::vector<FileLine> lines = split_lines(text);
  std::map<std::string, std::string> sig;
  std::size_t header = 0;
  ColumnIndex col;
  if (!check_magic(lines, &out) || !read_signature(lines, &sig, &header, &out) ||
      !check_signature(sig, expected, &out) || !read_header(lines[header], &col, &out))
    return out;
  out.state = FileState::kLoaded;
  out.report.state = FileState::kLoaded;
  for (std::size_t i = header + 1; i < lines.size(); ++i) {
    const FileLine& l = lines[i];
    if (l.text.empty() || l.text[0] == '#') continue;
    read_row(l, col, table, &out);
  }
  return out;
}

// ---------------------------------------------------------------- reading a file
enum class ReadResult { kOk, kMissing, kError };

//! Read a whole file (at most a little over kMaxFileBytes: the caller rejects longer files).
inline ReadResult read_whole_file(const std::string& path, std::string* out, std::string* err) {
#if defined(_WIN32)
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    if (errno == ENOENT) return ReadResult::kMissing;
    *err = std::strerror(errno);
    return ReadResult::kError;
  }
  std::string s;
  char buf[65536];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
    s.append(buf, n);
    if (s.size() > kMaxFileBytes) break;
  }
  std::fclose(f);
  *out = std::move(s);
  return ReadResult::kOk;
#else
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return ReadResult::kMissing;
    *err = std::strerror(errno);
    return ReadResult::kError;
  }
  std::string s;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = std::strerror(errno);
      ::close(fd);
      return ReadResult::kError;
    }
    if (n == 0) break;
    s.append(buf, static_cast<std::size_t>(n));
    if (s.size() > kMaxFileBytes) break;  // parse sees an over-long file; the caller rejects it
  }
  ::close(fd);
  *out = std::move(s);
  return ReadResult::kOk;
#endif
}

}  // namespace detail

}  // namespace tuning

PROX_NAMESPACE_END
