// SPDX-License-Identifier: Apache-2.0
//! @file glu_down_gemv.cuh  Ops 3 + 4 fused, Stage 2 in one kernel: the masked GLU GEMV
//! (s_j = u_j * act(g_j) for the selected channels) and the input-sparse down GEMV
//! (y = sum_{j selected} s_j W_down^T[j,:]).
//!
//! Why fused: run as two kernels, each pays its own ramp-up (read the mask, find its rows, wait one
//! memory latency for the first bytes) and the down GEMV cannot issue a single weight load until
//! the last GLU block has finished, although which W_down rows it needs is known from the mask
//! alone. Here one grid does both: after its GLU rows a block announces that its s values are
//! written (arrive), issues the loads of its first down rows, and only then waits until every
//! block has arrived; the weights are in flight while the grid converges.
//!
//! The wait is a grid-wide barrier, so all blocks must be resident at once: the grid is at most
//! SMs x resident blocks per SM (fixed at plan time from the occupancy of this kernel), and it is
//! launched as a cooperative kernel, so a grid that cannot be co-resident fails to launch instead
//! of hanging.
//!
//! Work split: GLU rows by rank over all blocks (detail::GluRows); down as (column tile, rank
//! range) tasks, T tiles x R = max(1, G / T) ranges, combined over the R ranges of a tile by the
//! deterministic split-K of detail::TileReducer. Every addition has a fixed order: the output is
//! bit-identical from run to run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/tune_key.hpp"
#include "core/types.cuh"
#include "core/warp.cuh"
#include "core/workspace.cuh"
#include "detail/rank_range.cuh"
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "down_gemv.cuh"
#include "glu_gemv.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the fused Stage-2 GEMV: those of the GLU GEMV (x, shape, W_gate, W_up, mask,
 * s) plus the down GEMV's W_down^T and y. All pointers are device pointers.
 * @tparam T `__half` or `__nv_bfloat16` (activations); @tparam Fmt the Stage-2 weight format.
 */
template <class T, class Fmt = NativeWeights<T>>
struct GluDownGemvArgs : GluGemvArgs<T, Fmt> {
  typename Fmt::Matrix w_down_t{};  //!< [d_ff][d_model] = W_down^T, 16-byte aligned
  T* y = nullptr;                   //!< out [d_model]; every element is written
};

/**
 * @brief Policy of the fused Stage-2 GEMV (vocabulary: core/policy.hpp): a GLU part (a GluGemvPolicy)
 * and a down part (as DownGemvPolicy) sharing the block size and the residency.
 * @tparam Threads   threads per block
 * @tparam GluRows   GLU rows a block holds at a time; @tparam Batch GLU rows reduced together
 * @tparam Tile      down outputs per task (Tile / Fmt::kElemsPerVec threads share a row, at most 32)
 * @tparam Rows      down rows a block holds at a time; @tparam Unroll down rows in flight per thread
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__); the grid is SMs x MinBlocks at most
 */
template <int Threads, int GluRows, int Batch, int Tile, int Rows, int Unroll, int MinBlocks>
struct GluDownGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kTile = Tile;
  static constexpr int kRows = Rows;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  using Glu = GluGemvPolicy<Threads, GluRows, Batch, 1, MinBlocks>;
  static_assert(Tile % 8 == 0 && Rows % 32 == 0, "policy shape");  // the rest per format: detail::DownRows
  static std::string name() {
    return "glud_t" + std::to_string(Threads) + "_c" + std::to_string(GluRows) + "_b" + std::to_string(Batch) + "_d" +
           std::to_string(Tile) + "_r" + std::to_string(Rows) + "_u" + std::to_string(Unroll) + "_m" +
           std::to_string(MinBlocks);
  }
};

//! Candidates (index 0 is the default where 256 threads fill a row's GLU steps; dispatch.cuh picks by
//! load slots). Rows = 1024 holds a Qwen3 14B/32B down task (300-750 rows at e = 40-70 %) in one round:
//! with 256, 2-3 rounds each restarted the stream from one memory latency (Stage 2 1.0-4.2 us slower).
//! The order is a preference: prox-tune gives a near-tie to the lower index. Measured on the H100:
using GluDownGemvPolicies =
    PolicyList<GluDownGemvPolicy<256, 64, 4, 256, 1024, 4, 2>,   // d_model 2048, 4096
               GluDownGemvPolicy<320, 64, 2, 256, 1024, 4, 2>,   // d_model 2560, 5120: FFN 0.7-2.5 us faster
               GluDownGemvPolicy<256, 64, 2, 256, 1024, 4, 3>>;  // timed within 0.5 %, FFN 1.6-1.8 us slower (14B)

//! The candidate list of a Stage-2 weight format, and its name in a tuning cache (the policy table's row).
template <class Fmt>
struct GluDownGemvPoliciesFor;
template <class W>
struct GluDownGemvPoliciesFor<NativeWeights<W>> {
  using type = GluDownGemvPolicies;
  static constexpr const char* kName = "glu_down_gemv";
};

//! Most blocks a fused Stage-2 grid has: the workspace's partials are sized for it, so the size does not
//! depend on the device. 1024 exceeds SMs x resident blocks of every current GPU (H100: 132 x 2-3).
constexpr int kMaxFusedGridBlocks = 1024;

namespace detail {

/**
 * @brief Grid barrier in two words of the workspace: [0] arrivals of the current launch, [1]
 * generation. The arrival count starts at zero (initialize_workspace; SparseFfn's Stage 1 zeroes it
 * on a workspace it finds not ready) and is left at zero; the generation is whatever it is.
 */
struct GridBarrier {
  //! Thread 0: the generation this launch will complete (read before this block arrives).
  PROX_DEVICE static PROX_FORCEINLINE unsigned generation(const unsigned* bar) {
    unsigned g;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
    return g;
  }
  //! Thread 0, after a block barrier that follows the block's stores: publish them and count in
  //! (atom.acq_rel: a release cumulative over the block's stores, as in TileReducer::split_k).
  //! The last block to arrive resets the count and releases the new generation.
  PROX_DEVICE static PROX_FORCEINLINE void arrive(unsigned* bar, unsigned gen, unsigned blocks) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(bar) : "memory");
    if (prev == blocks - 1u) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1u) : "memory");
    }
  }
  //! Thread 0: wait until every block has arrived (then a block barrier publishes it to the block).
  //! The sleep between polls keeps 200-400 polling blocks from saturating the L2 slice that holds the
  //! word while the last blocks still stream their GLU rows.
  PROX_DEVICE static PROX_FORCEINLINE void wait(const unsigned* bar, unsigned gen) {
    unsigned g;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
      if (g != gen) break;
      __nanosleep(kPollSleepNs);
    }
  }
  static constexpr unsigned kPollSleepNs = 20;
};

//! Sync words of the fused Stage 2: the barrier in the first 256 bytes, the down tile counters after.
constexpr int kBarrierWords = 64;

/**
 * @brief Largest grid of a kernel with a grid barrier (the fused Stage 2s) on device `d`: SMs x min(kMinBlocks,
 * blocks of Kernel that fit on one SM), at most kMaxFusedGridBlocks. Plan time (the occupancy is read once
 * per device).
 */
template <auto Kernel, int kThreads, int kMinBlocks>
Status barrier_grid_blocks(const DeviceInfo& d, int* out) noexcept {
  int fit = 0;
  PROX_RETURN_IF_ERROR((occupancy<Kernel, kThreads>(d.device, &fit)));
  if (fit <= 0 || d.sm_count <= 0) return Status::kErrorUnsupportedDevice;
  const int blocks = d.sm_count * (fit < kMinBlocks ? fit : kMinBlocks);
  *out = blocks < kMaxFusedGridBlocks ? blocks : kMaxFusedGridBlocks;
  return Status::kSuccess;
}

/**
 * @brief Workspace of a fused Stage 2 with any of `Policies` (down tiles of P::kTile columns): the barrier
 * words, then the down tile counters (the same place for every policy and grid), and the split-K partials
 * of `outputs` values per column (1, or a batch's tokens) for the largest grid any policy may have
 * (kMaxFusedGridBlocks).
 */
template <class Policies>
WorkspaceNeeds barrier_workspace_needs(int d_model, int outputs) noexcept {
  WorkspaceNeeds w;
  w.sync = sizeof(std::uint32_t) * kBarrierWords + tile_counter_bytes<kMinTileWidth>(d_model);
  for_each_policy<Policies>([&](auto p, int) {
    const int parts = kMaxFusedGridBlocks / ceil_div(d_model, decltype(p)::kTile);
    const std::size_t b = parts > 1 ? sizeof(float) * static_cast<std::size_t>(parts) * outputs * d_model : 0;
    w.scratch = b > w.scratch ? b : w.scratch;
  });
  return w;
}

//! The launch of a kernel with a grid barrier: `grid_blocks` blocks (0: barrier_grid_blocks(); more than
//! that could not all be resident: kErrorInvalidArgument), cooperative unless asked not to be.
template <auto Kernel, int kThreads, int kMinBlocks>
Status configure_barrier_grid(int grid_blocks, bool cooperative, const DeviceInfo& d, LaunchConfig* lc) noexcept {
  int max_blocks = 0;
  PROX_RETURN_IF_ERROR((barrier_grid_blocks<Kernel, kThreads, kMinBlocks>(d, &max_blocks)));
  if (grid_blocks > max_blocks) return Status::kErrorInvalidArgument;
  lc->grid = dim3(static_cast<unsigned>(grid_blocks > 0 ? grid_blocks : max_blocks));
  lc->block = dim3(kThreads);
  lc->cooperative = cooperative;
  return Status::kSuccess;
}

//! The down part's rules of a fused Stage 2 (batch 1 or batched; the GLU part's come first): W_down^T as
//! Fmt::check, y non-null and element-aligned.
template <class T, class Fmt, class Args>
Status check_fused_down(const Args& a) noexcept {
  if (Fmt::data(a.w_down_t) == nullptr || a.y == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(Fmt::check(a.w_down_t, a.d_ff, a.d_model, WeightOrientation::kInOut));
  return is_aligned(a.y, sizeof(T)) ? Status::kSuccess : Status::kErrorMisalignedPointer;
}

//! A fused Stage 2 (batch 1 or batched) launched alone on a workspace that is not ready (the whole grid
//! agrees): the barrier and counters are not used; they are zeroed for the next launch, y[tokens][d_model]
//! is NaN, the header flagged. Not inlined: kept out of the kernel's register allocation (inlined, it made
//! the 256-thread candidates spill 8-16 bytes more).
template <int kTile, class T>
__device__ __noinline__ void fused_not_ready(T* y, int tokens, int d_model, OpWorkspace ws) {
  if (threadIdx.x == 0) flag_dirty(ws.guard);
  grid_zero(ws.sync, kBarrierWords + static_cast<int>(tile_counter_bytes<kTile>(d_model) / sizeof(std::uint32_t)));
  const long long n = static_cast<long long>(tokens) * d_model;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    y[i] = from_float<T>(__int_as_float(0x7fc00000));
}

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void glu_down_gemv_kernel(
    const GluDownGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kRows = Policy::kRows;
  using Glu = detail::GluRowsOf<typename Policy::Glu, T, Fmt>;
  using Down = detail::DownRows<kThreads, kTile, Policy::kUnroll, 1, Fmt>;
  constexpr int kE = Down::kE;
  using Reducer = detail::TileReducer<kThreads, Down::kTn, kE, 1>;

  __shared__ typename Glu::Storage s_glu;
  __shared__ int s_rows[kRows];
  __shared__ float s_val[kRows];
  __shared__ int s_warp[kThreads / kWarpSize];
  __shared__ typename Reducer::Storage s_red;

  const int tid = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  pdl_wait();  // the mask comes from Stage 1; the previous launch's barrier state is settled
  // No pdl_launch_dependents() here: the next kernel is let in once every block has streamed its
  // down rows (below), not at the start (see there).
  // Launched alone, the workspace must have been initialized: a block that finds it not ready (the
  // whole grid agrees) uses neither the barrier nor the counters (the generation read here is then
  // unused). In SparseFfn, Stage 1 has just made the sync words ready (no check), and this kernel
  // marks the header ready for the next Stage 1.
  if (block == 0) detail::stamp_header(ws.guard, static_cast<unsigned>(tid));
  const unsigned gen = tid == 0 ? detail::GridBarrier::generation(ws.sync) : 0u;

  // GLU part: this block's rank range of the selected channels.
  const int n_words = a.d_ff / kWarpSize;
  detail::GluRange range;
  range.offset = detail::mask_rank_offset<kThreads>(a.channel_mask, n_words, s_warp, &range.total);
  detail::rank_range(range.total, block, blocks, &range.lo, &range.hi);
  detail::zero_unselected<kThreads>(a, block, blocks);
  const Act act{};
  Glu::run(a.x, a.d_model, a.d_ff, a.w_gate, a.w_up, a.channel_mask, 1, range, s_glu,
           [&](int, int j, float g, float u) { a.s[j] = u * act(g); });
  const int total = range.total;
  int lo = 0;
  int hi = 0;
  const int tiles = ceil_div(a.d_model, kTile);
  // Checked after the GLU part, so nothing of it stays live across the GLU loop (SparseFfn passes no
  // header to check: then this costs no memory access).
  if (!detail::workspace_ready(ws.guard)) {
    detail::fused_not_ready<kTile>(a.y, 1, a.d_model, ws);
    return;
  }
  __syncthreads();  // every s store of the block (rows and zero fill) precedes thread 0's release
  if (tid == 0) detail::GridBarrier::arrive(ws.sync, gen, static_cast<unsigned>(blocks));

  // Down part: tasks (tile, part); the weights of a task's first rows are requested before the wait.
  const int parts = max(1, blocks / tiles);
  bool waited = false;
#pragma unroll 1
  for (int task = block; task < tiles * parts; task += blocks) {
    const int tile = task % tiles;
    const int part = task / tiles;
    const int d0 = tile * kTile;
    detail::rank_range(total, part, parts, &lo, &hi);
    float acc[1][kE];
#pragma unroll
    for (int c = 0; c < kE; ++c) acc[0][c] = 0.0f;
#pragma unroll 1
    for (int sub = lo; sub < hi; sub += kRows) {
      const int count = min(kRows, hi - sub);
      detail::gather_rank_range<kThreads>(a.channel_mask, n_words, range.offset, sub, sub + count, s_rows);
      __syncthreads();
      Down::template run<kRows, 2>(Fmt::data(a.w_down_t), a.d_model, d0, s_rows, s_val, count, acc, [&] {
        if (!waited) {  // block-uniform
          if (tid == 0) detail::GridBarrier::wait(ws.sync, gen);
          __syncthreads();
          waited = true;
        }
        // All of a thread's s loads before the first store: one L2 round trip, not one per row
        // (a loop with the run-time bound count would issue them one after another).
        constexpr int kValsPerThread = (kRows + kThreads - 1) / kThreads;
        float sv[kValsPerThread];
#pragma unroll
        for (int j = 0; j < kValsPerThread; ++j) {
          const int i = tid + j * kThreads;
          sv[j] = i < count ? Fmt::down_s(a.w_down_t, s_rows[i], d0, a.d_model, __ldcg(a.s + s_rows[i])) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kValsPerThread; ++j) {
          const int i = tid + j * kThreads;
          if (i < count) s_val[i] = sv[j];
        }
        __syncthreads();
      });
      __syncthreads();  // s_rows / s_val are reused by the next round
    }
    // Every weight load of this block is done: let the next kernel of the stream launch (PDL) while
    // the split-K combine runs. With the trigger at the start the FFN was 0.3-1.6 us slower on every
    // Qwen3 shape (H100); our reading, not verified: the next kernel's blocks then crowd onto the first
    // SMs this grid frees. Blocks without a down task count as triggered when they exit.
    if (task + blocks >= tiles * parts) pdl_launch_dependents();
    Reducer::reduce(s_red, acc);
    const int ncols = min(kTile, a.d_model - d0);
    if (Reducer::split_k(s_red, static_cast<float*>(ws.scratch), ws.sync + detail::kBarrierWords + tile, a.d_model, d0, ncols, part,
                         parts)) {
      for (int ch = tid; ch < ncols; ch += kThreads)
        a.y[d0 + ch] = from_float<T>(Fmt::down_out(a.w_down_t, d0 + ch, Reducer::at(s_red, 0, ch)));
    }
    __syncthreads();  // s_red is reused by the next task
  }
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The fused Stage 2 as a planned op (drive it with prox::Operator; contract in proxy_gemv.cuh's
 * ProxyGemvOp). A cooperative launch: every block resident, so the grid-wide barrier cannot wait on a
 * block that never runs.
 */
template <class T, class Act = SiLU, class Fmt = NativeWeights<T>>
struct GluDownGemvOp {
  static constexpr const char* kName = "glu_down_gemv";
  using Format = Fmt;
  //! Its tuning-cache key (prox/tuning/choose.cuh): the format's candidate list and layout.
  static constexpr TuneKeyFields kTuneKey{GluDownGemvPoliciesFor<Fmt>::kName, DTypeTraits<T>::kName, Fmt::kKeyName,
                                          Act::kName, true};
  using Args = GluDownGemvArgs<T, Fmt>;
  using Policies = typename GluDownGemvPoliciesFor<Fmt>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
    //! Launch as a cooperative kernel, so a grid that cannot be co-resident fails to launch instead of
    //! hanging. Leave it on unless a platform rejects cooperative launches (MPS, green contexts); the
    //! grid is sized to fit either way.
    bool cooperative = true;
    //! Blocks to launch, at most SMs x min(kMinBlocks, blocks that fit); 0 = that maximum.
    int grid_blocks = 0;
  };

  template <class P>
  static constexpr int num_tiles(int d_model) noexcept {
    return ceil_div(d_model, P::kTile);
  }

  //! The GLU GEMV's rules (GluGemvOp::can_implement), W_down^T as Fmt::check, y element-aligned.
  static Status can_implement(const Args& a) noexcept {
    PROX_RETURN_IF_ERROR((GluGemvOp<T, Act, Fmt>::can_implement(a)));
    return detail::check_fused_down<T, Fmt>(a);
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options& o) noexcept { return detail::GluOpRules<T, Fmt>::check_options(o); }

  //! Barrier words and down tile counters (the same place for every policy and grid), and the split-K
  //! partials of the largest grid any policy may have (kMaxFusedGridBlocks).
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    return detail::barrier_workspace_needs<Policies>(a.d_model, 1);
  }

  //! Largest grid of policy P on device `d`: SMs x min(P::kMinBlocks, blocks that fit on one SM),
  //! at most kMaxFusedGridBlocks. Plan time (the occupancy is read once per device).
  template <class P>
  static Status max_grid_blocks(const DeviceInfo& d, int* out) noexcept {
    return detail::barrier_grid_blocks<glu_down_gemv_kernel<P, T, Act, Fmt>, P::kThreads, P::kMinBlocks>(d, out);
  }

  template <class P>
  static Status configure(const Args&, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    return detail::configure_barrier_grid<glu_down_gemv_kernel<P, T, Act, Fmt>, P::kThreads, P::kMinBlocks>(
        o.grid_blocks, o.cooperative, d, lc);
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(glu_down_gemv_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
  }
};

/**
 * @brief Fused Stage 2: the candidate whose GLU steps cover a row of d_model inputs with the fewest
 * load slots (detail::GluRows::row_slots), ties to the lower index. Measured on the H100: with 256 threads
 * a 5120-wide row takes 3 steps of which the last is half idle, and 320 threads (2 full steps) made
 * the FFN 0.7-2.5 us faster on Qwen3-14B and 32B; 256 threads stayed faster where they fit (2048, 4096).
 */
template <class T, class Act, class Fmt>
int default_policy(GluDownGemvOp<T, Act, Fmt>, const DeviceInfo&, const GluDownGemvArgs<T, Fmt>& a) noexcept {
  return detail::fewest_load_slots<typename GluDownGemvOp<T, Act, Fmt>::Policies>(
      [&](auto p) { return detail::GluRowsOf<typename decltype(p)::Glu, T, Fmt>::row_slots(a.d_model); });
}

PROX_NAMESPACE_END
