// SPDX-License-Identifier: Apache-2.0
//! @file tile_reduce.cuh  L1 building block shared by the input-sparse GEMVs (Stage 1 proxy, Stage 2
//! down): reduce a column tile's per-thread accumulators over the block's row groups, then combine
//! the split-K blocks of the tile with a deterministic serial reduction ("last block finishes").
#pragma once

#include <cstdint>

#include "../core/config.hpp"
#include "../core/warp.cuh"

PROX_NAMESPACE_BEGIN
namespace detail {

#if defined(__CUDACC__)

/**
 * @brief Reduction of a tile of kMats x (kTn * kCpv) column sums over a block.
 * @tparam kThreads threads per block; thread t owns column slot t % kTn (kCpv consecutive columns)
 *         and row group t / kTn.
 * @tparam kTn      threads along the columns; a power of two <= 32, so a warp holds 32/kTn row groups.
 * @tparam kCpv     columns per thread (one 16-byte weight piece).
 * @tparam kMats    matrices reduced side by side (2: gate and up; 1: down).
 *
 * Every addition happens in a fixed order (xor butterfly in the warp, then warps in index order,
 * then split-K partials in split order), so results are bit-identical from run to run.
 */
template <int kThreads, int kTn, int kCpv, int kMats>
struct TileReducer {
  static_assert(kTn >= 1 && kTn <= kWarpSize && (kTn & (kTn - 1)) == 0, "kTn must be a power of two <= 32");
  static_assert(kThreads % kWarpSize == 0, "block size must be a multiple of 32");
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kTile = kTn * kCpv;
  //! One pad word per 32 floats: lanes write kCpv-strided columns, the sums read consecutive ones,
  //! and both are free of bank conflicts.
  static constexpr int kPadded = kTile + kTile / 32;

  struct Storage {
    float red[kWarps][kMats][kPadded];
    int last;
  };

  PROX_DEVICE static PROX_FORCEINLINE int pad(int ch) { return ch + ch / 32; }

  //! Full sum of matrix m, tile column ch, after reduce() (and split_k() when it returned true).
  PROX_DEVICE static PROX_FORCEINLINE float& at(Storage& st, int m, int ch) { return st.red[0][m][pad(ch)]; }

  //! Reduce acc over the block's row groups into at(). Thread t holds columns (t % kTn) * kCpv + c.
  //! Contains __syncthreads(); call from all threads.
  PROX_DEVICE static void reduce(Storage& st, float (&acc)[kMats][kCpv]) {
    const int lane = lane_id();
    const int warp = warp_id();
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
#pragma unroll
      for (int c = 0; c < kCpv; ++c) {
        if constexpr (kTn < kWarpSize) acc[m][c] = warp_sum_strided<kTn>(acc[m][c]);
        if (lane < kTn) st.red[warp][m][pad(lane * kCpv + c)] = acc[m][c];
      }
    }
    __syncthreads();
    for (int v = static_cast<int>(threadIdx.x); v < kMats * kTile; v += kThreads) {
      const int m = v / kTile;
      const int ch = v % kTile;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += st.red[w][m][pad(ch)];
      st.red[0][m][pad(ch)] = sum;  // only this thread touches (m, ch)
    }
    __syncthreads();
  }

  /**
   * @brief Serial split-K over the gridDim.y blocks of one column tile.
   * Each block stores its tile sums to `partials[(split * kMats + m) * ld + col0 + ch]`; the block
   * that arrives last (counted on `*counter`) adds all splits in split order into at() and returns
   * true; the others return false and must exit. The last block resets *counter to 0, so the
   * workspace is left ready for the next launch (it must be zero before the first one).
   * With num_splits == 1 it returns true at once and touches no memory.
   *
   * Ordering: one thread per block publishes with fence.acq_rel.gpu after the block barrier (the
   * barrier orders the other threads' stores before it, the fence is cumulative), as CUTLASS's
   * generic barrier does; a full __threadfence in every thread cost microseconds per block.
   */
  PROX_DEVICE static bool split_k(Storage& st, float* partials, unsigned* counter, int ld, int col0, int ncols,
                                  int split, int num_splits) {
    if (num_splits == 1) return true;
    for (int v = static_cast<int>(threadIdx.x); v < kMats * kTile; v += kThreads) {
      const int m = v / kTile;
      const int ch = v % kTile;
      if (ch < ncols) partials[(static_cast<std::size_t>(split) * kMats + m) * ld + col0 + ch] = at(st, m, ch);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned prev;
      asm volatile("fence.acq_rel.gpu;\n\tatom.relaxed.gpu.global.add.u32 %0, [%1], 1;"
                   : "=r"(prev)
                   : "l"(counter)
                   : "memory");
      const bool last = prev == static_cast<unsigned>(num_splits - 1);
      if (last) asm volatile("fence.acq_rel.gpu;" ::: "memory");
      st.last = last;
    }
    __syncthreads();
    if (!st.last) return false;
    for (int v = static_cast<int>(threadIdx.x); v < kMats * kTile; v += kThreads) {
      const int m = v / kTile;
      const int ch = v % kTile;
      float sum = 0.0f;
      if (ch < ncols) {
        for (int s = 0; s < num_splits; ++s)
          sum += __ldcg(partials + (static_cast<std::size_t>(s) * kMats + m) * ld + col0 + ch);
      }
      at(st, m, ch) = sum;
    }
    if (threadIdx.x == 0) *counter = 0u;
    __syncthreads();
    return true;
  }
};

#endif  // __CUDACC__

}  // namespace detail
PROX_NAMESPACE_END
