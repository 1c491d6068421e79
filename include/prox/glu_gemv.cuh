// SPDX-License-Identifier: Apache-2.0
//! @file glu_gemv.cuh  Op 3, Stage 2: the masked GLU GEMV. For every channel j selected in the
//! bitmask, compute g_j = <x, W_gate[j,:]> and u_j = <x, W_up[j,:]> exactly from the original
//! weights (a Stage-2 weight format, stage2_weights.cuh; fp32 accumulation) and write s_j = u_j * act(g_j).
//! Unselected rows are never read.
//!
//! Grid: the selected channels are split evenly over the blocks by rank (detail/rank_range.cuh), so
//! every block gets the same number of rows whatever the mask looks like. A block shares each batch
//! of its rows among all its threads (each thread owns 16-byte pieces of every row of the batch),
//! with the loads of the next step in flight while the current one is reduced.
//!
//! detail::GluRows, the block, serves one token and a batch of tokens alike (the batched GLU GEMV,
//! batched_glu.cuh, and both fused Stage 2s): every token's dot products come from the same weight bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/shape.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/tune_key.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "core/workspace.cuh"
#include "detail/rank_range.cuh"
#include "dispatch.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the masked GLU GEMV. All pointers are device pointers.
 * @tparam T   `__half` or `__nv_bfloat16` (activations)
 * @tparam Fmt the Stage-2 weight format (stage2_weights.cuh): NativeWeights<T> (fp16/bf16 weights) by default
 */
template <class T, class Fmt = NativeWeights<T>>
struct GluGemvArgs {
  using Matrix = typename Fmt::Matrix;
  const T* x = nullptr;       //!< [d_model], 16-byte aligned
  int d_model = 0;            //!< a multiple of 8 (of Fmt::kElemsPerVec), 8..2^20
  int d_ff = 0;               //!< a multiple of 32, 32..2^20
  Matrix w_gate{};            //!< [d_ff][d_model] row-major (nn.Linear), 16-byte aligned
  Matrix w_up{};              //!< [d_ff][d_model] row-major, 16-byte aligned
  const std::uint32_t* channel_mask = nullptr;  //!< [d_ff/32] selected channels (Stage 1's output)
  float* s = nullptr;         //!< out [d_ff]: s_j for selected j, +0 for unselected j (every entry written,
                              //!< so the down GEMV can read s without waiting for the mask)
};

/**
 * @brief GLU policy (vocabulary: core/policy.hpp): the whole block works on a batch of kBatch selected
 * rows at once, each thread on its own 16-byte pieces of every row of the batch (no warp idles while
 * another finishes a row).
 * @tparam Threads   threads per block
 * @tparam Rows      selected rows a block holds at a time (more are processed in rounds)
 * @tparam Batch     selected rows reduced together (2 * Batch a power of two <= 32)
 * @tparam Unroll    16-byte pieces per row and thread in flight
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__); the default grid is SMs x MinBlocks
 */
template <int Threads, int Rows, int Batch, int Unroll, int MinBlocks = 3>
struct GluGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kRows = Rows;
  static constexpr int kBatch = Batch;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static_assert(Rows % 32 == 0 && Threads % 32 == 0, "policy shape");
  static_assert(is_pow2(2 * Batch) && 2 * Batch <= 32, "2 * Batch must be a power of two <= 32");
  static std::string name() {
    return "glus_t" + std::to_string(Threads) + "_c" + std::to_string(Rows) + "_b" + std::to_string(Batch) + "_p" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks);
  }
};

//! Candidates (index 0 is the default) of the unfused Stage 2 (SparseFfn::PlanOptions::fuse_stage2 =
//! false; the fused Stage 2 has its own list). prox-tune on the H100 picks each of them for some Qwen3
//! shape and density (docs/data/prox-tune-h100.tsv): 0 on most, 1 on 32B at 5-7/16, 2 on 8B at 5-7/16.
using GluGemvPolicies =
    PolicyList<GluGemvPolicy<128, 32, 4, 1, 3>, GluGemvPolicy<256, 64, 4, 1, 2>, GluGemvPolicy<128, 32, 2, 2, 3>>;

//! The candidate list of a Stage-2 weight format, and its name in a tuning cache (the policy table's row).
template <class Fmt>
struct GluGemvPoliciesFor;
template <class W>
struct GluGemvPoliciesFor<NativeWeights<W>> {
  using type = GluGemvPolicies;
  static constexpr const char* kName = "glu_gemv";
};

// ---------------------------------------------------------------- L1: block building blocks
namespace detail {

//! The token count of a GLU GEMV's arguments: `a.tokens` of a batch's (read where it is used, as the kernels
//! were measured), 1 for arguments without one.
template <class Args, class = void>
struct TokensOf {
  PROX_HOST_DEVICE static constexpr int get(const Args&) { return 1; }
};
template <class Args>
struct TokensOf<Args, std::void_t<decltype(std::declval<const Args&>().tokens)>> {
  PROX_HOST_DEVICE static int get(const Args& a) { return a.tokens; }
};

/**
 * @brief s = +0 on the channels of `mask` that are clear, for every token of `a` (a.s is [tokens][d_ff]),
 * over the mask words w with w % parts == part (each word is owned by one part, so a grid of `parts`
 * blocks writes every unselected entry once). One warp per word, one lane per channel: a coalesced store,
 * no loop over bits. (A thread walking its word's clear bits one store at a time kept the block from its
 * first weight loads for up to 32 dependent iterations: measured on the H100 in docs/benchmarks.md.)
 * `n_words` (d_ff / 32), `lane` and `warp` as the caller read them.
 */
template <int kThreads, class Args>
PROX_DEVICE PROX_FORCEINLINE void zero_unselected(const Args& a, const std::uint32_t* mask, int part, int parts,
                                                  int n_words, int lane, int warp) {
  constexpr int kWarps = kThreads / kWarpSize;
  for (long long w = part + static_cast<long long>(warp) * parts; w < n_words;
       w += static_cast<long long>(kWarps) * parts) {
    if (((mask[w] >> lane) & 1u) == 0u) {
      for (int b = 0; b < TokensOf<Args>::get(a); ++b)
        a.s[static_cast<std::size_t>(b) * a.d_ff + w * kWarpSize + lane] = 0.0f;
    }
  }
}
//! zero_unselected() of one token's arguments over its channel mask, reading the words and the lane itself.
template <int kThreads, class Args>
PROX_DEVICE PROX_FORCEINLINE void zero_unselected(const Args& a, int part, int parts) {
  const int n_words = a.d_ff / kWarpSize;
  const int lane = lane_id();
  zero_unselected<kThreads>(a, a.channel_mask, part, parts, n_words, lane, warp_id());
}

/**
 * @brief A block's share of the selected channels of the GLU kernels: ranks [lo, hi), and this thread's
 * mask offset (gather_rank_range's input).
 */
struct GluRange {
  int offset = 0;
  int lo = 0;
  int hi = 0;
  int total = 0;  //!< selected channels
};

/**
 * @brief The start of the batched GLU kernels (the batch-1 ones call the pieces themselves, in the order they
 * were measured with): the PDL wait, the header stamp (block 0), the block's GluRange of the union's channels,
 * and s = +0 for every token on the channels not in it. kTrigger: let the next kernel launch now (PDL); the
 * fused batched Stage 2 lets it in only once its down rows are streamed.
 */
template <int kThreads, bool kTrigger = true, class Args>
PROX_DEVICE PROX_FORCEINLINE GluRange glu_begin(const Args& a, const OpWorkspace& ws, int* s_warp) {
  pdl_wait();  // the masks come from Stage 1
  if constexpr (kTrigger) pdl_launch_dependents();
  // SparseFfn's Stage 1 is complete and left its sync words clean: mark the workspace ready.
  if (blockIdx.x == 0) stamp_header(ws.guard, threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int n_words = a.d_ff / kWarpSize;
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  GluRange r;
  r.offset = mask_rank_offset<kThreads>(a.union_mask, n_words, s_warp, &r.total);
  rank_range(r.total, block, blocks, &r.lo, &r.hi);
  zero_unselected<kThreads>(a, a.union_mask, block, blocks, n_words, lane, warp);
  return r;
}

/**
 * @brief The GLU work of one block, for one token (the GLU GEMV, the fused Stage 2) or a batch of kTokens
 * (the batched GLU GEMV, the fused batched Stage 2): for the selected channels j of a rank range, every
 * token's g_j and u_j from the same weight bytes, handed to `store(b, j, g, u)` (which applies the activation).
 * The block works on kRowBatch rows at a time, each thread on kUnroll 16-byte weight pieces of every row of
 * the batch and on the matching pieces of every token's x (Fmt::kElemsPerVec / 8 x pieces per weight piece);
 * the 2 x kRowBatch x kTokens dot products of a batch are reduced together.
 * @tparam kThreads the block size; @tparam kRows rows held at a time (more go in rounds);
 * @tparam T the activation type; @tparam Fmt the Stage-2 weight format.
 */
template <int kThreads_, int kRows_, int kRowBatch, int kUnroll, int kTokens, class T, class Fmt>
struct GluRows {
  static constexpr int kThreads = kThreads_;
  static constexpr int kRows = kRows_;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kR = kRowBatch;          // rows reduced together
  static constexpr int kP = kUnroll;            // weight pieces per row and thread in flight
  static constexpr int kB = kTokens;
  static constexpr int kE = Fmt::kElemsPerVec;  // weights per 16-byte piece
  static constexpr int kXP = kE / 8;            // 16-byte pieces of x (8 elements of T) per weight piece
  static constexpr int kV = 2 * kR * kB;        // values reduced per batch: value (m kR + c) kB + b
  static_assert(sizeof(T) == 2 && kE % 8 == 0, "16-bit activations, whole x pieces per weight piece");
  static_assert(kV <= 32 && is_pow2(kV), "2 x rows x tokens: a power of two <= 32");
  static_assert(kB == 1 || kP == 1, "a batch streams one piece per row and step");
  //! Reduction planes: (matrix) for one token; (matrix, row of the batch) for a batch, the layout the batched
  //! GLU was measured with (each plane holds only its rows; a plane per matrix would serve as well).
  static constexpr int kPlanes = kB == 1 ? 2 : 2 * kR;
  PROX_HOST_DEVICE static constexpr int plane(int m, int c) { return kB == 1 ? m : m * kR + c; }

  struct Storage {
    int ch[kRows];
    float red[kWarps][kPlanes][kB][kRows];
  };
  //! One step's loads: every token's x pieces, the gate and up pieces of the batch's rows, and for a format
  //! that scales pieces their scales.
  struct StepPlain {
    uint4 vx[kB][kP][kXP];
    uint4 vg[kR][kP];
    uint4 vu[kR][kP];
  };
  struct StepScaled : StepPlain {
    float sg[kR][kP];
    float su[kR][kP];
  };
  template <bool kScaled>
  using StepOf = std::conditional_t<kScaled, StepScaled, StepPlain>;

  //! Steps of kThreads x kUnroll pieces over one row of d_model inputs (host and device).
  PROX_HOST_DEVICE static constexpr int steps_per_row(int d_model) {
    return glu_steps_per_row<Fmt>(d_model, kThreads, kP);
  }
  //! Load slots the block spends on one row of d_model inputs: its steps x the pieces a step loads (what the
  //! default rules of the fused Stage 2s and the batched GLU minimize: detail::fewest_load_slots).
  PROX_HOST_DEVICE static constexpr long row_slots(int d_model) {
    return static_cast<long>(steps_per_row(d_model)) * kThreads * kP;
  }

  /**
   * @brief The channels with rank in [range.lo, range.hi) among the set bits of `mask` (block-uniform), in
   * rounds of at most kRows rows: store(b, j, g_bj, u_bj) for every token b < tokens (x is [tokens][d_model]).
   * `range.offset` is this thread's mask_rank_offset. Ends with a block barrier, after which st may be reused.
   */
  template <class Store>
  PROX_DEVICE static PROX_FORCEINLINE void run(const T* x, int d_model, int d_ff, const typename Fmt::Matrix& gate,
                                               const typename Fmt::Matrix& up, const std::uint32_t* mask,
                                               int tokens_in, const GluRange& range, Storage& st, Store&& store) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int tokens = kB == 1 ? 1 : tokens_in;
    const int n_words = d_ff / kWarpSize;
    const auto* wg = Fmt::data(gate);
    const auto* wu = Fmt::data(up);
    // The row shape: for a batch before the rounds, for one token in each round (the same values; the
    // orders the kernels were measured with).
    const auto row_shape = [&](int& pieces, int& steps_per_batch, std::size_t& ld) {
      pieces = d_model / kE;  // 16-byte weight pieces per row
      steps_per_batch = steps_per_row(d_model);
      ld = static_cast<std::size_t>(d_model);
    };
    int pieces_b = 0;
    int steps_b = 0;
    std::size_t ld_b = 0;
    if constexpr (kB > 1) row_shape(pieces_b, steps_b, ld_b);
#pragma unroll 1
    for (int sub = range.lo; sub < range.hi; sub += kRows) {  // block-uniform rounds of at most kRows rows
      const int count = min(kRows, range.hi - sub);
      gather_rank_range<kThreads>(mask, n_words, range.offset, sub, sub + count, st.ch);
      __syncthreads();

      // Work is a flat sequence of steps; step st covers rows [b0, b0 + kR) of the batch st / kSteps
      // and pieces q0 + p kThreads of each row. Loads of step st + 1 are issued before the arithmetic
      // of step st (register double buffering), so memory is busy while the block reduces a batch.
      int pieces = pieces_b;
      int steps_per_batch = steps_b;
      std::size_t ld = ld_b;
      if constexpr (kB == 1) row_shape(pieces, steps_per_batch, ld);
      const int total_steps = ((count + kR - 1) / kR) * steps_per_batch;

      using Step = StepOf<Fmt::kPieceScales>;
      // Branch-free: a step past the end loads nothing (all predicates false), so ptxas keeps every
      // load of step st + 1 ahead of the arithmetic of step st instead of sinking it behind a branch.
      const auto load_step = [&](int step, Step& d) {
        const bool live = step < total_steps;
        const int b0 = (step / steps_per_batch) * kR;
        const int q0 = tid + (step % steps_per_batch) * kThreads * kP;
        // A batch streams one piece per step: past the row's end it selects no row either.
        const bool rows_live = kB == 1 ? live : live && q0 < pieces;
#pragma unroll
        for (int c = 0; c < kR; ++c) {
          const bool have = rows_live && b0 + c < count;
          const int j = st.ch[have ? b0 + c : 0];
          const std::size_t row = static_cast<std::size_t>(j) * ld;
#pragma unroll
          for (int p = 0; p < kP; ++p) {
            const int q = q0 + p * kThreads;
            const bool ok = have && q < pieces;
            d.vg[c][p] = ld_stream_16(wg + row + kE * q, ok);
            d.vu[c][p] = ld_stream_16(wu + row + kE * q, ok);
            if constexpr (Fmt::kPieceScales) {
              d.sg[c][p] = ok ? Fmt::piece_scale(gate, j, q, d_model) : 0.0f;
              d.su[c][p] = ok ? Fmt::piece_scale(up, j, q, d_model) : 0.0f;
            }
          }
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) {
#pragma unroll
          for (int p = 0; p < kP; ++p) {
            const int q = q0 + p * kThreads;
#pragma unroll
            for (int i = 0; i < kXP; ++i)
              d.vx[b][p][i] = ld_cached_16(x + b * ld + kE * q + 8 * i, live && q < pieces && b < tokens);
          }
        }
      };
      float v[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = 0.0f;
      // x unpacked once per piece for one token; for a batch, per row after its weights (the same values:
      // the orders the kernels were measured with).
      const auto unpack_x = [&](const uint4 (&vx)[kXP], float (&fx)[kE]) {
        if constexpr (kXP == 1) {
          unpack8<T>(vx[0], fx);
        } else {
#pragma unroll
          for (int i = 0; i < kXP; ++i) {
            float f[8];
            unpack8<T>(vx[i], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) fx[8 * i + e] = f[e];
          }
        }
      };
      const auto compute_step = [&](int step, const Step& d) {
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          float fx1[kE];
          if constexpr (kB == 1) unpack_x(d.vx[0][p], fx1);
#pragma unroll
          for (int c = 0; c < kR; ++c) {
            float fg[kE];
            float fu[kE];
            Fmt::dequant(d.vg[c][p], fg);
            Fmt::dequant(d.vu[c][p], fu);
            float sg = 1.0f;
            float su = 1.0f;
            if constexpr (Fmt::kPieceScales) {
              sg = d.sg[c][p];
              su = d.su[c][p];
            }
#pragma unroll
            for (int b = 0; b < kB; ++b) {
              float fxb[kE];
              if constexpr (kB > 1) unpack_x(d.vx[b][p], fxb);
              const float(&fx)[kE] = kB == 1 ? fx1 : fxb;
              const int ig = c * kB + b;  // v[ig] += <x, w_gate piece>, v[iu] += <x, w_up piece>
              const int iu = (kR + c) * kB + b;
              if constexpr (Fmt::kPieceScales) {  // a scaled format: the piece's sums, then its scales
                float pg = 0.0f;
                float pu = 0.0f;
#pragma unroll
                for (int e = 0; e < kE; ++e) {
                  pg = fmaf(fx[e], fg[e], pg);
                  pu = fmaf(fx[e], fu[e], pu);
                }
                v[ig] = fmaf(pg, sg, v[ig]);
                v[iu] = fmaf(pu, su, v[iu]);
              } else {
#pragma unroll
                for (int e = 0; e < kE; ++e) {
                  v[ig] = fmaf(fx[e], fg[e], v[ig]);
                  v[iu] = fmaf(fx[e], fu[e], v[iu]);
                }
              }
            }
          }
        }
        if (step % steps_per_batch == steps_per_batch - 1) {
          // Batch done: one reduction for all kV values (kV - 1 + log2(32 / kV) shuffles).
          const int b0 = (step / steps_per_batch) * kR;
          float r;
          if constexpr (kV == 16) {  // warp_sum_many<16>, unrolled (warp_halvings says why)
            warp_halvings<kV / 2>(v, kWarpSize / 2);
            r = v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
          } else {
            r = warp_sum_many<kV>(v);
          }
          constexpr int kLanesPerValue = kWarpSize / kV;
          if (lane % kLanesPerValue == 0) {
            const int idx = lane / kLanesPerValue;  // (m kR + c) kB + b
            const int b = idx % kB;
            const int mc = idx / kB;
            const int c = mc % kR;
            if (b0 + c < count) st.red[warp][kB == 1 ? mc / kR : mc][b][b0 + c] = r;  // plane(mc / kR, c)
          }
#pragma unroll
          for (int i = 0; i < kV; ++i) v[i] = 0.0f;
        }
      };
      Step buf0;
      Step buf1;
      load_step(0, buf0);
#pragma unroll 1
      for (int step = 0; step < total_steps; step += 2) {
        load_step(step + 1, buf1);
        compute_step(step, buf0);
        load_step(step + 2, buf0);
        if (step + 1 < total_steps) compute_step(step + 1, buf1);
      }
      __syncthreads();
      for (int i = tid; i < count * kB; i += kThreads) {
        const int b = kB == 1 ? 0 : i / count;
        const int r = kB == 1 ? i : i % count;
        if (b >= tokens) continue;
        const int c = r % kR;
        float g = 0.0f;
        float u = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          g += st.red[w][plane(0, c)][b][r];
          u += st.red[w][plane(1, c)][b][r];
        }
        const int j = st.ch[r];
        store(b, j, Fmt::glu_out(gate, j, g), Fmt::glu_out(up, j, u));
      }
      __syncthreads();  // st is reused by the next round
    }
  }
};

//! The GLU rows of a GluGemvPolicy P (one token).
template <class P, class T, class Fmt>
using GluRowsOf = GluRows<P::kThreads, P::kRows, P::kBatch, P::kUnroll, 1, T, Fmt>;

/**
 * @brief The rules every GLU GEMV shares (GluGemvOp, BatchedGluGemvOp; the fused Stage 2s build on them):
 * validation and the one-wave launch. `union_mask` is the batched ops' (null for one token, which reads
 * channel_mask alone); `tokens` is checked against [1, max_tokens].
 */
template <class T, class Fmt>
struct GluOpRules {
  template <class Args>
  static Status can_implement(const Args& a, const std::uint32_t* union_mask, bool batched, int tokens,
                              int max_tokens) noexcept {
    if (a.x == nullptr || Fmt::data(a.w_gate) == nullptr || Fmt::data(a.w_up) == nullptr ||
        a.channel_mask == nullptr || (batched && union_mask == nullptr) || a.s == nullptr)
      return Status::kErrorNullPointer;
    if (tokens < 1 || tokens > max_tokens) return Status::kErrorInvalidArgument;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    PROX_RETURN_IF_ERROR(Fmt::check(a.w_gate, a.d_ff, a.d_model));
    PROX_RETURN_IF_ERROR(Fmt::check(a.w_up, a.d_ff, a.d_model));
    if (!is_aligned(a.x, 16) || !is_aligned(a.channel_mask, 4) || !is_aligned(union_mask, 4) ||
        !is_aligned(a.s, 4))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
  //! Options with `grid_blocks` (0 or more).
  template <class Options>
  static Status check_options(const Options& o) noexcept {
    return o.grid_blocks < 0 ? Status::kErrorInvalidArgument : Status::kSuccess;
  }
  //! grid_blocks blocks, or 0: one wave (SMs x kMinBlocks): the channels are split by rank, so one wave fills
  //! the GPU whatever the mask.
  template <class P>
  static Status configure(int grid_blocks, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(grid_blocks > 0 ? grid_blocks : d.sm_count * P::kMinBlocks));
    lc->block = dim3(P::kThreads);
    return Status::kSuccess;
  }
};

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void glu_gemv_kernel(const GluGemvArgs<T, Fmt> a,
                                                                                         const OpWorkspace ws) {
  using Rows = detail::GluRowsOf<Policy, T, Fmt>;
  __shared__ typename Rows::Storage s_st;
  __shared__ int s_warp[Rows::kWarps];
  pdl_wait();  // the mask comes from Stage 1
  pdl_launch_dependents();
  // SparseFfn's Stage 1 is complete and left its sync words clean: mark the workspace ready.
  if (blockIdx.x == 0) detail::stamp_header(ws.guard, threadIdx.x);
  // (glu_begin's steps, with the block index read after the mask scan: the order this kernel was measured with)
  detail::GluRange range;
  range.offset = detail::mask_rank_offset<Policy::kThreads>(a.channel_mask, a.d_ff / kWarpSize, s_warp, &range.total);
  detail::rank_range(range.total, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), &range.lo, &range.hi);
  detail::zero_unselected<Policy::kThreads>(a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
  const Act act{};
  Rows::run(a.x, a.d_model, a.d_ff, a.w_gate, a.w_up, a.channel_mask, 1, range, s_st,
            [&](int, int j, float g, float u) { a.s[j] = u * act(g); });
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The masked GLU GEMV as a planned op (drive it with prox::Operator; contract in
 * proxy_gemv.cuh's ProxyGemvOp). No workspace of its own.
 * @tparam T activations; @tparam Act SiLU / GeluTanh; @tparam Fmt the Stage-2 weight format.
 */
template <class T, class Act = SiLU, class Fmt = NativeWeights<T>>
struct GluGemvOp {
  static constexpr const char* kName = "glu_gemv";
  using Format = Fmt;
  //! Its tuning-cache key (prox/tuning/choose.cuh): the format's candidate list and layout.
  static constexpr TuneKeyFields kTuneKey{GluGemvPoliciesFor<Fmt>::kName, DTypeTraits<T>::kName, Fmt::kKeyName,
                                          Act::kName, true};
  using Args = GluGemvArgs<T, Fmt>;
  using Policies = typename GluGemvPoliciesFor<Fmt>::type;
  using Rules = detail::GluOpRules<T, Fmt>;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
    //! Blocks to launch; 0 = one wave (SMs x the policy's kMinBlocks): the selected channels are split
    //! evenly by rank, so one wave fills the GPU whatever the mask.
    int grid_blocks = 0;
  };

  /**
   * @brief Validate without launching. Shape rule: d_model a multiple of 8 (of Fmt::kElemsPerVec) in
   * [8, 2^20]; d_ff a multiple of 32 in [32, 2^20]; x 16-byte aligned; the weights as Fmt::check; mask and
   * s 4-byte aligned.
   */
  static Status can_implement(const Args& a) noexcept { return Rules::can_implement(a, nullptr, false, 1, 1); }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options& o) noexcept { return Rules::check_options(o); }
  static WorkspaceNeeds workspace_needs(const Args&) noexcept { return {}; }

  template <class P>
  static Status configure(const Args&, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    return Rules::template configure<P>(o.grid_blocks, d, lc);
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(glu_gemv_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
  }
};

// Unfused GLU GEMV: no rule of its own; default_policy()'s fallback, policy 0 (dispatch.cuh). Its grid is one
// wave whatever the policy (rows split evenly by rank).

PROX_NAMESPACE_END
