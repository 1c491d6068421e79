// SPDX-License-Identifier: Apache-2.0
//! @file cache.hpp  The run-time half of the tuning cache: keys, the device/build signature, reading
//! and parsing a cache file (rows validated against the compiled policy tables), lock-free lookups,
//! and the hook through which a tuner fills misses (mode 2).
//!
//! Host-only C++17 (cuda_runtime.h only for the device signature and the capture check). The keys of
//! prox's ops and choose<Ffn>() are in tuning/choose.cuh. What an engine does not need at run time
//! lives in the compiled `prox_tuning` library (tools/tuning): the measuring harness, save() (file
//! locking, atomic replace) and the environment (PROX_AUTOTUNE, PROX_CACHE_DIR, XDG, HOME);
//! docs/tuning.md describes the design and the file.
//!
//! Guarantees
//!  - Lookups (find / index_of) never lock: they read an immutable snapshot
//!    (`std::shared_ptr<const Map>`, atomic load). Updates and loads swap the snapshot under one
//!    mutex; GPU tuning is serialized by tuning_mutex().
//!  - An entry, once in a Cache's memory, is never replaced for that Cache's lifetime (a later
//!    record or a file re-read keeps the first one), so a choice made is fixed for the process.
//!  - Nothing here throws (beyond std::bad_alloc from the constructor) or aborts. A corrupt,
//!    truncated, foreign-version or other-device file is ignored with ONE warning per file and
//!    problem, through the warning handler (set_warning_handler); malformed rows are skipped one
//!    by one and counted; rows naming an unknown op or policy are dropped.
//!  - Nothing here writes a file, reads the environment, or clears a pending CUDA error.
//!
//! Printing: prox prints nothing unless PROX_DEBUG is defined, with one documented exception:
//! the default warning handler of this cache writes one line ("prox: tuning cache: ...") to
//! stderr per warning. Install your own handler (or a no-op) with set_warning_handler().
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#if !defined(_WIN32)
#include <fcntl.h>
#include <unistd.h>
#endif

#include "../core/config.hpp"
#include "../core/math.hpp"
#include "../core/policy.hpp"
#include "../core/status.hpp"

PROX_NAMESPACE_BEGIN

namespace tuning {

// ---------------------------------------------------------------- constants and modes
//! First line of every cache file; the trailing number is the file-format version.
constexpr const char* kMagic = "# prox_autotune v1";
constexpr const char* kMagicPrefix = "# prox_autotune ";
//! Density buckets: densities are rounded *up* to a multiple of 1/kDensityBuckets.
constexpr int kDensityBuckets = 16;
//! Near-tie rule of the tuner: the lowest index whose median is within this fraction of the best
//! wins. 0.5 %: the p20-p80 spread of a tuned median is 0.2-0.5 % on the H100, and the fused Stage-2
//! candidates of a 5120-wide row differ by 1.4-1.6 %, which the former 2 % left to the slower lower
//! index (docs/tuning.md). Part of the selection logic that kSelectionVersion versions.
constexpr double kTieTolerance = 0.005;
//! Version of the selection logic (tie rule, measurement protocol); hashed into the signature, so a
//! file chosen under other rules is not used. 2: tie tolerance 2 % -> 0.5 %.
constexpr int kSelectionVersion = 2;
//! Files larger than this are treated as corrupt rather than read.
constexpr std::size_t kMaxFileBytes = std::size_t{64} << 20;

/**
 * @brief What choose() may do on a miss. CacheOptions::mode sets it (the prox_tuning library also
 * reads `PROX_AUTOTUNE`).
 */
enum class Mode : int {
  kOff = 0,         //!< lookups miss: plan() uses the default policies
  kReadOnly = 1,    //!< (default) use cached choices; a miss stays a miss
  kTuneOnMiss = 2,  //!< choose() hands a miss to the cache's miss handler (never during capture)
};

constexpr const char* to_string(Mode m) noexcept {
  switch (m) {
    case Mode::kOff: return "off";
    case Mode::kReadOnly: return "read-only";
    case Mode::kTuneOnMiss: return "tune-on-miss";
  }
  return "unknown";
}

/**
 * @brief Density bucket of a density in [0, 1]: ceil(density * 16), so a bucket b covers
 * ((b-1)/16, b/16]. 0 stays 0 (nothing kept); >= 1 and NaN give 16 (dense, the safe side).
 */
inline int density_bucket(double density) noexcept {
  if (!(density == density) || density >= 1.0) return kDensityBuckets;
  if (density <= 0.0) return 0;
  const int b = static_cast<int>(std::ceil(density * kDensityBuckets - 1e-9));
  return b < 1 ? 1 : (b > kDensityBuckets ? kDensityBuckets : b);
}

//! The density a bucket stands for (its upper edge; the tuner measures there).
constexpr double bucket_density(int bucket) noexcept { return static_cast<double>(bucket) / kDensityBuckets; }

// ---------------------------------------------------------------- key, entry, policy table
/**
 * @brief Cache key. All fields are strict (equal or miss). `op` names a candidate list
 * ("threshold", "proxy_gemv" (INT4 proxy), "proxy_gemv_dense" (fp16/bf16 proxy), "glu_gemv",
 * "down_gemv", "glu_down_gemv" (fused Stage 2)); tuning/choose.cuh builds keys from op types.
 */
struct Key {
  std::string op;       //!< candidate list, a key of the PolicyTable
  std::string dtype;    //!< activation type: "f16" | "bf16"
  std::string weights;  //!< weight format + layout version: "int4v1", "f16", "bf16", or "-"
  std::string act;      //!< GLU activation: "silu", "gelu_tanh", or "-"
  int d_model = 0;      //!< input size (threshold: vector length)
  int d_ff = 0;         //!< channels (0 for ops without one)
  int density16 = kDensityBuckets;  //!< density bucket (sixteenths, 0..16): input density for
                                    //!< proxy_gemv/threshold, selected-channel density for
                                    //!< glu_gemv/down_gemv/glu_down_gemv
  int batch = 1;        //!< tokens (1: decoding)

  bool operator==(const Key& o) const {
    return op == o.op && dtype == o.dtype && weights == o.weights && act == o.act && d_model == o.d_model &&
           d_ff == o.d_ff && density16 == o.density16 && batch == o.batch;
  }
  bool operator!=(const Key& o) const { return !(*this == o); }
};

//! Cached value: the chosen policy by *name* (mapped back to an index through the current list,
//! so a list edit invalidates cleanly) and its timing, in microseconds.
struct Entry {
  std::string policy;
  double median_us = 0.0;
  double p20_us = 0.0;
  double p80_us = 0.0;
  int reps = 0;
};

//! Candidate names of every op, in list order: op -> names (index = position). Hashed into the
//! file signature, so any edit of a candidate list selects another file.
using PolicyTable = std::map<std::string, std::vector<std::string>>;

//! Names of a PolicyList's policies, in order.
template <class List>
std::vector<std::string> policy_names() {
  std::vector<std::string> out;
  for_each_policy<List>([&](auto p, int) { out.push_back(decltype(p)::name()); });
  return out;
}

//! FNV-1a 64-bit hash: the policy-table signature and the default file name.
inline std::uint64_t fnv1a64(const std::string& s, std::uint64_t h = ::prox::detail::kFnv1aBasis) noexcept {
  for (unsigned char c : s) h = ::prox::detail::fnv1a64_step(h, c);
  return h;
}

//! Hash of a policy table and the selection-logic version (the `policy_hash` signature field).
inline std::uint64_t policy_table_hash(const PolicyTable& table) {
  std::string s = "selection=" + std::to_string(kSelectionVersion) + "\n";
  for (const auto& [op, names] : table) {
    s += op;
    s += '=';
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (i) s += ';';
      s += names[i];
    }
    s += '\n';
  }
  return fnv1a64(s);
}

//! 16 lowercase hex digits.
inline std::string to_hex64(std::uint64_t v) {
  static const char* kDigits = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i) {
    s[static_cast<std::size_t>(i)] = kDigits[v & 0xF];
    v >>= 4;
  }
  return s;
}

// ---------------------------------------------------------------- device and build signature
/**
 * @brief File-level signature. Every field except driver_version is enforced: a file whose
 * signature differs in any of them is ignored (and never overwritten).
 */
struct Signature {
  std::string gpu_name;      //!< cudaDeviceProp::name
  int sm_count = 0;          //!< multiProcessorCount (catches MIG slices and SKU variants)
  int cc_major = 0;          //!< compute capability
  int cc_minor = 0;
  long long l2_bytes = 0;    //!< L2 cache size
  int mem_bus_bits = 0;      //!< global memory bus width
  int mem_clock_khz = 0;     //!< peak memory clock
  int cudart_version = CUDART_VERSION;       //!< CUDA runtime the code was built against
  std::string prox_version = PROX_VERSION_STRING;
  std::uint64_t policy_hash = 0;             //!< policy_table_hash() (set by Cache)
  int driver_version = 0;    //!< recorded, not enforced

  //! Enforced fields as (name, value) in file order.
  std::vector<std::pair<std::string, std::string>> enforced_fields() const {
    return {{"gpu", gpu_name},
            {"sm_count", std::to_string(sm_count)},
            {"cc", std::to_string(cc_major) + "." + std::to_string(cc_minor)},
            {"l2_bytes", std::to_string(l2_bytes)},
            {"mem_bus_bits", std::to_string(mem_bus_bits)},
            {"mem_clock_khz", std::to_string(mem_clock_khz)},
            {"cudart", std::to_string(cudart_version)},
            {"prox", prox_version},
            {"policy_hash", to_hex64(policy_hash)}};
  }
  //! Hash of the enforced fields: names the default file, prox-<hash_hex()>.tsv.
  std::string hash_hex() const {
    std::string s;
    for (const auto& [k, v] : enforced_fields()) s += k + "=" + v + "\n";
    return to_hex64(fnv1a64(s));
  }
};

/**
 * @brief Read the signature of CUDA device `device` (policy_hash left 0; Cache fills it in).
 * Planning-time only: it queries the device. Each CUDA call's own result is checked; a failed
 * query is reported, never cleared from the runtime.
 */
inline Status query_signature(int device, Signature* out) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  try {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return Status::kErrorNoDevice;
    if (device < 0 || device >= count) return Status::kErrorInvalidArgument;
    Signature s;
    int l2 = 0;
    if (cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&s.cc_major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&s.cc_minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&s.mem_bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
      return Status::kErrorCudaRuntime;
    }
    // The memory clock attribute is informational on some platforms; a failure leaves 0.
    if (cudaDeviceGetAttribute(&s.mem_clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess)
      s.mem_clock_khz = 0;
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return Status::kErrorCudaRuntime;
    std::size_t len = 0;
    while (len < sizeof(prop.name) && prop.name[len] != '\0') ++len;
    s.gpu_name.assign(prop.name, len);
    s.l2_bytes = l2;
    if (cudaDriverGetVersion(&s.driver_version) != cudaSuccess) s.driver_version = 0;
    *out = std::move(s);
    return Status::kSuccess;
  } catch (...) {
    return Status::kErrorCudaRuntime;
  }
}

/**
 * @brief kSuccess when `stream` is not capturing; kErrorCapturing when it is, or when its capture
 * state cannot be queried (e.g. the legacy stream during another stream's global-mode capture).
 * Tuning allocates and synchronizes, so every tuning path asks this first.
 */
inline Status check_not_capturing(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) return Status::kErrorCapturing;
  return cs == cudaStreamCaptureStatusNone ? Status::kSuccess : Status::kErrorCapturing;
}

// ---------------------------------------------------------------- warnings
//! Receives one human-readable line per warning (no trailing newline).
using WarningHandler = std::function<void(const std::string&)>;

namespace detail {
struct WarningState {
  std::mutex mutex;
  WarningHandler handler;  // empty: default (stderr)
};
inline WarningState& warning_state() {
  static WarningState state;
  return state;
}
inline void emit_warning(const std::string& message) noexcept {
  try {
    WarningHandler h;
    {
      std::lock_guard<std::mutex> lock(warning_state().mutex);
      h = warning_state().handler;
    }
    if (h) {
      h(message);
    } else {
      std::fprintf(stderr, "prox: tuning cache: %s\n", message.c_str());
    }
  } catch (...) {
    // A throwing handler must not take the caller down.
  }
}
}  // namespace detail

/**
 * @brief Install the process-wide warning handler of the tuning cache; returns the previous one.
 * An empty handler restores the default (one line to stderr). To silence: `[](const std::string&) {}`.
 */
inline WarningHandler set_warning_handler(WarningHandler handler) {
  std::lock_guard<std::mutex> lock(detail::warning_state().mutex);
  WarningHandler old = std::move(detail::warning_state().handler);
  detail::warning_state().handler = std::move(handler);
  return old;
}

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

struct ParsedFile {
  FileState state = FileState::kCorrupt;
  std::string problem;  // file-level problem (state != kLoaded)
  Map entries;
  LoadReport report;    // row counts (state == kLoaded)
};

/**
 * @brief Parse the text of a cache file against the expected signature and policy table.
 * Never throws except std::bad_alloc. Rows must end with a newline (a cut final row is malformed).
 */
inline ParsedFile parse_cache_text(const std::string& text, const Signature& expected, const PolicyTable& table) {
  ParsedFile out;
  struct Line {
    std::string text;
    bool terminated;
    std::size_t number;
  };
  std::vector<Line> lines;
  {
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
  }
  if (lines.empty()) {
    out.problem = "empty file";
    return out;
  }
  if (lines[0].text != kMagic) {
    if (lines[0].text.rfind(kMagicPrefix, 0) == 0 && lines[0].terminated) {
      out.state = FileState::kVersionMismatch;
      out.problem = "format '" + lines[0].text.substr(2) + "', this build reads '" + std::string(kMagic + 2) + "'";
    } else {
      out.problem = "first line is not '" + std::string(kMagic) + "'";
    }
    return out;
  }
  if (!lines[0].terminated) {
    out.problem = "truncated after the first line";
    return out;
  }
  // Signature lines "# key<TAB>value", then the header row.
  std::map<std::string, std::string> sig;
  std::size_t i = 1;
  for (; i < lines.size(); ++i) {
    const Line& l = lines[i];
    if (l.text.empty()) continue;
    if (l.text[0] != '#') break;
    if (!l.terminated) {
      out.problem = "truncated in the signature (line " + std::to_string(l.number) + ")";
      return out;
    }
    const std::size_t tab = l.text.find('\t');
    if (l.text.rfind("# ", 0) != 0 || tab == std::string::npos) continue;  // a comment
    std::string value;
    if (!percent_decode(l.text.substr(tab + 1), &value)) {
      out.problem = "bad escape in signature line " + std::to_string(l.number);
      return out;
    }
    sig.emplace(l.text.substr(2, tab - 2), std::move(value));
  }
  if (i >= lines.size()) {
    out.problem = "no header row (truncated?)";
    return out;
  }
  for (const auto& [k, v] : expected.enforced_fields()) {
    const auto it = sig.find(k);
    if (it == sig.end() || it->second != v) {
      out.state = FileState::kSignatureMismatch;
      out.problem = "written for another device or build (" + k + ": file '" +
                    (it == sig.end() ? std::string("<missing>") : it->second) + "', this process '" + v + "')";
      return out;
    }
  }
  // Header row: columns by name.
  const Line& header = lines[i];
  if (!header.terminated) {
    out.problem = "truncated header row";
    return out;
  }
  const std::vector<std::string> names = split(header.text, '\t');
  std::map<std::string, std::size_t> col;
  for (std::size_t c = 0; c < names.size(); ++c) {
    if (!col.emplace(names[c], c).second) {
      out.problem = "duplicate column '" + names[c] + "'";
      return out;
    }
  }
  for (const std::string& need : columns()) {
    if (col.find(need) == col.end()) {
      out.problem = "header row lacks column '" + need + "'";
      return out;
    }
  }
  out.state = FileState::kLoaded;
  LoadReport& rep = out.report;
  rep.state = FileState::kLoaded;
  const auto note = [&](const Line& l, const std::string& why) {
    if (rep.problem.empty()) rep.problem = "line " + std::to_string(l.number) + ": " + why;
  };
  for (++i; i < lines.size(); ++i) {
    const Line& l = lines[i];
    if (l.text.empty() || l.text[0] == '#') continue;
    ++rep.rows;
    if (!l.terminated) {
      ++rep.malformed;
      note(l, "truncated row");
      continue;
    }
    const std::vector<std::string> f = split(l.text, '\t');
    if (f.size() != names.size()) {
      ++rep.malformed;
      note(l, "expected " + std::to_string(names.size()) + " fields, found " + std::to_string(f.size()));
      continue;
    }
    const auto field = [&](const char* name) -> const std::string& { return f[col[name]]; };
    Key k;
    Entry e;
    long long d_model = 0, d_ff = 0, bucket = 0, batch = 0, reps = 0;
    const bool ok = percent_decode(field("op"), &k.op) && percent_decode(field("dtype"), &k.dtype) &&
                    percent_decode(field("weights"), &k.weights) && percent_decode(field("act"), &k.act) &&
                    percent_decode(field("policy"), &e.policy) && parse_int(field("d_model"), 1, 1 << 24, &d_model) &&
                    parse_int(field("d_ff"), 0, 1 << 24, &d_ff) &&
                    parse_int(field("density16"), 0, kDensityBuckets, &bucket) &&
                    parse_int(field("batch"), 1, 1 << 16, &batch) && parse_int(field("reps"), 1, 1 << 30, &reps) &&
                    parse_fixed(field("median_us"), &e.median_us) && parse_fixed(field("p20_us"), &e.p20_us) &&
                    parse_fixed(field("p80_us"), &e.p80_us);
    if (!ok) {
      ++rep.malformed;
      note(l, "bad number or escape");
      continue;
    }
    k.d_model = static_cast<int>(d_model);
    k.d_ff = static_cast<int>(d_ff);
    k.density16 = static_cast<int>(bucket);
    k.batch = static_cast<int>(batch);
    e.reps = static_cast<int>(reps);
    bool unknown = false;
    const std::string why = check_entry(k, e, table, &unknown);
    if (!why.empty()) {
      ++(unknown ? rep.unknown_policy : rep.malformed);
      note(l, why);
      continue;
    }
    std::string ks = key_string(k);  // before k is moved from (argument order is unspecified)
    if (!out.entries.emplace(std::move(ks), Stored{std::move(k), std::move(e)}).second) {
      ++rep.duplicates;
      note(l, "duplicate key (the first row is kept)");
      continue;
    }
    ++rep.loaded;
  }
  return out;
}

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

//! Snapshot pointer with atomic load/store: the C++11 shared_ptr atomic free functions. (They are
//! deprecated in C++20 in favour of std::atomic<std::shared_ptr>, which libstdc++ 12 implements with
//! a pointer lock bit that ThreadSanitizer cannot see; the free functions use a mutex pool it can.)
template <class T>
class AtomicSharedPtr {
 public:
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
  std::shared_ptr<const T> load() const noexcept { return std::atomic_load_explicit(&p_, std::memory_order_acquire); }
  void store(std::shared_ptr<const T> v) noexcept {
    std::atomic_store_explicit(&p_, std::move(v), std::memory_order_release);
  }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

 private:
  std::shared_ptr<const T> p_ = std::make_shared<const T>();
};

}  // namespace detail

// ---------------------------------------------------------------- the cache
//! Where a Cache's file is and what choose() may do with it. The prox_tuning library's open_cache()
//! fills these from the environment; here they are explicit.
struct CacheOptions {
  std::string path;             //!< the file; "" = in memory only
  Mode mode = Mode::kReadOnly;  //!< what choose() does on a miss
};

class Cache;

/**
 * @brief Tunes the keys choose() missed (mode 2), called by choose() with the cache's tuning_mutex()
 * held and never while `stream` captures. The prox_tuning library installs one
 * (install_miss_handler(), and its open_cache() / default_cache()); without one a miss stays -1.
 * A key the handler cannot tune is left missing.
 */
using MissHandler = std::function<Status(Cache& cache, const std::vector<Key>& missing, cudaStream_t stream)>;

//! The prox_tuning library's access to a Cache's file state (its save() and environment handling).
class CacheWriter;

/**
 * @brief The tuning cache of one device and build: key -> chosen policy, read from a TSV file.
 * Writing the file (save()) and finding it from the environment are the prox_tuning library's.
 *
 * @code
 * prox::tuning::Signature sig;
 * prox::tuning::query_signature(device, &sig);
 * prox::tuning::Cache cache(sig, prox::tuning::policy_table(), {"/path/prox.tsv"});  // table: choose.cuh
 * cache.load();                                            // a missing file is fine
 * int idx = cache.index_of(key);                           // -1 on a miss
 * @endcode
 */
class Cache {
 public:
  /**
   * @param device  the device part of the signature (query_signature); policy_hash is replaced by
   *                the hash of `table`
   * @param table   current candidate names per op
   * @param options the file and the mode
   */
  Cache(const Signature& device, PolicyTable table, const CacheOptions& options = {})
      : table_(std::move(table)), sig_(device), path_(options.path), mode_(options.mode) {
    sig_.policy_hash = policy_table_hash(table_);
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  Mode mode() const noexcept { return mode_; }
  //! The file ("" = in-memory only).
  const std::string& path() const noexcept { return path_; }
  //! The full signature (policy_hash filled in).
  const Signature& signature() const noexcept { return sig_; }
  const PolicyTable& policies() const noexcept { return table_; }

  /**
   * @brief Read the file and merge its valid rows into memory (keys already in memory win).
   * A missing file or no path is success. A corrupt / foreign file is ignored with one warning and
   * still returns kSuccess (the cache simply stays as it was); see last_load() for details.
   * Returns kErrorCacheIo only if the file exists but cannot be read.
   */
  Status load() noexcept {
    try {
      LoadReport rep;
      detail::Map file_entries;
      const Status st = read_and_parse(&rep, &file_entries);
      merge_into_memory(file_entries, &rep);
      report_load_problems(rep);
      set_last_load(rep);
      return st;
    } catch (...) {
      return Status::kErrorCacheIo;
    }
  }

  //! The entry of `key`, if any (lock-free; never blocks on tuning or I/O).
  std::optional<Entry> find(const Key& key) const noexcept {
    try {
      const std::shared_ptr<const detail::Map> snap = snapshot_.load();
      const auto it = snap->find(detail::key_string(key));
      if (it == snap->end()) return std::nullopt;
      return it->second.entry;
    } catch (...) {
      return std::nullopt;
    }
  }

  //! Index of the cached policy of `key` in the op's list of this cache's table, or -1 on a miss
  //! (lock-free). The one name -> index mapping: choose() uses it with the compiled table.
  int index_of(const Key& key) const noexcept {
    const std::optional<Entry> e = find(key);
    if (!e) return -1;
    return policy_index(key.op, e->policy);
  }

  //! Index of policy `name` in `op`'s list of this cache's table, or -1.
  int policy_index(const std::string& op, const std::string& name) const noexcept {
    const auto it = table_.find(op);
    if (it == table_.end()) return -1;
    for (std::size_t i = 0; i < it->second.size(); ++i)
      if (it->second[i] == name) return static_cast<int>(i);
    return -1;
  }

  /**
   * @brief Insert an entry (memory only; the prox_tuning library's save() persists). If the key is
   * already present the existing entry is kept (choices are fixed for the Cache's lifetime) and
   * *inserted is false.
   * @return kErrorInvalidArgument for an unknown op/policy, a bad key or non-finite timings.
   */
  Status record(const Key& key, const Entry& entry, bool* inserted = nullptr) noexcept {
    try {
      if (inserted != nullptr) *inserted = false;
      bool unknown = false;
      if (!detail::check_entry(key, entry, table_, &unknown).empty()) return Status::kErrorInvalidArgument;
      std::lock_guard<std::mutex> lock(update_mutex_);
      const std::shared_ptr<const detail::Map> cur = snapshot_.load();
      const std::string ks = detail::key_string(key);
      if (cur->find(ks) != cur->end()) return Status::kSuccess;
      auto next = std::make_shared<detail::Map>(*cur);
      next->emplace(ks, detail::Stored{key, entry});
      snapshot_.store(std::move(next));
      if (inserted != nullptr) *inserted = true;
      return Status::kSuccess;
    } catch (...) {
      return Status::kErrorCacheIo;
    }
  }

  //! Number of entries in memory.
  std::size_t size() const noexcept { return snapshot_.load()->size(); }

  //! Every entry in memory, in key order.
  std::vector<std::pair<Key, Entry>> entries() const {
    std::vector<std::pair<Key, Entry>> out;
    const std::shared_ptr<const detail::Map> snap = snapshot_.load();
    out.reserve(snap->size());
    for (const auto& [k, v] : *snap) out.emplace_back(v.key, v.entry);
    return out;
  }

  //! Report of the last load() (or of the re-read inside the last save()).
  LoadReport last_load() const {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    return last_load_;
  }

  //! Number of warnings this Cache has emitted (each distinct problem at most once).
  int warnings() const noexcept { return warnings_.load(std::memory_order_relaxed); }
  //! Text of the last warning ("" if none).
  std::string last_warning() const {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    return last_warning_;
  }

  //! Serializes GPU timing (the tuner holds it while it measures; choose() while its handler runs).
  std::mutex& tuning_mutex() noexcept { return tuning_mutex_; }

  //! Install the handler choose() calls for misses in mode 2 (empty: misses stay -1). Thread-safe.
  void set_miss_handler(MissHandler handler) {
    std::lock_guard<std::mutex> lock(handler_mutex_);
    miss_handler_ = std::move(handler);
  }
  //! A copy of the installed miss handler (empty if none).
  MissHandler miss_handler() const {
    std::lock_guard<std::mutex> lock(handler_mutex_);
    return miss_handler_;
  }

  //! Count a miss that could not be tuned because the stream was capturing (mode 2).
  void count_capture_miss() noexcept { capture_misses_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t capture_misses() const noexcept { return capture_misses_.load(std::memory_order_relaxed); }

 private:
  friend class CacheWriter;

  //! Read + parse the file (no locks on memory). Fills *rep (state and counts) and *entries.
  Status read_and_parse(LoadReport* rep, detail::Map* entries) {
    *rep = LoadReport{};
    if (path_.empty()) {
      rep->state = FileState::kNoPath;
      return Status::kSuccess;
    }
    std::string text;
    std::string err;
    const detail::ReadResult r = detail::read_whole_file(path_, &text, &err);
    if (r == detail::ReadResult::kMissing) {
      rep->state = FileState::kMissing;
      return Status::kSuccess;
    }
    if (r == detail::ReadResult::kError) {
      rep->state = FileState::kUnreadable;
      rep->problem = err;
      warn("unreadable:" + path_, "cannot read " + path_ + ": " + err + " (ignored)");
      return Status::kErrorCacheIo;
    }
    if (text.size() > kMaxFileBytes) {
      rep->state = FileState::kCorrupt;
      rep->problem = "file larger than " + std::to_string(kMaxFileBytes) + " bytes";
      return Status::kSuccess;
    }
    detail::ParsedFile parsed = detail::parse_cache_text(text, sig_, table_);
    if (parsed.state == FileState::kLoaded) {
      *rep = parsed.report;
      *entries = std::move(parsed.entries);
    } else {
      rep->state = parsed.state;
      rep->problem = parsed.problem;
    }
    return Status::kSuccess;
  }

  //! Adopt file entries whose keys are not in memory yet; count the others in rep->kept_in_memory.
  void merge_into_memory(const detail::Map& file_entries, LoadReport* rep) {
    if (file_entries.empty()) return;
    std::lock_guard<std::mutex> lock(update_mutex_);
    const std::shared_ptr<const detail::Map> cur = snapshot_.load();
    auto next = std::make_shared<detail::Map>(*cur);
    std::size_t kept = 0;
    for (const auto& [k, v] : file_entries)
      if (!next->emplace(k, v).second) ++kept;
    rep->kept_in_memory = kept;
    snapshot_.store(std::move(next));
  }

  //! At most one warning per file and kind of problem.
  void report_load_problems(const LoadReport& rep) {
    switch (rep.state) {
      case FileState::kCorrupt:
        warn("corrupt:" + path_, "ignoring " + path_ + ": not a valid prox_autotune file (" + rep.problem + ")");
        break;
      case FileState::kVersionMismatch:
        warn("foreign:" + path_, "ignoring " + path_ + ": " + rep.problem + "; it will not be overwritten");
        break;
      case FileState::kSignatureMismatch:
        warn("foreign:" + path_, "ignoring " + path_ + ": " + rep.problem + "; it will not be overwritten");
        break;
      case FileState::kLoaded: {
        const std::size_t bad = rep.malformed + rep.unknown_policy + rep.duplicates;
        if (bad > 0) {
          warn("rows:" + path_, "skipped " + std::to_string(bad) + " of " + std::to_string(rep.rows) + " rows of " +
                                    path_ + " (malformed " + std::to_string(rep.malformed) + ", unknown policy " +
                                    std::to_string(rep.unknown_policy) + ", duplicate " +
                                    std::to_string(rep.duplicates) + "; first: " + rep.problem + ")");
        }
        break;
      }
      default: break;
    }
  }

  void set_last_load(const LoadReport& rep) {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    last_load_ = rep;
  }

  //! Emit `message` unless a warning with this `tag` was emitted before.
  void warn(const std::string& tag, const std::string& message) noexcept {
    try {
      {
        std::lock_guard<std::mutex> lock(warn_mutex_);
        if (!warned_.insert(tag).second) return;
        last_warning_ = message;
      }
      warnings_.fetch_add(1, std::memory_order_relaxed);
      detail::emit_warning(message);
    } catch (...) {
    }
  }

  const PolicyTable table_;
  Signature sig_;
  const std::string path_;
  const Mode mode_;
  detail::AtomicSharedPtr<detail::Map> snapshot_;
  std::mutex update_mutex_;
  std::mutex tuning_mutex_;
  mutable std::mutex handler_mutex_;
  MissHandler miss_handler_;
  mutable std::mutex warn_mutex_;
  std::set<std::string> warned_;
  std::string last_warning_;
  LoadReport last_load_;
  std::atomic<int> warnings_{0};
  std::atomic<std::uint64_t> capture_misses_{0};
};

}  // namespace tuning

PROX_NAMESPACE_END
