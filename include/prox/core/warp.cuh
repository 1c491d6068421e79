// SPDX-License-Identifier: Apache-2.0
//! @file warp.cuh  Warp and block helpers: deterministic reductions, ballot compaction, PDL controls.
#pragma once

#include <cstdint>

#include "config.hpp"

PROX_NAMESPACE_BEGIN

constexpr int kWarpSize = 32;

#if defined(__CUDACC__)

PROX_DEVICE PROX_FORCEINLINE int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }
PROX_DEVICE PROX_FORCEINLINE int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

/**
 * @brief Sum over the lanes of a warp with a fixed xor butterfly: every lane gets the same,
 * bit-reproducible result (the order of additions never depends on timing).
 */
PROX_DEVICE PROX_FORCEINLINE float warp_sum(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

//! Max over the lanes of a warp (xor butterfly): every lane gets it. fmaxf drops NaNs.
PROX_DEVICE PROX_FORCEINLINE float warp_max(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

/**
 * @brief Largest |get(k)| over 0 <= k < n, the lanes of one warp striding by 32; every lane gets it,
 * and `finite` says whether every get(k) was finite. The scale pass of the offline quantizers (one
 * warp per output channel: int4::pack_device, fp8::quantize_device). All lanes must call it.
 */
template <class Get>
PROX_DEVICE PROX_FORCEINLINE float warp_abs_max(const Get& get, int n, bool& finite) {
  float amax = 0.0f;
  bool all_finite = true;
  for (int k = lane_id(); k < n; k += kWarpSize) {
    const float v = get(k);
    all_finite = all_finite && isfinite(v);
    amax = fmaxf(amax, fabsf(v));
  }
  finite = __all_sync(0xffffffffu, all_finite) != 0;
  return warp_max(amax);
}

/**
 * @brief Sum the values of lanes that differ only in lane bits >= `kStride` (kStride a power of two
 * below 32): lanes l and l ^ kStride, l ^ 2 kStride, ... are added with a fixed butterfly.
 * Used when a warp holds several row groups of one tile side by side.
 */
template <int kStride>
PROX_DEVICE PROX_FORCEINLINE float warp_sum_strided(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off >= kStride; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

/**
 * @brief One step of a recursive-halving warp reduction over lane bit `off`: the lane with that bit
 * set keeps the upper `half` of v[0, 2 half), its partner the lower half, and each adds the other's
 * copy of the half it keeps, into v[0, half). Returns true where the upper half was kept. Each sum is
 * own + partner, the pairs of the xor butterfly (a + b and b + a are the same bits).
 * Call it from a loop that unrolls with one induction variable, so that `half` is a constant and
 * every index of v is one (else v goes to the stack).
 */
template <int N>
PROX_DEVICE PROX_FORCEINLINE bool warp_halve(float (&v)[N], int half, int off) {
  const bool upper = (lane_id() & off) != 0;
#pragma unroll
  for (int i = 0; i < half; ++i) {
    const float send = upper ? v[i] : v[i + half];
    const float keep = upper ? v[i + half] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
  }
  return upper;
}

//! warp_halve() with half = Half, Half / 2, ..., 1 over lane bits off, off / 2, ...: warp_sum_many's
//! halvings by compile-time recursion. The batched GLU (16 values) needs it: there warp_sum_many's loop
//! left warp_halve's inner loop rolled and the values on the stack (warp_sum_many keeps its loop: the
//! batch-1 kernels' code stays as measured).
template <int Half, int N>
PROX_DEVICE PROX_FORCEINLINE void warp_halvings(float (&v)[N], int off) {
  if constexpr (Half >= 1) {
    warp_halve(v, Half, off);
    warp_halvings<Half / 2>(v, off / 2);
  }
}

/**
 * @brief Sum each of V values over the warp at once, by recursive halving: at each of the first
 * log2(V) steps a lane keeps half of its values and adds its partner's copy of that half
 * (warp_halve), so the whole reduction takes V - 1 + log2(32 / V) shuffles instead of 5 V. Returns,
 * in lane l, the full sum of value index l / (32 / V). Fixed order: bit-reproducible.
 */
template <int V>
PROX_DEVICE PROX_FORCEINLINE float warp_sum_many(float (&v)[V]) {
  static_assert(V >= 1 && V <= kWarpSize && (V & (V - 1)) == 0, "V must be a power of two <= 32");
#pragma unroll
  for (int half = V / 2, off = kWarpSize / 2; half >= 1; half /= 2, off /= 2) warp_halve(v, half, off);
#pragma unroll
  for (int off = kWarpSize / V / 2; off >= 1; off /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
  return v[0];
}

/**
 * @brief Block-wide stream compaction of kPer items per thread, in order (item i of thread t comes
 * at i * kThreads + t): pos[i] gets the number of flagged items of round i below this thread's,
 * total[i] the round's flagged count. One block barrier for all kPer rounds: every warp publishes
 * its kPer ballot counts at once and each thread adds up the counts below it.
 * @param warp_counts shared scratch of kPer * kThreads/32 ints. Contains one __syncthreads(); every
 *        thread of the block must call it, and the block syncs again before reusing the scratch.
 */
template <int kThreads, int kPer>
PROX_DEVICE PROX_FORCEINLINE void block_compact_positions(const bool (&flag)[kPer], int* warp_counts, int (&pos)[kPer],
                                                          int (&total)[kPer]) {
  static_assert(kThreads % kWarpSize == 0, "block size must be a multiple of 32");
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = lane_id();
  const int warp = warp_id();
  unsigned ballot[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    ballot[i] = __ballot_sync(0xffffffffu, flag[i]);
    if (lane == 0) warp_counts[i * kWarps + warp] = __popc(ballot[i]);
  }
  __syncthreads();
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    int before = 0;
    int sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = warp_counts[i * kWarps + w];
      before += (w < warp) ? c : 0;
      sum += c;
    }
    pos[i] = before + __popc(ballot[i] & below);
    total[i] = sum;
  }
}

/**
 * @brief Append, in order, the flagged items of a block to shared lists: item i of thread t has index
 * `first + i * kThreads + t` and payload val[i]; flagged ones go to out_idx / out_val in index order.
 * Returns the number appended. Used by the input-sparse GEMVs to compact their chunk of x or of the
 * channel mask. One block barrier for all kPer items (block_compact_positions; one compaction step
 * per item took two barriers per item: 8 for the 1024-input chunks of the Stage-1 proxy GEMV).
 * @param warp_scratch shared scratch of kPer * kThreads/32 ints. Contains __syncthreads(); every
 *        thread calls; the caller syncs before reading the lists or reusing the scratch.
 */
template <int kThreads, int kPer>
PROX_DEVICE PROX_FORCEINLINE int block_compact_append(const bool (&flag)[kPer], int first, const float (&val)[kPer],
                                                      int* out_idx, float* out_val, int* warp_scratch) {
  int pos[kPer];
  int total[kPer];
  block_compact_positions<kThreads, kPer>(flag, warp_scratch, pos, total);
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (flag[i]) {
      out_idx[count + pos[i]] = first + i * kThreads + static_cast<int>(threadIdx.x);
      out_val[count + pos[i]] = val[i];
    }
    count += total[i];
  }
  return count;
}

/**
 * @brief Block-wide exclusive prefix sum of one int per thread (fixed order: deterministic).
 * Returns the sum over threads below this one; `*total` gets the block total.
 * @param warp_scratch shared scratch of kThreads/32 ints. Contains __syncthreads(); all threads call.
 */
template <int kThreads>
PROX_DEVICE PROX_FORCEINLINE int block_exclusive_sum(int v, int* warp_scratch, int* total) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = lane_id();
  const int warp = warp_id();
  int incl = v;
#pragma unroll
  for (int off = 1; off < kWarpSize; off <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += n;
  }
  if (lane == kWarpSize - 1) warp_scratch[warp] = incl;
  __syncthreads();
  int before = 0;
  int sum = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int c = warp_scratch[w];
    before += (w < warp) ? c : 0;
    sum += c;
  }
  __syncthreads();
  *total = sum;
  return before + incl - v;
}

//! Programmatic dependent launch: wait until the preceding kernel's memory is visible (sm_90+;
//! a no-op elsewhere or when the kernel was launched without the PDL attribute).
PROX_DEVICE PROX_FORCEINLINE void pdl_wait() {
#if PROX_ARCH_SM90
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

//! Programmatic dependent launch: allow the next kernel in the stream to start launching.
PROX_DEVICE PROX_FORCEINLINE void pdl_launch_dependents() {
#if PROX_ARCH_SM90
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#endif  // __CUDACC__

PROX_NAMESPACE_END
