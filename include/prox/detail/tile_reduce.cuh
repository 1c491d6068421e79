// SPDX-License-Identifier: Apache-2.0
//! @file tile_reduce.cuh  L1 building block shared by the input-sparse GEMVs (Stage 1 proxy, Stage 2
//! down): reduce a column tile's per-thread accumulators over the block's row groups, then combine
//! the split-K blocks of the tile with a deterministic serial reduction: through global memory
//! ("last block finishes"), or, when the split-K blocks of a tile form one thread-block cluster
//! (sm_90+), through distributed shared memory.
#pragma once

#include <cstdint>

#include "../core/config.hpp"
#include "../core/math.hpp"
#include "../core/warp.cuh"

PROX_NAMESPACE_BEGIN
namespace detail {

//! Most split-K blocks combined in one thread-block cluster: the portable cluster size limit of
//! sm_90 (launchers fall back to the global combine above it).
constexpr int kMaxClusterSplits = 8;

#if defined(__CUDACC__)

// ---------------------------------------------------------------- thread-block cluster primitives
// sm_90+ only. Before sm_90 no launch is a cluster: cluster_num_blocks_y() reads 1, so callers'
// cluster paths are never taken there, and the barrier and DSMEM primitives compile to nothing.

//! Blocks of this block's cluster along y, or 0 when the cluster spans more than one block in x or z.
//! 1 without a cluster launch (a non-cluster launch is a cluster of one block) and before sm_90.
PROX_DEVICE PROX_FORCEINLINE int cluster_num_blocks_y() {
#if PROX_ARCH_SM90
  unsigned y;
  unsigned all;
  asm("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(y));
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(all));
  return all == y ? static_cast<int>(y) : 0;
#else
  return 1;
#endif
}

//! barrier.cluster.arrive.release: this thread's prior memory accesses (shared memory of any block
//! of the cluster included) are performed before the other blocks' wait returns.
PROX_DEVICE PROX_FORCEINLINE void cluster_arrive() {
#if PROX_ARCH_SM90
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}

//! barrier.cluster.wait.acquire: wait until every thread of the cluster has arrived.
PROX_DEVICE PROX_FORCEINLINE void cluster_wait() {
#if PROX_ARCH_SM90
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}

//! Load the float at shared-memory address p of this block from the same offset in the shared
//! memory of the cluster's block `rank` (distributed shared memory).
PROX_DEVICE PROX_FORCEINLINE float ld_shared_cluster(const float* p, int rank) {
#if PROX_ARCH_SM90
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  float v;
  asm volatile(
      "{\n\t.reg .u32 ra;\n\t"
      "mapa.shared::cluster.u32 ra, %1, %2;\n\t"
      "ld.shared::cluster.f32 %0, [ra];\n\t}"
      : "=f"(v)
      : "r"(local), "r"(rank)
      : "memory");
  return v;
#else
  (void)p;
  (void)rank;
  return 0.0f;
#endif
}

/**
 * @brief Reduction of a tile of kMats x (kTn * kCpv) column sums over a block.
 * @tparam kThreads threads per block; thread t owns column slot t % kTn (kCpv consecutive columns)
 *         and row group t / kTn.
 * @tparam kTn      threads along the columns; a power of two <= 32, so a warp holds 32/kTn row groups.
 * @tparam kCpv     columns per thread (one 16-byte weight piece).
 * @tparam kMats    matrices reduced side by side (2: gate and up; 1: down).
 * @tparam kRows    rows of partial sums the storage holds: one per warp for reduce(); fewer for kernels
 *                  that combine their own rows into at() (the tensor-core batched down GEMV: one per
 *                  warp of a column, so that 256-output tiles fit 48 KB of static shared memory).
 *
 * Every addition happens in a fixed order (xor butterfly in the warp, then warps in index order,
 * then split-K partials in split order), so results are bit-identical from run to run.
 */
template <int kThreads, int kTn, int kCpv, int kMats, int kRows = kThreads / kWarpSize>
struct TileReducer {
  static_assert(kTn >= 1 && kTn <= kWarpSize && (kTn & (kTn - 1)) == 0, "kTn must be a power of two <= 32");
  static_assert(kThreads % kWarpSize == 0, "block size must be a multiple of 32");
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kTile = kTn * kCpv;
  //! One pad word per 32 floats: lanes write kCpv-strided columns, the sums read consecutive ones,
  //! and both are free of bank conflicts.
  static constexpr int kPadded = kTile + kTile / 32;
  //! Partial loads the last block of a split-K combine has in flight per thread (split_k()): 32 for
  //! one matrix (the down GEMVs: up to 32 splits in one batch), 16 for two (Stage 1: up to 8 splits
  //! of gate and up; 32 was 0.4 us slower on the Qwen3-8B Stage 1 at s1 = 10 %, measured on the H100).
  static constexpr int kBatchLoads = kMats == 1 ? 32 : 16;

  static_assert(kRows >= 1 && kRows <= kWarps, "storage rows");
  struct Storage {
    float red[kRows][kMats][kPadded];
    int last;
  };

  PROX_DEVICE static PROX_FORCEINLINE int pad(int ch) { return ch + ch / 32; }

  //! Full sum of matrix m, tile column ch, after reduce() (and split_k() when it returned true).
  PROX_DEVICE static PROX_FORCEINLINE float& at(Storage& st, int m, int ch) { return st.red[0][m][pad(ch)]; }

  //! Row groups side by side in one warp, and the values each thread holds.
  static constexpr int kGroupsPerWarp = kWarpSize / kTn;
  static constexpr int kVals = kMats * kCpv;

  //! Reduce acc over the block's row groups into at(). Thread t holds columns (t % kTn) * kCpv + c.
  //! Contains __syncthreads(); call from all threads.
  PROX_DEVICE static void reduce(Storage& st, float (&acc)[kMats][kCpv]) {
    static_assert(kRows == kWarps, "reduce() stores one row per warp");
    const int lane = lane_id();
    const int warp = warp_id();
    if constexpr (kGroupsPerWarp > 1 && kVals % kGroupsPerWarp == 0) {
      // The warp's row groups by recursive halving: at the shuffle over lane bit `off`, the lane with
      // that bit set keeps the upper half of its values and its partner the lower half, each adding
      // the other's copy of the half it keeps. log2(kGroupsPerWarp) steps of kVals/2, kVals/4, ...
      // shuffles instead of kVals each, and every lane then stores kVals / kGroupsPerWarp sums (not
      // kTn lanes kVals each). Each sum is the pairs of warp_sum_strided's butterfly added in the same
      // order (a + b and b + a are the same bits), so the results are bit-identical to it (checked
      // by tests/test_tile_reduce.cu). Measured on the H100 (docs/benchmarks.md): Stage 1 0.1-0.5 us
      // faster (its 32 values: 16 shuffles instead of 32), the down GEMV with 128-column tiles 0.4 us.
      float v[kVals];
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int c = 0; c < kCpv; ++c) v[m * kCpv + c] = acc[m][c];
      }
      int base = 0;  // index of v[0] in the thread's original values
      constexpr int kSteps = log2_pow2(kGroupsPerWarp);
      // The steps unrolled by compile-time recursion, each with a constant half and lane bit, so every index
      // of v is a constant: a plain loop stayed rolled at 2+ steps (FP8's 16 columns a thread in 128- and
      // 64-column tiles: 4 and 8 row groups a warp) and put v on the stack (64 bytes a thread, sm_90a).
      halve_steps<0, kSteps>(v, base);
      const int slot = lane % kTn;
#pragma unroll
      for (int j = 0; j < kVals / kGroupsPerWarp; ++j) {
        const int i = base + j;
        st.red[warp][i / kCpv][pad(slot * kCpv + i % kCpv)] = v[j];
      }
    } else {
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int c = 0; c < kCpv; ++c) {
          if constexpr (kTn < kWarpSize) acc[m][c] = warp_sum_strided<kTn>(acc[m][c]);
          if (lane < kTn) st.red[warp][m][pad(lane * kCpv + c)] = acc[m][c];
        }
      }
    }
    combine_warps(st);
  }
  //! Steps kStep .. kSteps - 1 of reduce()'s recursive halving, each with compile-time half and lane bit.
  template <int kStep, int kSteps>
  PROX_DEVICE static PROX_FORCEINLINE void halve_steps(float (&v)[kVals], int& base) {
    if constexpr (kStep < kSteps) {
      constexpr int kHalf = kVals >> (kStep + 1);
      if (warp_halve(v, kHalf, (kWarpSize / 2) >> kStep)) base += kHalf;
      halve_steps<kStep + 1, kSteps>(v, base);
    }
  }
  //! The second half of reduce(), for kernels that store each warp's column sums themselves: every
  //! warp w has written st.red[w][m][pad(ch)] for all of its kMats x kTile values; add them in warp
  //! order into at(). Contains __syncthreads(); call from all threads.
  PROX_DEVICE static void combine_warps(Storage& st) {
    static_assert(kRows == kWarps, "combine_warps() adds one row per warp");
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
   * Ordering: one thread per block arrives with atom.acq_rel.gpu after the block barrier (the
   * barrier orders the other threads' stores before it; the release is cumulative). A full
   * __threadfence in every thread cost microseconds per block. ptxas emits the same MEMBAR.ALL.GPU
   * before the atomic as for fence.acq_rel.gpu + atom.relaxed (read in the SASS); the difference is
   * the acquire, which comes after the atomic here instead of as a second fence in the last block:
   * one full memory barrier less on its critical path, 0.3-0.4 us of each kernel's fixed cost
   * (measured on the H100, docs/benchmarks.md).
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
      asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
      const bool last = prev == static_cast<unsigned>(num_splits - 1);
      st.last = last;
    }
    __syncthreads();
    if (!st.last) return false;
    // The last block reads every split's partials of its kVals values per thread in batches of
    // kBatchLoads loads, all issued before the first addition: one L2 round trip per batch. A plain
    // loop over the splits (run-time trip count) compiled to unrolled-by-16/8/4/1 pieces, one round
    // trip each and per value: 2 serialized round trips on the Qwen3-8B Stage 1, 4 on the 14B
    // Stage 1, 3 in the 14B down GEMV. Measured on the H100 (docs/benchmarks.md), the batches cut
    // Stage 1's fixed cost by 0.3-0.8 us and the 4B FFN by 4 %. The additions keep split order, so
    // the sums are the same bits as the plain loop's.
    constexpr int kVals = (kMats * kTile + kThreads - 1) / kThreads;
    constexpr int kBatch = kBatchLoads / kVals > 0 ? kBatchLoads / kVals : 1;
    const int tid = static_cast<int>(threadIdx.x);
    const std::size_t split_stride = static_cast<std::size_t>(kMats) * ld;  // floats from one split to the next
    float sum[kVals];
#pragma unroll
    for (int j = 0; j < kVals; ++j) sum[j] = 0.0f;
#pragma unroll 1
    for (int s0 = 0; s0 < num_splits; s0 += kBatch) {
      const int avail = num_splits - s0;
      float part[kVals][kBatch];
#pragma unroll
      for (int j = 0; j < kVals; ++j) {
        const int v = tid + j * kThreads;
        const int m = v / kTile;
        const int ch = v % kTile;
        const bool ok = v < kMats * kTile && ch < ncols;
        const float* p = partials + (static_cast<std::size_t>(s0) * kMats + m) * ld + col0 + ch;
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          part[j][i] = ok && i < avail ? __ldcg(p) : 0.0f;
          p += split_stride;
        }
      }
#pragma unroll
      for (int j = 0; j < kVals; ++j) {
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (i < avail) sum[j] += part[j][i];
      }
    }
#pragma unroll
    for (int j = 0; j < kVals; ++j) {
      const int v = tid + j * kThreads;
      if (v < kMats * kTile) at(st, v / kTile, v % kTile) = v % kTile < ncols ? sum[j] : 0.0f;
    }
    if (threadIdx.x == 0) *counter = 0u;
    __syncthreads();
    return true;
  }

  // ---------------------------------------------------------------- split-K through a cluster (sm_90+)
  // The alternative to split_k() when the launcher made the num_splits blocks of each column tile one
  // thread-block cluster of (1, num_splits, 1) blocks: no global partials, counter or fence, so a few
  // serialized global-memory round trips become two cluster barriers and one DSMEM read per split.
  // The grid's y extent is num_splits, so a block's cluster rank (x + nx * (y + ny * z) within the
  // cluster) is blockIdx.y, its split: rank order is split order. The workspace is not touched.
  //
  // Use: cluster_splits() > 1 -> cluster_slice() -> reduce() -> cluster_combine() -> epilogue on the
  // slice -> cluster_done(). Every thread of every block of the cluster must make each call (no early
  // exit in between).

  //! num_splits when the launch formed clusters of exactly the (1, num_splits, 1) split-K blocks of a
  //! tile, else 1 (no cluster launch, another cluster shape, or before sm_90): then use split_k().
  PROX_DEVICE static PROX_FORCEINLINE int cluster_splits(int num_splits) {
    return num_splits > 1 && cluster_num_blocks_y() == num_splits ? num_splits : 1;
  }

  /**
   * @brief Columns [lo, hi) of a tile of ncols (a multiple of 32) that the block of `split` finishes
   * in the cluster combine: ceil(kTile / num_splits) rounded up to whole 32-column words, so each
   * warp of the epilogue owns whole mask words; trailing splits may get none (lo == hi).
   */
  PROX_DEVICE static PROX_FORCEINLINE void cluster_slice(int split, int num_splits, int ncols, int& lo, int& hi) {
    const int per = round_up(ceil_div(kTile, num_splits), kWarpSize);
    lo = min(split * per, ncols);
    hi = min(lo + per, ncols);
  }

  /**
   * @brief Combine the tile sums of the cluster's num_splits blocks (after reduce()) for this block's
   * slice [lo, hi): at(st, m, ch) of every block, in rank (= split) order, added to 0.0f -- the
   * additions of split_k(), so the results are bit-identical to it. The sums are stored to this
   * block's at() for [lo, hi) and visible to the whole block on return; the rest of at() is stale.
   *
   * Barriers: the first (arrive.release + wait.acquire) makes every block's reduce() visible; the
   * second is only arrived at here, once this block's remote reads are done, and must be waited on
   * with cluster_done() before the block exits, so no block's shared memory goes away while another
   * block still reads it. The epilogue runs in between, overlapping the barrier.
   * Storing in place is safe: the slices are disjoint, and a column of this block's own slice is
   * read (from every rank, this one included) only by the thread that then writes it.
   */
  PROX_DEVICE static void cluster_combine(Storage& st, int lo, int hi, int num_splits) {
    cluster_arrive();
    cluster_wait();
    for (int ch = lo + static_cast<int>(threadIdx.x); ch < hi; ch += kThreads) {
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        float part[kMaxClusterSplits];  // all remote loads in flight before the first add
#pragma unroll
        for (int q = 0; q < kMaxClusterSplits; ++q)
          part[q] = q < num_splits ? ld_shared_cluster(&at(st, m, ch), q) : 0.0f;
        float sum = 0.0f;
#pragma unroll
        for (int q = 0; q < kMaxClusterSplits; ++q)
          if (q < num_splits) sum += part[q];
        at(st, m, ch) = sum;
      }
    }
    cluster_arrive();
    __syncthreads();
  }

  //! Second half of the closing cluster barrier of cluster_combine(): call before the block exits.
  PROX_DEVICE static PROX_FORCEINLINE void cluster_done() { cluster_wait(); }
};

#endif  // __CUDACC__

}  // namespace detail
PROX_NAMESPACE_END
