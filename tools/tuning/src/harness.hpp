// SPDX-License-Identifier: Apache-2.0
//! @file harness.hpp  What every op's measurement shares and does not depend on the op: device
//! buffers, synthetic host data, the description of a rotation set of weights, the timing loop and
//! the winner's record (harness.cu), and the host-side parallel loop of the float64 references.
//! The per-op part is a TuneIO<Op> (bench.cuh describes the contract).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <prox/core/types.cuh>
#include <prox/tuning/cache.hpp>
#include <prox_support/device_buffer.hpp>
#include <prox_tuning/tune.hpp>
#include <prox_tuning/verify.hpp>
#include <prox_support/parallel.hpp>

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

inline Status cuda_ok(cudaError_t e) noexcept {
  return e == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
}

// ---------------------------------------------------------------- device memory
//! prox_support's owning device allocation. Its alloc() clears the runtime's last error after a failed
//! cudaMalloc, which the tuner reports as a Status: that failure had already replaced any error pending
//! before it, and left there it would be taken for an error of later work by whoever next asks
//! cudaGetLastError (the engine, when the tuner runs on a miss inside it). Sticky errors stay.
using ::prox_support::DeviceBuffer;

//! A DeviceBuffer of `bytes` (the previous allocation freed first), its failure as a Status.
inline Status allocate(DeviceBuffer& buf, std::size_t bytes) noexcept { return cuda_ok(buf.alloc(bytes)); }

//! The fixed inputs and outputs of one bench: typed allocations that live as long as the bench.
class Buffers {
 public:
  template <class U>
  Status alloc(U** out, std::size_t n) {
    bufs_.emplace_back();
    PROX_RETURN_IF_ERROR(allocate(bufs_.back(), sizeof(U) * std::max<std::size_t>(n, 1)));
    *out = bufs_.back().as<U>();
    return Status::kSuccess;
  }

 private:
  std::vector<DeviceBuffer> bufs_;
};

//! Copy host -> device and wait (inputs change between densities, not between launches).
template <class U>
Status upload(U* dst, const std::vector<U>& src, cudaStream_t stream) noexcept {
  if (src.empty()) return Status::kSuccess;
  PROX_RETURN_IF_ERROR(
      cuda_ok(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(U), cudaMemcpyHostToDevice, stream)));
  return cuda_ok(cudaStreamSynchronize(stream));
}

// ---------------------------------------------------------------- synthetic host data
//! Threshold between the dropped (|x| < 0.5) and the kept (|x| >= 1) magnitudes of make_input().
constexpr float kInputTau = 0.75f;

//! The random generator of a bench's inputs for one cache key: a function of the tuning seed and
//! the key's density bucket, so a re-run draws the same inputs.
inline std::mt19937_64 key_rng(std::uint64_t seed, const Key& key) {
  return std::mt19937_64(seed ^ static_cast<std::uint64_t>(key.density16) * 0x100000001b3ull);
}

//! Exactly round(density * n) of n flags set, at random positions.
inline std::vector<std::uint8_t> pick_flags(int n, double density, std::mt19937_64& rng) {
  const int k = static_cast<int>(std::llround(std::min(1.0, std::max(0.0, density)) * n));
  std::vector<int> all(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<std::uint8_t> f(static_cast<std::size_t>(n), 0);
  for (int i = 0; i < k; ++i) f[static_cast<std::size_t>(all[static_cast<std::size_t>(i)])] = 1;
  return f;
}

//! T from a float (round to nearest), host side: prox::from_float, and float itself.
template <class T>
T host_from_float(float v) {
  if constexpr (std::is_same<T, float>::value) {
    return v;
  } else {
    return ::prox::from_float<T>(v);
  }
}

//! A T as a double, host side: prox::to_float, and float itself.
template <class T>
double host_to_double(T v) {
  if constexpr (std::is_same<T, float>::value) {
    return v;
  } else {
    return static_cast<double>(::prox::to_float(v));
  }
}

//! x with exactly round(density * n) coordinates of magnitude in [1, 2) (kept at kInputTau) and the
//! rest in [0, 0.5) (dropped), random signs.
template <class T>
std::vector<T> make_input(int n, double density, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const std::vector<std::uint8_t> keep = pick_flags(n, density, rng);
  std::vector<T> x(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float mag = keep[i] ? 1.0f + u(rng) : 0.49f * u(rng);
    x[i] = host_from_float<T>(u(rng) < 0.5f ? -mag : mag);
  }
  return x;
}

//! n values uniform in [lo, hi), as T.
template <class T>
std::vector<T> uniform_vector(int n, float lo, float hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& e : v) e = host_from_float<T>(u(rng));
  return v;
}

// ---------------------------------------------------------------- weights: one rotation set
//! Element type of a weight matrix.
enum class Elem { kF16, kBF16, kF32, kBits32 };
template <class T>
constexpr Elem elem_of() {
  if constexpr (std::is_same<T, __half>::value) {
    return Elem::kF16;
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return Elem::kBF16;
  } else {
    static_assert(std::is_same<T, float>::value, "weight element type");
    return Elem::kF32;
  }
}

/**
 * @brief Octaves of magnitude the synthetic weights span from row to row (or column to column):
 * each line of a matrix is scaled by 2^-e, e uniform in [0, kMagnitudeOctaves). Outputs then range
 * over orders of magnitude, and so do their rounding bounds (verify.hpp), so a candidate that
 * corrupts a small output is caught. Timing does not depend on the values.
 */
constexpr int kMagnitudeOctaves = 8;

//! Which lines of a matrix share a magnitude (kRows: output channels of [N][K] weights).
enum class Spread { kNone, kRows, kCols };

//! One weight matrix of a rotation set: [rows][cols] elements.
struct WeightSpec {
  Elem elem = Elem::kF16;
  std::size_t rows = 0;
  std::size_t cols = 0;
  float lo = -1.0f;  //!< values uniform in [lo, hi) (kBits32: random bits, lo/hi unused) ...
  float hi = 1.0f;
  Spread spread = Spread::kNone;  //!< ... times 2^-e per line (kMagnitudeOctaves)
  //! The op reads a fraction `density` of the rows (kept inputs, selected channels); else all of it.
  bool rows_by_density = true;
  std::size_t bytes() const noexcept { return rows * cols * (elem == Elem::kF16 || elem == Elem::kBF16 ? 2 : 4); }
};

//! Region alignment of a set's matrices: every op needs 16 bytes; 256 keeps them on separate sectors.
constexpr std::size_t kRegionAlign = 256;

//! Most weight matrices one rotation set holds (Stage 1 with INT4 proxies: gate, up and their scales).
constexpr std::size_t kMaxWeightMatrices = 4;

//! Pointers to the matrices of one rotation set on the device, in WeightSpec order.
struct DeviceSet {
  std::array<const char*, kMaxWeightMatrices> m{};
  template <class U>
  const U* as(std::size_t i) const noexcept {
    return reinterpret_cast<const U*>(m[i]);
  }
};

//! Host copies of rotation set 0's matrices (what the float64 references read).
struct HostSet {
  std::vector<std::vector<unsigned char>> m;
  template <class U>
  const U* as(std::size_t i) const noexcept {
    return reinterpret_cast<const U*>(m[i].data());
  }
};

//! Fill one matrix of `spec` at `p` with its synthetic values (a function of `seed` and the element).
Status fill_weights(void* p, const WeightSpec& spec, std::uint64_t seed, cudaStream_t stream) noexcept;

// ---------------------------------------------------------------- outputs
//! A device output the check reads: poisoned with 0xFF bytes (NaN) before the checked launch.
struct Output {
  void* ptr = nullptr;
  std::size_t bytes = 0;
};

//! Host copies of the outputs of one checked launch, in TuneIO::outputs() order.
struct Fetched {
  std::vector<std::vector<unsigned char>> out;
  template <class U>
  std::vector<U> as(std::size_t i) const {
    std::vector<U> v(out[i].size() / sizeof(U));
    if (!v.empty()) std::memcpy(v.data(), out[i].data(), v.size() * sizeof(U));
    return v;
  }
  //! Output i of T elements as doubles.
  template <class U>
  std::vector<double> as_double(std::size_t i) const {
    const std::vector<U> v = as<U>(i);
    std::vector<double> d(v.size());
    for (std::size_t k = 0; k < v.size(); ++k) d[k] = host_to_double(v[k]);
    return d;
  }
};

// ---------------------------------------------------------------- timing and recording (harness.cu)
//! Launch the delay kernel: it busy-waits `ns` nanoseconds so the timed launches queue up behind it.
Status launch_spin(unsigned long long ns, cudaStream_t stream) noexcept;

//! Rotation sets of `set_bytes` so that >= 2 x L2 (or options.rotate_bytes) touched bytes pass
//! between two uses of one set, at most 64 and within options.max_rotate_bytes and half the free memory.
int rotation_sets(std::size_t set_bytes, std::size_t touched_bytes, const TuneOptions& options) noexcept;

/**
 * @brief Time every verified candidate: per round and candidate, `warmup` launches, the delay
 * kernel, then the timed reps, each `chain` launches bracketed by one pair of events (a rep's time is
 * their mean). `launch(c, set)` launches candidate c on rotation set `set`. Fills median/p20/p80/reps
 * of `res`; a launch failure marks the candidate.
 */
Status time_candidates(std::vector<CandidateResult>& res, int nsets, const TuneOptions& options, cudaStream_t stream,
                       const std::function<Status(int, int)>& launch);

//! Pick the winner (choose_index), record it, fill *out. Error if no candidate is valid.
Status finish(Cache& cache, const Key& key, std::vector<CandidateResult>& res, const TuneOptions& options,
              TuneResult* out);

// ---------------------------------------------------------------- host references
//! The float64 references split over threads (prox_support/parallel.hpp).
using ::prox_support::parallel_for;

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
