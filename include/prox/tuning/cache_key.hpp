// SPDX-License-Identifier: Apache-2.0
//! @file cache_key.hpp  The vocabulary of the tuning cache: its constants and modes, density buckets,
//! the key and the entry, the policy table and its hash, the device/build signature, and the capture
//! check of every tuning path.
//!
//! Host-only C++17 (cuda_runtime.h only for the device signature and the capture check). The file
//! format is tuning/cache_file.hpp, the Cache tuning/cache.hpp (which includes both); docs/tuning.md
//! describes the design and the file.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

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

}  // namespace tuning

PROX_NAMESPACE_END
