// SPDX-License-Identifier: Apache-2.0
//! @file threshold.cuh  Op 1: magnitude threshold mask of a vector, |v_i| >= tau, with in-order
//! compaction of the kept coordinates (TEAL-style input sparsity). Stage 1 fuses the same L1
//! predicate; this op exists on its own for callers that want the mask or the compacted list.
//!
//! Semantics (docs/api.md): kept iff |v| >= tau in IEEE float. tau = 0 keeps every non-NaN entry
//! (zeros included); tau = +inf keeps only +-inf; NaN is never kept. tau must be >= 0 and not NaN.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "core/config.hpp"
#include "core/device.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/tune_key.hpp"
#include "core/types.cuh"
#include "core/warp.cuh"
#include "core/workspace.cuh"

PROX_NAMESPACE_BEGIN

// ---------------------------------------------------------------- L1: predicate
//! The one threshold predicate of prox (inputs in Stage 1, channels in Stage 1's epilogue, this op).
PROX_HOST_DEVICE PROX_FORCEINLINE bool keep_magnitude(float v, float tau) {
#if defined(__CUDA_ARCH__)
  return fabsf(v) >= tau;  // NaN compares false: never kept
#else
  return std::fabs(v) >= tau;
#endif
}

//! Host-side validation shared by every op that takes a threshold.
inline bool valid_threshold(float tau) noexcept { return tau >= 0.0f; }  // false for NaN

// ---------------------------------------------------------------- L3 arguments
//! Longest vector the threshold op takes: one block sweeps it, and 2^24 elements keep its int
//! positions and counts far from overflow.
constexpr int kMaxThresholdLength = 1 << 24;

/**
 * @brief Arguments of the threshold op. All pointers are device pointers.
 * @tparam T `__half` or `__nv_bfloat16`.
 */
template <class T>
struct ThresholdArgs {
  const T* x = nullptr;         //!< [n] input vector
  int n = 0;                    //!< length, 1 <= n <= kMaxThresholdLength (2^24)
  float tau = 0.0f;             //!< threshold, >= 0
  std::uint32_t* mask = nullptr;  //!< out [ceil(n/32)]: bit (i % 32) of word i / 32 set iff x_i kept (required)
  int* indices = nullptr;       //!< out [n] (optional): kept coordinates in ascending order
  int* count = nullptr;         //!< out [1] (optional; required with indices): number kept
  T* x_sparse = nullptr;        //!< out [n] (optional): x with dropped coordinates set to +0
};

//! Tile policy of the threshold op (vocabulary: core/policy.hpp): one block sweeps the vector in
//! steps of kThreads x kItems elements; each thread issues the loads of its kItems elements of a step
//! together, so a step costs one memory latency.
template <int Threads, int Items = 1>
struct ThresholdPolicy {
  static constexpr int kThreads = Threads;  //!< threads of the single block
  static constexpr int kItems = Items;      //!< elements per thread and step
  static_assert(Threads % 32 == 0 && Threads <= 1024, "block size");
  static_assert(Items >= 1 && Items <= 32, "items per thread");
  static std::string name() {
    return "thr" + std::to_string(Threads) + (Items > 1 ? "_i" + std::to_string(Items) : std::string());
  }
};

//! Candidates (index 0 is the default). prox-tune on the H100, launches chained with PDL, n = 2048 /
//! 4096 / 5120 (each item per thread costs a compaction round in the one block):
using ThresholdPolicies = PolicyList<ThresholdPolicy<256, 16>,   // 3.1 / 3.3 / 5.0 us
                                     ThresholdPolicy<128, 16>,   // 2.6 / 3.9 / 5.0 us
                                     ThresholdPolicy<256, 32>>;  // 4.7 / 4.9 / 5.0 us

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T>
PROX_KERNEL __launch_bounds__(Policy::kThreads) void threshold_kernel(const ThresholdArgs<T> a) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kItems = Policy::kItems;
  __shared__ int warp_counts[kItems * (kThreads / kWarpSize)];
  pdl_wait();
  pdl_launch_dependents();
  const int tid = static_cast<int>(threadIdx.x);
  int offset = 0;
  for (int base = 0; base < a.n; base += kThreads * kItems) {
    // Item j of thread t is element base + j * kThreads + t: each warp covers whole mask words, and
    // the kept elements of item j precede those of item j + 1 in the compacted order.
    T raw[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = base + j * kThreads + tid;
      raw[j] = i < a.n ? a.x[i] : from_float<T>(0.0f);
    }
    bool keep[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      keep[j] = base + j * kThreads + tid < a.n && keep_magnitude(to_float(raw[j]), a.tau);
    }
    int pos[kItems];
    int total[kItems];
    block_compact_positions<kThreads, kItems>(keep, warp_counts, pos, total);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = base + j * kThreads + tid;
      // The mask word is balloted again here, not kept from the compaction: holding kItems ballots
      // across its barrier took 141 registers instead of 114 at 256 x 16 (a spill at 256 x 32), and
      // the op was 0.15-0.3 us slower on the H100.
      const unsigned word = __ballot_sync(0xffffffffu, keep[j]);
      if (i < a.n) {
        if (lane_id() == 0) a.mask[i / kWarpSize] = word;  // i is a multiple of 32 on lane 0
        if (a.x_sparse != nullptr) a.x_sparse[i] = keep[j] ? raw[j] : from_float<T>(0.0f);
        if (a.indices != nullptr && keep[j]) a.indices[offset + pos[j]] = i;
      }
      offset += total[j];
    }
    __syncthreads();  // warp_counts is written again by the next step
  }
  if (a.count != nullptr && threadIdx.x == 0) *a.count = offset;
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The threshold op as a planned op (drive it with prox::Operator; contract in proxy_gemv.cuh's
 * ProxyGemvOp). One block; no workspace.
 * @code
 * prox::ThresholdArgs<__half> a;  a.x = d_x;  a.n = 4096;  a.tau = tau_x;  a.mask = d_mask;
 * prox::Operator<prox::ThresholdOp<__half>> op;
 * if (op.initialize(a) == prox::Status::kSuccess) op.run(a, nullptr, 0, stream);
 * @endcode
 */
template <class T>
struct ThresholdOp {
  static constexpr const char* kName = "threshold";
  //! Its tuning-cache key (prox/tuning/choose.cuh): its length is d_model; no weights, no activation.
  static constexpr TuneKeyFields kTuneKey{"threshold", DTypeTraits<T>::kName, "-", "-", false};
  using Args = ThresholdArgs<T>;
  using Policies = ThresholdPolicies;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };

  //! Validate arguments without launching. Rules: pointers non-null where required, n in [1, 2^24],
  //! tau >= 0 and not NaN, count given whenever indices is.
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || a.mask == nullptr) return Status::kErrorNullPointer;
    if (a.indices != nullptr && a.count == nullptr) return Status::kErrorNullPointer;
    if (a.n < 1 || a.n > kMaxThresholdLength) return Status::kErrorInvalidShape;
    if (!valid_threshold(a.tau)) return Status::kErrorInvalidThreshold;
    if (!is_aligned(a.x, sizeof(T)) || !is_aligned(a.mask, 4) || !is_aligned(a.indices, 4) ||
        !is_aligned(a.count, 4) || !is_aligned(a.x_sparse, sizeof(T))) {
      return Status::kErrorMisalignedPointer;
    }
    return Status::kSuccess;
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.n == b.n; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }
  //! No workspace.
  static WorkspaceNeeds workspace_needs(const Args&) noexcept { return {}; }

  template <class P>
  static Status configure(const Args&, const Options&, const DeviceInfo&, LaunchConfig* lc) noexcept {
    lc->grid = dim3(1);
    lc->block = dim3(P::kThreads);
    return Status::kSuccess;
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace&, cudaStream_t stream) noexcept {
    return detail::launch_kernel(threshold_kernel<P, T>, lc, stream, a);
  }
};

PROX_NAMESPACE_END
