// SPDX-License-Identifier: Apache-2.0
//! @file batched_glu_down.cuh  The fused Stage 2 for batched decode: the batched GLU GEMV and the batched
//! down GEMV (batched_glu.cuh, batched_down.cuh) in one grid, as glu_down_gemv.cuh fuses them for one token.
//!
//! A block streams its rank range of the union's gate/up rows (every token's dot products from the same
//! bytes; s[b][j] = u act(g) where token b selected j, +0 elsewhere), announces that its s values are
//! written (the grid barrier's arrive), gathers its first down rows and issues their loads, and only then
//! waits until every block has arrived; then each down task (a 128-output tile and a rank range of the
//! union) weights the union's W_down^T rows by every token's s, and the tile's split-K partials are
//! combined in part order (detail::TileReducer). Against the two batched kernels this saves the down
//! kernel's launch, its mask compaction and the first memory latency of its rows, which the barrier's wait
//! overlaps. Every addition has a fixed order: the same bits from run to run.
//!
//! As in glu_down_gemv.cuh the barrier needs every block resident: the grid is at most SMs x resident
//! blocks per SM (fixed at plan time from the occupancy), launched cooperatively by default.
//! Token capacities 2 and 4 (CUDA-core GEMVs); at capacity 8 SparseFfn runs the two tensor-core kernels.
//!
//! Measured on the H100 (docs/history.md), the fused kernel is not faster than the two it replaces on most
//! shapes: in the PDL-chained FFN, against the batched GLU and down kernels at B = 2 / 4, Qwen3-14B -2.5 /
//! +1.0 %, 32B +0.1 / +1.6 %, 8B +0.2 / +0.7 %, 4B -0.2 / +8.0 %, 1.7B +0.1 / +6.3 %. Under ncu (caches
//! flushed; one step of rows in flight at the barrier then) it took as long alone as the two kernels
//! together (8B at B = 4: 85-87 against 54.5 + 29.9 us). So SparseFfn runs it only when asked
//! (PlanOptions::fuse_batch_stage2). The wait at the barrier is part of it: two steps of rows in flight
//! there instead of one made the FFN 0.6-2.7 % faster on 1.7B and 8B.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "activation.cuh"
#include "batched_down.cuh"
#include "batched_glu.cuh"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/workspace.cuh"
#include "detail/rank_range.cuh"
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "glu_down_gemv.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the fused batched Stage 2: those of the batched GLU GEMV (x, tokens, shape, W_gate,
 * W_up, each token's channel mask and their union, s) plus W_down^T and y. All pointers are device pointers.
 */
template <class T, class Fmt = NativeWeights<T>>
struct BatchedGluDownGemvArgs : BatchedGluGemvArgs<T, Fmt> {
  typename Fmt::Matrix w_down_t{};  //!< [d_ff][d_model] = W_down^T, 16-byte aligned
  T* y = nullptr;                   //!< out [tokens][d_model]; every element written
};

/**
 * @brief Policy of the fused batched Stage 2: a GLU part (a CUDA-core BatchedGluPolicy) and a down part
 * (128-output tiles, as BatchedDownPolicy) sharing the block size and the residency.
 * @tparam Tokens    token capacity, 2 or 4
 * @tparam Threads   threads per block
 * @tparam GluRows   GLU rows a block holds at a time
 * @tparam Rows      down rows a block holds at a time; @tparam Unroll down rows in flight per thread
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__); the grid is SMs x MinBlocks at most
 */
template <int Tokens, int Threads, int GluRows, int Rows, int Unroll, int MinBlocks>
struct BatchedGluDownPolicy {
  static constexpr int kTokens = Tokens;
  static constexpr int kThreads = Threads;
  static constexpr int kTile = 128;
  static constexpr int kRows = Rows;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  using Glu = BatchedGluPolicy<Tokens, Threads, GluRows, MinBlocks, false>;
  static_assert(Tokens == 2 || Tokens == 4, "token capacity 2 or 4 (CUDA-core GEMVs)");
  static_assert(Rows % 32 == 0 && Threads % 32 == 0, "policy shape");
  static std::string name() {
    return "bglud_b" + std::to_string(Tokens) + "_t" + std::to_string(Threads) + "_c" + std::to_string(GluRows) +
           "_r" + std::to_string(Rows) + "_u" + std::to_string(Unroll) + "_m" + std::to_string(MinBlocks);
  }
};

//! Candidates (dispatch.cuh: the fewest GLU load slots per row of d_model inputs, as the batched GLU GEMV;
//! ties to the lower index): the batched GLU GEMV's block sizes (256 threads, and at capacity 4 also 320),
//! 2048 down rows per round: with 1024 a Qwen3-14B or 32B down task (1100-1600 union rows at B = 2 and 4)
//! took two rounds, each restarting the row stream (FFN 1-1.6 % slower there, H100, docs/history.md).
template <int Tokens>
struct NativeBatchedGluDownPolicies;
template <>
struct NativeBatchedGluDownPolicies<2> {
  using type = PolicyList<BatchedGluDownPolicy<2, 256, 64, 2048, 4, 2>>;
};
template <>
struct NativeBatchedGluDownPolicies<4> {
  using type = PolicyList<BatchedGluDownPolicy<4, 256, 64, 2048, 4, 2>, BatchedGluDownPolicy<4, 320, 64, 2048, 4, 2>>;
};
//! The candidates of capacity Tokens for Stage-2 format Fmt (CUDA cores: the native lists serve every format).
template <int Tokens, class Fmt = NativeWeights<__half>>
struct BatchedGluDownPoliciesFor {
  using type = typename NativeBatchedGluDownPolicies<Tokens>::type;
};

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_glu_down_kernel(
    const BatchedGluDownGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kRows = Policy::kRows;
  using Glu = detail::BatchedGluRowsOf<typename Policy::Glu, T, Fmt>;
  using Down = detail::DownRows<kThreads, kTile, Policy::kUnroll, kB, Fmt>;
  constexpr int kE = Down::kE;
  using Reducer = detail::TileReducer<kThreads, Down::kTn, kE, kB>;
  // Storage live at different times shares its bytes: the GLU part's (it ends with a block barrier), a down
  // round's rows and s values, and a task's tile reduction (after its rounds; a barrier ends each task).
  struct RoundStorage {
    int rows[kRows];
    float val[kB][kRows];
  };
  union DownStorage {
    RoundStorage round;
    typename Reducer::Storage red;
  };
  union Storage {
    typename Glu::Storage glu;
    DownStorage down;
  };
  __shared__ Storage s;
  __shared__ int s_warp[kThreads / kWarpSize];

  const int tid = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  // The PDL wait, the header stamp, the zero fill of s off the union and the block's rank range. No PDL
  // trigger yet: the next kernel is let in once every down row is streamed (glu_down_gemv.cuh says why).
  const detail::GluRange range = detail::glu_begin<kThreads, false>(a, ws, s_warp);
  const unsigned gen = tid == 0 ? detail::GridBarrier::generation(ws.sync) : 0u;
  const Act act{};
  Glu::run(a.x, a.d_model, a.d_ff, a.w_gate, a.w_up, a.union_mask, a.tokens, range, s.glu,
           [&](int b, int j, float g, float u) { detail::batched_glu_store(a, b, j, g, u, act); });
  // Checked after the GLU part, as the batch-1 fused Stage 2 does (SparseFfn passes no header to check).
  if (!detail::workspace_ready(ws.guard)) {
    detail::fused_not_ready<kTile>(a.y, a.tokens, a.d_model, ws);
    return;
  }
  // Glu::run ends with a block barrier: every s store of the block precedes thread 0's release.
  if (tid == 0) detail::GridBarrier::arrive(ws.sync, gen, static_cast<unsigned>(blocks));

  const int n_words = a.d_ff / kWarpSize;
  const int tiles = ceil_div(a.d_model, kTile);
  const int parts = max(1, blocks / tiles);
  bool waited = false;
#pragma unroll 1
  for (int task = block; task < tiles * parts; task += blocks) {
    const int tile = task % tiles;
    const int part = task / tiles;
    const int d0 = tile * kTile;
    int lo = 0;
    int hi = 0;
    detail::rank_range(range.total, part, parts, &lo, &hi);
    float acc[kB][kE];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
#pragma unroll
      for (int c = 0; c < kE; ++c) acc[b][c] = 0.0f;
    }
#pragma unroll 1
    for (int sub = lo; sub < hi; sub += kRows) {
      const int count = min(kRows, hi - sub);
      detail::gather_rank_range<kThreads>(a.union_mask, n_words, range.offset, sub, sub + count, s.down.round.rows);
      __syncthreads();
      // Two steps of rows in flight while the block waits at the barrier (with one, the FFN was 0.6-2.7 %
      // slower on the Qwen3 1.7B and 8B shapes at B = 2 and 4, 14B -0.2 / +1.5 %: H100, docs/history.md).
      Down::template run<kRows, 2>(Fmt::data(a.w_down_t), a.d_model, d0, s.down.round.rows, &s.down.round.val[0][0], count, acc, [&] {
        if (!waited) {  // block-uniform
          if (tid == 0) detail::GridBarrier::wait(ws.sync, gen);
          __syncthreads();
          waited = true;
        }
        // Every token's s of the round's rows, all loads before the first store (one L2 round trip).
        constexpr int kPer = (kRows + kThreads - 1) / kThreads;
        float sv[kB][kPer];
#pragma unroll
        for (int b = 0; b < kB; ++b) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const int i = tid + j * kThreads;
            sv[b][j] = i < count && b < a.tokens
                           ? Fmt::down_s(a.w_down_t, s.down.round.rows[i], d0, a.d_model,
                                         __ldcg(a.s + static_cast<std::size_t>(b) * a.d_ff + s.down.round.rows[i]))
                           : 0.0f;
          }
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) {
            const int i = tid + j * kThreads;
            if (i < count) s.down.round.val[b][i] = sv[b][j];
          }
        }
        __syncthreads();
      });
      __syncthreads();  // rows / val are reused by the next round
    }
    // Every weight load of this block is done: let the next kernel of the stream launch (PDL) while the
    // split-K combine runs. Blocks without a down task count as triggered when they exit.
    if (task + blocks >= tiles * parts) pdl_launch_dependents();
    Reducer::reduce(s.down.red, acc);
    detail::batched_tile_combine<kTile, Reducer, Fmt>(s.down.red, a.w_down_t, a.y, a.tokens, a.d_model,
                                                      static_cast<float*>(ws.scratch),
                                                      ws.sync + detail::kBarrierWords + tile, d0, part, parts);
    __syncthreads();  // red is reused by the next task
  }
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The fused batched Stage 2 as a planned op (operator.cuh's contract), token capacity Tokens (2 or
 * 4) and a run-time `tokens` in [1, Tokens]. A cooperative launch by default, as GluDownGemvOp.
 */
template <class T, class Act = SiLU, int Tokens = 2, class Fmt = NativeWeights<T>>
struct BatchedGluDownGemvOp {
  static constexpr const char* kName = "batched_glu_down_gemv";
  static constexpr int kTokens = Tokens;
  using Format = Fmt;
  using Args = BatchedGluDownGemvArgs<T, Fmt>;
  using Policies = typename BatchedGluDownPoliciesFor<Tokens, Fmt>::type;
  struct Options {
    bool pdl = false;          //!< launch with PDL (sm_90+)
    bool cooperative = true;   //!< as GluDownGemvOp::Options::cooperative
    int grid_blocks = 0;       //!< blocks to launch, at most SMs x min(kMinBlocks, blocks that fit); 0 = that
  };

  template <class P>
  static constexpr int num_tiles(int d_model) noexcept {
    return ceil_div(d_model, P::kTile);
  }

  //! The batched GLU GEMV's rules, W_down^T as Fmt::check, y element-aligned.
  static Status can_implement(const Args& a) noexcept {
    PROX_RETURN_IF_ERROR((BatchedGluGemvOp<T, Act, Tokens, Fmt>::can_implement(a)));
    return detail::check_fused_down<T, Fmt>(a);
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options& o) noexcept { return detail::GluOpRules<T, Fmt>::check_options(o); }

  //! GluDownGemvOp's sync words (barrier, then the down tile counters), and the split-K partials of every
  //! token for the largest grid any policy may have (kMaxFusedGridBlocks).
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    return detail::barrier_workspace_needs<Policies>(a.d_model, Tokens);
  }

  //! Largest grid of policy P on device `d` (as GluDownGemvOp::max_grid_blocks).
  template <class P>
  static Status max_grid_blocks(const DeviceInfo& d, int* out) noexcept {
    return detail::barrier_grid_blocks<batched_glu_down_kernel<P, T, Act, Fmt>, P::kThreads, P::kMinBlocks>(d, out);
  }

  template <class P>
  static Status configure(const Args&, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    return detail::configure_barrier_grid<batched_glu_down_kernel<P, T, Act, Fmt>, P::kThreads, P::kMinBlocks>(
        o.grid_blocks, o.cooperative, d, lc);
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(batched_glu_down_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
  }
};

//! Fused batched Stage 2: as the batched GLU GEMV's rule, the fewest GLU load slots per row of d_model inputs.
template <class T, class Act, int B, class Fmt>
int default_policy(BatchedGluDownGemvOp<T, Act, B, Fmt>, const DeviceInfo&,
                   const BatchedGluDownGemvArgs<T, Fmt>& a) noexcept {
  return detail::fewest_load_slots<typename BatchedGluDownGemvOp<T, Act, B, Fmt>::Policies>(
      [&](auto p) { return detail::BatchedGluRowsOf<typename decltype(p)::Glu, T, Fmt>::row_slots(a.d_model); });
}

PROX_NAMESPACE_END
