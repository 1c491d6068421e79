// SPDX-License-Identifier: Apache-2.0
//! @file glu_gemv.cuh  Op 3, Stage 2: the masked GLU GEMV. For every channel j selected in the
//! bitmask, compute g_j = <x, W_gate[j,:]> and u_j = <x, W_up[j,:]> exactly from the original
//! fp16/bf16 weights (fp32 accumulation) and write s_j = u_j * act(g_j). Unselected rows are never read.
//!
//! Grid: the selected channels are split evenly over the blocks by rank (detail/rank_range.cuh), so
//! every block gets the same number of rows whatever the mask looks like. A block shares each batch
//! of its rows among all its threads (each thread owns 16-byte pieces of every row of the batch),
//! with the loads of the next step in flight while the current one is reduced.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

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

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the masked GLU GEMV. All pointers are device pointers.
 * @tparam T `__half` or `__nv_bfloat16` (activations and weights).
 */
template <class T>
struct GluGemvArgs {
  const T* x = nullptr;       //!< [d_model], 16-byte aligned
  int d_model = 0;            //!< a multiple of 8, 8..2^20
  int d_ff = 0;               //!< a multiple of 32, 32..2^20
  const T* w_gate = nullptr;  //!< [d_ff][d_model] row-major (nn.Linear), 16-byte aligned
  const T* w_up = nullptr;    //!< [d_ff][d_model] row-major, 16-byte aligned
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
  //! Steps of Threads x Unroll 16-byte pieces that cover one row of d_model inputs (d_model / 8
  //! pieces); the last one leaves the threads past the row's end idle. Host and device.
  PROX_HOST_DEVICE static constexpr int steps_per_row(int d_model) noexcept {
    return ceil_div(d_model / 8, Threads * Unroll);
  }
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

// ---------------------------------------------------------------- L1: block building block
namespace detail {

/**
 * @brief The GLU work of one block, shared by glu_gemv_kernel and the fused Stage-2 kernel
 * (glu_down_gemv.cuh): s_j = u_j * act(g_j) for the selected channels of a rank range.
 * `Policy::kThreads` must be the block size.
 */
template <class Policy, class T, class Act>
struct GluRows {
  static constexpr int kThreads = Policy::kThreads;
  static constexpr int kRows = Policy::kRows;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kB = Policy::kBatch;
  static constexpr int kP = Policy::kUnroll;
  static constexpr int kV = 2 * kB;  // values reduced per batch: g and u of kB rows

  struct Storage {
    int ch[kRows];
    float red[kWarps][2][kRows];
  };

  //! s = +0 for the unselected channels of mask words w with w % parts == part (each word is
  //! owned by one part, so a grid of `parts` blocks writes every unselected entry once). One warp
  //! per word, one lane per channel: a coalesced store, no loop over bits. (A thread walking its
  //! word's clear bits one store at a time kept the block from its first weight loads for up to
  //! 32 dependent iterations: measured on the H100 in docs/benchmarks.md.)
  PROX_DEVICE static void zero_unselected(const GluGemvArgs<T>& a, int part, int parts) {
    const int n_words = a.d_ff / kWarpSize;
    const int lane = lane_id();
    for (long long w = part + static_cast<long long>(warp_id()) * parts; w < n_words;
         w += static_cast<long long>(kWarps) * parts) {
      if (((a.channel_mask[w] >> lane) & 1u) == 0u) a.s[w * kWarpSize + lane] = 0.0f;
    }
  }

  /**
   * @brief Write s_j for the selected channels with rank in [lo, hi) (block-uniform), in rounds of
   * at most kRows rows. `offset` is this thread's detail::mask_rank_offset<kThreads>. Ends
   * with a block barrier, after which st may be reused.
   */
  PROX_DEVICE static void run(const GluGemvArgs<T>& a, int offset, int lo, int hi, Storage& st) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int n_words = a.d_ff / kWarpSize;
    const Act act{};
#pragma unroll 1
    for (int sub = lo; sub < hi; sub += kRows) {  // block-uniform rounds of at most kRows rows
      const int count = min(kRows, hi - sub);
      gather_rank_range<kThreads>(a.channel_mask, n_words, offset, sub, sub + count, st.ch);
      __syncthreads();

      // Work is a flat sequence of steps; step st covers rows [b0, b0 + kB) of the batch st / kSteps
      // and pieces q0 + p kThreads of each row. Loads of step st + 1 are issued before the arithmetic
      // of step st (register double buffering), so memory is busy while the block reduces a batch.
      const int pieces = a.d_model / 8;  // 16-byte pieces per row
      const int steps_per_batch = Policy::steps_per_row(a.d_model);
      const int total_steps = ((count + kB - 1) / kB) * steps_per_batch;
      const std::size_t ld = static_cast<std::size_t>(a.d_model);

      struct Step {
        uint4 vx[kP];
        uint4 vg[kB][kP];
        uint4 vu[kB][kP];
      };
      // Branch-free: a step past the end loads nothing (all predicates false), so ptxas keeps every
      // load of step st + 1 ahead of the arithmetic of step st instead of sinking it behind a branch.
      const auto load_step = [&](int step, Step& d) {
        const bool live = step < total_steps;
        const int b0 = (step / steps_per_batch) * kB;
        const int q0 = tid + (step % steps_per_batch) * kThreads * kP;
#pragma unroll
        for (int c = 0; c < kB; ++c) {
          const bool have = live && b0 + c < count;
          const std::size_t row = static_cast<std::size_t>(st.ch[have ? b0 + c : 0]) * ld;
#pragma unroll
          for (int p = 0; p < kP; ++p) {
            const int q = q0 + p * kThreads;
            const bool ok = have && q < pieces;
            d.vg[c][p] = ld_stream_16(a.w_gate + row + 8 * q, ok);
            d.vu[c][p] = ld_stream_16(a.w_up + row + 8 * q, ok);
          }
        }
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int q = q0 + p * kThreads;
          d.vx[p] = ld_cached_16(a.x + 8 * q, live && q < pieces);
        }
      };
      float v[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = 0.0f;
      const auto compute_step = [&](int step, const Step& d) {
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          float fx[8];
          unpack8<T>(d.vx[p], fx);
#pragma unroll
          for (int c = 0; c < kB; ++c) {
            float fg[8];
            float fu[8];
            unpack8<T>(d.vg[c][p], fg);
            unpack8<T>(d.vu[c][p], fu);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              v[c] = fmaf(fx[e], fg[e], v[c]);
              v[kB + c] = fmaf(fx[e], fu[e], v[kB + c]);
            }
          }
        }
        if (step % steps_per_batch == steps_per_batch - 1) {
          // Batch done: one reduction for all 2 kB values (2 kB - 1 + log2(32 / 2 kB) shuffles).
          const int b0 = (step / steps_per_batch) * kB;
          const float r = warp_sum_many<kV>(v);
          constexpr int kLanesPerValue = kWarpSize / kV;
          if (lane % kLanesPerValue == 0) {
            const int idx = lane / kLanesPerValue;
            const int c = idx % kB;
            if (b0 + c < count) st.red[warp][idx / kB][b0 + c] = r;
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
      for (int i = tid; i < count; i += kThreads) {
        float g = 0.0f;
        float u = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          g += st.red[w][0][i];
          u += st.red[w][1][i];
        }
        a.s[st.ch[i]] = u * act(g);
      }
      __syncthreads();  // st is reused by the next round
    }
  }
};

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void glu_gemv_kernel(const GluGemvArgs<T> a,
                                                                                         const OpWorkspace ws) {
  using Rows = detail::GluRows<Policy, T, Act>;
  __shared__ typename Rows::Storage s_st;
  __shared__ int s_warp[Rows::kWarps];

  pdl_wait();  // the mask comes from Stage 1
  pdl_launch_dependents();
  // SparseFfn's Stage 1 is complete and left its sync words clean: mark the workspace ready.
  if (blockIdx.x == 0) detail::stamp_header(ws.guard, threadIdx.x);

  int total = 0;
  const int offset = detail::mask_rank_offset<Policy::kThreads>(a.channel_mask, a.d_ff / kWarpSize, s_warp, &total);
  int lo = 0;
  int hi = 0;
  detail::rank_range(total, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), &lo, &hi);
  Rows::zero_unselected(a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
  Rows::run(a, offset, lo, hi, s_st);
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The masked GLU GEMV as a planned op (drive it with prox::Operator; contract in
 * proxy_gemv.cuh's ProxyGemvOp). No workspace of its own.
 */
template <class T, class Act = SiLU>
struct GluGemvOp {
  static constexpr const char* kName = "glu_gemv";
  //! Its tuning-cache key (prox/tuning/choose.cuh): W_gate and W_up are T.
  static constexpr TuneKeyFields kTuneKey{"glu_gemv", DTypeTraits<T>::kName, DTypeTraits<T>::kName, Act::kName, true};
  using Args = GluGemvArgs<T>;
  using Policies = GluGemvPolicies;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
    //! Blocks to launch; 0 = one wave (SMs x the policy's kMinBlocks): the selected channels are split
    //! evenly by rank, so one wave fills the GPU whatever the mask.
    int grid_blocks = 0;
  };

  /**
   * @brief Validate without launching. Shape rule: d_model a multiple of 8 in [8, 2^20]; d_ff a
   * multiple of 32 in [32, 2^20]; x, w_gate, w_up 16-byte aligned; mask and s 4-byte aligned.
   */
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr || a.channel_mask == nullptr || a.s == nullptr)
      return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    if (!is_aligned(a.x, 16) || !is_aligned(a.w_gate, 16) || !is_aligned(a.w_up, 16) ||
        !is_aligned(a.channel_mask, 4) || !is_aligned(a.s, 4))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options& o) noexcept {
    return o.grid_blocks < 0 ? Status::kErrorInvalidArgument : Status::kSuccess;
  }
  static WorkspaceNeeds workspace_needs(const Args&) noexcept { return {}; }

  template <class P>
  static Status configure(const Args&, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(o.grid_blocks > 0 ? o.grid_blocks : d.sm_count * P::kMinBlocks));
    lc->block = dim3(P::kThreads);
    return Status::kSuccess;
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(glu_gemv_kernel<P, T, Act>, lc, stream, a, ws);
  }
};

PROX_NAMESPACE_END
