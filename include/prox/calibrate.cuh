// SPDX-License-Identifier: Apache-2.0
//! @file calibrate.cuh  Offline threshold calibration on the device: a bounded uniform reservoir of
//! |v| with an exact quantile, a 4096-bin histogram, NaN/Inf accounting, and calibrate_layer(), the
//! paper's per-layer order (tau_x from x, then tau_s from Stage 1's s~ computed with that tau_x).
//!
//! Calibration is offline: finalize() and the read_*() calls synchronize the stream and copy a few
//! bytes to the host. add_samples() is asynchronous. Nothing here allocates device memory: every
//! buffer, CUB's sort storage included, lives in the caller's workspace (ThresholdCalibrator::
//! workspace_bytes()). Semantics are documented in docs/calibration.md.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "allocation.hpp"
#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/warp.cuh"
#include "sparse_ffn.cuh"

PROX_NAMESPACE_BEGIN

namespace calib {

//! Reservoir size per layer and signal (the paper keeps at most 200,000 samples).
constexpr std::size_t kDefaultCapacity = 200000;
//! Samples one internal pass of add_samples() handles; bounds the candidate buffer. 2^18 holds
//! 64 tokens of a 4096-wide x in one pass.
constexpr std::size_t kDefaultChunk = std::size_t(1) << 18;
//! Default seed of the reservoir's sample priorities.
constexpr std::uint64_t kDefaultSeed = 0x70726f7863616c69ull;  // "proxcali"
//! Histogram bins and log2 of it.
constexpr int kHistogramBins = 4096;
constexpr int kHistogramLog2Bins = 12;
//! Smallest histogram range exponent: the range is [0, 2^e) with e >= -126 (so an all-zero or
//! all-subnormal sample set still has a positive range).
constexpr int kMinHistogramExponent = -126;

//! The splitmix64 finalizer (core/math.hpp), a bijection on 64-bit integers.
using ::prox::detail::mix64;

/**
 * @brief Reservoir priority of the sample at global stream position `index` (0-based, counting
 * every sample ever passed to add_samples since the last reset, NaN/Inf included).
 *
 * The reservoir keeps the `capacity` finite samples with the smallest priorities (bottom-k).
 * Priorities depend on the position only, never on the value, so the kept set is a uniform random
 * subset; for a fixed seed distinct positions get distinct priorities (mix64 is a bijection), so
 * the kept set, and therefore the threshold, does not depend on how the stream was split into
 * add_samples() calls or on launch order. ~0 is reserved for empty slots.
 */
PROX_HOST_DEVICE constexpr std::uint64_t sample_priority(std::uint64_t seed, std::uint64_t index) noexcept {
  const std::uint64_t p = mix64(index ^ mix64(seed));
  return p == ~std::uint64_t(0) ? ~std::uint64_t(0) - 1 : p;
}

/**
 * @brief Range exponent e of the histogram for a maximum |v| given as float bits: the smallest e
 * with max|v| < 2^e (at least kMinHistogramExponent). For a finite max, e <= 128.
 */
PROX_HOST_DEVICE constexpr int histogram_exponent(std::uint32_t max_abs_bits) noexcept {
  const int e = static_cast<int>((max_abs_bits >> 23) & 0xFFu) - 126;  // [2^(E-127), 2^(E-126)) -> E - 126
  return e > kMinHistogramExponent ? e : kMinHistogramExponent;
}

/**
 * @brief Bin of a finite magnitude a (0 <= a < 2^e) in the histogram of range [0, 2^e):
 * floor(a * 4096 / 2^e). Exact: a float times a power of two is exact in double, so host and
 * device agree bit for bit.
 */
PROX_HOST_DEVICE inline int histogram_bin(float a, int exponent) noexcept {
  const double scaled = ldexp(static_cast<double>(a), kHistogramLog2Bins - exponent);
  const int b = static_cast<int>(scaled);
  return b < kHistogramBins - 1 ? b : kHistogramBins - 1;  // never taken when a < 2^e; guards rounding misuse
}

//! Reservoir and pass sizes of a ThresholdCalibrator.
struct CalibratorOptions {
  std::size_t capacity = kDefaultCapacity;  //!< reservoir size, 1 .. 2^29
  std::size_t chunk = kDefaultChunk;        //!< samples per internal pass, 1 .. 2^29
  std::uint64_t seed = kDefaultSeed;        //!< seed of sample_priority()
};

//! What finalize() reports (host struct).
struct ThresholdResult {
  float tau = 0.0f;               //!< threshold: a value is kept iff |v| >= tau (NaN never kept)
  double target = 0.0;            //!< requested sparsity s
  double realized = 0.0;          //!< fraction of reservoir samples with |v| < tau
  unsigned long long seen = 0;    //!< samples passed to add_samples() (all kinds)
  unsigned long long finite = 0;  //!< finite samples among them
  unsigned long long nan = 0;     //!< NaN samples (skipped)
  unsigned long long inf = 0;     //!< +-Inf samples (skipped)
  unsigned long long reservoir = 0;  //!< samples in the reservoir: min(finite, capacity)
  float max_abs = 0.0f;           //!< largest finite |v| seen
};

/**
 * @brief The 4096-bin histogram of |v| over every finite sample seen (host struct, ~64 KB: put
 * it on the heap). Bins are linear over [0, hi) with hi = 2^e the smallest power of two greater
 * than max_abs (so max_abs < hi <= 2 max_abs for normal values): bin b counts
 * edges[b] <= |v| < edges[b + 1], edges[b] = b * hi / 4096. A power-of-two range is what lets a
 * one-pass histogram stay exact while max|v| grows: doubling hi merges bin pairs exactly.
 */
struct Histogram {
  double hi = 0.0;                 //!< upper edge of the range, 2^exponent
  int exponent = kMinHistogramExponent;
  float max_abs = 0.0f;            //!< largest finite |v| seen
  unsigned long long total = 0;    //!< sum of counts == number of finite samples
  unsigned long long counts[kHistogramBins] = {};
  double edges[kHistogramBins + 1] = {};
};

namespace detail {

//! Device-resident calibrator state. All-zero bytes are the valid empty state (reset = one memset).
struct CalibState {
  unsigned long long finite;
  unsigned long long nan;
  unsigned long long inf;
  unsigned int max_bits;         //!< bits of max finite |v|: non-negative floats order like their bits
  int exponent_offset;           //!< histogram exponent - kMinHistogramExponent
  unsigned int candidates;       //!< reservoir candidates appended by the current pass
  unsigned int pad;
};

//! finalize()'s device-side answer (quantile, tie extents, next distinct value).
struct SelectResult {
  unsigned int tau_bits;   //!< a[m], or +inf when m == n
  unsigned int next_bits;  //!< smallest value > a[m], or +inf
  int lo;                  //!< #{a < a[m]}
  int hi;                  //!< #{a <= a[m]}
};

constexpr int kScanThreads = 256;
constexpr int kHistThreads = 512;
constexpr int kRescaleThreads = 1024;
constexpr unsigned int kInfBits = 0x7f800000u;

template <class T>
PROX_DEVICE PROX_FORCEINLINE float load_sample(const T* p, std::size_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    return to_float(p[i]);
  }
}

/**
 * @brief Pass 1 over a chunk: count finite / NaN / Inf, track max |v|, and append reservoir
 * candidates (priority below the current reservoir's largest) after the reservoir, at
 * keys/vals[capacity + k]. Candidate order is arbitrary; the sort that follows makes it irrelevant
 * because priorities are distinct.
 */
template <class T>
PROX_KERNEL __launch_bounds__(kScanThreads) void calib_scan_kernel(const T* __restrict__ x, int n,
                                                                   std::uint64_t base_index, std::uint64_t seed,
                                                                   CalibState* st, std::uint64_t* keys, float* vals,
                                                                   int capacity) {
  // The reservoir is sorted by priority: its last slot is the bar a new sample must beat (~0 while
  // the reservoir is not full, so every finite sample is a candidate then).
  const std::uint64_t cutoff = keys[capacity - 1];
  const int lane = lane_id();
  unsigned n_fin = 0, n_nan = 0, n_inf = 0, max_bits = 0;
  const int stride = static_cast<int>(gridDim.x) * kScanThreads;
  // The loop bound is uniform per block, so whole warps take part in every ballot.
  for (int i0 = static_cast<int>(blockIdx.x) * kScanThreads; i0 < n; i0 += stride) {
    const int i = i0 + static_cast<int>(threadIdx.x);
    bool cand = false;
    std::uint64_t prio = 0;
    float a = 0.0f;
    if (i < n) {
      const float v = load_sample(x, static_cast<std::size_t>(i));
      if (isnan(v)) {
        ++n_nan;
      } else if (isinf(v)) {
        ++n_inf;
      } else {
        ++n_fin;
        a = fabsf(v);
        max_bits = max(max_bits, __float_as_uint(a));
        prio = sample_priority(seed, base_index + static_cast<std::uint64_t>(i));
        cand = prio < cutoff;
      }
    }
    // Warp-aggregated append: one atomic per warp, not per sample.
    const unsigned mask = __ballot_sync(0xffffffffu, cand);
    if (mask != 0u) {
      const int leader = __ffs(mask) - 1;
      unsigned pos = 0;
      if (lane == leader) pos = atomicAdd(&st->candidates, static_cast<unsigned>(__popc(mask)));
      pos = __shfl_sync(0xffffffffu, pos, leader);
      if (cand) {
        const std::size_t slot = static_cast<std::size_t>(capacity) + pos + __popc(mask & ((1u << lane) - 1u));
        keys[slot] = prio;
        vals[slot] = a;
      }
    }
  }
  n_fin = __reduce_add_sync(0xffffffffu, n_fin);
  n_nan = __reduce_add_sync(0xffffffffu, n_nan);
  n_inf = __reduce_add_sync(0xffffffffu, n_inf);
  max_bits = __reduce_max_sync(0xffffffffu, max_bits);
  if (lane == 0) {
    if (n_fin != 0u) atomicAdd(&st->finite, static_cast<unsigned long long>(n_fin));
    if (n_nan != 0u) atomicAdd(&st->nan, static_cast<unsigned long long>(n_nan));
    if (n_inf != 0u) atomicAdd(&st->inf, static_cast<unsigned long long>(n_inf));
    if (max_bits != 0u) atomicMax(&st->max_bits, max_bits);
  }
}

/**
 * @brief Grow the histogram range to cover the new max|v|: the range only doubles, and doubling
 * merges bins (2b, 2b+1) into b, so counts stay exact. One block.
 */
//! (A template, like every prox kernel, so that the header can be included by many translation units.)
template <int Bins>
PROX_KERNEL __launch_bounds__(kRescaleThreads) void calib_rescale_kernel(CalibState* st,
                                                                         unsigned long long* hist) {
  static_assert(Bins == kHistogramBins, "one histogram size");
  __shared__ unsigned long long s[Bins];
  const int e_old = st->exponent_offset + kMinHistogramExponent;
  const int e_new = histogram_exponent(st->max_bits);
  if (e_new <= e_old) return;  // uniform across the block
  const int shift = e_new - e_old;
  for (int b = static_cast<int>(threadIdx.x); b < kHistogramBins; b += kRescaleThreads) s[b] = hist[b];
  __syncthreads();
  for (int b = static_cast<int>(threadIdx.x); b < kHistogramBins; b += kRescaleThreads) {
    unsigned long long sum = 0;
    if (shift >= kHistogramLog2Bins) {
      if (b == 0)
        for (int j = 0; j < kHistogramBins; ++j) sum += s[j];
    } else {
      const int first = b << shift;
      const int last = min((b + 1) << shift, kHistogramBins);
      for (int j = first; j < last; ++j) sum += s[j];
    }
    hist[b] = sum;
  }
  if (threadIdx.x == 0) st->exponent_offset = e_new - kMinHistogramExponent;
}

//! Pass 2 over a chunk: bin finite |v| with the (already grown) range; shared-memory counts first.
template <class T>
PROX_KERNEL __launch_bounds__(kHistThreads) void calib_histogram_kernel(const T* __restrict__ x, int n,
                                                                        const CalibState* st,
                                                                        unsigned long long* hist) {
  __shared__ unsigned s[kHistogramBins];
  for (int b = static_cast<int>(threadIdx.x); b < kHistogramBins; b += kHistThreads) s[b] = 0u;
  __syncthreads();
  const int e = st->exponent_offset + kMinHistogramExponent;
  const int stride = static_cast<int>(gridDim.x) * kHistThreads;
  for (int i = static_cast<int>(blockIdx.x) * kHistThreads + static_cast<int>(threadIdx.x); i < n; i += stride) {
    const float v = load_sample(x, static_cast<std::size_t>(i));
    if (isfinite(v)) atomicAdd(&s[histogram_bin(fabsf(v), e)], 1u);
  }
  __syncthreads();
  for (int b = static_cast<int>(threadIdx.x); b < kHistogramBins; b += kHistThreads)
    if (s[b] != 0u) atomicAdd(&hist[b], static_cast<unsigned long long>(s[b]));
}

//! Quantile of the sorted magnitudes (as bits) and the extent of its tie run. One thread: ~2 log2(n) loads.
template <class U>
PROX_KERNEL void calib_select_kernel(const U* __restrict__ a, int n, int m, SelectResult* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  SelectResult r;
  if (m >= n) {
    r.tau_bits = kInfBits;
    r.next_bits = kInfBits;
    r.lo = n;  // every finite sample is below +inf
    r.hi = n;
  } else {
    const U t = a[m];
    int lo = 0, hi = m;  // first index with a[i] >= t, in [0, m]
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (a[mid] < t) lo = mid + 1;
      else hi = mid;
    }
    r.lo = lo;
    lo = m + 1;
    hi = n;  // first index with a[i] > t, in [m + 1, n]
    while (lo < hi) {
      const int mid = lo + (hi - lo) / 2;
      if (a[mid] <= t) lo = mid + 1;
      else hi = mid;
    }
    r.hi = lo;
    r.tau_bits = t;
    r.next_bits = lo < n ? a[lo] : kInfBits;
  }
  *out = r;
}

inline Status cuda_status(cudaError_t e) noexcept {
  return e == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
}

inline float float_from_bits(unsigned int b) noexcept {
  float f;
  static_assert(sizeof(f) == sizeof(b), "float is 32 bits");
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

}  // namespace detail

/**
 * @brief Magnitude-threshold calibrator for one signal (a layer's x, or its s~): streams device
 * samples, keeps a bounded uniform reservoir of |v| and a histogram, and returns the exact
 * quantile of the reservoir for a target sparsity.
 *
 * Threshold rule (kept iff |v| >= tau, as every prox op): with the reservoir's magnitudes sorted
 * a[0..n-1] and target sparsity s, m = floor(s n); tau = a[m], or +inf when m == n. The realized
 * sparsity on the reservoir is #{a < tau} / n, which is (s - 1/n, s] unless ties straddle a[m]
 * (then see finalize()).
 * When n <= capacity the reservoir holds every finite sample, so tau is the exact quantile of the
 * data; beyond, it is the exact quantile of a uniform random subset of `capacity` samples.
 *
 * @code
 * prox::calib::ThresholdCalibrator cal;
 * cal.plan();                                            // capacity 200,000
 * cudaMalloc(&ws, cal.workspace_bytes());
 * cal.init(ws, cal.workspace_bytes(), stream);
 * cal.add_samples(d_x, tokens * d_model, stream);       // __half, __nv_bfloat16 or float
 * prox::calib::ThresholdResult r;
 * if (cal.finalize(0.10, stream, &r) == prox::Status::kSuccess) tau_x = r.tau;
 * @endcode
 *
 * The object holds host bookkeeping and pointers into the caller's workspace; copies share that
 * workspace. One stream at a time.
 */
class ThresholdCalibrator {
 public:
  /**
   * @brief Validate options and size the workspace (queries CUB's sort storage for the current
   * device). kErrorNoDevice without a device; kErrorInvalidArgument for sizes out of range.
   */
  Status plan(const CalibratorOptions& opts = {}) noexcept {
    planned_ = false;
    bound_ = false;
    opts_ = opts;
    constexpr std::size_t kMax = std::size_t(1) << 29;
    if (opts.capacity < 1 || opts.capacity > kMax || opts.chunk < 1 || opts.chunk > kMax)
      return Status::kErrorInvalidArgument;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return Status::kErrorNoDevice;
    const int slots = static_cast<int>(opts.capacity + opts.chunk);
    std::size_t pairs = 0, keys = 0;
    PROX_RETURN_IF_ERROR(query_pairs(slots, &pairs));
    PROX_RETURN_IF_ERROR(query_keys(static_cast<int>(opts.capacity), &keys));
    temp_bytes_ = pairs > keys ? pairs : keys;
    constexpr std::size_t kAlign = 256;
    const std::size_t cap = opts.capacity;
    std::size_t off = 0;
    const auto take = [&](std::size_t bytes) {
      const std::size_t at = off;
      off = round_up(off + bytes, kAlign);
      return at;
    };
    off_state_ = take(sizeof(detail::CalibState));
    off_select_ = take(sizeof(detail::SelectResult));
    off_hist_ = take(sizeof(unsigned long long) * kHistogramBins);
    off_keys_[0] = take(sizeof(std::uint64_t) * static_cast<std::size_t>(slots));
    off_keys_[1] = take(sizeof(std::uint64_t) * static_cast<std::size_t>(slots));
    off_vals_[0] = take(sizeof(float) * static_cast<std::size_t>(slots));
    off_vals_[1] = take(sizeof(float) * static_cast<std::size_t>(slots));
    off_sorted_[0] = take(sizeof(unsigned) * cap);
    off_sorted_[1] = take(sizeof(unsigned) * cap);
    off_temp_ = take(temp_bytes_);
    ws_total_ = off;
    planned_ = true;
    return Status::kSuccess;
  }

  //! Device workspace bytes (valid after plan(), else 0): 24 (capacity + chunk) + 8 capacity bytes
  //! plus CUB's sort storage; about 13 MB with the defaults.
  std::size_t workspace_bytes() const noexcept { return planned_ ? ws_total_ : 0; }
  const CalibratorOptions& options() const noexcept { return opts_; }
  //! Samples passed to add_samples() since the last reset (host count; NaN/Inf included).
  unsigned long long samples_seen() const noexcept { return seen_; }

  /**
   * @brief Bind a workspace (workspace_bytes(), 256-byte aligned as cudaMalloc returns) and reset.
   * Asynchronous.
   */
  Status init(void* workspace, std::size_t bytes, cudaStream_t stream) noexcept {
    if (!planned_) return Status::kErrorNotPlanned;
    if (workspace == nullptr) return Status::kErrorNullPointer;
    if (!is_aligned(workspace, 256)) return Status::kErrorMisalignedPointer;
    if (bytes < ws_total_) return Status::kErrorWorkspaceTooSmall;
    ws_ = static_cast<char*>(workspace);
    bound_ = true;
    return reset(stream);
  }

  //! Forget every sample (state, histogram, reservoir). Asynchronous.
  Status reset(cudaStream_t stream) noexcept {
    if (!bound_) return Status::kErrorNotPlanned;
    seen_ = 0;
    cur_ = 0;
    PROX_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(state(), 0, sizeof(detail::CalibState), stream)));
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cudaMemsetAsync(hist(), 0, sizeof(unsigned long long) * kHistogramBins, stream)));
    // Empty reservoir slots hold priority ~0, which no sample has (sample_priority()), and value 0:
    // the sort moves them with their values, which are thus never read uninitialized.
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cudaMemsetAsync(vals(cur_), 0, sizeof(float) * opts_.capacity, stream)));
    return detail::cuda_status(cudaMemsetAsync(keys(cur_), 0xFF, sizeof(std::uint64_t) * opts_.capacity, stream));
  }

  /**
   * @brief Add n device samples (`__half`, `__nv_bfloat16` or `float`, contiguous). NaN and +-Inf
   * are skipped and counted. Asynchronous (no host synchronization); `samples` must stay valid
   * until the stream has run the work. n == 0 is a no-op.
   */
  template <class T>
  Status add_samples(const T* samples, std::size_t n, cudaStream_t stream) noexcept {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                  "samples are float, __half or __nv_bfloat16");
    if (!bound_) return Status::kErrorNotPlanned;
    if (n == 0) return Status::kSuccess;
    if (samples == nullptr) return Status::kErrorNullPointer;
    if (!is_aligned(samples, sizeof(T))) return Status::kErrorMisalignedPointer;
    const int cap = static_cast<int>(opts_.capacity);
    for (std::size_t done = 0; done < n;) {
      const std::size_t left = n - done;
      const int m = static_cast<int>(left < opts_.chunk ? left : opts_.chunk);
      const T* x = samples + done;
      std::uint64_t* k = keys(cur_);
      float* v = vals(cur_);
      PROX_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(&state()->candidates, 0, sizeof(unsigned), stream)));
      PROX_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemsetAsync(k + cap, 0xFF, sizeof(std::uint64_t) * static_cast<std::size_t>(m), stream)));
      // Candidate slots of skipped (NaN/Inf) samples keep priority ~0 and get a defined value.
      PROX_RETURN_IF_ERROR(
          detail::cuda_status(cudaMemsetAsync(v + cap, 0, sizeof(float) * static_cast<std::size_t>(m), stream)));
      const unsigned scan_blocks = static_cast<unsigned>(min_int(ceil_div(m, detail::kScanThreads * 4), 1024));
      PROX_RETURN_IF_ERROR(prox::detail::launch_kernel(detail::calib_scan_kernel<T>,
                                                       plain_launch(dim3(scan_blocks), dim3(detail::kScanThreads)),
                                                       stream, x, m,
                                                       static_cast<std::uint64_t>(seen_), opts_.seed, state(), k, v,
                                                       cap));
      PROX_RETURN_IF_ERROR(prox::detail::launch_kernel(detail::calib_rescale_kernel<kHistogramBins>,
                                                       plain_launch(dim3(1), dim3(detail::kRescaleThreads)), stream,
                                                       state(), hist()));
      const unsigned hist_blocks = static_cast<unsigned>(min_int(ceil_div(m, detail::kHistThreads * 16), 256));
      PROX_RETURN_IF_ERROR(prox::detail::launch_kernel(detail::calib_histogram_kernel<T>,
                                                       plain_launch(dim3(hist_blocks), dim3(detail::kHistThreads)),
                                                       stream, x, m,
                                                       static_cast<const detail::CalibState*>(state()), hist()));
      // Keep the `cap` smallest priorities of reservoir + candidates (unused candidate slots hold ~0).
      const int items = cap + m;
      std::size_t need = 0;
      PROX_RETURN_IF_ERROR(query_pairs(items, &need));
      if (need > temp_bytes_) return Status::kErrorWorkspaceTooSmall;
      cub::DoubleBuffer<std::uint64_t> kb(keys(cur_), keys(1 - cur_));
      cub::DoubleBuffer<float> vb(vals(cur_), vals(1 - cur_));
      std::size_t temp = temp_bytes_;
      PROX_RETURN_IF_ERROR(detail::cuda_status(
          cub::DeviceRadixSort::SortPairs(ws_ + off_temp_, temp, kb, vb, items, 0, 64, stream)));
      if (kb.selector != vb.selector) return Status::kErrorCudaRuntime;  // CUB keeps them paired
      cur_ = kb.Current() == keys(0) ? 0 : 1;
      seen_ += static_cast<unsigned long long>(m);
      done += static_cast<std::size_t>(m);
    }
    return Status::kSuccess;
  }

  /**
   * @brief Threshold for target sparsity s from the current reservoir. Synchronizes `stream`.
   * May be called repeatedly (other targets) and between add_samples() calls.
   * tau = a[m] (m = floor(s n)), unless ties around a[m] make its realized sparsity miss s by more
   * than tol = max(1/n, 0.01); then the nearer of a[m] (realizing #{a < a[m]} / n) and the next
   * distinct magnitude (realizing #{a <= a[m]} / n) is reported, the lower sparsity when equally far.
   * @return kSuccess; kErrorInvalidTarget for NaN or s outside [0, 1] (out untouched);
   *   kErrorEmptySamples when no finite sample was seen (counts filled); kErrorUnreachableTarget
   *   when even the reported tau misses s by more than tol (out is filled: the nearest achievable).
   */
  Status finalize(double target, cudaStream_t stream, ThresholdResult* out) noexcept {
    if (out == nullptr) return Status::kErrorNullPointer;
    if (!bound_) return Status::kErrorNotPlanned;
    if (!(target >= 0.0) || !(target <= 1.0)) return Status::kErrorInvalidTarget;
    detail::CalibState st{};
    PROX_RETURN_IF_ERROR(read_state(&st, stream));
    ThresholdResult r = counts_of(st);
    r.target = target;
    if (st.finite == 0) {
      r.tau = detail::float_from_bits(detail::kInfBits);
      r.realized = 0.0;
      *out = r;
      return Status::kErrorEmptySamples;
    }
    const int n = static_cast<int>(r.reservoir);
    // floor(s n) in double: exact for n < 2^29 up to the rounding of s itself.
    long long m = static_cast<long long>(std::floor(target * static_cast<double>(n)));
    if (m > n) m = n;
    if (m < 0) m = 0;
    unsigned* s0 = sorted(0);
    unsigned* s1 = sorted(1);
    // The reservoir's first n slots are its samples (sorted by priority); copy, then sort magnitudes.
    PROX_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpyAsync(
        s0, vals(cur_), sizeof(unsigned) * static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice, stream)));
    std::size_t need = 0;
    PROX_RETURN_IF_ERROR(query_keys(n, &need));
    if (need > temp_bytes_) return Status::kErrorWorkspaceTooSmall;
    cub::DoubleBuffer<unsigned> db(s0, s1);
    std::size_t temp = temp_bytes_;
    // Non-negative floats sort like their bit patterns: an integer radix sort on 32 bits.
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cub::DeviceRadixSort::SortKeys(ws_ + off_temp_, temp, db, n, 0, 32, stream)));
    auto* sel = reinterpret_cast<detail::SelectResult*>(ws_ + off_select_);
    PROX_RETURN_IF_ERROR(prox::detail::launch_kernel(
        detail::calib_select_kernel<unsigned>, plain_launch(dim3(1), dim3(32)), stream,
        static_cast<const unsigned*>(db.Current()), n, static_cast<int>(m), sel));
    detail::SelectResult h{};
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cudaMemcpyAsync(&h, sel, sizeof(h), cudaMemcpyDeviceToHost, stream)));
    PROX_RETURN_IF_ERROR(detail::cuda_status(cudaStreamSynchronize(stream)));
    const double dn = static_cast<double>(n);
    const double tol = 1.0 / dn > 0.01 ? 1.0 / dn : 0.01;
    r.tau = detail::float_from_bits(h.tau_bits);
    r.realized = static_cast<double>(h.lo) / dn;
    if (std::fabs(r.realized - target) > tol) {
      // Ties straddle a[m]: any tau in (a[m], next] realizes hi / n instead. Take the nearer one
      // (the lower sparsity when equally far: keeping more is the safer error).
      const double alt = static_cast<double>(h.hi) / dn;
      if (std::fabs(alt - target) < std::fabs(r.realized - target)) {
        r.tau = detail::float_from_bits(h.next_bits);
        r.realized = alt;
      }
    }
    *out = r;
    return std::fabs(r.realized - target) > tol ? Status::kErrorUnreachableTarget : Status::kSuccess;
  }

  //! Copy the histogram to the host. Synchronizes `stream`.
  Status read_histogram(Histogram* out, cudaStream_t stream) noexcept {
    if (out == nullptr) return Status::kErrorNullPointer;
    if (!bound_) return Status::kErrorNotPlanned;
    detail::CalibState st{};
    PROX_RETURN_IF_ERROR(detail::cuda_status(
        cudaMemcpyAsync(out->counts, hist(), sizeof(out->counts), cudaMemcpyDeviceToHost, stream)));
    PROX_RETURN_IF_ERROR(read_state(&st, stream));
    out->exponent = st.exponent_offset + kMinHistogramExponent;
    out->hi = std::ldexp(1.0, out->exponent);
    out->max_abs = detail::float_from_bits(st.max_bits);
    out->total = 0;
    for (int b = 0; b < kHistogramBins; ++b) {
      out->total += out->counts[b];
      out->edges[b] = std::ldexp(static_cast<double>(b), out->exponent - kHistogramLog2Bins);
    }
    out->edges[kHistogramBins] = out->hi;
    return Status::kSuccess;
  }

  /**
   * @brief Copy the reservoir's magnitudes to the host (in priority order, not sorted).
   * Synchronizes `stream`. `host` holds `host_capacity` floats; *count gets min(finite, capacity);
   * kErrorInvalidArgument (nothing copied) when host_capacity < *count.
   */
  Status read_reservoir(float* host, std::size_t host_capacity, std::size_t* count, cudaStream_t stream) noexcept {
    if (host == nullptr || count == nullptr) return Status::kErrorNullPointer;
    if (!bound_) return Status::kErrorNotPlanned;
    detail::CalibState st{};
    PROX_RETURN_IF_ERROR(read_state(&st, stream));
    const std::size_t n = st.finite < opts_.capacity ? static_cast<std::size_t>(st.finite) : opts_.capacity;
    *count = n;
    if (host_capacity < n) return Status::kErrorInvalidArgument;
    if (n == 0) return Status::kSuccess;
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cudaMemcpyAsync(host, vals(cur_), sizeof(float) * n, cudaMemcpyDeviceToHost, stream)));
    return detail::cuda_status(cudaStreamSynchronize(stream));
  }

 private:
  static int min_int(int a, int b) noexcept { return a < b ? a : b; }

  static Status query_pairs(int items, std::size_t* bytes) noexcept {
    cub::DoubleBuffer<std::uint64_t> kb(nullptr, nullptr);
    cub::DoubleBuffer<float> vb(nullptr, nullptr);
    return detail::cuda_status(cub::DeviceRadixSort::SortPairs(nullptr, *bytes, kb, vb, items, 0, 64));
  }
  static Status query_keys(int items, std::size_t* bytes) noexcept {
    cub::DoubleBuffer<unsigned> db(nullptr, nullptr);
    return detail::cuda_status(cub::DeviceRadixSort::SortKeys(nullptr, *bytes, db, items, 0, 32));
  }

  Status read_state(detail::CalibState* h, cudaStream_t stream) noexcept {
    PROX_RETURN_IF_ERROR(
        detail::cuda_status(cudaMemcpyAsync(h, state(), sizeof(*h), cudaMemcpyDeviceToHost, stream)));
    return detail::cuda_status(cudaStreamSynchronize(stream));
  }

  ThresholdResult counts_of(const detail::CalibState& st) const noexcept {
    ThresholdResult r;
    r.seen = seen_;
    r.finite = st.finite;
    r.nan = st.nan;
    r.inf = st.inf;
    r.reservoir = st.finite < opts_.capacity ? st.finite : opts_.capacity;
    r.max_abs = detail::float_from_bits(st.max_bits);
    return r;
  }

  detail::CalibState* state() const noexcept { return reinterpret_cast<detail::CalibState*>(ws_ + off_state_); }
  unsigned long long* hist() const noexcept { return reinterpret_cast<unsigned long long*>(ws_ + off_hist_); }
  std::uint64_t* keys(int i) const noexcept { return reinterpret_cast<std::uint64_t*>(ws_ + off_keys_[i]); }
  float* vals(int i) const noexcept { return reinterpret_cast<float*>(ws_ + off_vals_[i]); }
  unsigned* sorted(int i) const noexcept { return reinterpret_cast<unsigned*>(ws_ + off_sorted_[i]); }

  CalibratorOptions opts_{};
  bool planned_ = false;
  bool bound_ = false;
  char* ws_ = nullptr;
  int cur_ = 0;  //!< which key/value buffer holds the reservoir (CUB's DoubleBuffer selector)
  unsigned long long seen_ = 0;
  std::size_t temp_bytes_ = 0, ws_total_ = 0;
  std::size_t off_state_ = 0, off_select_ = 0, off_hist_ = 0, off_temp_ = 0;
  std::size_t off_keys_[2] = {0, 0}, off_vals_[2] = {0, 0}, off_sorted_[2] = {0, 0};
};

// ---------------------------------------------------------------- one layer, the paper's order

//! Which signal calibrate_layer() is working on (progress reports).
enum class CalibrationStage : int { kInputs = 0, kProxy = 1 };

//! Progress callback: called on the calling thread after the stream has finished the work reported.
using ProgressFn = void (*)(CalibrationStage stage, int done_tokens, int total_tokens, void* user);

/**
 * @brief Arguments of calibrate_layer(). Device pointers unless noted.
 * @tparam T `__half` or `__nv_bfloat16`
 */
template <class T>
struct LayerCalibrationArgs {
  const T* x = nullptr;      //!< [tokens][d_model] row-major FFN inputs of this layer, 16-byte aligned
  int tokens = 0;            //!< calibration tokens, >= 1
  StageSparsity target{};    //!< (s1, s2), e.g. from allocate_sparsity(e)
  void* ffn_workspace = nullptr;       //!< ffn.workspace_bytes(), zeroed once before first use
  std::size_t ffn_workspace_bytes = 0;
  float* s_proxy = nullptr;  //!< [batch_tokens][d_ff] float scratch for s~
  int batch_tokens = 1;      //!< tokens of s~ per add_samples() (fewer, larger sorts)
  Histogram* histogram_x = nullptr;  //!< host, optional: histogram of x
  Histogram* histogram_s = nullptr;  //!< host, optional: histogram of s~
  ProgressFn progress = nullptr;     //!< optional (synchronizes the stream before each call)
  void* progress_user = nullptr;
};

//! Result of calibrate_layer() (host).
struct LayerCalibration {
  float tau_x = 0.0f;
  float tau_s = 0.0f;
  ThresholdResult x{};  //!< tau_x's calibration (on x)
  ThresholdResult s{};  //!< tau_s's calibration (on s~ computed with tau_x)
};

/**
 * @brief Calibrate one layer in the paper's order (appendix, "Sequential threshold calibration"):
 * 1. tau_x = quantile of |x| at s1 over every sample of the layer's inputs;
 * 2. re-plan `ffn` with tau_x and run Stage 1 in values mode on each token: s~ with the input mask;
 * 3. tau_s = quantile of |s~| at s2;  4. re-plan `ffn` with (tau_x, tau_s).
 * `cal` is reset and reused for both signals (its state afterwards is s~'s).
 *
 * `ffn` must be planned (any thresholds); re-plans keep every plan option (ffn.plan_options(): the
 * policies, fusion, clusters, spread, PDL, cooperative launch). A Config::thresholds pointer is kept
 * for the final plan, and the caller writes the calibrated values there. The workspace is
 * initialized here (initialize_workspace). Synchronizes `stream` (finalize). Allocates nothing.
 * @return kSuccess; kErrorUnreachableTarget when a target was not met within max(1/n, 0.01):
 *   both thresholds are then still computed (nearest achievable), `out` is filled and `ffn` is
 *   planned with them, so the caller decides whether to accept; any other error stops early.
 * @code
 * prox::StageSparsity st; prox::allocate_sparsity(0.5, &st);
 * prox::calib::LayerCalibrationArgs<__half> a{d_x, tokens, st, d_ws, ffn.workspace_bytes(), d_s, 16};
 * prox::calib::LayerCalibration lc;
 * auto status = prox::calib::calibrate_layer(ffn, weights, a, cal, stream, &lc);
 * @endcode
 */
template <class T, class Act, class ProxyFmt>
Status calibrate_layer(SparseFfn<T, Act, ProxyFmt>& ffn, const typename SparseFfn<T, Act, ProxyFmt>::Weights& w,
                       const LayerCalibrationArgs<T>& a, ThresholdCalibrator& cal, cudaStream_t stream,
                       LayerCalibration* out) noexcept {
  using Ffn = SparseFfn<T, Act, ProxyFmt>;
  if (out == nullptr || a.x == nullptr || a.s_proxy == nullptr || a.ffn_workspace == nullptr)
    return Status::kErrorNullPointer;
  if (!ffn.planned()) return Status::kErrorNotPlanned;
  if (a.tokens < 1 || a.batch_tokens < 1) return Status::kErrorInvalidShape;
  if (!(a.target.s1 >= 0.0) || !(a.target.s1 <= 1.0) || !(a.target.s2 >= 0.0) || !(a.target.s2 <= 1.0))
    return Status::kErrorInvalidTarget;
  if (a.ffn_workspace_bytes < ffn.workspace_bytes()) return Status::kErrorWorkspaceTooSmall;
  if (!is_aligned(a.x, 16) || !is_aligned(a.s_proxy, 4)) return Status::kErrorMisalignedPointer;
  const typename Ffn::Config cfg0 = ffn.config();
  const int K = cfg0.d_model;
  const int N = cfg0.d_ff;
  // Re-plans keep every plan option (policies, fusion, clusters, spread, PDL, cooperative launch);
  // only the thresholds change. Step 2 runs on the scalar tau_x (a device-threshold pointer would
  // override it); the final plan keeps the caller's pointer, whose values the caller sets to *out.
  const typename Ffn::PlanOptions opts = ffn.plan_options();
  const auto with_taus = [&](float tau_x, float tau_s, const float* thresholds) {
    typename Ffn::Config c = cfg0;
    c.tau_x = tau_x;
    c.tau_s = tau_s;
    c.thresholds = thresholds;
    return c;
  };
  // The workspace is this call's for its duration: initialized here, so a workspace the caller never
  // initialized cannot turn s~ into the NaNs of a not-ready workspace (core/workspace.cuh).
  PROX_RETURN_IF_ERROR(initialize_workspace(a.ffn_workspace, a.ffn_workspace_bytes, stream));

  // 1. tau_x from every input sample of the layer.
  PROX_RETURN_IF_ERROR(cal.reset(stream));
  PROX_RETURN_IF_ERROR(cal.add_samples(a.x, static_cast<std::size_t>(a.tokens) * K, stream));
  const Status st_x = cal.finalize(a.target.s1, stream, &out->x);
  if (st_x != Status::kSuccess && st_x != Status::kErrorUnreachableTarget) return st_x;
  out->tau_x = out->x.tau;
  if (a.histogram_x != nullptr) PROX_RETURN_IF_ERROR(cal.read_histogram(a.histogram_x, stream));
  if (a.progress != nullptr) a.progress(CalibrationStage::kInputs, a.tokens, a.tokens, a.progress_user);

  // 2. s~ with the finalized input mask: Stage 1's values mode under the new tau_x.
  PROX_RETURN_IF_ERROR(ffn.plan(with_taus(out->tau_x, cfg0.tau_s, nullptr), w, opts));
  PROX_RETURN_IF_ERROR(cal.reset(stream));
  for (int t0 = 0; t0 < a.tokens; t0 += a.batch_tokens) {
    const int nb = a.tokens - t0 < a.batch_tokens ? a.tokens - t0 : a.batch_tokens;
    for (int b = 0; b < nb; ++b) {
      const T* xt = a.x + static_cast<std::size_t>(t0 + b) * K;
      PROX_RETURN_IF_ERROR(ffn.run_proxy_values(xt, a.s_proxy + static_cast<std::size_t>(b) * N, a.ffn_workspace,
                                                a.ffn_workspace_bytes, stream));
    }
    PROX_RETURN_IF_ERROR(
        cal.add_samples(static_cast<const float*>(a.s_proxy), static_cast<std::size_t>(nb) * N, stream));
    if (a.progress != nullptr) {
      PROX_RETURN_IF_ERROR(detail::cuda_status(cudaStreamSynchronize(stream)));
      a.progress(CalibrationStage::kProxy, t0 + nb, a.tokens, a.progress_user);
    }
  }

  // 3. tau_s, then the final plan.
  const Status st_s = cal.finalize(a.target.s2, stream, &out->s);
  if (st_s != Status::kSuccess && st_s != Status::kErrorUnreachableTarget) return st_s;
  out->tau_s = out->s.tau;
  if (a.histogram_s != nullptr) PROX_RETURN_IF_ERROR(cal.read_histogram(a.histogram_s, stream));
  PROX_RETURN_IF_ERROR(ffn.plan(with_taus(out->tau_x, out->tau_s, cfg0.thresholds), w, opts));
  return st_x != Status::kSuccess ? st_x : st_s;
}

}  // namespace calib

PROX_NAMESPACE_END
