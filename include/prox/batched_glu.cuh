// SPDX-License-Identifier: Apache-2.0
//! @file batched_glu.cuh  Batched decode, Stage 2's GLU (BatchedGluGemvOp): the exact gate/up rows of the union
//! of 2..8 tokens' channel sets, every token's dot products from the same bytes (batched.cuh says what the
//! batched ops share); s[b][j] = u act(g) where token b selected j, else +0. On the CUDA cores the block is
//! glu_gemv.cuh's detail::GluRows with a token count; at capacity 8 the native weights run on the tensor cores
//! (batched_glu_mma_kernel), a format without them on the CUDA cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "core/workspace.cuh"
#include "detail/mma.cuh"
#include "detail/rank_range.cuh"
#include "dispatch.cuh"
#include "glu_gemv.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the batched masked GLU GEMV. All pointers are device pointers.
 * @tparam T activations; @tparam Fmt the Stage-2 weight format (stage2_weights.cuh).
 */
template <class T, class Fmt = NativeWeights<T>>
struct BatchedGluGemvArgs {
  using Matrix = typename Fmt::Matrix;
  const T* x = nullptr;       //!< [tokens][d_model], 16-byte aligned
  int tokens = 0;             //!< 1..the op's kTokens
  int d_model = 0;            //!< a multiple of 8 (of Fmt::kElemsPerVec), 8..2^20
  int d_ff = 0;               //!< a multiple of 32, 32..2^20
  Matrix w_gate{};            //!< [d_ff][d_model], 16-byte aligned
  Matrix w_up{};              //!< [d_ff][d_model], 16-byte aligned
  const std::uint32_t* channel_mask = nullptr;  //!< [tokens][d_ff/32] each token's channels
  const std::uint32_t* union_mask = nullptr;    //!< [d_ff/32] their union (the rows read)
  float* s = nullptr;  //!< out [tokens][d_ff]: s[b][j] = u act(g) where token b selected j, +0 elsewhere
};

/**
 * @brief Policy of the batched GLU GEMV. A block takes its share of the union's channels in sub-batches
 * of kRows, in one of two ways:
 * - CUDA cores (Mma = false): detail::GluRows, as GluGemvPolicy: the whole block on a batch of kRowBatch rows,
 *   each thread on its 16-byte pieces of every row of the batch and of every token's x; the 2 x kRowBatch x
 *   Tokens dot products of a batch are reduced together (16 values).
 * - tensor cores (Mma = true): each warp multiplies a group of 16 channels' gate and up rows with every
 *   token's x over a slice of d_model (m16n8k16, fp32 accumulators), the group's warps splitting d_model
 *   between them; kUnroll 32-element steps per lane and pipeline stage. Only for formats with Fmt::kHasMma.
 */
template <int Tokens, int Threads, int Rows, int MinBlocks, bool Mma = false>
struct BatchedGluPolicy {
  static constexpr int kTokens = Tokens;
  static constexpr int kThreads = Threads;
  static constexpr int kRows = Rows;
  static constexpr int kRowBatch = 8 / Tokens;  //!< CUDA cores: rows reduced together
  static constexpr int kUnroll = 2;             //!< tensor cores: 32-element steps per pipeline stage
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr bool kMma = Mma;
  static_assert(Tokens == 2 || Tokens == 4 || Tokens == 8, "token capacity 2, 4 or 8");
  static_assert(Rows % 32 == 0 && Threads % 32 == 0 && Threads / 32 >= Rows / 16, "policy shape");
  static std::string name() {
    return std::string(Mma ? "bglu_mma_b" : "bglu_b") + std::to_string(Tokens) + "_t" + std::to_string(Threads) +
           "_c" + std::to_string(Rows) + "_m" + std::to_string(MinBlocks);
  }
};

//! The tensor cores win at B = 8, where the CUDA-core kernel is bound by its multiply-adds (ncu, Qwen3-8B:
//! 63 % SM throughput, 53 % of DRAM bandwidth), and lose at B = 2 and 4 (FFN +4 to +13 % on 8B to 32B, H100,
//! docs/history.md), where the CUDA-core kernel streams at 68-73 % of DRAM bandwidth. At B = 4 a 320-thread
//! candidate covers a row of 2560 or 5120 inputs in 1 or 2 full steps, where 256 threads take 2 or 3 with the
//! last one a quarter or half busy (dispatch.cuh: the fewest load slots): FFN at B = 4 7 % faster on Qwen3-4B,
//! 2 % on 14B and 32B; 1-1.4 % slower on 1.7B and 8B, which keep 256 (H100, docs/history.md). At B = 2 it
//! spills (96 registers under 2 blocks of 320 threads; the GLU holds 4 rows and 2 tokens per step).
//! The native weights' candidates. The tensor cores win at B = 8, where the CUDA-core kernel is bound by its
//! multiply-adds (ncu, Qwen3-8B: 63 % SM throughput, 53 % of DRAM bandwidth), and lose at B = 2 and 4 (FFN +4
//! to +13 % on 8B to 32B, H100, docs/history.md), where the CUDA-core kernel streams at 68-73 % of DRAM
//! bandwidth. At B = 4 a 320-thread candidate covers a row of 2560 or 5120 inputs in 1 or 2 full steps, where
//! 256 threads take 2 or 3 with the last one a quarter or half busy (default_policy below: the fewest load
//! slots): FFN at B = 4 7 % faster on Qwen3-4B, 2 % on 14B and 32B; 1-1.4 % slower on 1.7B and 8B, which keep
//! 256 (H100, docs/history.md). At B = 2 it spills (96 registers under 2 blocks of 320 threads; the GLU holds
//! 4 rows and 2 tokens per step).
template <int Tokens>
struct NativeBatchedGluPolicies {
  using type = PolicyList<BatchedGluPolicy<Tokens, 256, 64, 2, (Tokens == 8)>>;
};
template <>
struct NativeBatchedGluPolicies<4> {
  using type = PolicyList<BatchedGluPolicy<4, 256, 64, 2>, BatchedGluPolicy<4, 320, 64, 2>>;
};

namespace detail {
//! A list of BatchedGluPolicy with every tensor-core candidate on the CUDA cores instead.
template <class List>
struct CudaCoreGluList;
template <class... Ps>
struct CudaCoreGluList<PolicyList<Ps...>> {
  using type = PolicyList<BatchedGluPolicy<Ps::kTokens, Ps::kThreads, Ps::kRows, Ps::kMinBlocks, false>...>;
};
}  // namespace detail

//! The candidates of capacity Tokens for Stage-2 format Fmt: the native lists, on the CUDA cores for a format
//! without the tensor-core kernel (Fmt::kHasMma false).
template <int Tokens, class Fmt = NativeWeights<__half>>
struct BatchedGluPoliciesFor {
  using Native = typename NativeBatchedGluPolicies<Tokens>::type;
  using type = std::conditional_t<Fmt::kHasMma, Native, typename detail::CudaCoreGluList<Native>::type>;
};

namespace detail {
//! The CUDA-core GLU rows of a BatchedGluPolicy (glu_gemv.cuh's block with the policy's token capacity).
template <class P, class T, class Fmt>
struct BatchedGluRowsFor {
  using type = GluRows<P::kThreads, P::kRows, P::kRowBatch, 1, P::kTokens, T, Fmt>;
};
template <class P, class T, class Fmt>
using BatchedGluRowsOf = typename BatchedGluRowsFor<P, T, Fmt>::type;

//! s[b][j] = u act(g) where token b selected channel j, +0 where it did not (the batched GLU's epilogue).
template <class Args, class Act>
PROX_DEVICE PROX_FORCEINLINE void batched_glu_store(const Args& a, int b, int j, float g, float u, const Act& act) {
  const int n_words = a.d_ff / kWarpSize;
  const bool mine = (a.channel_mask[static_cast<std::size_t>(b) * n_words + j / kWarpSize] >> (j % kWarpSize)) & 1u;
  a.s[static_cast<std::size_t>(b) * a.d_ff + j] = mine ? u * act(g) : 0.0f;
}
}  // namespace detail

//! The batched GLU GEMV on the CUDA cores (BatchedGluPolicy with Mma = false): the union's channels by rank
//! (detail::GluRows), s of every token.
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_glu_gemv_kernel(
    const BatchedGluGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  using Rows = detail::BatchedGluRowsOf<Policy, T, Fmt>;
  __shared__ typename Rows::Storage s_rows;
  __shared__ int s_warp[Policy::kThreads / kWarpSize];
  const detail::GluRange range =
      detail::glu_begin<Policy::kThreads>(a, ws, s_warp);
  const Act act{};
  Rows::run(a.x, a.d_model, a.d_ff, a.w_gate, a.w_up, a.union_mask, a.tokens, range, s_rows,
            [&](int b, int j, float g, float u) { detail::batched_glu_store(a, b, j, g, u, act); });
}

//! The batched GLU GEMV on the tensor cores (BatchedGluPolicy with Mma = true): same arguments, outputs and
//! zero fill as batched_glu_gemv_kernel; the channel sums are combined over the d_model slices in order.
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_glu_mma_kernel(
    const BatchedGluGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  static_assert(Fmt::kHasMma && std::is_same_v<typename Fmt::Element, T>, "tensor cores: weights of the activation type");
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kRows = Policy::kRows;
  constexpr int kU = Policy::kUnroll;
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ int s_ch[kRows];
  __shared__ float s_part[kWarps][2][kRows][8];  // [d_model slice][gate, up][row][token (8: the mma's n)]
  __shared__ int s_warp[kWarps];

  const detail::GluRange range = detail::glu_begin<kThreads>(a, ws, s_warp);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int tokens = a.tokens;
  const int n_words = a.d_ff / kWarpSize;

  // Lane (g, t) = (lane / 4, lane % 4): fragment rows g and g + 8 are channels 16 cg + g and 16 cg + g + 8 of
  // the sub-batch; a 32-element step of d_model gives lane t the elements 8t .. 8t+7 of both rows, of both
  // matrices and of token g's x: their 32-bit words 0, 1 (2, 3) are the fragments' k = 2t, 2t+8 of the
  // step's first (second) m16n8k16. The k order within a step is free for a dot product, so the loads
  // are plain 16-byte row pieces. Token g >= tokens reads x = 0.
  const int g = lane >> 2;
  const int t = lane & 3;
  const Act act{};
  const int k32 = (a.d_model + 31) / 32;
  const std::size_t ld = static_cast<std::size_t>(a.d_model);
  const bool x_ok = g < tokens;
  const T* xg = a.x + static_cast<std::size_t>(x_ok ? g : 0) * ld + 8 * t;
#pragma unroll 1
  for (int sub = range.lo; sub < range.hi; sub += kRows) {
    const int count = min(kRows, range.hi - sub);
    detail::gather_rank_range<kThreads>(a.union_mask, n_words, range.offset, sub, sub + count, s_ch);
    __syncthreads();
    // As many 16-channel groups as the sub-batch needs; the warps left over split d_model between them.
    const int groups = (count + 15) / 16;
    const int split = kWarps / groups;
    const int cg = warp % groups;
    const int kh = warp / groups;
    if (kh < split) {
      const int ra = cg * 16 + g;
      const int rb = ra + 8;
      const bool ok_a = ra < count;
      const bool ok_b = rb < count;
      const std::size_t off_a = static_cast<std::size_t>(s_ch[ok_a ? ra : 0]) * ld + 8 * t;
      const std::size_t off_b = static_cast<std::size_t>(s_ch[ok_b ? rb : 0]) * ld + 8 * t;
      const int per = (k32 + split - 1) / split;
      const int s0 = kh * per;
      const int s1 = min(k32, s0 + per);
      float c[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int e = 0; e < 4; ++e) c[m][e] = 0.0f;
      }
      struct Step {
        uint4 w[kU][4];  // [step][gate row a, gate row b, up row a, up row b]
        uint4 x[kU];
      };
      const auto load_step = [&](int it, Step& d) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int st = s0 + it * kU + u;
          const std::size_t k = static_cast<std::size_t>(st) * 32;
          const bool in = st < s1 && static_cast<int>(k) + 8 * t < a.d_model;
          d.w[u][0] = ld_stream_16(Fmt::data(a.w_gate) + off_a + k, in && ok_a);
          d.w[u][1] = ld_stream_16(Fmt::data(a.w_gate) + off_b + k, in && ok_b);
          d.w[u][2] = ld_stream_16(Fmt::data(a.w_up) + off_a + k, in && ok_a);
          d.w[u][3] = ld_stream_16(Fmt::data(a.w_up) + off_b + k, in && ok_b);
          d.x[u] = ld_cached_16(xg + k, in && x_ok);
        }
      };
      const auto compute_step = [&](const Step& d) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const uint4& wa = d.w[u][2 * m];
            const uint4& wb = d.w[u][2 * m + 1];
            detail::mma_16816_bits<T>(c[m], wa.x, wb.x, wa.y, wb.y, d.x[u].x, d.x[u].y);
            detail::mma_16816_bits<T>(c[m], wa.z, wb.z, wa.w, wb.w, d.x[u].z, d.x[u].w);
          }
        }
      };
      const int steps = (s1 - s0 + kU - 1) / kU;
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
      // c[m]: (row a, token 2t), (row a, 2t + 1), (row b, 2t), (row b, 2t + 1).
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        s_part[kh][m][ra][2 * t] = c[m][0];
        s_part[kh][m][ra][2 * t + 1] = c[m][1];
        s_part[kh][m][rb][2 * t] = c[m][2];
        s_part[kh][m][rb][2 * t + 1] = c[m][3];
      }
    }
    __syncthreads();
    for (int i = tid; i < count * kB; i += kThreads) {
      const int b = i / count;
      const int r = i % count;
      if (b >= tokens) continue;
      float gs = 0.0f;
      float us = 0.0f;
      for (int w = 0; w < split; ++w) {  // in slice order: deterministic
        gs += s_part[w][0][r][b];
        us += s_part[w][1][r][b];
      }
      detail::batched_glu_store(a, b, s_ch[r], gs, us, act);  // native weights: no scale (kHasMma)
    }
    __syncthreads();
  }
}

/**
 * @brief The batched GLU GEMV as a planned op (operator.cuh's contract). No workspace of its own; in
 * SparseFfn it stamps the workspace header ready (as GluGemvOp does).
 * @tparam T activations; @tparam Act SiLU / GeluTanh; @tparam Tokens capacity 2, 4, 8; @tparam Fmt the
 * Stage-2 weight format.
 */
template <class T, class Act = SiLU, int Tokens = 2, class Fmt = NativeWeights<T>>
struct BatchedGluGemvOp {
  static constexpr const char* kName = "batched_glu_gemv";
  static constexpr int kTokens = Tokens;
  using Format = Fmt;
  using Args = BatchedGluGemvArgs<T, Fmt>;
  using Policies = typename BatchedGluPoliciesFor<Tokens, Fmt>::type;
  using Rules = detail::GluOpRules<T, Fmt>;
  struct Options {
    bool pdl = false;     //!< launch with PDL (sm_90+)
    int grid_blocks = 0;  //!< blocks to launch; 0 = one wave (SMs x kMinBlocks)
  };
  //! GluGemvOp's rules, tokens in [1, Tokens], union_mask required.
  static Status can_implement(const Args& a) noexcept {
    return Rules::can_implement(a, a.union_mask, true, a.tokens, Tokens);
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options& o) noexcept { return Rules::check_options(o); }
  static WorkspaceNeeds workspace_needs(const Args&) noexcept { return {}; }
  template <class P>
  static Status configure(const Args&, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    return Rules::template configure<P>(o.grid_blocks, d, lc);
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    if constexpr (P::kMma) {
      return detail::launch_kernel(batched_glu_mma_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
    } else {
      return detail::launch_kernel(batched_glu_gemv_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
    }
  }
};

/**
 * @brief Batched GLU GEMV: as the batch-1 fused Stage 2's rule, the fewest GLU load slots per row of d_model
 * inputs (detail::fewest_load_slots): at B = 4, 320 threads on d_model 2560 and 5120, 256 on 2048 and 4096.
 */
template <class T, class Act, int B, class Fmt>
int default_policy(BatchedGluGemvOp<T, Act, B, Fmt>, const DeviceInfo&, const BatchedGluGemvArgs<T, Fmt>& a) noexcept {
  return detail::fewest_load_slots<typename BatchedGluGemvOp<T, Act, B, Fmt>::Policies>(
      [&](auto p) { return detail::BatchedGluRowsOf<decltype(p), T, Fmt>::row_slots(a.d_model); });
}

PROX_NAMESPACE_END
