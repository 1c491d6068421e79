// SPDX-License-Identifier: Apache-2.0
//! @file glu_mma.cuh  The batched GLU rows on the tensor cores for a Stage-2 format of 16 one-byte weights a
//! 16-byte piece (the FP8 formats): BatchedGluMmaPolicy, run by batched_glu_gemv_kernel (batched_glu.cuh).
//!
//! Why: on the CUDA cores an FP8 weight costs a conversion to fp32 (half an e4m3x2 -> f16x2 conversion and one
//! f16 -> f32) and one multiply-add per token; at B = 4 that is about 9.5 instructions a weight, and the batched
//! FP8 GLU ran at 31 % of DRAM bandwidth (ncu, H200, Qwen3-8B, e = 70 %). Here a warp multiplies 16 channels'
//! gate and up rows with the tokens' x by m16n8k16 (token b in column b of B, the other columns zero): the
//! weights are converted to the activation type (exact: e4m3 values are fp16 and bf16 values), and the
//! multiply-adds of every token go to the tensor cores.
//!
//! Work split: the block takes its rank range of the union's channels in rounds of kRows; a round's 16-channel
//! groups go to the warps, and warps left over split d_model between them (as batched_glu_mma_kernel). A warp
//! step covers 64 inputs: lane (g, t) = (lane / 4, lane % 4) loads inputs 16t .. 16t+15 of the step from rows g
//! and g + 8 of its group, of both matrices, and lanes g < tokens load the same inputs of token g's x. Since a
//! dot product's k order is free, word i of a lane's 16 codes gives m16n8k16 number i: its low pair is the
//! fragment's k = 2t, 2t+1, its high pair k = 2t+8, 2t+9, and the same words of x are B's. Block scales: a
//! 64-input step lies in one 128-column block, so the step's sums are scaled per row (the fragment's rows g and
//! g + 8) before they are added. Every addition has a fixed order: the result is the same from run to run.
//!
//! At batch 1 the same rows, as the GLU part of the fused FP8 Stage 2, were slower than the CUDA cores (dense FP8
//! 8B 61.2 against 53.6 us, H200; docs/history.md): with a third fewer instructions the kernel waited on its
//! loads (ncu long-scoreboard stalls 6.4 against 2.0 an instruction), and a second step in flight spilled.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "batched_glu.cuh"
#include "core/config.hpp"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "detail/mma.cuh"
#include "detail/rank_range.cuh"
#include "glu_gemv.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief A batched GLU GEMV policy (BatchedGluGemvOp) whose rows run on the tensor cores as GluRowsMma, for a
 * format of one-byte codes (the FP8 formats): the tokens are B's columns (lanes g < tokens load x of token g).
 * kMma is false: batched_glu_mma_kernel is the native weights' kernel; this one runs in batched_glu_gemv_kernel.
 */
template <int Tokens, int Threads, int Rows, int MinBlocks>
struct BatchedGluMmaPolicy {
  static constexpr int kTokens = Tokens;
  static constexpr int kThreads = Threads;
  static constexpr int kRows = Rows;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr bool kMma = false;
  static_assert(Tokens >= 2 && Tokens <= 8, "token capacity");
  static_assert(Rows % 16 == 0 && Threads / 32 >= Rows / 16, "policy shape");
  static std::string name() {
    return "bglu_tc_b" + std::to_string(Tokens) + "_t" + std::to_string(Threads) + "_c" + std::to_string(Rows) +
           "_m" + std::to_string(MinBlocks);
  }
};

namespace detail {

/**
 * @brief The batched GLU rows (GluRows' run() and Storage, as batched_glu_gemv_kernel calls them) on the tensor
 * cores, for 2 to 8 tokens. Fmt holds 16 one-byte codes a 16-byte piece and converts a pair of them to a pair of
 * T exactly (Fmt::mma_pair<T>). One 64-input step a register buffer (24 registers of loads), two buffers.
 */
template <int kThreads_, int kRows_, int kTokens, class T, class Fmt>
struct GluRowsMma {
  static constexpr int kThreads = kThreads_;
  static constexpr int kRows = kRows_;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kStep = 64;  // inputs a warp step covers: 4 lanes t x 16
  static_assert(Fmt::kElemsPerVec == 16 && sizeof(typename Fmt::Element) == 1, "16 one-byte codes a piece");
  static_assert(kWarps >= kRows / 16 && kRows % 16 == 0, "a 16-channel group a warp");
  static_assert(kTokens >= 2 && kTokens <= 8, "the mma's n is 8 tokens");

  struct Storage {
    int ch[kRows];
    float part[kWarps][2][kTokens][kRows];  // [d_model slice][gate, up][token][row]
  };
  template <class Store>
  PROX_DEVICE static PROX_FORCEINLINE void run(const T* x, int d_model, int d_ff, const typename Fmt::Matrix& gate,
                                               const typename Fmt::Matrix& up, const std::uint32_t* mask,
                                               int tokens, const GluRange& range, Storage& st, Store&& store) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n_words = d_ff / kWarpSize;
    const int ksteps = ceil_div(d_model, kStep);
    const std::size_t ld = static_cast<std::size_t>(d_model);
    const auto* wg = Fmt::data(gate);
    const auto* wu = Fmt::data(up);
    const bool x_lane = g < tokens;  // column g of B: token g; the other columns are zero
    const T* xg = x + static_cast<std::size_t>(x_lane ? g : 0) * ld;
#pragma unroll 1
    for (int sub = range.lo; sub < range.hi; sub += kRows) {  // block-uniform rounds of at most kRows rows
      const int count = min(kRows, range.hi - sub);
      gather_rank_range<kThreads>(mask, n_words, range.offset, sub, sub + count, st.ch);
      __syncthreads();
      // As batched_glu_mma_kernel: 16-channel groups over the warps, the warps left over splitting d_model.
      const int groups = (count + 15) / 16;
      const int split = kWarps / groups;  // warps a group's row is split over
      const int cg = warp % groups;
      const int kh = warp / groups;
      if (kh < split) {
        const int ra = cg * 16 + g;
        const int rb = ra + 8;
        const bool ok_a = ra < count;
        const bool ok_b = rb < count;
        const int ja = st.ch[ok_a ? ra : 0];
        const int jb = st.ch[ok_b ? rb : 0];
        const std::size_t off_a = static_cast<std::size_t>(ja) * ld + 16 * t;
        const std::size_t off_b = static_cast<std::size_t>(jb) * ld + 16 * t;
        const int per = (ksteps + split - 1) / split;
        const int s0 = kh * per;
        const int s1 = min(ksteps, s0 + per);
        float c[2][4];  // [gate, up]: (row a, col 2t), (row a, 2t + 1), (row b, 2t), (row b, 2t + 1)
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
          for (int e = 0; e < 4; ++e) c[m][e] = 0.0f;
        }
        struct Plain {
          uint4 w[4];  // gate row a, gate row b, up row a, up row b
          uint4 x[2];  // 16 inputs of token g's x (lanes g < tokens)
        };
        struct Scaled : Plain {
          float sc[4];  // the step's block scales, as w
        };
        using Step = std::conditional_t<Fmt::kPieceScales, Scaled, Plain>;
        const auto load_step = [&](int it, Step& d) {
          const int s = s0 + it;
          const int k = s * kStep + 16 * t;
          const bool in = s < s1 && k < d_model;
          d.w[0] = ld_stream_16(wg + off_a + s * kStep, in && ok_a);
          d.w[1] = ld_stream_16(wg + off_b + s * kStep, in && ok_b);
          d.w[2] = ld_stream_16(wu + off_a + s * kStep, in && ok_a);
          d.w[3] = ld_stream_16(wu + off_b + s * kStep, in && ok_b);
          d.x[0] = ld_cached_16(xg + k, in && x_lane);
          d.x[1] = ld_cached_16(xg + k + 8, in && x_lane);
          if constexpr (Fmt::kPieceScales) {
            // The step's 128-column block, the same for every lane: the fragment's sums mix the four lanes t'
            // inputs, so a lane past d_model (a partial last step) must scale them as the others do.
            const bool live = s < s1;
            const int q = (s * kStep) / 16;
            d.sc[0] = live && ok_a ? Fmt::piece_scale(gate, ja, q, d_model) : 0.0f;
            d.sc[1] = live && ok_b ? Fmt::piece_scale(gate, jb, q, d_model) : 0.0f;
            d.sc[2] = live && ok_a ? Fmt::piece_scale(up, ja, q, d_model) : 0.0f;
            d.sc[3] = live && ok_b ? Fmt::piece_scale(up, jb, q, d_model) : 0.0f;
          }
        };
        const auto word = [](const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; };
        const auto compute_step = [&](const Step& d) {
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const uint4& wa = d.w[2 * m];
            const uint4& wb = d.w[2 * m + 1];
            const auto four = [&](float(&acc)[4]) {
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const std::uint32_t qa = word(wa, i);
                const std::uint32_t qb = word(wb, i);
                const std::uint32_t xlo = i < 2 ? word(d.x[0], 2 * i) : word(d.x[1], 2 * i - 4);
                const std::uint32_t xhi = i < 2 ? word(d.x[0], 2 * i + 1) : word(d.x[1], 2 * i - 3);
                mma_16816_bits<T>(acc, Fmt::template mma_pair<T>(qa), Fmt::template mma_pair<T>(qb),
                                  Fmt::template mma_pair<T>(qa >> 16), Fmt::template mma_pair<T>(qb >> 16), xlo, xhi);
              }
            };
            if constexpr (!Fmt::kPieceScales) {
              four(c[m]);
            } else {
              float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              four(p);
              c[m][0] = fmaf(p[0], d.sc[2 * m], c[m][0]);
              c[m][1] = fmaf(p[1], d.sc[2 * m], c[m][1]);
              c[m][2] = fmaf(p[2], d.sc[2 * m + 1], c[m][2]);
              c[m][3] = fmaf(p[3], d.sc[2 * m + 1], c[m][3]);
            }
          }
        };
        // Two register buffers: the loads of step it + 1 are issued before the arithmetic of step it. The same
        // loop (and group split) as batched_glu_mma_kernel's, written out: through a shared helper the native
        // kernel's SASS changed (1722 -> 1818 instructions at capacity 8, sm_90a), which would need a GPU A/B.
        const int steps = s1 - s0;
        Step b0;
        Step b1;
        if (steps > 0) load_step(0, b0);
#pragma unroll 1
        for (int it = 0; it < steps; it += 2) {
          if (it + 1 < steps) load_step(it + 1, b1);
          compute_step(b0);
          if (it + 2 < steps) load_step(it + 2, b0);
          if (it + 1 < steps) compute_step(b1);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {  // columns 2t and 2t + 1: tokens 2t and 2t + 1
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int b = 2 * t + h;
            if (b < tokens) {
              if (ok_a) st.part[kh][m][b][ra] = c[m][h];
              if (ok_b) st.part[kh][m][b][rb] = c[m][2 + h];
            }
          }
        }
      }
      __syncthreads();
      for (int i = tid; i < count * tokens; i += kThreads) {
        const int b = i / count;
        const int r = i % count;
        float gs = 0.0f;
        float us = 0.0f;
        for (int w = 0; w < split; ++w) {  // in slice order: deterministic
          gs += st.part[w][0][b][r];
          us += st.part[w][1][b][r];
        }
        const int j = st.ch[r];
        store(b, j, Fmt::glu_out(gate, j, gs), Fmt::glu_out(up, j, us));
      }
      __syncthreads();  // st is reused by the next round
    }
  }
};

//! The GLU rows of a BatchedGluMmaPolicy (the batched GLU GEMV's CUDA-core kernel runs them).
template <int Tokens, int Threads, int Rows, int MinBlocks, class T, class Fmt>
struct BatchedGluRowsFor<BatchedGluMmaPolicy<Tokens, Threads, Rows, MinBlocks>, T, Fmt> {
  using type = GluRowsMma<Threads, Rows, Tokens, T, Fmt>;
};

//! Whether a batched GLU policy's rows run on the tensor cores as GluRowsMma.
template <class P>
struct IsTensorCoreRows : std::false_type {};
template <int B, int Th, int R, int M>
struct IsTensorCoreRows<BatchedGluMmaPolicy<B, Th, R, M>> : std::true_type {};

}  // namespace detail

PROX_NAMESPACE_END
