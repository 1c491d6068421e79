// SPDX-License-Identifier: Apache-2.0
//! @file tune.cuh  The device-side tuner: times every candidate policy of an op for a shape and a
//! density bucket, checks each against policy 0, records the winner in a tuning Cache; and
//! choose<Ffn>(), which turns a SparseFfn configuration into a PolicyChoice by cache lookup.
//!
//! Measurement protocol (docs/tuning.md): synthetic random data at the bucket's density (its upper
//! edge, so every density of the bucket is covered); weights rotated over enough buffers that more
//! than 2 x L2 of touched weight bytes pass between two uses of one buffer (HBM-cold timings, as in
//! decoding); per candidate `warmup` untimed launches, then a delay kernel so the timed launches
//! queue up behind it, then >= 20 reps of `chain` (8) launches, each rep bracketed by CUDA events and
//! the launches chained with PDL as SparseFfn::run launches them; median, p20, p80 of the per-launch
//! mean of each rep.
//! Candidates whose output differs from policy 0 beyond rounding, or that fail to launch, get an
//! infinite time and are never chosen or persisted. Winner: the lowest index within 2% of the best.
//!
//! Ops tuned: threshold, proxy_gemv (INT4 and dense proxies), glu_gemv, down_gemv and the fused
//! Stage 2 glu_down_gemv (what SparseFfn runs by default), each with its own candidate list and keys.
//!
//! Tuning is never capturable: every entry point returns Status::kErrorCapturing when
//! cudaStreamIsCapturing says the stream captures (or cannot tell). It allocates and frees device
//! memory and synchronizes the stream; call it at start-up, before graph capture.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/launch.cuh"
#include "../core/math.hpp"
#include "../core/policy.hpp"
#include "../core/status.hpp"
#include "../core/types.cuh"
#include "../dispatch.hpp"
#include "../down_gemv.cuh"
#include "../glu_down_gemv.cuh"
#include "../glu_gemv.cuh"
#include "../int4_format.hpp"
#include "../proxy_gemv.cuh"
#include "../sparse_ffn.cuh"
#include "../threshold.cuh"
#include "cache.hpp"

PROX_NAMESPACE_BEGIN

namespace tuning {

// ---------------------------------------------------------------- op names, keys, the policy table
constexpr const char* kOpThreshold = "threshold";
constexpr const char* kOpProxyGemv = "proxy_gemv";             //!< INT4 proxy weights
constexpr const char* kOpProxyGemvDense = "proxy_gemv_dense";  //!< fp16/bf16 proxy weights
constexpr const char* kOpGluGemv = "glu_gemv";
constexpr const char* kOpDownGemv = "down_gemv";
constexpr const char* kOpGluDownGemv = "glu_down_gemv";        //!< fused Stage 2 (GLU + down, one grid)

//! Minimum timed reps per candidate.
constexpr int kMinReps = 20;

/**
 * @brief Per proxy-weight format: the op name of its candidate list and the weight tag of keys.
 * @tparam Fmt Int4Weights or DenseWeights<W>.
 */
template <class Fmt>
struct ProxyFormatTraits;

template <>
struct ProxyFormatTraits<Int4Weights> {
  static constexpr const char* kOp = kOpProxyGemv;
  static std::string weights() { return "int4v" + std::to_string(int4::kLayoutVersion); }
};

template <class W>
struct ProxyFormatTraits<DenseWeights<W>> {
  static constexpr const char* kOp = kOpProxyGemvDense;
  static std::string weights() { return DTypeTraits<W>::kName; }
};

/**
 * @brief The candidate names of every op in this build: the table a Cache maps names with and
 * hashes into its file signature.
 */
inline PolicyTable policy_table() {
  return {{kOpThreshold, policy_names<ThresholdPolicies>()},
          {kOpProxyGemv, policy_names<ProxyGemvPolicies>()},
          {kOpProxyGemvDense, policy_names<DenseProxyGemvPolicies>()},
          {kOpGluGemv, policy_names<GluGemvPolicies>()},
          {kOpDownGemv, policy_names<DownGemvPolicies>()},
          {kOpGluDownGemv, policy_names<GluDownGemvPolicies>()}};
}

//! A key from its fields, the density rounded up to its 1/16 bucket (the op key builders below).
inline Key make_key(const char* op, std::string dtype, std::string weights, std::string act, int d_model, int d_ff,
                    double density) {
  Key k;
  k.op = op;
  k.dtype = std::move(dtype);
  k.weights = std::move(weights);
  k.act = std::move(act);
  k.d_model = d_model;
  k.d_ff = d_ff;
  k.density16 = density_bucket(density);
  return k;
}

//! Key of the threshold op on a vector of n elements of T at input density `density`.
template <class T>
Key threshold_key(int n, double density) {
  return make_key(kOpThreshold, DTypeTraits<T>::kName, "-", "-", n, 0, density);
}

//! Key of the Stage-1 proxy GEMV at input density `input_density` (fraction of x kept).
template <class T, class Fmt, class Act>
Key proxy_gemv_key(int d_model, int d_ff, double input_density) {
  return make_key(ProxyFormatTraits<Fmt>::kOp, DTypeTraits<T>::kName, ProxyFormatTraits<Fmt>::weights(), Act::kName,
                  d_model, d_ff, input_density);
}

//! Key of the masked GLU GEMV at selected-channel density `channel_density`.
template <class T, class Act>
Key glu_gemv_key(int d_model, int d_ff, double channel_density) {
  return make_key(kOpGluGemv, DTypeTraits<T>::kName, DTypeTraits<T>::kName, Act::kName, d_model, d_ff, channel_density);
}

//! Key of the sparse down GEMV at selected-channel density `channel_density`.
template <class T>
Key down_gemv_key(int d_model, int d_ff, double channel_density) {
  return make_key(kOpDownGemv, DTypeTraits<T>::kName, DTypeTraits<T>::kName, "-", d_model, d_ff, channel_density);
}

//! Key of the fused Stage-2 GEMV (glu_down_gemv) at selected-channel density `channel_density`.
template <class T, class Act>
Key glu_down_gemv_key(int d_model, int d_ff, double channel_density) {
  return make_key(kOpGluDownGemv, DTypeTraits<T>::kName, DTypeTraits<T>::kName, Act::kName, d_model, d_ff,
                  channel_density);
}

// ---------------------------------------------------------------- caches for devices
/**
 * @brief Make a Cache for `device` (-1: the current one) with this build's policy table and load
 * its file. The cache is returned even if the file was unreadable (status kErrorCacheIo); corrupt
 * or foreign files are ignored with one warning and give kSuccess.
 * @code
 * std::unique_ptr<prox::tuning::Cache> cache;
 * prox::tuning::open_cache(&cache);                       // PROX_AUTOTUNE*, PROX_CACHE_DIR, XDG, HOME
 * @endcode
 */
inline Status open_cache(std::unique_ptr<Cache>* out, const CacheOptions& options = {}, int device = -1) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  try {
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return Status::kErrorNoDevice;
    Signature sig;
    PROX_RETURN_IF_ERROR(query_signature(device, &sig));
    auto cache = std::make_unique<Cache>(sig, policy_table(), options);
    const Status st = cache->load();
    *out = std::move(cache);
    return st;
  } catch (...) {
    return Status::kErrorCacheIo;
  }
}

/**
 * @brief The process-wide cache of the current device, configured from the environment and loaded
 * on first use (one per device; never destroyed before exit; nullptr without a usable device).
 */
inline Cache* default_cache() noexcept {
  try {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
    static std::mutex mutex;
    static std::map<int, std::unique_ptr<Cache>> caches;
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = caches.find(device);
    if (it != caches.end()) return it->second.get();
    std::unique_ptr<Cache> cache;
    const Status st = open_cache(&cache, CacheOptions{}, device);
    if (cache == nullptr) {
      (void)st;
      return nullptr;
    }
    Cache* p = cache.get();
    caches.emplace(device, std::move(cache));
    return p;
  } catch (...) {
    return nullptr;
  }
}

// ---------------------------------------------------------------- options and results
//! How the tuner measures.
struct TuneOptions {
  int warmup = 3;               //!< untimed launches per candidate and round
  int reps = 25;                //!< timed reps per candidate (at least kMinReps), each `chain` launches
  int rounds = 2;               //!< the reps are split into rounds that visit candidates in turn (drift)
  //! Launches per timed rep, back to back between one pair of events and chained with PDL where the
  //! device has it (as SparseFfn::run launches): a rep's time is their mean, so each launch's ramp-up
  //! and tail overlap its neighbours' as in a decoding step's graph. 1 = each launch timed alone.
  int chain = 8;
  double tie_tolerance = kTieTolerance;  //!< near-tie rule
  std::size_t rotate_bytes = 0;          //!< touched weight bytes between two uses of a buffer; 0: 2 x L2
  std::size_t max_rotate_bytes = std::size_t{4} << 30;  //!< cap on the rotation buffers (also <= half the free memory)
  bool verify = true;                    //!< check every candidate's output against policy 0
  std::uint64_t seed = 0x9e3779b97f4a7c15ull;  //!< synthetic data seed
};

//! One candidate's outcome.
struct CandidateResult {
  std::string policy;                  //!< policy name
  Status status = Status::kSuccess;    //!< launch status (kSuccess if it launched)
  bool verified = false;               //!< output matched policy 0 (or verification was off)
  double median_us = HUGE_VAL;         //!< inf if it failed
  double p20_us = HUGE_VAL;
  double p80_us = HUGE_VAL;
  int reps = 0;
  std::string failure;                 //!< why it was rejected ("" if fine)
};

//! What one tuning of one key found.
struct TuneResult {
  Key key;
  std::vector<CandidateResult> candidates;  //!< in list order
  int chosen = -1;                 //!< index of the winner (-1: every candidate failed)
  bool recorded = false;           //!< the cache took the entry (false if the key was already there)
  int rotation_sets = 0;           //!< weight buffers rotated
  std::size_t rotation_bytes = 0;  //!< device bytes of those buffers
};

// ---------------------------------------------------------------- internals
namespace detail {

using ::prox::detail::splitmix64;

//! p[i] = uniform in [lo, hi) from a hash of (seed, i); T is float, __half or __nv_bfloat16.
template <class T>
PROX_KERNEL void tune_fill_kernel(T* __restrict__ p, std::size_t n, std::uint64_t seed, float lo, float hi) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float u = static_cast<float>(splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull)) >> 40) * (1.0f / 16777216.0f);
    const float v = lo + (hi - lo) * u;
    if constexpr (std::is_same<T, float>::value) {
      p[i] = v;
    } else {
      p[i] = from_float<T>(v);
    }
  }
}

//! Random 32-bit words (INT4 proxy weights: every nibble pattern is a valid weight for timing).
//! (Kernels in this header are templates so that several translation units can include it.)
template <int kUnused = 0>
PROX_KERNEL void tune_fill_bits_kernel(std::uint32_t* __restrict__ p, std::size_t n, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = static_cast<std::uint32_t>(splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull)) >> 32);
}

//! Busy-waits `ns` nanoseconds, so the timed launches queue up behind it (launch latency hidden).
template <int kUnused = 0>
PROX_KERNEL void tune_spin_kernel(unsigned long long ns) {
  unsigned long long start = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
  }
}

//! Refuse while `stream` captures (or when capture state cannot be queried, e.g. the legacy stream
//! during another stream's global-mode capture).
inline Status check_not_capturing(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &cs);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::kErrorCapturing;
  }
  return cs == cudaStreamCaptureStatusNone ? Status::kSuccess : Status::kErrorCapturing;
}

inline Status cuda_ok(cudaError_t e) noexcept {
  return e == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
}

//! Owning device allocation (tuning only: allocation happens outside the hot path).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }
  Status alloc(std::size_t bytes) noexcept {
    reset();
    if (bytes == 0) return Status::kSuccess;
    if (cudaMalloc(&p_, bytes) != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();  // out of memory is not sticky; clear it
      return Status::kErrorCudaRuntime;
    }
    bytes_ = bytes;
    return Status::kSuccess;
  }
  void reset() noexcept {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  template <class U>
  U* as() const noexcept {
    return static_cast<U*>(p_);
  }
  char* bytes_ptr() const noexcept { return static_cast<char*>(p_); }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

class EventSet {
 public:
  EventSet() = default;
  EventSet(const EventSet&) = delete;
  EventSet& operator=(const EventSet&) = delete;
  ~EventSet() {
    for (cudaEvent_t e : ev_) cudaEventDestroy(e);
  }
  Status create(std::size_t n) noexcept {
    while (ev_.size() < n) {
      cudaEvent_t e = nullptr;
      if (cudaEventCreate(&e) != cudaSuccess) return Status::kErrorCudaRuntime;
      ev_.push_back(e);
    }
    return Status::kSuccess;
  }
  cudaEvent_t operator[](std::size_t i) const noexcept { return ev_[i]; }

 private:
  std::vector<cudaEvent_t> ev_;
};

template <class T>
Status fill_uniform(T* p, std::size_t n, std::uint64_t seed, float lo, float hi, cudaStream_t stream) noexcept {
  if (n == 0) return Status::kSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(ceil_div<std::size_t>(n, 256), 4096));
  return prox::detail::launch_kernel(tune_fill_kernel<T>, dim3(blocks), dim3(256), 0, stream, LaunchOptions{}, p, n,
                                     seed, lo, hi);
}

inline Status fill_bits(std::uint32_t* p, std::size_t n, std::uint64_t seed, cudaStream_t stream) noexcept {
  if (n == 0) return Status::kSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>(ceil_div<std::size_t>(n, 256), 4096));
  return prox::detail::launch_kernel(tune_fill_bits_kernel<>, dim3(blocks), dim3(256), 0, stream, LaunchOptions{}, p, n,
                                     seed);
}

//! Fill proxy weights of format Fmt (bytes of them) with random data.
template <class Fmt>
struct ProxyFill;
template <>
struct ProxyFill<Int4Weights> {
  static Status fill(void* p, std::size_t bytes, std::uint64_t seed, cudaStream_t s) noexcept {
    return fill_bits(static_cast<std::uint32_t*>(p), bytes / 4, seed, s);
  }
};
template <class W>
struct ProxyFill<DenseWeights<W>> {
  static Status fill(void* p, std::size_t bytes, std::uint64_t seed, cudaStream_t s) noexcept {
    return fill_uniform(static_cast<W*>(p), bytes / sizeof(W), seed, -1.0f, 1.0f, s);
  }
};

template <class T>
Status upload(T* dst, const std::vector<T>& src, cudaStream_t stream) noexcept {
  if (src.empty()) return Status::kSuccess;
  PROX_RETURN_IF_ERROR(
      cuda_ok(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, stream)));
  return cuda_ok(cudaStreamSynchronize(stream));
}

template <class T>
Status download(std::vector<T>* dst, const T* src, std::size_t n, cudaStream_t stream) noexcept {
  dst->resize(n);
  if (n == 0) return Status::kSuccess;
  PROX_RETURN_IF_ERROR(cuda_ok(cudaMemcpyAsync(dst->data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, stream)));
  return cuda_ok(cudaStreamSynchronize(stream));
}

//! Exactly round(density * n) of n positions, chosen at random (sorted ascending).
inline std::vector<int> pick_positions(int n, double density, std::mt19937_64& rng) {
  const int k = static_cast<int>(std::llround(std::min(1.0, std::max(0.0, density)) * n));
  std::vector<int> all(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(k));
  std::sort(all.begin(), all.end());
  return all;
}

//! Threshold between the dropped (|x| < 0.5) and the kept (|x| >= 1) magnitudes of make_input().
constexpr float kInputTau = 0.75f;

//! x with exactly round(density * n) coordinates of magnitude in [1, 2) (kept at kInputTau) and the
//! rest in [0, 0.5) (dropped), random signs.
template <class T>
std::vector<T> make_input(int n, double density, std::mt19937_64& rng) {
  std::vector<T> x(static_cast<std::size_t>(n));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<char> keep(static_cast<std::size_t>(n), 0);
  for (int i : pick_positions(n, density, rng)) keep[static_cast<std::size_t>(i)] = 1;
  for (int i = 0; i < n; ++i) {
    const float mag = keep[static_cast<std::size_t>(i)] ? 1.0f + u(rng) : 0.49f * u(rng);
    x[static_cast<std::size_t>(i)] = from_float<T>(u(rng) < 0.5f ? -mag : mag);
  }
  return x;
}

//! The random generator of a bench's inputs for one cache key: a function of the tuning seed and
//! the key's density bucket, so a re-run draws the same inputs.
inline std::mt19937_64 key_rng(std::uint64_t seed, const Key& key) {
  return std::mt19937_64(seed ^ static_cast<std::uint64_t>(key.density16) * 0x100000001b3ull);
}

//! Channel bitmask [ceil(n/32)] with exactly round(density * n) bits set at random.
inline std::vector<std::uint32_t> make_mask(int n, double density, std::mt19937_64& rng) {
  std::vector<std::uint32_t> m(static_cast<std::size_t>((n + 31) / 32), 0u);
  for (int j : pick_positions(n, density, rng)) m[static_cast<std::size_t>(j / 32)] |= 1u << (j % 32);
  return m;
}

inline bool mask_bit(const std::vector<std::uint32_t>& m, int j) {
  return (m[static_cast<std::size_t>(j / 32)] >> (j % 32)) & 1u;
}

inline std::uint32_t float_bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

//! Bits of a 16-bit element (__half / __nv_bfloat16).
template <class T>
std::uint16_t bits16(const T& v) {
  static_assert(sizeof(T) == 2, "16-bit element type");
  std::uint16_t u;
  std::memcpy(&u, &v, 2);
  return u;
}

//! The Stage-2 benches poison their outputs with all-one bytes: the reason, if policy 0 left a
//! selected channel of s unwritten (empty string otherwise).
inline std::string unwritten_selected_s(const std::vector<std::uint32_t>& m, const std::vector<float>& s, int n) {
  for (int j = 0; j < n; ++j)
    if (mask_bit(m, j) && float_bits(s[static_cast<std::size_t>(j)]) == 0xFFFFFFFFu)
      return "policy 0 did not write selected channel " + std::to_string(j);
  return std::string();
}

//! The same for y: every element must be written.
template <class T>
std::string unwritten_y(const std::vector<T>& y, int n) {
  for (int d = 0; d < n; ++d)
    if (bits16(y[static_cast<std::size_t>(d)]) == 0xFFFFu) return "policy 0 did not write y[" + std::to_string(d) + "]";
  return std::string();
}

//! Buffers to rotate so that >= target touched bytes pass between two uses of one buffer.
inline int rotation_sets(std::size_t set_bytes, std::size_t touched_bytes, const TuneOptions& o, cudaStream_t) {
  constexpr int kMaxSets = 64;
  std::size_t target = o.rotate_bytes;
  if (target == 0) {
    int dev = 0;
    int l2 = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) == cudaSuccess)
      target = 2 * static_cast<std::size_t>(l2);
    else
      target = std::size_t{100} << 20;
  }
  touched_bytes = std::max<std::size_t>(touched_bytes, 4096);
  std::size_t n = touched_bytes >= target ? 1 : ceil_div(target, touched_bytes) + 1;
  std::size_t budget = o.max_rotate_bytes;
  std::size_t free_b = 0;
  std::size_t total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) budget = std::min(budget, free_b / 2);
  else (void)cudaGetLastError();
  const std::size_t fit = set_bytes == 0 ? kMaxSets : std::max<std::size_t>(1, budget / set_bytes);
  n = std::min<std::size_t>({n, fit, static_cast<std::size_t>(kMaxSets)});
  return static_cast<int>(std::max<std::size_t>(n, 1));
}

//! Nearest-rank percentile of sorted values.
inline double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return HUGE_VAL;
  const std::size_t i = static_cast<std::size_t>(std::floor(q * static_cast<double>(sorted.size() - 1) + 0.5));
  return sorted[std::min(i, sorted.size() - 1)];
}

/**
 * @brief Time every verified candidate: per round and candidate, `warmup` launches, a delay
 * kernel, then the timed reps, each `chain` launches bracketed by one pair of events (a rep's time is
 * their mean). `launch(c, set)` launches candidate c on rotation buffer `set`. Fills
 * median/p20/p80/reps of res; a launch failure marks the candidate.
 */
template <class LaunchFn>
Status time_candidates(std::vector<CandidateResult>& res, int nsets, const TuneOptions& o, cudaStream_t stream,
                       LaunchFn&& launch) {
  const int total = std::max(o.reps, kMinReps);
  const int rounds = std::max(1, std::min(o.rounds, total));
  const int per = ceil_div(total, rounds);
  const int chain = std::max(1, o.chain);
  EventSet ev;
  PROX_RETURN_IF_ERROR(ev.create(2 * static_cast<std::size_t>(per)));
  std::vector<std::vector<double>> times(res.size());
  int set = 0;
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t c = 0; c < res.size(); ++c) {
      if (!res[c].verified || res[c].status != Status::kSuccess) continue;
      Status st = Status::kSuccess;
      for (int w = 0; w < o.warmup && st == Status::kSuccess; ++w) st = launch(static_cast<int>(c), set++ % nsets);
      // ~5 us of host work per timed launch: the delay covers the enqueueing of all of them.
      const unsigned long long delay_ns =
          200000ull + 20000ull * static_cast<unsigned long long>(per) * static_cast<unsigned long long>(chain);
      if (st == Status::kSuccess)
        st = prox::detail::launch_kernel(tune_spin_kernel<>, dim3(1), dim3(1), 0, stream, LaunchOptions{}, delay_ns);
      for (int i = 0; i < per && st == Status::kSuccess; ++i) {
        if (cudaEventRecord(ev[2 * static_cast<std::size_t>(i)], stream) != cudaSuccess)
          return Status::kErrorCudaRuntime;
        for (int j = 0; j < chain && st == Status::kSuccess; ++j) st = launch(static_cast<int>(c), set++ % nsets);
        if (cudaEventRecord(ev[2 * static_cast<std::size_t>(i) + 1], stream) != cudaSuccess)
          return Status::kErrorCudaRuntime;
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) return Status::kErrorCudaRuntime;  // a kernel faulted
      if (st != Status::kSuccess) {
        res[c].status = st;
        res[c].failure = std::string("launch failed during timing: ") + to_string(st);
        continue;
      }
      for (int i = 0; i < per; ++i) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, ev[2 * static_cast<std::size_t>(i)], ev[2 * static_cast<std::size_t>(i) + 1]) !=
            cudaSuccess)
          return Status::kErrorCudaRuntime;
        times[c].push_back(1000.0 * static_cast<double>(ms) / chain);
      }
    }
  }
  for (std::size_t c = 0; c < res.size(); ++c) {
    if (!res[c].verified || res[c].status != Status::kSuccess || times[c].empty()) {
      res[c].median_us = res[c].p20_us = res[c].p80_us = HUGE_VAL;
      res[c].reps = 0;
      continue;
    }
    std::sort(times[c].begin(), times[c].end());
    res[c].median_us = percentile(times[c], 0.5);
    res[c].p20_us = percentile(times[c], 0.2);
    res[c].p80_us = percentile(times[c], 0.8);
    res[c].reps = static_cast<int>(times[c].size());
  }
  return Status::kSuccess;
}

//! Pick the winner, record it, fill the TuneResult. Error if candidate 0 (the reference) failed.
inline Status finish(Cache& cache, const Key& key, std::vector<CandidateResult>& res, const TuneOptions& o,
                     TuneResult* out) {
  std::vector<double> medians;
  for (const auto& r : res) medians.push_back(r.median_us);
  const int chosen = choose_index(medians, o.tie_tolerance);
  bool recorded = false;
  if (chosen >= 0) {
    const CandidateResult& w = res[static_cast<std::size_t>(chosen)];
    PROX_RETURN_IF_ERROR(cache.record(key, Entry{w.policy, w.median_us, w.p20_us, w.p80_us, w.reps}, &recorded));
  }
  if (out != nullptr) {
    out->key = key;
    out->candidates = res;
    out->chosen = chosen;
    out->recorded = recorded;
  }
  if (chosen < 0) return res.empty() || res[0].status == Status::kSuccess ? Status::kErrorCudaRuntime : res[0].status;
  return Status::kSuccess;
}

template <class List>
std::vector<CandidateResult> fresh_results() {
  std::vector<CandidateResult> res;
  for (const std::string& n : policy_names<List>()) {
    CandidateResult r;
    r.policy = n;
    res.push_back(std::move(r));
  }
  return res;
}

inline std::string fmt_mismatch(const char* what, int j, double got, double want, double tol) {
  return std::string(what) + "[" + std::to_string(j) + "] = " + std::to_string(got) + ", policy 0 gives " +
         std::to_string(want) + " (tolerance " + std::to_string(tol) + ")";
}

//! GLU output s against policy 0 (glu_gemv and glu_down_gemv): selected channels within rounding
//! (the policies sum the K products in different orders), unselected entries bit for bit (+0 under
//! the "every entry written" contract of GluGemvArgs::s).
inline bool compare_glu_s(const std::vector<float>& ref, const std::vector<float>& s,
                          const std::vector<std::uint32_t>& m, int n, std::string* why) {
  double max_abs = 0.0;
  for (int j = 0; j < n; ++j)
    if (mask_bit(m, j)) max_abs = std::max(max_abs, static_cast<double>(std::fabs(ref[static_cast<std::size_t>(j)])));
  for (int j = 0; j < n; ++j) {
    const float v = s[static_cast<std::size_t>(j)];
    if (!mask_bit(m, j)) {
      if (float_bits(v) != float_bits(ref[static_cast<std::size_t>(j)])) {
        *why = "s[" + std::to_string(j) + "] of an unselected channel is " + std::to_string(v) + ", policy 0 leaves " +
               std::to_string(ref[static_cast<std::size_t>(j)]);
        return false;
      }
      continue;
    }
    const double r = ref[static_cast<std::size_t>(j)];
    const double tol = 4e-3 * std::fabs(r) + 1e-3 * max_abs + 1e-30;
    if (!(std::fabs(static_cast<double>(v) - r) <= tol)) {
      *why = fmt_mismatch("s", j, v, r, tol);
      return false;
    }
  }
  return true;
}

//! Down output y against policy 0 (down_gemv and glu_down_gemv): y is rounded to T once from fp32
//! sums taken in policy-dependent order, so allow a few ulps of T.
template <class T>
bool compare_down_y(const std::vector<T>& ref, const std::vector<T>& y, int n, std::string* why) {
  const double rtol = std::is_same<T, __half>::value ? 4e-3 : 2e-2;
  double max_abs = 0.0;
  for (const T& v : ref) max_abs = std::max(max_abs, static_cast<double>(std::fabs(to_float(v))));
  for (int d = 0; d < n; ++d) {
    const double r = to_float(ref[static_cast<std::size_t>(d)]);
    const double v = to_float(y[static_cast<std::size_t>(d)]);
    const double tol = rtol * std::fabs(r) + 1e-3 * max_abs + 1e-30;
    if (!(std::fabs(v - r) <= tol)) {
      *why = fmt_mismatch("y", d, v, r, tol);
      return false;
    }
  }
  return true;
}

//! Grow the rotation buffer `w` of the exact-weight benches to n sets of set_bytes, filled with
//! uniform [-0.05, 0.05] values of T (`*sets` = sets it holds; a smaller n is already there).
template <class T>
Status ensure_weight_sets(DeviceBuffer& w, int* sets, int n, std::size_t set_bytes, std::uint64_t seed,
                          cudaStream_t stream) {
  if (n <= *sets) return Status::kSuccess;
  w.reset();
  *sets = 0;
  PROX_RETURN_IF_ERROR(w.alloc(static_cast<std::size_t>(n) * set_bytes));
  PROX_RETURN_IF_ERROR(fill_uniform(w.as<T>(), w.bytes() / sizeof(T), seed, -0.05f, 0.05f, stream));
  *sets = n;
  return cuda_ok(cudaStreamSynchronize(stream));
}

/**
 * @brief What every op bench does once its inputs are ready: run each candidate once with its
 * outputs poisoned, keep candidate 0's outputs as the reference and check every other candidate
 * against it, then time all of them over the rotation sets and record the winner.
 * @param check_run  (c) -> Status: run candidate c for the check (rotation set 0)
 * @param launch     (c, set) -> Status: the launch that is timed
 * @param poison     () -> Status: mark the outputs unwritten
 * @param fetch      (is_reference, std::string* why) -> Status: download the outputs, keep them as the
 *                   reference when is_reference; a non-empty *why rejects the candidate (rejecting
 *                   candidate 0 leaves nothing to verify against, so the bench stops there)
 * @param check      (std::string* why) -> bool: the outputs just fetched match the reference
 */
template <class CheckRun, class Launch, class Poison, class Fetch, class Check>
Status verify_time_record(Cache& cache, const Key& key, std::vector<CandidateResult>& res, const TuneOptions& o,
                          cudaStream_t stream, int nsets, std::size_t set_bytes, CheckRun&& check_run, Launch&& launch,
                          Poison&& poison, Fetch&& fetch, Check&& check, TuneResult* out) {
  for (std::size_t c = 0; c < res.size(); ++c) {
    PROX_RETURN_IF_ERROR(poison());
    res[c].status = check_run(static_cast<int>(c));
    if (res[c].status != Status::kSuccess) {
      res[c].failure = std::string("launch failed: ") + to_string(res[c].status);
    } else {
      PROX_RETURN_IF_ERROR(fetch(c == 0, &res[c].failure));
    }
    if (!res[c].failure.empty()) {
      if (c == 0) return finish(cache, key, res, o, out);  // no reference: nothing can be verified
      continue;
    }
    res[c].verified = c == 0 || !o.verify || check(&res[c].failure);
  }
  PROX_RETURN_IF_ERROR(time_candidates(res, nsets, o, stream, launch));
  if (out != nullptr) {
    out->rotation_sets = nsets;
    out->rotation_bytes = static_cast<std::size_t>(nsets) * set_bytes;
  }
  return finish(cache, key, res, o, out);
}

// ---------------------------------------------------------------- per-op benches
//! The launch options SparseFfn::run gives every kernel under the default PlanOptions: PDL where the
//! device has it, the other LaunchOptions left at their defaults. The benches launch their
//! candidates so, which makes the launches of a timed chain (TuneOptions::chain) overlap as in the FFN.
inline Status ffn_launch_options(LaunchOptions* out) {
  DeviceInfo info;
  PROX_RETURN_IF_ERROR(query_device(&info));
  *out = LaunchOptions{};
  out->pdl = SparseFfn<__half>::PlanOptions{}.pdl && info.supports_pdl();
  return Status::kSuccess;
}

//! What every bench keeps: the tuning options, the stream and the FFN's launch options.
class BenchBase {
 protected:
  //! The options and stream, and the launch options of the FFN (ffn_launch_options()).
  Status bind_common(const TuneOptions& o, cudaStream_t stream) noexcept {
    o_ = o;
    stream_ = stream;
    return ffn_launch_options(&launch_opts_);
  }

  TuneOptions o_{};
  cudaStream_t stream_ = nullptr;
  LaunchOptions launch_opts_{};  //!< ffn_launch_options(), set by bind_common()
};

//! Threshold op: no weights (nothing to rotate); outputs mask + indices + count are compared exactly.
template <class T>
class ThresholdBench : BenchBase {
 public:
  using List = ThresholdPolicies;

  Status init(int n, const TuneOptions& o, cudaStream_t stream) noexcept {
    if (n < 1 || n > (1 << 24)) return Status::kErrorInvalidShape;
    n_ = n;
    PROX_RETURN_IF_ERROR(bind_common(o, stream));
    PROX_RETURN_IF_ERROR(x_.alloc(sizeof(T) * static_cast<std::size_t>(n)));
    PROX_RETURN_IF_ERROR(mask_.alloc(sizeof(std::uint32_t) * static_cast<std::size_t>((n + 31) / 32)));
    PROX_RETURN_IF_ERROR(idx_.alloc(sizeof(int) * static_cast<std::size_t>(n)));
    return count_.alloc(sizeof(int));
  }

  Status measure(Cache& cache, double density, TuneResult* out) {
    const Key key = threshold_key<T>(n_, density);
    std::mt19937_64 rng = key_rng(o_.seed, key);
    PROX_RETURN_IF_ERROR(upload(x_.as<T>(), make_input<T>(n_, bucket_density(key.density16), rng), stream_));
    ThresholdArgs<T> a;
    a.x = x_.as<T>();
    a.n = n_;
    a.tau = kInputTau;
    a.mask = mask_.as<std::uint32_t>();
    a.indices = idx_.as<int>();
    a.count = count_.as<int>();
    const auto launch = [&](int c, int) {
      return dispatch_policy<List>(c, [&](auto p) {
        return threshold::launch<decltype(p)>(a, nullptr, stream_, launch_opts_);
      });
    };
    std::vector<CandidateResult> res = fresh_results<List>();
    std::vector<std::uint32_t> ref_mask, mask;
    std::vector<int> ref_idx, idx, ref_count, count;
    const std::size_t words = static_cast<std::size_t>((n_ + 31) / 32);
    const auto poison = [&]() {
      PROX_RETURN_IF_ERROR(cuda_ok(cudaMemsetAsync(mask_.bytes_ptr(), 0xFF, mask_.bytes(), stream_)));
      return cuda_ok(cudaMemsetAsync(count_.bytes_ptr(), 0xFF, count_.bytes(), stream_));
    };
    const auto fetch = [&](bool is_reference, std::string* why) {
      PROX_RETURN_IF_ERROR(download(&mask, mask_.as<std::uint32_t>(), words, stream_));
      PROX_RETURN_IF_ERROR(download(&count, count_.as<int>(), 1, stream_));
      const int kept = count[0];
      if (kept < 0 || kept > n_) {
        *why = "count " + std::to_string(kept) + " out of range";
        return Status::kSuccess;
      }
      PROX_RETURN_IF_ERROR(download(&idx, idx_.as<int>(), static_cast<std::size_t>(kept), stream_));
      if (is_reference) {
        ref_mask = mask;
        ref_idx = idx;
        ref_count = count;
      }
      return Status::kSuccess;
    };
    const auto check = [&](std::string* why) {
      if (count != ref_count) {
        *why = "count " + std::to_string(count[0]) + ", policy 0 gives " + std::to_string(ref_count[0]);
      } else if (mask != ref_mask) {
        *why = "mask differs from policy 0";
      } else if (idx != ref_idx) {
        *why = "indices differ from policy 0";
      }
      return why->empty();
    };
    return verify_time_record(
        cache, key, res, o_, stream_, 1, 0, [&](int c) { return launch(c, 0); }, launch, poison, fetch, check, out);
  }

 private:
  int n_ = 0;
  DeviceBuffer x_, mask_, idx_, count_;
};

//! What the benches that rotate weight sets share: the shape, the options, the stream, the bytes of
//! one weight matrix (256-byte aligned) and how many rotation sets are allocated.
class WeightBenchBase : protected BenchBase {
 protected:
  //! The shape, options and stream, and the launch options of the FFN (BenchBase::bind_common()).
  Status bind(int d_model, int d_ff, std::size_t matrix_bytes, const TuneOptions& o, cudaStream_t stream) noexcept {
    K_ = d_model;
    N_ = d_ff;
    mat_bytes_ = round_up<std::size_t>(matrix_bytes, 256);
    return bind_common(o, stream);
  }

  //! The Stage-2 benches' inputs for `key`: a random channel mask at the key's bucket density (seeded
  //! by the key) into *hmask and uploaded to `mask`, and the rotation sets of `set_bytes` whose
  //! selected rows touch more than 2 x L2 (*nsets).
  Status masked_sets(const Key& key, std::uint32_t* mask, std::size_t set_bytes, std::vector<std::uint32_t>* hmask,
                     int* nsets) {
    const double density = bucket_density(key.density16);
    std::mt19937_64 rng = key_rng(o_.seed, key);
    *hmask = make_mask(N_, density, rng);
    PROX_RETURN_IF_ERROR(upload(mask, *hmask, stream_));
    *nsets = rotation_sets(set_bytes, static_cast<std::size_t>(density * static_cast<double>(set_bytes)), o_, stream_);
    return Status::kSuccess;
  }

  //! The Stage-2 benches' GLU arguments: this shape, x, the channel mask and the s output (the
  //! weights are filled in per rotation set).
  template <class T>
  GluGemvArgs<T> glu_args(const DeviceBuffer& x, const DeviceBuffer& mask, const DeviceBuffer& s) const noexcept {
    GluGemvArgs<T> a;
    a.x = x.as<T>();
    a.d_model = K_;
    a.d_ff = N_;
    a.channel_mask = mask.as<std::uint32_t>();
    a.s = s.as<float>();
    return a;
  }

  int K_ = 0, N_ = 0;
  std::size_t mat_bytes_ = 0;
  int sets_ = 0;
};

//! Stage-1 proxy GEMV: rotated gate/up proxy weights (+ scales); verifies s~ and the channel mask.
template <class T, class Fmt, class Act>
class ProxyBench : WeightBenchBase {
 public:
  using List = typename ProxyPolicyListFor<Fmt>::type;

  Status init(int d_model, int d_ff, const TuneOptions& o, cudaStream_t stream) noexcept {
    PROX_RETURN_IF_ERROR(check_proxy_shape(d_model, d_ff));
    PROX_RETURN_IF_ERROR(bind(d_model, d_ff, static_cast<std::size_t>(d_model) * Fmt::row_bytes(d_ff), o, stream));
    scale_stride_ = round_up<std::size_t>(sizeof(float) * static_cast<std::size_t>(N_), 256);
    PROX_RETURN_IF_ERROR(x_.alloc(sizeof(T) * static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(mask_.alloc(sizeof(std::uint32_t) * static_cast<std::size_t>(N_ / 32)));
    PROX_RETURN_IF_ERROR(s_.alloc(sizeof(float) * static_cast<std::size_t>(N_)));
    ProxyGemvArgs<T> a;
    a.d_model = K_;
    a.d_ff = N_;
    ws_bytes_ = 0;
    for_each_policy<List>([&](auto p, int) {
      ws_bytes_ = std::max(ws_bytes_, proxy_gemv::workspace_bytes<decltype(p)>(a));
    });
    PROX_RETURN_IF_ERROR(ws_.alloc(ws_bytes_));
    // Split-K tile counters start at zero; the kernels leave them zero.
    return cuda_ok(cudaMemsetAsync(ws_.bytes_ptr(), 0, ws_bytes_, stream_));
  }

  Status measure(Cache& cache, double input_density, TuneResult* out) {
    const Key key = proxy_gemv_key<T, Fmt, Act>(K_, N_, input_density);
    const double density = bucket_density(key.density16);
    std::mt19937_64 rng = key_rng(o_.seed, key);
    PROX_RETURN_IF_ERROR(upload(x_.as<T>(), make_input<T>(K_, density, rng), stream_));
    const std::size_t set_bytes = 2 * mat_bytes_ + (Fmt::kNeedsScales ? 2 * scale_stride_ : 0);
    const std::size_t touched = static_cast<std::size_t>(density * 2.0 * static_cast<double>(mat_bytes_)) +
                                (Fmt::kNeedsScales ? 2 * scale_stride_ : 0);
    const int nsets = rotation_sets(set_bytes, touched, o_, stream_);
    PROX_RETURN_IF_ERROR(ensure_sets(nsets));

    ProxyGemvArgs<T> a;
    a.x = x_.as<T>();
    a.d_model = K_;
    a.d_ff = N_;
    a.tau_x = kInputTau;
    a.tau_s = 0.0f;
    a.channel_mask = mask_.as<std::uint32_t>();
    a.s_proxy = nullptr;
    const auto with_set = [&](ProxyGemvArgs<T> b, int set) {
      b.w_gate = w_.bytes_ptr() + (2 * static_cast<std::size_t>(set)) * mat_bytes_;
      b.w_up = w_.bytes_ptr() + (2 * static_cast<std::size_t>(set) + 1) * mat_bytes_;
      if (Fmt::kNeedsScales) {
        b.scale_gate =
            reinterpret_cast<const float*>(sc_.bytes_ptr() + (2 * static_cast<std::size_t>(set)) * scale_stride_);
        b.scale_up =
            reinterpret_cast<const float*>(sc_.bytes_ptr() + (2 * static_cast<std::size_t>(set) + 1) * scale_stride_);
      }
      return b;
    };
    const auto run = [&](const ProxyGemvArgs<T>& b, int c) {
      return dispatch_policy<List>(c, [&](auto p) {
        return proxy_gemv::launch<decltype(p), Fmt, Act>(b, ws_.bytes_ptr(), ws_bytes_, stream_, launch_opts_);
      });
    };
    std::vector<CandidateResult> res = fresh_results<List>();

    // Reference s~ of policy 0, then tau_s = median |s~| so the mask check sees both outcomes.
    {
      ProxyGemvArgs<T> b = with_set(a, 0);
      b.s_proxy = s_.as<float>();
      res[0].status = run(b, 0);
      if (res[0].status != Status::kSuccess) {
        res[0].failure = std::string("launch failed: ") + to_string(res[0].status);
        return finish(cache, key, res, o_, out);
      }
      std::vector<float> s0;
      PROX_RETURN_IF_ERROR(download(&s0, s_.as<float>(), static_cast<std::size_t>(N_), stream_));
      for (float& v : s0) v = std::fabs(v);
      std::nth_element(s0.begin(), s0.begin() + s0.size() / 2, s0.end());
      const float med = s0[s0.size() / 2];
      a.tau_s = std::isfinite(med) ? med : 0.0f;
    }
    std::vector<float> ref_s, s;
    std::vector<std::uint32_t> ref_mask, mask;
    const auto check_run = [&](int c) {  // values mode, so s~ itself is compared
      ProxyGemvArgs<T> b = with_set(a, 0);
      b.s_proxy = s_.as<float>();
      return run(b, c);
    };
    const auto launch = [&](int c, int set) { return run(with_set(a, set), c); };  // timed: mask mode
    const auto poison = [&]() {  // NaN: unwritten
      return cuda_ok(cudaMemsetAsync(s_.bytes_ptr(), 0xFF, s_.bytes(), stream_));
    };
    const auto fetch = [&](bool is_reference, std::string*) {
      PROX_RETURN_IF_ERROR(download(&s, s_.as<float>(), static_cast<std::size_t>(N_), stream_));
      PROX_RETURN_IF_ERROR(download(&mask, mask_.as<std::uint32_t>(), static_cast<std::size_t>(N_ / 32), stream_));
      if (is_reference) {
        ref_s = s;
        ref_mask = mask;
      }
      return Status::kSuccess;
    };
    const auto check = [&](std::string* why) { return compare(ref_s, ref_mask, s, mask, a.tau_s, why); };
    return verify_time_record(cache, key, res, o_, stream_, nsets, set_bytes, check_run, launch, poison, fetch, check,
                              out);
  }

 private:
  //! s~ within rounding of policy 0 (split-K changes the fp32 summation order, and the INT4 format's
  //! fp16 step sums group rows by step, relative 2^-11 per operation); mask bits may differ only where
  //! |s~| is within that rounding of tau_s.
  bool compare(const std::vector<float>& ref_s, const std::vector<std::uint32_t>& ref_mask, const std::vector<float>& s,
               const std::vector<std::uint32_t>& mask, float tau_s, std::string* why) const {
    double max_abs = 0.0;
    for (float v : ref_s) max_abs = std::max(max_abs, static_cast<double>(std::fabs(v)));
    for (int j = 0; j < N_; ++j) {
      const double r = ref_s[static_cast<std::size_t>(j)];
      const double v = s[static_cast<std::size_t>(j)];
      const double tol = 4e-3 * std::fabs(r) + 1e-3 * max_abs + 1e-30;
      if (!(std::fabs(v - r) <= tol)) {
        *why = fmt_mismatch("s~", j, v, r, tol);
        return false;
      }
      if (mask_bit(mask, j) != mask_bit(ref_mask, j) && std::fabs(std::fabs(r) - static_cast<double>(tau_s)) > tol) {
        *why = "channel " + std::to_string(j) + " selected differently from policy 0 away from the threshold (|s~| = " +
               std::to_string(std::fabs(r)) + ", tau_s = " + std::to_string(tau_s) + ")";
        return false;
      }
    }
    return true;
  }

  Status ensure_sets(int n) {
    if (n <= sets_) return Status::kSuccess;
    w_.reset();
    sc_.reset();
    sets_ = 0;
    PROX_RETURN_IF_ERROR(w_.alloc(static_cast<std::size_t>(n) * 2 * mat_bytes_));
    PROX_RETURN_IF_ERROR(ProxyFill<Fmt>::fill(w_.bytes_ptr(), w_.bytes(), o_.seed + 1, stream_));
    if (Fmt::kNeedsScales) {
      PROX_RETURN_IF_ERROR(sc_.alloc(static_cast<std::size_t>(n) * 2 * scale_stride_));
      // Per-channel scales of INT4 weights of magnitude ~0.02 (amax / 7).
      PROX_RETURN_IF_ERROR(
          fill_uniform(sc_.as<float>(), sc_.bytes() / sizeof(float), o_.seed + 2, 0.001f, 0.004f, stream_));
    }
    sets_ = n;
    return cuda_ok(cudaStreamSynchronize(stream_));
  }

  std::size_t scale_stride_ = 0, ws_bytes_ = 0;
  DeviceBuffer x_, mask_, s_, ws_, w_, sc_;
};

//! Masked GLU GEMV: rotated gate/up weights; verifies s of the selected channels within rounding and
//! the unselected entries bit for bit against policy 0.
template <class T, class Act>
class GluBench : WeightBenchBase {
 public:
  using List = GluGemvPolicies;

  Status init(int d_model, int d_ff, const TuneOptions& o, cudaStream_t stream) noexcept {
    PROX_RETURN_IF_ERROR(check_ffn_shape(d_model, d_ff));
    PROX_RETURN_IF_ERROR(
        bind(d_model, d_ff, sizeof(T) * static_cast<std::size_t>(d_model) * static_cast<std::size_t>(d_ff), o, stream));
    PROX_RETURN_IF_ERROR(x_.alloc(sizeof(T) * static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(mask_.alloc(sizeof(std::uint32_t) * static_cast<std::size_t>(N_ / 32)));
    PROX_RETURN_IF_ERROR(s_.alloc(sizeof(float) * static_cast<std::size_t>(N_)));
    // SparseFfn::plan runs the GLU GEMV on SMs x resident blocks (one balanced wave): time it there.
    DeviceInfo info;
    PROX_RETURN_IF_ERROR(query_device(&info));
    sms_ = info.sm_count;
    PROX_RETURN_IF_ERROR(fill_uniform(x_.as<T>(), static_cast<std::size_t>(K_), o_.seed + 3, -1.0f, 1.0f, stream_));
    return cuda_ok(cudaStreamSynchronize(stream_));
  }

  Status measure(Cache& cache, double channel_density, TuneResult* out) {
    const Key key = glu_gemv_key<T, Act>(K_, N_, channel_density);
    const std::size_t set_bytes = 2 * mat_bytes_;
    std::vector<std::uint32_t> hmask;
    int nsets = 0;
    PROX_RETURN_IF_ERROR(masked_sets(key, mask_.as<std::uint32_t>(), set_bytes, &hmask, &nsets));
    PROX_RETURN_IF_ERROR(ensure_sets(nsets));
    const GluGemvArgs<T> a = glu_args<T>(x_, mask_, s_);
    const auto run = [&](int c, int set) {
      GluGemvArgs<T> b = a;
      b.w_gate = reinterpret_cast<const T*>(w_.bytes_ptr() + (2 * static_cast<std::size_t>(set)) * mat_bytes_);
      b.w_up = reinterpret_cast<const T*>(w_.bytes_ptr() + (2 * static_cast<std::size_t>(set) + 1) * mat_bytes_);
      return dispatch_policy<List>(c, [&](auto p) {
        b.grid_blocks = glu_gemv::wave_blocks<decltype(p)>(sms_);  // the grid SparseFfn::plan gives it
        return glu_gemv::launch<decltype(p), Act>(b, nullptr, 0, stream_, launch_opts_);
      });
    };
    std::vector<CandidateResult> res = fresh_results<List>();
    std::vector<float> ref_s, s;
    const auto poison = [&]() { return cuda_ok(cudaMemsetAsync(s_.bytes_ptr(), 0xFF, s_.bytes(), stream_)); };
    const auto fetch = [&](bool is_reference, std::string* why) {
      PROX_RETURN_IF_ERROR(download(&s, s_.as<float>(), static_cast<std::size_t>(N_), stream_));
      if (!is_reference) return Status::kSuccess;
      ref_s = s;
      *why = unwritten_selected_s(hmask, s, N_);  // policy 0 itself must write every selected channel
      return Status::kSuccess;
    };
    const auto check = [&](std::string* why) { return compare_glu_s(ref_s, s, hmask, N_, why); };
    return verify_time_record(
        cache, key, res, o_, stream_, nsets, set_bytes, [&](int c) { return run(c, 0); }, run, poison, fetch, check,
        out);
  }

 private:
  Status ensure_sets(int n) { return ensure_weight_sets<T>(w_, &sets_, n, 2 * mat_bytes_, o_.seed + 4, stream_); }

  int sms_ = 0;
  DeviceBuffer x_, mask_, s_, w_;
};

//! Sparse down GEMV: rotated W_down^T; verifies y within the output type's rounding.
template <class T>
class DownBench : WeightBenchBase {
 public:
  using List = DownGemvPolicies;

  Status init(int d_model, int d_ff, const TuneOptions& o, cudaStream_t stream) noexcept {
    PROX_RETURN_IF_ERROR(check_ffn_shape(d_model, d_ff));
    PROX_RETURN_IF_ERROR(
        bind(d_model, d_ff, sizeof(T) * static_cast<std::size_t>(d_model) * static_cast<std::size_t>(d_ff), o, stream));
    PROX_RETURN_IF_ERROR(s_.alloc(sizeof(float) * static_cast<std::size_t>(N_)));
    PROX_RETURN_IF_ERROR(mask_.alloc(sizeof(std::uint32_t) * static_cast<std::size_t>(N_ / 32)));
    PROX_RETURN_IF_ERROR(y_.alloc(sizeof(T) * static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(fill_uniform(s_.as<float>(), static_cast<std::size_t>(N_), o_.seed + 5, -1.0f, 1.0f, stream_));
    DownGemvArgs<T> a;
    a.d_model = K_;
    a.d_ff = N_;
    ws_bytes_ = 0;
    for_each_policy<List>([&](auto p, int) {
      ws_bytes_ = std::max(ws_bytes_, down_gemv::workspace_bytes<decltype(p)>(a));
    });
    PROX_RETURN_IF_ERROR(ws_.alloc(ws_bytes_));
    PROX_RETURN_IF_ERROR(cuda_ok(cudaMemsetAsync(ws_.bytes_ptr(), 0, ws_bytes_, stream_)));
    return cuda_ok(cudaStreamSynchronize(stream_));
  }

  Status measure(Cache& cache, double channel_density, TuneResult* out) {
    const Key key = down_gemv_key<T>(K_, N_, channel_density);
    const std::size_t set_bytes = mat_bytes_;
    std::vector<std::uint32_t> hmask;
    int nsets = 0;
    PROX_RETURN_IF_ERROR(masked_sets(key, mask_.as<std::uint32_t>(), set_bytes, &hmask, &nsets));
    PROX_RETURN_IF_ERROR(ensure_sets(nsets));
    DownGemvArgs<T> a;
    a.s = s_.as<float>();
    a.channel_mask = mask_.as<std::uint32_t>();
    a.d_model = K_;
    a.d_ff = N_;
    a.y = y_.as<T>();
    const auto run = [&](int c, int set) {
      DownGemvArgs<T> b = a;
      b.w_down_t = reinterpret_cast<const T*>(w_.bytes_ptr() + static_cast<std::size_t>(set) * mat_bytes_);
      return dispatch_policy<List>(c, [&](auto p) {
        return down_gemv::launch<decltype(p)>(b, ws_.bytes_ptr(), ws_bytes_, stream_, launch_opts_);
      });
    };
    std::vector<CandidateResult> res = fresh_results<List>();
    std::vector<T> ref_y, y;
    const auto poison = [&]() {  // NaN: unwritten
      return cuda_ok(cudaMemsetAsync(y_.bytes_ptr(), 0xFF, y_.bytes(), stream_));
    };
    const auto fetch = [&](bool is_reference, std::string* why) {
      PROX_RETURN_IF_ERROR(download(&y, y_.as<T>(), static_cast<std::size_t>(K_), stream_));
      if (!is_reference) return Status::kSuccess;
      ref_y = y;
      *why = unwritten_y(y, K_);  // policy 0 itself must write every element of y
      return Status::kSuccess;
    };
    const auto check = [&](std::string* why) { return compare_down_y(ref_y, y, K_, why); };
    return verify_time_record(
        cache, key, res, o_, stream_, nsets, set_bytes, [&](int c) { return run(c, 0); }, run, poison, fetch, check,
        out);
  }

 private:
  Status ensure_sets(int n) { return ensure_weight_sets<T>(w_, &sets_, n, mat_bytes_, o_.seed + 6, stream_); }

  std::size_t ws_bytes_ = 0;
  DeviceBuffer s_, mask_, y_, ws_, w_;
};


/**
 * @brief Fused Stage 2 (glu_down_gemv) as SparseFfn runs it: every candidate gets the grid plan()
 * gives it (glu_down_gemv::max_grid_blocks: SMs x resident blocks, every block co-resident), one
 * workspace sized for the largest of those grids and zeroed once (prox::initialize_workspace; the
 * kernel leaves its barrier and tile counters ready), and SparseFfn::run's launch options (PDL where
 * the device has it, cooperative). Rotated gate/up/down weights; verifies s like the GLU bench and y
 * like the down bench, against policy 0.
 */
template <class T, class Act>
class GluDownBench : WeightBenchBase {
 public:
  using List = GluDownGemvPolicies;

  //! (May throw std::bad_alloc for its host vectors; run_bench_locked catches it.)
  Status init(int d_model, int d_ff, const TuneOptions& o, cudaStream_t stream) {
    PROX_RETURN_IF_ERROR(check_ffn_shape(d_model, d_ff));
    PROX_RETURN_IF_ERROR(
        bind(d_model, d_ff, sizeof(T) * static_cast<std::size_t>(d_model) * static_cast<std::size_t>(d_ff), o, stream));
    // SparseFfn::plan's grid per policy; a policy the device cannot run keeps its status and fails
    // as a candidate (policy 0 failing stops the bench, as plan() would refuse).
    blocks_.assign(static_cast<std::size_t>(List::kSize), 0);
    grid_status_.assign(static_cast<std::size_t>(List::kSize), Status::kSuccess);
    ws_bytes_ = 0;
    for_each_policy<List>([&](auto p, int i) {
      using P = decltype(p);
      int blocks = 0;
      const Status st = glu_down_gemv::max_grid_blocks<P, Act, T>(&blocks);
      grid_status_[static_cast<std::size_t>(i)] = st;
      if (st != Status::kSuccess) return;
      blocks_[static_cast<std::size_t>(i)] = blocks;
      ws_bytes_ = std::max(ws_bytes_, glu_down_gemv::workspace_bytes<P>(K_, blocks));
    });
    PROX_RETURN_IF_ERROR(x_.alloc(sizeof(T) * static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(mask_.alloc(sizeof(std::uint32_t) * static_cast<std::size_t>(N_ / 32)));
    PROX_RETURN_IF_ERROR(s_.alloc(sizeof(float) * static_cast<std::size_t>(N_)));
    PROX_RETURN_IF_ERROR(y_.alloc(sizeof(T) * static_cast<std::size_t>(K_)));
    PROX_RETURN_IF_ERROR(ws_.alloc(std::max<std::size_t>(ws_bytes_, 256)));
    // Grid barrier and tile counters start at zero; every launch leaves them ready for the next.
    PROX_RETURN_IF_ERROR(initialize_workspace(ws_.bytes_ptr(), ws_.bytes(), stream_));
    PROX_RETURN_IF_ERROR(fill_uniform(x_.as<T>(), static_cast<std::size_t>(K_), o_.seed + 7, -1.0f, 1.0f, stream_));
    return cuda_ok(cudaStreamSynchronize(stream_));
  }

  Status measure(Cache& cache, double channel_density, TuneResult* out) {
    const Key key = glu_down_gemv_key<T, Act>(K_, N_, channel_density);
    const std::size_t set_bytes = 3 * mat_bytes_;  // W_gate, W_up, W_down^T
    std::vector<std::uint32_t> hmask;
    int nsets = 0;
    PROX_RETURN_IF_ERROR(masked_sets(key, mask_.as<std::uint32_t>(), set_bytes, &hmask, &nsets));
    PROX_RETURN_IF_ERROR(ensure_sets(nsets));
    GluDownGemvArgs<T> a;
    static_cast<GluGemvArgs<T>&>(a) = glu_args<T>(x_, mask_, s_);
    a.y = y_.as<T>();
    const auto run = [&](int c, int set) {
      const Status grid = grid_status_[static_cast<std::size_t>(c)];
      if (grid != Status::kSuccess) return grid;
      GluDownGemvArgs<T> b = a;
      const char* base = w_.bytes_ptr() + 3 * static_cast<std::size_t>(set) * mat_bytes_;
      b.w_gate = reinterpret_cast<const T*>(base);
      b.w_up = reinterpret_cast<const T*>(base + mat_bytes_);
      b.w_down_t = reinterpret_cast<const T*>(base + 2 * mat_bytes_);
      b.grid_blocks = blocks_[static_cast<std::size_t>(c)];
      return dispatch_policy<List>(c, [&](auto p) {
        return glu_down_gemv::launch<decltype(p), Act>(b, ws_.bytes_ptr(), ws_.bytes(), stream_, launch_opts_);
      });
    };
    std::vector<CandidateResult> res = fresh_results<List>();
    std::vector<float> ref_s, s;
    std::vector<T> ref_y, y;
    const auto poison = [&]() {  // NaN: unwritten
      PROX_RETURN_IF_ERROR(cuda_ok(cudaMemsetAsync(s_.bytes_ptr(), 0xFF, s_.bytes(), stream_)));
      return cuda_ok(cudaMemsetAsync(y_.bytes_ptr(), 0xFF, y_.bytes(), stream_));
    };
    const auto fetch = [&](bool is_reference, std::string* why) {
      PROX_RETURN_IF_ERROR(download(&s, s_.as<float>(), static_cast<std::size_t>(N_), stream_));
      PROX_RETURN_IF_ERROR(download(&y, y_.as<T>(), static_cast<std::size_t>(K_), stream_));
      if (!is_reference) return Status::kSuccess;
      ref_s = s;
      ref_y = y;
      // Policy 0 itself must write every selected channel of s and every element of y.
      *why = unwritten_selected_s(hmask, s, N_);
      if (why->empty()) *why = unwritten_y(y, K_);
      return Status::kSuccess;
    };
    const auto check = [&](std::string* why) {
      return compare_glu_s(ref_s, s, hmask, N_, why) && compare_down_y(ref_y, y, K_, why);
    };
    return verify_time_record(
        cache, key, res, o_, stream_, nsets, set_bytes, [&](int c) { return run(c, 0); }, run, poison, fetch, check,
        out);
  }

 private:
  Status ensure_sets(int n) { return ensure_weight_sets<T>(w_, &sets_, n, 3 * mat_bytes_, o_.seed + 8, stream_); }

  std::vector<int> blocks_;
  std::vector<Status> grid_status_;
  std::size_t ws_bytes_ = 0;
  DeviceBuffer x_, mask_, s_, y_, ws_, w_;
};

//! Run a bench over densities (deduplicated by bucket). The caller holds cache.tuning_mutex().
template <class Bench, class... InitArgs>
Status run_bench_locked(Cache& cache, const std::vector<double>& densities, cudaStream_t stream, const TuneOptions& o,
                        std::vector<TuneResult>* results, InitArgs... init_args) noexcept {
  try {
    PROX_RETURN_IF_ERROR(check_not_capturing(stream));
    Bench bench;
    PROX_RETURN_IF_ERROR(bench.init(init_args..., o, stream));
    std::vector<int> done;
    for (double d : densities) {
      const int b = density_bucket(d);
      if (std::find(done.begin(), done.end(), b) != done.end()) continue;
      done.push_back(b);
      TuneResult r;
      const Status st = bench.measure(cache, bucket_density(b), &r);
      if (results != nullptr && !r.key.op.empty()) results->push_back(std::move(r));
      PROX_RETURN_IF_ERROR(st);
    }
    return Status::kSuccess;
  } catch (...) {
    (void)cudaGetLastError();
    return Status::kErrorCudaRuntime;  // host allocation failure
  }
}

//! run_bench_locked under the cache's tuning mutex (refuses during capture before locking).
template <class Bench, class... InitArgs>
Status run_bench(Cache& cache, const std::vector<double>& densities, cudaStream_t stream, const TuneOptions& o,
                 std::vector<TuneResult>* results, InitArgs... init_args) noexcept {
  PROX_RETURN_IF_ERROR(check_not_capturing(stream));
  try {
    std::lock_guard<std::mutex> lock(cache.tuning_mutex());
    return run_bench_locked<Bench>(cache, densities, stream, o, results, init_args...);
  } catch (...) {
    return Status::kErrorCudaRuntime;  // std::system_error from the mutex
  }
}

//! run_bench at one density, its result (if any) copied to *result: the single-density tune_* forms.
template <class Bench, class... InitArgs>
Status run_bench_one(Cache& cache, double density, cudaStream_t stream, const TuneOptions& o, TuneResult* result,
                     InitArgs... init_args) noexcept {
  try {
    std::vector<TuneResult> r;
    const Status st = run_bench<Bench>(cache, {density}, stream, o, &r, init_args...);
    if (result != nullptr && !r.empty()) *result = r.front();
    return st;
  } catch (...) {
    return Status::kErrorCudaRuntime;  // std::bad_alloc
  }
}

template <class Ffn>
struct FfnTraits;
template <class T, class Act, class Fmt>
struct FfnTraits<SparseFfn<T, Act, Fmt>> {
  using Type = T;
  using Activation = Act;
  using ProxyFormat = Fmt;
};

//! Index of a cached entry's policy in List (by name), -1 on a miss or an unknown name.
template <class List>
int cached_index(const Cache& cache, const Key& key) {
  const std::optional<Entry> e = cache.find(key);
  if (!e) return -1;
  const std::vector<std::string> names = policy_names<List>();
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == e->policy) return static_cast<int>(i);
  return -1;
}

}  // namespace detail

// ---------------------------------------------------------------- public tuning entry points
/**
 * @brief Tune the threshold op for vectors of n elements of T at input density `density`; record
 * the winner in `cache` (memory; call cache.save() to persist).
 * @param result optional: every candidate's timing and the choice
 * @return kErrorCapturing if `stream` captures; kErrorInvalidShape for a bad n; kErrorCudaRuntime
 *         if allocation or a launch of policy 0 fails.
 */
template <class T>
Status tune_threshold(Cache& cache, int n, double density, cudaStream_t stream, const TuneOptions& options = {},
                      TuneResult* result = nullptr) noexcept {
  return detail::run_bench_one<detail::ThresholdBench<T>>(cache, density, stream, options, result, n);
}

/**
 * @brief Tune the Stage-1 proxy GEMV (`Fmt` = Int4Weights or DenseWeights<W>, activation Act) for
 * shape (d_model, d_ff) at input density `input_density`; record the winner in `cache`.
 * @code
 * prox::tuning::TuneResult r;
 * auto st = prox::tuning::tune_proxy_gemv<__half, prox::Int4Weights, prox::SiLU>(*cache, 4096, 12288, 0.5,
 *                                                                               stream, {}, &r);
 * @endcode
 */
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, double input_density, cudaStream_t stream,
                       const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::run_bench_one<detail::ProxyBench<T, Fmt, Act>>(cache, input_density, stream, options, result, d_model,
                                                                 d_ff);
}

//! Tune the masked GLU GEMV for (d_model, d_ff) at selected-channel density `channel_density`.
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                     const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::run_bench_one<detail::GluBench<T, Act>>(cache, channel_density, stream, options, result, d_model,
                                                         d_ff);
}

//! Tune the sparse down GEMV for (d_model, d_ff) at selected-channel density `channel_density`.
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                      const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::run_bench_one<detail::DownBench<T>>(cache, channel_density, stream, options, result, d_model, d_ff);
}

/**
 * @brief Tune the fused Stage 2 (glu_down_gemv, what SparseFfn runs by default) for (d_model, d_ff)
 * at selected-channel density `channel_density`. Each candidate runs on the grid SparseFfn::plan
 * gives it (SMs x resident blocks, launched cooperatively with the FFN's launch options); s and y are
 * verified against policy 0 with the GLU and down benches' tolerances.
 * @code
 * prox::tuning::TuneResult r;
 * auto st = prox::tuning::tune_glu_down_gemv<__half, prox::SiLU>(*cache, 4096, 12288, 0.3, stream, {}, &r);
 * @endcode
 */
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                          const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::run_bench_one<detail::GluDownBench<T, Act>>(cache, channel_density, stream, options, result, d_model,
                                                              d_ff);
}

/**
 * @brief Multi-density forms: tune one op at several densities (deduplicated by bucket), with its
 * weight buffers allocated once; one TuneResult per bucket is appended to *results (optional).
 * @code
 * std::vector<prox::tuning::TuneResult> rs;
 * prox::tuning::tune_glu_gemv<__half, prox::SiLU>(cache, 4096, 12288, std::vector<double>{0.25, 0.3}, stream, {}, &rs);
 * @endcode
 */
template <class T>
Status tune_threshold(Cache& cache, int n, const std::vector<double>& densities, cudaStream_t stream,
                      const TuneOptions& options = {}, std::vector<TuneResult>* results = nullptr) noexcept {
  return detail::run_bench<detail::ThresholdBench<T>>(cache, densities, stream, options, results, n);
}
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                       cudaStream_t stream, const TuneOptions& options = {},
                       std::vector<TuneResult>* results = nullptr) noexcept {
  return detail::run_bench<detail::ProxyBench<T, Fmt, Act>>(cache, input_densities, stream, options, results, d_model,
                                                            d_ff);
}
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                     cudaStream_t stream, const TuneOptions& options = {},
                     std::vector<TuneResult>* results = nullptr) noexcept {
  return detail::run_bench<detail::GluBench<T, Act>>(cache, channel_densities, stream, options, results, d_model, d_ff);
}
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                      cudaStream_t stream, const TuneOptions& options = {},
                      std::vector<TuneResult>* results = nullptr) noexcept {
  return detail::run_bench<detail::DownBench<T>>(cache, channel_densities, stream, options, results, d_model, d_ff);
}
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                          cudaStream_t stream, const TuneOptions& options = {},
                          std::vector<TuneResult>* results = nullptr) noexcept {
  return detail::run_bench<detail::GluDownBench<T, Act>>(cache, channel_densities, stream, options, results, d_model,
                                                         d_ff);
}

/**
 * @brief Tune the ops of a SparseFfn<T, Act, ProxyFmt> layer shape, for both Stage-2 forms: the
 * proxy GEMV at every input density; the fused Stage 2 (glu_down_gemv, PlanOptions::fuse_stage2 =
 * true, the default) and the separate GLU and down GEMVs (fuse_stage2 = false) at every channel
 * density (each deduplicated by bucket). Weight buffers are allocated once per op and reused across
 * densities. Appends one TuneResult per key to *results (optional), in the order proxy, GLU, down,
 * fused. Records into `cache`; call cache.save() to persist.
 */
template <class Ffn>
Status tune_ffn(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                const std::vector<double>& channel_densities, cudaStream_t stream, const TuneOptions& options = {},
                std::vector<TuneResult>* results = nullptr) noexcept {
  using Tr = detail::FfnTraits<Ffn>;
  using T = typename Tr::Type;
  using Act = typename Tr::Activation;
  using Fmt = typename Tr::ProxyFormat;
  PROX_RETURN_IF_ERROR((detail::run_bench<detail::ProxyBench<T, Fmt, Act>>(cache, input_densities, stream, options,
                                                                           results, d_model, d_ff)));
  PROX_RETURN_IF_ERROR((detail::run_bench<detail::GluBench<T, Act>>(cache, channel_densities, stream, options, results,
                                                                    d_model, d_ff)));
  PROX_RETURN_IF_ERROR(
      detail::run_bench<detail::DownBench<T>>(cache, channel_densities, stream, options, results, d_model, d_ff));
  return detail::run_bench<detail::GluDownBench<T, Act>>(cache, channel_densities, stream, options, results, d_model,
                                                         d_ff);
}

/**
 * @brief The policies for a SparseFfn layer from the tuning cache, for SparseFfn::plan().
 *
 * Fills the fields of the kernels plan() will launch: `proxy` always; with `fuse_stage2` (the
 * default, as PlanOptions::fuse_stage2) `glu_down`, otherwise `glu` and `down`. The other fields stay
 * -1 (plan() launches nothing with them).
 *
 * Mode kOff: every field -1 (plan() uses its defaults). kReadOnly: cached choices, -1 for a miss.
 * kTuneOnMiss: a miss is tuned now (serialized by the cache's tuning mutex, then saved if the
 * cache has a file) unless `stream` captures, in which case it stays -1 and
 * cache.capture_misses() is incremented. Keys: the proxy GEMV at `input_density`; the fused Stage 2,
 * or the GLU and down GEMVs, at `channel_density`; each rounded up to its 1/16 bucket. Cached names
 * are mapped to indices of the compiled candidate lists, so an entry naming a policy this build
 * lacks is a miss.
 *
 * @tparam Ffn SparseFfn<T, Act, ProxyFmt>
 * @param input_density   expected fraction of x kept by tau_x (1 - s1)
 * @param channel_density expected fraction of channels selected by tau_s (1 - s2)
 * @param fuse_stage2     the PlanOptions::fuse_stage2 the plan will use (default: PlanOptions' default)
 * @return kSuccess, or (mode 2 only) the tuner's error; *out is valid (-1s on failure) either way.
 *
 * @code
 * using Ffn = prox::SparseFfn<__half>;
 * Ffn::PlanOptions opts;
 * prox::tuning::choose<Ffn>(*prox::tuning::default_cache(), cfg, 0.30, 0.25, &opts.choice, stream);
 * ffn.plan(cfg, weights, opts);
 * @endcode
 */
template <class Ffn>
Status choose(Cache& cache, const typename Ffn::Config& cfg, double input_density, double channel_density,
              PolicyChoice* out, cudaStream_t stream = nullptr, const TuneOptions& options = {},
              bool fuse_stage2 = typename Ffn::PlanOptions{}.fuse_stage2) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  *out = PolicyChoice{};
  if (cache.mode() == Mode::kOff) return Status::kSuccess;
  using Tr = detail::FfnTraits<Ffn>;
  using T = typename Tr::Type;
  using Act = typename Tr::Activation;
  using Fmt = typename Tr::ProxyFormat;
  const bool fused = fuse_stage2;
  try {
    const Key kp = proxy_gemv_key<T, Fmt, Act>(cfg.d_model, cfg.d_ff, input_density);
    const Key kg = glu_gemv_key<T, Act>(cfg.d_model, cfg.d_ff, channel_density);
    const Key kd = down_gemv_key<T>(cfg.d_model, cfg.d_ff, channel_density);
    const Key kf = glu_down_gemv_key<T, Act>(cfg.d_model, cfg.d_ff, channel_density);
    const auto look = [&] {
      out->proxy = detail::cached_index<typename Ffn::ProxyPolicies>(cache, kp);
      if (fused) {
        out->glu_down = detail::cached_index<typename Ffn::GluDownPolicies>(cache, kf);
      } else {
        out->glu = detail::cached_index<typename Ffn::GluPolicies>(cache, kg);
        out->down = detail::cached_index<typename Ffn::DownPolicies>(cache, kd);
      }
    };
    const auto missing = [&] { return out->proxy < 0 || (fused ? out->glu_down < 0 : out->glu < 0 || out->down < 0); };
    look();
    if (!missing() || cache.mode() != Mode::kTuneOnMiss) return Status::kSuccess;
    if (detail::check_not_capturing(stream) != Status::kSuccess) {
      cache.count_capture_miss();
      return Status::kSuccess;
    }
    // Under the tuning mutex, look again (another thread may have tuned meanwhile) and tune what
    // is still missing: concurrent choose() calls tune a key once.
    std::lock_guard<std::mutex> lock(cache.tuning_mutex());
    look();
    const std::size_t before = cache.size();
    if (out->proxy < 0)
      PROX_RETURN_IF_ERROR((detail::run_bench_locked<detail::ProxyBench<T, Fmt, Act>>(
          cache, {input_density}, stream, options, nullptr, cfg.d_model, cfg.d_ff)));
    if (fused && out->glu_down < 0)
      PROX_RETURN_IF_ERROR((detail::run_bench_locked<detail::GluDownBench<T, Act>>(
          cache, {channel_density}, stream, options, nullptr, cfg.d_model, cfg.d_ff)));
    if (!fused && out->glu < 0)
      PROX_RETURN_IF_ERROR((detail::run_bench_locked<detail::GluBench<T, Act>>(
          cache, {channel_density}, stream, options, nullptr, cfg.d_model, cfg.d_ff)));
    if (!fused && out->down < 0)
      PROX_RETURN_IF_ERROR((detail::run_bench_locked<detail::DownBench<T>>(cache, {channel_density}, stream, options,
                                                                           nullptr, cfg.d_model, cfg.d_ff)));
    look();
    if (cache.size() != before && !cache.path().empty()) (void)cache.save();  // failures warn once
    return Status::kSuccess;
  } catch (...) {
    *out = PolicyChoice{};
    return Status::kErrorCudaRuntime;
  }
}

/**
 * @brief choose() for a whole PlanOptions: reads opts->fuse_stage2 and fills opts->choice, so the
 * choice matches the Stage-2 form the plan will run.
 * @code
 * Ffn::PlanOptions opts;                    // fuse_stage2 = true: proxy + glu_down are chosen
 * prox::tuning::choose<Ffn>(*prox::tuning::default_cache(), cfg, 0.30, 0.233, &opts, stream);
 * ffn.plan(cfg, weights, opts);
 * @endcode
 */
template <class Ffn>
Status choose(Cache& cache, const typename Ffn::Config& cfg, double input_density, double channel_density,
              typename Ffn::PlanOptions* opts, cudaStream_t stream = nullptr,
              const TuneOptions& options = {}) noexcept {
  if (opts == nullptr) return Status::kErrorNullPointer;
  return choose<Ffn>(cache, cfg, input_density, channel_density, &opts->choice, stream, options, opts->fuse_stage2);
}

}  // namespace tuning

PROX_NAMESPACE_END
