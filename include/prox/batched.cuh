// SPDX-License-Identifier: Apache-2.0
//! @file batched.cuh  Batched decode: the Prox FFN's ops for 2..8 tokens per call (speculative
//! verification, small-batch serving, beam search).
//!
//! Semantics: every token gets what batch-1 Prox would give it -- its own Stage-1 input set, its own
//! channel set and its own exact Stage-2 result -- while each weight row is read once per call when any
//! token needs it:
//!   BatchedProxyGemvOp  Stage 1 over the union of the tokens' kept inputs: a token's x is 0 on a row
//!                       it did not keep, so the row adds nothing to its sums. Per-token channel masks
//!                       and their union.
//!   BatchedGluGemvOp    exact gate/up rows of the union's channels, every token's dot products from
//!                       the same bytes; s[b][j] = u * act(g) where token b selected j, else +0.
//!   BatchedDownGemvOp   the union's rows of W_down^T, each token weighted by its own s (0 where it did
//!                       not select the channel).
//! Each op is a planned op (operator.cuh's contract) with a compile-time token capacity kTokens (2, 4
//! or 8: the tile shapes follow it) and a run-time `tokens` in [1, kTokens]. SparseFfn::run_batch
//! drives them. INT4 proxy weights only (the method); the A1 ablation's fp16 proxies stay batch-1.
//!
//! Results are deterministic (fixed assignment of work, fixed addition order) but not bit-identical to
//! batch 1: the union changes how kept rows are grouped into Stage 1's fp16 steps and its split-K
//! chunks' row groups, and the batched kernels' reduction trees differ from batch 1's (docs/api.md).
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
#include "detail/rank_range.cuh"
#include "detail/tile_reduce.cuh"
#include "down_gemv.cuh"
#include "int4.cuh"
#include "proxy_gemv.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

//! Most tokens one batched call takes.
constexpr int kMaxBatchTokens = 8;

//! The compiled token capacity that serves `tokens` (2..8): 2, 4 or 8.
constexpr int batch_capacity(int tokens) noexcept { return tokens <= 2 ? 2 : tokens <= 4 ? 4 : 8; }

// ================================================================ Stage 1
/**
 * @brief Arguments of the batched Stage-1 proxy GEMV (INT4 proxies). All pointers are device pointers.
 * Per-token arrays are token-major with the row strides given (x: d_model; masks: d_ff / 32; s_proxy:
 * d_ff).
 */
template <class T>
struct BatchedProxyGemvArgs {
  using Matrix = Int4Weights::Matrix;
  const T* x = nullptr;  //!< [tokens][d_model], element-aligned
  int tokens = 0;        //!< 1..the op's kTokens
  int d_model = 0;       //!< 1..2^20
  int d_ff = 0;          //!< a multiple of 32, 32..2^20
  float tau_x = 0.0f;    //!< input threshold (>= 0), the same for every token (thresholds are per layer)
  float tau_s = 0.0f;    //!< channel threshold (>= 0)
  const float* thresholds = nullptr;  //!< optional device {tau_x, tau_s} (as ProxyGemvArgs::thresholds)
  Matrix gate{};
  Matrix up{};
  std::uint32_t* channel_mask = nullptr;  //!< out [tokens][d_ff/32]: token b's selected channels
  std::uint32_t* union_mask = nullptr;    //!< out [d_ff/32]: channels any token selected (Stage 2 reads it)
  float* s_proxy = nullptr;               //!< out [tokens][d_ff] (optional): each token's s~
  //! Optional runtime statistics (accumulated): counters[b] for token b < tokens, counters[tokens] for
  //! the union (kept_inputs: inputs any token kept; selected_channels: the union's channels).
  SparsityCounters* counters = nullptr;
};

/**
 * @brief Policy of the batched Stage 1 (vocabulary: core/policy.hpp). Each warp streams 16 union rows of a
 * 128-channel tile per step and multiplies them on the tensor cores (m16n8k16, fp16 in, fp32 accumulate):
 * the INT4 decode is done once for all tokens. The result is laid out per token group of 2 tokens and
 * 8 slots of 16 channels (the reduction's columns).
 * @tparam Tokens    token capacity (2, 4, 8)
 * @tparam Threads   threads per block
 * @tparam Chunk     input coordinates per block (split-K), a multiple of 16
 * @tparam MinBlocks __launch_bounds__ minimum resident blocks per SM
 * @tparam SplitMats each warp streams gate or up, not both (kSplitMats)
 */
template <int Tokens, int Threads, int Chunk, int MinBlocks, bool SplitMats = false>
struct BatchedProxyPolicy {
  static constexpr int kTokens = Tokens;
  //! Each warp streams one matrix (gate or up: warps in pairs) instead of both: half the accumulators
  //! and loads per thread, so 80 registers and 3 blocks of 256 threads per SM instead of 128 and 2.
  static constexpr bool kSplitMats = SplitMats;
  //! A split candidate is a candidate only where its grid needs exactly two waves (dispatch.cuh).
  static constexpr bool kTwoWaves = SplitMats;
  static constexpr int kThreads = Threads;
  static constexpr int kChunk = Chunk;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr int kTokensPerThread = 2;
  static constexpr int kTokenGroups = Tokens / kTokensPerThread;
  static constexpr int kSlots = 8;             //!< 16-channel slots of a tile (one per lane group of 4)
  static constexpr int kTile = kSlots * Int4Weights::kChannelsPerVec;  //!< 128 channels
  static constexpr int kTn = kSlots * kTokenGroups;  //!< reduction column blocks of 16 channels
  //! Split d_model into detail::balanced_chunks (B = 2, 4) or into the policy's own ceil(d_model / kChunk)
  //! (B = 8: the balanced split made the Qwen3-1.7B FFN 2 % slower there, H100).
  static constexpr bool kBalanced = Tokens < 8;
  static_assert(Tokens % 2 == 0 && Tokens <= kMaxBatchTokens, "token capacity 2, 4 or 8");
  static_assert(kTn <= kWarpSize && Threads % kTn == 0 && Threads % kWarpSize == 0, "policy shape");
  static_assert(Chunk % 16 == 0, "the tensor-core steps take 16 rows");
  static std::string name() {
    return "bproxy_b" + std::to_string(Tokens) + "_t" + std::to_string(Threads) + "_k" + std::to_string(Chunk) +
           "_m" + std::to_string(MinBlocks) + (SplitMats ? "_split" : "");
  }
};

//! The candidates of a token capacity (dispatch.cuh picks the fewest waves, then the most blocks; B = 2
//! and 4 split d_model into detail::balanced_chunks, so kChunk is the longest chunk). Long chunks: with
//! 512-input chunks at B = 2 a block streamed its ~260 union rows in 4 steps, and the Qwen3-8B grid took 3
//! waves. Outside its row stream the kernel spends about 10 us (ncu, Qwen3-8B B = 4: launch, x, combine
//! and epilogue, docs/history.md). At B = 2 and 4, 256-thread blocks (2 per SM) beat 128-thread ones (4 per SM)
//! by 9 % on the Qwen3-14B FFN at B = 4, and by 1-18 % on the 4B-32B shapes with balanced chunks (H100,
//! docs/history.md); the 2048-input chunk then needs 58 KB of shared memory (dynamic, opt-in). B = 8
//! stays at 128 threads: its 168 registers per thread would spill under 2 blocks of 256. Its 1024-input
//! chunks (54 KB, dynamic) make the Qwen3-8B grid one wave of 3 blocks per SM instead of two (768 -> 384
//! blocks; ncu Stage 1 41.8 -> 34.4 us) and the 14B one 1.7 waves instead of 3.4: FFN at B = 8 3.7-4.3 %
//! faster on 8B, 14B and 32B. Where shorter chunks also fit one wave (1.7B, 4B) they keep more blocks.
//! The split candidate (kSplitMats: 80 registers, 3 blocks per SM) is a default only where its grid needs
//! two waves: on Qwen3-14B (680 blocks against 408, both 2 waves) the FFN at B = 2 and 4 is 1.2 % faster.
//! In one wave it lost although the kernel was faster (Qwen3-8B B = 2: 384 blocks against 192, Stage 1
//! 18.4 -> 17.3 us under ncu, the FFN 0.5 % slower: 3 full blocks per SM leave the PDL-launched GLU
//! kernel no room to start early); in three (Qwen3-32B, 1000 blocks against 600) the FFN was 0.9-1.2 %
//! slower (H100, docs/history.md).
template <int Tokens>
struct BatchedProxyPoliciesFor;
template <>
struct BatchedProxyPoliciesFor<2> {
  using type = PolicyList<BatchedProxyPolicy<2, 256, 1024, 2>, BatchedProxyPolicy<2, 256, 2048, 2>,
                         BatchedProxyPolicy<2, 256, 1024, 3, true>>;
};
template <>
struct BatchedProxyPoliciesFor<4> {
  using type = PolicyList<BatchedProxyPolicy<4, 256, 1024, 2>, BatchedProxyPolicy<4, 256, 2048, 2>,
                         BatchedProxyPolicy<4, 256, 1024, 3, true>>;
};
template <>
struct BatchedProxyPoliciesFor<8> {
  using type = PolicyList<BatchedProxyPolicy<8, 128, 1024, 3>, BatchedProxyPolicy<8, 128, 512, 3>,
                         BatchedProxyPolicy<8, 128, 256, 3>>;
};

namespace detail {

/**
 * @brief d += A B for one m16n8k16 tensor-core tile (sm_80+): A 16 x 16 of T = fp16 or bf16 (row-major
 * fragment, two values per register, lower k in the low half: a0 rows g, k 2t..2t+1; a1 rows g+8; a2 rows
 * g, k 2t+8..2t+9; a3 rows g+8), B 16 x 8 of T (b0: k 2t..2t+1, column g; b1: k 2t+8..2t+9), fp32
 * accumulators d (rows g and g+8, columns 2t and 2t+1), where g is lane / 4 and t is lane % 4 (PTX ISA,
 * "Matrix Fragments for mma.m16n8k16").
 */
template <class T>
PROX_DEVICE PROX_FORCEINLINE void mma_16816_bits(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                                 std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
  // sm_75 (a fat binary's older target; plan() refuses the device) has no m16n8k16: for fp16, two m16n8k8
  // over k 0..7 (a0, a1, b0) and k 8..15 (a2, a3, b1) give the same sums; it has no bf16 mma at all.
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a2), "r"(a3), "r"(b1));
  } else {
    __trap();
  }
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

//! mma_16816_bits for fp16 fragments given as __half2.
PROX_DEVICE PROX_FORCEINLINE void mma_16816(float (&d)[4], const __half2 (&a)[4], uint2 b) {
  mma_16816_bits<__half>(d, pair_bits(a[0]), pair_bits(a[1]), pair_bits(a[2]), pair_bits(a[3]), b.x, b.y);
}

//! The batched Stage 1's large shared arrays, in dynamic shared memory (above 48 KB with 256-thread blocks:
//! the block reduction holds a row of partial sums per warp); BatchedProxyGemvOp::configure sizes it.
template <class Policy>
struct BatchedProxySmem {
  using Reducer = TileReducer<Policy::kThreads, Policy::kTn, 16, 2 * Policy::kTokensPerThread>;
  typename Reducer::Storage red;
  int rows[Policy::kChunk];                                     //!< the union's kept rows of the chunk
  __align__(16) __half x[Policy::kTokens][Policy::kChunk];  //!< x 2^-6 per token and kept row (0: not kept)
};

}  // namespace detail

template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_proxy_gemv_kernel(
    const BatchedProxyGemvArgs<T> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kTpt = Policy::kTokensPerThread;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kChunk = Policy::kChunk;
  constexpr int kTile = Policy::kTile;  // channels of a tile
  constexpr int kTn = Policy::kTn;
  constexpr int kMats = 2 * kTpt;
  constexpr int kWarps = kThreads / kWarpSize;
  // Reducer columns: token group g's channel ch is column g * kTile + ch.
  using Smem = detail::BatchedProxySmem<Policy>;
  using Reducer = typename Smem::Reducer;
  static_assert(std::is_same_v<Reducer, detail::TileReducer<kThreads, kTn, 16, kMats>>, "reducer shape");
  constexpr int kCols = kTn * 16;
  constexpr int kXPer = kChunk / kThreads;  // coordinates of x per thread and token
  static_assert(kChunk % kThreads == 0 && (kXPer == 2 || kXPer == 4 || kXPer == 8), "runs of 2, 4 or 8");

  extern __shared__ __align__(16) unsigned char prox_batched_proxy_smem[];
  Smem& smem = *reinterpret_cast<Smem*>(prox_batched_proxy_smem);
  int(&s_rows)[kChunk] = smem.rows;
  __half(&s_x)[kB][kChunk] = smem.x;
  typename Reducer::Storage& s_red = smem.red;
  __shared__ int s_warp[kWarps];
  __shared__ std::uint32_t s_union[kTile / kWarpSize];
  __shared__ int s_ready;

  const int tid = static_cast<int>(threadIdx.x);
  const int tile = static_cast<int>(blockIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int n0 = tile * kTile;
  const int chunk_len = detail::split_chunk_length(a.d_model, static_cast<int>(gridDim.y), kChunk, 16);
  const int k0 = chunk * chunk_len;
  const int ncols = min(kTile, a.d_ff - n0);  // a multiple of 32
  const int tokens = a.tokens;

  pdl_wait();
  pdl_launch_dependents();
  const float tau_x = a.thresholds != nullptr ? __ldg(a.thresholds) : a.tau_x;
  const float tau_s = a.thresholds != nullptr ? __ldg(a.thresholds + 1) : a.tau_s;
  const detail::HeaderWords header =
      tid == 0 ? detail::workspace_header(ws.guard, blockIdx.x + blockIdx.y) : detail::HeaderWords{};
  // The scales of the one channel this thread finishes in the epilogue (tile column tid % kTile for every
  // token), loaded now: the last block of a tile does not wait for them after the combine (as
  // proxy_gemv_kernel).
  static_assert(kThreads % kTile == 0, "a thread's epilogue channel is the same for every token");
  const int my_ch = tid % kTile;
  const bool my_in = my_ch < ncols;
  const float my_sg = my_in ? a.gate.scales[n0 + my_ch] : 0.0f;
  const float my_su = my_in ? a.up.scales[n0 + my_ch] : 0.0f;

  // 1. Threshold every token's chunk of x; compact the union of the kept coordinates, in order. Thread t
  // owns the kXPer consecutive coordinates k0 + t kXPer .. + kXPer - 1 of every token: one vector load
  // per token (x aligned to the run), all issued before the first compare. (Strided scalar loads, kXPer
  // per token, made the prologue the larger part of the kernel: 9.8 of 32.5 us on Qwen3-8B at B = 4,
  // ncu on the H100, docs/history.md.) The chunk starts at a multiple of 16 and d_model is a multiple of
  // 8, so a thread's run lies wholly inside or wholly outside the chunk and the matrix.
  const int kk0 = tid * kXPer;
  const bool run_in = kk0 < chunk_len && k0 + kk0 < a.d_model;
  const bool vec = reinterpret_cast<std::uintptr_t>(a.x) % (kXPer * sizeof(T)) == 0;
  float xv[kB][kXPer];
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    if (run_in && b < tokens) {
      load_run<kXPer>(a.x + static_cast<std::size_t>(b) * a.d_model + k0 + kk0, vec, xv[b]);
    } else {
#pragma unroll
      for (int i = 0; i < kXPer; ++i) xv[b][i] = 0.0f;
    }
  }
  bool keep[kB][kXPer];
  bool any[kXPer];
  int mine = 0;
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    any[i] = false;
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      keep[b][i] = run_in && b < tokens && keep_magnitude(xv[b][i], tau_x);
      any[i] = any[i] || keep[b][i];
    }
    mine += any[i] ? 1 : 0;
  }
  // Runs in thread order are coordinates in order: the union's rows are listed in increasing k.
  int count = 0;
  int at = block_exclusive_sum<kThreads>(mine, s_warp, &count);
  if (tid < kTile / kWarpSize) s_union[tid] = 0u;
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    if (any[i]) {
      s_rows[at] = k0 + kk0 + i;
#pragma unroll
      for (int b = 0; b < kB; ++b) s_x[b][at] = __float2half_rn(keep[b][i] ? xv[b][i] * Int4Weights::kXScale : 0.0f);
      ++at;
    }
  }
  // The tensor-core steps take 16 rows: x is 0 on the rows past the union up to the next multiple of 16
  // (their weight loads are predicated off and decode to 0; 0 x stale shared memory could be NaN).
  for (int i = tid; i < kB * 16; i += kThreads) {
    const int r = count + i % 16;
    if (r < ((count + 15) & ~15)) s_x[i / 16][r] = __float2half_rn(0.0f);
  }
  if (tid == 0) s_ready = detail::workspace_ready(header, ws.guard);
  __syncthreads();
  const bool ready = s_ready != 0;
  if (a.counters != nullptr && tile == 0) {
    // Per-token kept counts of this chunk: one warp-reduced atomic per token and warp.
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      int mine = 0;
#pragma unroll
      for (int i = 0; i < kXPer; ++i) mine += keep[b][i] ? 1 : 0;
      int sum = mine;
#pragma unroll
      for (int off = kWarpSize / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (b < tokens && lane_id() == 0 && sum > 0)
        atomicAdd(&a.counters[b].kept_inputs, static_cast<unsigned long long>(sum));
    }
    if (tid == 0) {
      atomicAdd(&a.counters[tokens].kept_inputs, static_cast<unsigned long long>(count));
      if (chunk == 0) {
        for (int b = 0; b <= tokens; ++b) atomicAdd(&a.counters[b].calls, 1ull);
      }
    }
  }

  // 2. Stream the union's rows of this tile, and 3. reduce over the block's row groups.
  // Tensor cores: per step a warp takes 16 union rows of the 128-channel tile, one m16n8k16 tile per
  // 2 x 8 channels and matrix: A = the decoded INT4 weights (16 channels x 16 rows), B = x (16 rows x 8
  // tokens; tokens past kB are 0), fp32 accumulators. Lane (g, t) = (lane / 4, lane % 4) loads 8 bytes
  // (channels n0 + 16 g .. + 15) of the step's rows 4t .. 4t+3 of gate and up: the reduction's order
  // within a step is free, so these 4 rows are the fragment's k = 2t, 2t+1, 2t+8, 2t+9, and a byte
  // permute pairs two rows' nibbles of one channel before the usual decode. Lane (g, t) ends with
  // channels n0 + 16 g .. + 15 of tokens 2t, 2t+1 (token group t). The decode is done once for all
  // tokens and the products run on the tensor cores (docs/history.md: a CUDA-core version decoded
  // per 2 tokens and was compute-bound at 24 % of DRAM bandwidth at B = 2, Qwen3-8B, H100).
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int n = n0 + g * 16;
  const bool col_ok = n < a.d_ff;
  const std::size_t row_bytes = Int4Weights::row_bytes(a.d_ff);
  const char* gate = static_cast<const char*>(Int4Weights::data(a.gate)) + Int4Weights::col_bytes(n);
  const char* up = static_cast<const char*>(Int4Weights::data(a.up)) + Int4Weights::col_bytes(n);
  // kSplitMats: warp w streams matrix w % 2 (gate, up) only, the pair's steps as one warp's.
  constexpr int kMw = Policy::kSplitMats ? 1 : 2;  // matrices per warp
  static_assert(kMw == 2 || kWarps % 2 == 0, "warps in pairs");
  const int my_m = kMw == 2 ? 0 : (warp & 1);  // kMw == 1: this warp's matrix
  constexpr int kStreams = kMw == 2 ? kWarps : kWarps / 2;  // warps that stream one matrix's rows
  const int sw = kMw == 2 ? warp : warp / 2;
  const char* mat0 = kMw == 2 ? gate : (my_m ? up : gate);
  float c[kMw][8][4];
#pragma unroll
  for (int m = 0; m < kMw; ++m) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) c[m][i][e] = 0.0f;
    }
  }
  struct Step {
    Piece<8> w[kMw][4];  // [gate, up] (kSplitMats: [this warp's matrix]) [row 4t + j]
  };
  const int steps = (count + 15) / 16;
  const auto load_step = [&](int st, Step& d) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = st * 16 + 4 * t + j;
      const bool ok = col_ok && r < count;
      const std::size_t off = static_cast<std::size_t>(s_rows[ok ? r : 0]) * row_bytes;
      d.w[0][j] = ld_stream_piece<8>(mat0 + off, ok, Int4Weights::kFill);
      if constexpr (kMw == 2) d.w[1][j] = ld_stream_piece<8>(up + off, ok, Int4Weights::kFill);
    }
  };
  const auto compute_step = [&](int st, const Step& d) {
    uint2 xb = make_uint2(0u, 0u);
    if (g < kB) xb = *reinterpret_cast<const uint2*>(&s_x[g < kB ? g : 0][st * 16 + 4 * t]);
#pragma unroll
    for (int m = 0; m < kMw; ++m) {
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        __half2 ev01[4], od01[4], ev23[4], od23[4];  // even / odd channels, rows (4t, 4t+1) / (4t+2, 4t+3)
        int4::dequant_word(__byte_perm(d.w[m][0].w[w], d.w[m][1].w[w], 0x5410u), ev01);
        int4::dequant_word(__byte_perm(d.w[m][0].w[w], d.w[m][1].w[w], 0x7632u), od01);
        int4::dequant_word(__byte_perm(d.w[m][2].w[w], d.w[m][3].w[w], 0x5410u), ev23);
        int4::dequant_word(__byte_perm(d.w[m][2].w[w], d.w[m][3].w[w], 0x7632u), od23);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __half2 af[4] = {ev01[j], od01[j], ev23[j], od23[j]};  // A rows g: channel 2j, g+8: 2j+1
          detail::mma_16816(c[m][4 * w + j], af, xb);
        }
      }
    }
  };
  Step b0;
  Step b1;
  int st = sw;
  load_step(st, b0);
#pragma unroll 1
  for (; st + kStreams < steps; st += 2 * kStreams) {
    load_step(st + kStreams, b1);
    compute_step(st, b0);
    load_step(st + 2 * kStreams, b0);
    compute_step(st + kStreams, b1);
  }
  if (st < steps) compute_step(st, b0);
  // Word w, pair j: A row g is channel 8w + 2j of the slot, row g + 8 channel 8w + 2j + 1; C columns are
  // tokens 2t, 2t + 1. Scaled back by 2^6 (exact) into the reducer's layout: token group t's column
  // block t * kSlots + g.
  if (t < Policy::kTokenGroups) {
    const int col = (t * Policy::kSlots + g) * 16;
#pragma unroll
    for (int m = 0; m < kMw; ++m) {
      const int mm = kMw == 2 ? m : my_m;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int ch = 8 * (i / 4) + 2 * (i % 4);
        s_red.red[warp][2 * mm][Reducer::pad(col + ch)] = c[m][i][0] * Int4Weights::kXUnscale;
        s_red.red[warp][2 * mm + 1][Reducer::pad(col + ch)] = c[m][i][1] * Int4Weights::kXUnscale;
        s_red.red[warp][2 * mm][Reducer::pad(col + ch + 1)] = c[m][i][2] * Int4Weights::kXUnscale;
        s_red.red[warp][2 * mm + 1][Reducer::pad(col + ch + 1)] = c[m][i][3] * Int4Weights::kXUnscale;
        if constexpr (kMw == 1) {  // the other matrix's rows of this warp: 0
          const int om = 1 - my_m;
          s_red.red[warp][2 * om][Reducer::pad(col + ch)] = 0.0f;
          s_red.red[warp][2 * om + 1][Reducer::pad(col + ch)] = 0.0f;
          s_red.red[warp][2 * om][Reducer::pad(col + ch + 1)] = 0.0f;
          s_red.red[warp][2 * om + 1][Reducer::pad(col + ch + 1)] = 0.0f;
        }
      }
    }
  }
  Reducer::combine_warps(s_red);

  // 4. The split-K combine across chunks.
  if (!ready) {
    // Not initialized or another layout: the counters cannot be trusted. Zero them and the next
    // kernel's sync words, flag the header; the chunk-0 block of each tile selects every channel of
    // every token (Stage 2 then computes the exact dense FFN) and writes NaN s~.
    detail::proxy_not_ready<kTile>(ws, a.d_ff, n0, ncols, chunk, /*select_all=*/false, nullptr, nullptr, nullptr);
    if (chunk != 0) return;
    for (int i = tid; i < (tokens + 1) * ncols; i += kThreads) {
      const int b = i / ncols;  // b == tokens: the union
      const int ch = i % ncols;
      if (ch % kWarpSize == 0) {
        std::uint32_t* m = b < tokens ? a.channel_mask + static_cast<std::size_t>(b) * (a.d_ff / kWarpSize)
                                      : a.union_mask;
        m[(n0 + ch) / kWarpSize] = 0xffffffffu;
      }
      if (b < tokens && a.s_proxy != nullptr)
        a.s_proxy[static_cast<std::size_t>(b) * a.d_ff + n0 + ch] = __int_as_float(0x7fc00000);
    }
    if (a.counters != nullptr && tid <= tokens)
      atomicAdd(&a.counters[tid].selected_channels, static_cast<unsigned long long>(ncols));
    return;
  }
  if (!Reducer::split_k(s_red, static_cast<float*>(ws.scratch), ws.sync + tile, gridDim.x * kCols, tile * kCols,
                        kCols, chunk, static_cast<int>(gridDim.y))) {
    return;
  }

  // 5. Epilogue: each warp takes whole 32-channel words of one token: rescale, s~, threshold, ballot.
  const Act act{};
  constexpr int kPairs = kB * kTile;
#pragma unroll 1
  for (int i0 = 0; i0 < kPairs; i0 += kThreads) {
    const int i = i0 + tid;
    const int b = i / kTile;  // warp-uniform (kTile is a multiple of 32)
    const int ch = my_ch;  // i % kTile: kThreads is a multiple of kTile
    const int j = n0 + ch;
    const bool in = i < kPairs && b < tokens && my_in;
    bool sel = false;
    if (in) {
      const int tg = b / kTpt;
      const int t = b % kTpt;
      const float g = Reducer::at(s_red, t, tg * kTile + ch) * my_sg;
      const float u = Reducer::at(s_red, kTpt + t, tg * kTile + ch) * my_su;
      const float s = u * act(g);
      sel = keep_magnitude(s, tau_s);
      if (a.s_proxy != nullptr) a.s_proxy[static_cast<std::size_t>(b) * a.d_ff + j] = s;
    }
    const unsigned word = __ballot_sync(0xffffffffu, sel);
    if (lane_id() == 0 && in) {
      a.channel_mask[static_cast<std::size_t>(b) * (a.d_ff / kWarpSize) + j / kWarpSize] = word;
      if (word != 0u) {
        atomicOr(&s_union[ch / kWarpSize], word);
        if (a.counters != nullptr)
          atomicAdd(&a.counters[b].selected_channels, static_cast<unsigned long long>(__popc(word)));
      }
    }
  }
  __syncthreads();
  if (tid < ncols / kWarpSize) {
    const std::uint32_t w = s_union[tid];
    a.union_mask[n0 / kWarpSize + tid] = w;
    if (a.counters != nullptr && w != 0u)
      atomicAdd(&a.counters[tokens].selected_channels, static_cast<unsigned long long>(__popc(w)));
  }
}

/**
 * @brief The batched Stage 1 as a planned op (operator.cuh's contract).
 * @tparam T `__half` / `__nv_bfloat16`; @tparam Act SiLU / GeluTanh; @tparam Tokens capacity 2, 4, 8.
 */
template <class T, class Act = SiLU, int Tokens = 2>
struct BatchedProxyGemvOp {
  static constexpr const char* kName = "batched_proxy_gemv";
  static constexpr int kTokens = Tokens;
  using Args = BatchedProxyGemvArgs<T>;
  using Policies = typename BatchedProxyPoliciesFor<Tokens>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };

  template <class P>
  static constexpr int num_tiles(int d_ff) noexcept {
    return ceil_div(d_ff, P::kTile);
  }
  //! Split-K chunks of d_model: more, shorter ones where the policy's own split leaves a grid of less
  //! than one wave (detail::balanced_chunks; B = 2 and 4 only, kBalanced).
  template <class P>
  static constexpr int num_chunks(int d_model, int d_ff, int sm_count) noexcept {
    if constexpr (!P::kBalanced) return ceil_div(d_model, P::kChunk);
    return detail::balanced_chunks(d_model, P::kChunk, 16, num_tiles<P>(d_ff),
                                   static_cast<long>(sm_count) * P::kMinBlocks);
  }
  //! The most chunks num_chunks() gives on any device (what the workspace's partials are sized for).
  template <class P>
  static constexpr int max_chunks(int d_model, int d_ff) noexcept {
    if constexpr (!P::kBalanced) return ceil_div(d_model, P::kChunk);
    return detail::max_balanced_chunks(d_model, P::kChunk, 16, num_tiles<P>(d_ff));
  }
  template <class P>
  static constexpr long num_blocks(int d_model, int d_ff, int sm_count) noexcept {
    return static_cast<long>(num_tiles<P>(d_ff)) * num_chunks<P>(d_model, d_ff, sm_count);
  }

  /**
   * @brief Validate without launching: ProxyGemvOp's rules (shape, thresholds, alignment), tokens in
   * [1, Tokens], channel_mask and union_mask required (Stage 2 reads both), counters 8-byte aligned.
   */
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || a.gate.packed == nullptr || a.up.packed == nullptr || a.gate.scales == nullptr ||
        a.up.scales == nullptr || a.channel_mask == nullptr || a.union_mask == nullptr)
      return Status::kErrorNullPointer;
    if (a.tokens < 1 || a.tokens > Tokens) return Status::kErrorInvalidArgument;
    PROX_RETURN_IF_ERROR(check_proxy_shape(a.d_model, a.d_ff));
    if (!valid_threshold(a.tau_x) || !valid_threshold(a.tau_s)) return Status::kErrorInvalidThreshold;
    if (!is_aligned(a.x, sizeof(T)) || !is_aligned(a.gate.packed, 16) || !is_aligned(a.up.packed, 16) ||
        !is_aligned(a.gate.scales, 4) || !is_aligned(a.up.scales, 4) || !is_aligned(a.channel_mask, 4) ||
        !is_aligned(a.union_mask, 4) || !is_aligned(a.s_proxy, 4) || !is_aligned(a.thresholds, 4) ||
        !is_aligned(a.counters, 8))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
  //! The shape of a plan: a plan made for `tokens` serves any count up to Tokens.
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }

  //! Tile counters in the region ProxyGemvOp uses (one per kMinTileWidth channels), and the split-K
  //! partials: chunks x (2 matrices x Tokens) x the tiles' channels.
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    WorkspaceNeeds w;
    w.sync = detail::tile_counter_bytes<detail::kMinTileWidth>(a.d_ff);
    for_each_policy<Policies>([&](auto p, int) {
      using P = decltype(p);
      const int chunks = max_chunks<P>(a.d_model, a.d_ff);
      const std::size_t cols = static_cast<std::size_t>(num_tiles<P>(a.d_ff)) * P::kTn * 16;
      const std::size_t parts = chunks > 1 ? sizeof(float) * 2 * P::kTokensPerThread * chunks * cols : 0;
      w.scratch = parts > w.scratch ? parts : w.scratch;
    });
    return w;
  }

  //! Plan time: grid (tiles, chunks) and the dynamic shared memory (detail::BatchedProxySmem), with the
  //! kernel's limit raised to it where it exceeds the default 48 KB.
  template <class P>
  static Status configure(const Args& a, const Options&, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(num_tiles<P>(a.d_ff)),
                    static_cast<unsigned>(num_chunks<P>(a.d_model, a.d_ff, d.sm_count)));
    lc->block = dim3(P::kThreads);
    if (lc->grid.y > 65535u) return Status::kErrorInvalidShape;
    lc->smem = sizeof(detail::BatchedProxySmem<P>);
    return detail::allow_dynamic_smem<batched_proxy_gemv_kernel<P, T, Act>>(d.device, lc->smem);
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(batched_proxy_gemv_kernel<P, T, Act>, lc, stream, a, ws);
  }
};

// ================================================================ Stage 2: GLU
/**
 * @brief Arguments of the batched masked GLU GEMV. All pointers are device pointers.
 */
template <class T>
struct BatchedGluGemvArgs {
  const T* x = nullptr;       //!< [tokens][d_model], 16-byte aligned
  int tokens = 0;             //!< 1..the op's kTokens
  int d_model = 0;            //!< a multiple of 8, 8..2^20
  int d_ff = 0;               //!< a multiple of 32, 32..2^20
  const T* w_gate = nullptr;  //!< [d_ff][d_model], 16-byte aligned
  const T* w_up = nullptr;    //!< [d_ff][d_model], 16-byte aligned
  const std::uint32_t* channel_mask = nullptr;  //!< [tokens][d_ff/32] each token's channels
  const std::uint32_t* union_mask = nullptr;    //!< [d_ff/32] their union (the rows read)
  float* s = nullptr;  //!< out [tokens][d_ff]: s[b][j] = u act(g) where token b selected j, +0 elsewhere
};

/**
 * @brief Policy of the batched GLU GEMV. A block takes its share of the union's channels in sub-batches
 * of kRows, in one of two ways:
 * - CUDA cores (Mma = false): as GluGemvPolicy, the whole block on a batch of kRowBatch rows, each thread
 *   on its 16-byte pieces of every row of the batch and of every token's x; the 2 x kRowBatch x Tokens dot
 *   products of a batch are reduced together (16 values).
 * - tensor cores (Mma = true): each warp multiplies a group of 16 channels' gate and up rows with every
 *   token's x over a slice of d_model (m16n8k16, fp32 accumulators), the group's warps splitting d_model
 *   between them; kUnroll 32-element steps per lane and pipeline stage.
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
  PROX_HOST_DEVICE static constexpr int steps_per_row(int d_model) noexcept { return ceil_div(d_model / 8, Threads); }
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
template <int Tokens>
struct BatchedGluPoliciesFor {
  using type = PolicyList<BatchedGluPolicy<Tokens, 256, 64, 2, (Tokens == 8)>>;
};
template <>
struct BatchedGluPoliciesFor<4> {
  using type = PolicyList<BatchedGluPolicy<4, 256, 64, 2>, BatchedGluPolicy<4, 320, 64, 2>>;
};

namespace detail {
/**
 * @brief A block's share of the union's channels in the batched GLU kernels: ranks [lo, hi), and this
 * thread's mask offset (gather_rank_range's input).
 */
struct GluRange {
  int offset = 0;
  int lo = 0;
  int hi = 0;
  int total = 0;  //!< channels in the union
};
/**
 * @brief The start of the batched GLU kernels (and of the fused batched Stage 2): the PDL wait, the
 * header stamp (block 0), and s = +0 for every token on the channels no token selected (one warp per
 * mask word, as GluRows). Returns the block's GluRange. kTrigger: let the next kernel launch now (PDL);
 * the fused Stage 2 lets it in only once its down rows are streamed.
 */
template <int kThreads, class T, bool kTrigger = true>
PROX_DEVICE PROX_FORCEINLINE GluRange batched_glu_begin(const BatchedGluGemvArgs<T>& a, const OpWorkspace& ws,
                                                        int* s_warp) {
  constexpr int kWarps = kThreads / kWarpSize;
  pdl_wait();
  if constexpr (kTrigger) pdl_launch_dependents();
  if (blockIdx.x == 0) stamp_header(ws.guard, threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int n_words = a.d_ff / kWarpSize;
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  GluRange r;
  r.offset = mask_rank_offset<kThreads>(a.union_mask, n_words, s_warp, &r.total);
  rank_range(r.total, block, blocks, &r.lo, &r.hi);
  for (long long w = block + static_cast<long long>(warp) * blocks; w < n_words;
       w += static_cast<long long>(kWarps) * blocks) {
    if (((a.union_mask[w] >> lane) & 1u) == 0u) {
      for (int b = 0; b < a.tokens; ++b) a.s[static_cast<std::size_t>(b) * a.d_ff + w * kWarpSize + lane] = 0.0f;
    }
  }
  return r;
}

//! s[b][j] = u act(g) where token b selected channel j, +0 where it did not (the batched GLU's epilogue).
template <class T, class Act>
PROX_DEVICE PROX_FORCEINLINE void batched_glu_store(const BatchedGluGemvArgs<T>& a, int b, int j, float g, float u,
                                                    const Act& act) {
  const int n_words = a.d_ff / kWarpSize;
  const bool mine = (a.channel_mask[static_cast<std::size_t>(b) * n_words + j / kWarpSize] >> (j % kWarpSize)) & 1u;
  a.s[static_cast<std::size_t>(b) * a.d_ff + j] = mine ? u * act(g) : 0.0f;
}
}  // namespace detail

namespace detail {
/**
 * @brief The CUDA-core batched GLU's row stream (BatchedGluPolicy with Mma = false), shared by
 * batched_glu_gemv_kernel and the fused batched Stage 2: the block's ranks [range.lo, range.hi) of the
 * union's channels in sub-batches of kRows, the whole block on a batch of kRowBatch rows, each thread on
 * its 16-byte pieces of every row and of every token's x; s of every token (batched_glu_store). Contains
 * __syncthreads() and ends with one: `st` may be reused after it returns.
 */
template <class Policy, class T, class Act>
struct BatchedGluRows {
  static constexpr int kB = Policy::kTokens;
  static constexpr int kThreads = Policy::kThreads;
  static constexpr int kRows = Policy::kRows;
  static constexpr int kR = Policy::kRowBatch;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kV = 2 * kR * kB;  // 16 values per batch: value (m * kR + c) * kB + b
  static_assert(kV == 16, "one reduction of 16 values per batch");
  static_assert(!Policy::kMma, "the CUDA-core policy");
  struct Storage {
    int ch[kRows];
    float red[kWarps][kV / kB][kB][kRows];  // [warp][m * kR + c][token][row]
  };

  PROX_DEVICE static PROX_FORCEINLINE void run(const BatchedGluGemvArgs<T>& a, const GluRange& range, Storage& st) {
    const int tid = static_cast<int>(threadIdx.x);
    const int lane = lane_id();
    const int warp = warp_id();
    const int tokens = a.tokens;
    const int n_words = a.d_ff / kWarpSize;

    const Act act{};
    const int pieces = a.d_model / 8;
    const int steps_per_batch = Policy::steps_per_row(a.d_model);
    const std::size_t ld = static_cast<std::size_t>(a.d_model);
#pragma unroll 1
    for (int sub = range.lo; sub < range.hi; sub += kRows) {
      const int count = min(kRows, range.hi - sub);
      detail::gather_rank_range<kThreads>(a.union_mask, n_words, range.offset, sub, sub + count, st.ch);
      __syncthreads();
      const int total_steps = ((count + kR - 1) / kR) * steps_per_batch;
      struct Step {
        uint4 vx[kB];
        uint4 vg[kR];
        uint4 vu[kR];
      };
      const auto load_step = [&](int step, Step& d) {
        const bool live = step < total_steps;
        const int b0 = (step / steps_per_batch) * kR;
        const int q = tid + (step % steps_per_batch) * kThreads;
        const bool qok = live && q < pieces;
#pragma unroll
        for (int c = 0; c < kR; ++c) {
          const bool have = qok && b0 + c < count;
          const std::size_t row = static_cast<std::size_t>(st.ch[have ? b0 + c : 0]) * ld;
          d.vg[c] = ld_stream_16(a.w_gate + row + 8 * q, have);
          d.vu[c] = ld_stream_16(a.w_up + row + 8 * q, have);
        }
#pragma unroll
        for (int b = 0; b < kB; ++b) d.vx[b] = ld_cached_16(a.x + b * ld + 8 * q, qok && b < tokens);
      };
      float v[kV];
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = 0.0f;
      const auto compute_step = [&](int step, const Step& d) {
#pragma unroll
        for (int c = 0; c < kR; ++c) {
          float fg[8];
          float fu[8];
          unpack8<T>(d.vg[c], fg);
          unpack8<T>(d.vu[c], fu);
#pragma unroll
          for (int b = 0; b < kB; ++b) {
            float fx[8];
            unpack8<T>(d.vx[b], fx);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              v[c * kB + b] = fmaf(fx[e], fg[e], v[c * kB + b]);
              v[(kR + c) * kB + b] = fmaf(fx[e], fu[e], v[(kR + c) * kB + b]);
            }
          }
        }
        if (step % steps_per_batch == steps_per_batch - 1) {
          const int b0 = (step / steps_per_batch) * kR;
          warp_halvings<kV / 2>(v, kWarpSize / 2);  // warp_sum_many<16>, unrolled (warp_halvings says why)
          const float r = v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
          constexpr int kLanesPerValue = kWarpSize / kV;
          if (lane % kLanesPerValue == 0) {
            const int idx = lane / kLanesPerValue;  // (m * kR + c) * kB + b
            const int b = idx % kB;
            const int mc = idx / kB;
            const int c = mc % kR;
            if (b0 + c < count) st.red[warp][mc][b][b0 + c] = r;
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
        const int b = i / count;
        const int r = i % count;
        if (b >= tokens) continue;
        const int c = r % kR;
        float g = 0.0f;
        float u = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          g += st.red[w][c][b][r];
          u += st.red[w][kR + c][b][r];
        }
        detail::batched_glu_store(a, b, st.ch[r], g, u, act);
      }
      __syncthreads();
    }
  }
};
}  // namespace detail

template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_glu_gemv_kernel(
    const BatchedGluGemvArgs<T> a, const OpWorkspace ws) {
  using Rows = detail::BatchedGluRows<Policy, T, Act>;
  __shared__ typename Rows::Storage s_rows;
  __shared__ int s_warp[Policy::kThreads / kWarpSize];
  const detail::GluRange range = detail::batched_glu_begin<Policy::kThreads>(a, ws, s_warp);
  Rows::run(a, range, s_rows);
}

//! The batched GLU GEMV on the tensor cores (BatchedGluPolicy with Mma = true): same arguments, outputs and
//! zero fill as batched_glu_gemv_kernel; the channel sums are combined over the d_model slices in order.
template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_glu_mma_kernel(
    const BatchedGluGemvArgs<T> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kRows = Policy::kRows;
  constexpr int kU = Policy::kUnroll;
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ int s_ch[kRows];
  __shared__ float s_part[kWarps][2][kRows][8];  // [d_model slice][gate, up][row][token (8: the mma's n)]
  __shared__ int s_warp[kWarps];

  const detail::GluRange range = detail::batched_glu_begin<kThreads>(a, ws, s_warp);
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
          d.w[u][0] = ld_stream_16(a.w_gate + off_a + k, in && ok_a);
          d.w[u][1] = ld_stream_16(a.w_gate + off_b + k, in && ok_b);
          d.w[u][2] = ld_stream_16(a.w_up + off_a + k, in && ok_a);
          d.w[u][3] = ld_stream_16(a.w_up + off_b + k, in && ok_b);
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
      detail::batched_glu_store(a, b, s_ch[r], gs, us, act);
    }
    __syncthreads();
  }
}

/**
 * @brief The batched GLU GEMV as a planned op (operator.cuh's contract). No workspace of its own; in
 * SparseFfn it stamps the workspace header ready (as GluGemvOp does).
 */
template <class T, class Act = SiLU, int Tokens = 2>
struct BatchedGluGemvOp {
  static constexpr const char* kName = "batched_glu_gemv";
  static constexpr int kTokens = Tokens;
  using Args = BatchedGluGemvArgs<T>;
  using Policies = typename BatchedGluPoliciesFor<Tokens>::type;
  struct Options {
    bool pdl = false;     //!< launch with PDL (sm_90+)
    int grid_blocks = 0;  //!< blocks to launch; 0 = one wave (SMs x kMinBlocks)
  };
  //! GluGemvOp's rules, tokens in [1, Tokens], union_mask required.
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr || a.channel_mask == nullptr ||
        a.union_mask == nullptr || a.s == nullptr)
      return Status::kErrorNullPointer;
    if (a.tokens < 1 || a.tokens > Tokens) return Status::kErrorInvalidArgument;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    if (!is_aligned(a.x, 16) || !is_aligned(a.w_gate, 16) || !is_aligned(a.w_up, 16) ||
        !is_aligned(a.channel_mask, 4) || !is_aligned(a.union_mask, 4) || !is_aligned(a.s, 4))
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
    if constexpr (P::kMma) {
      return detail::launch_kernel(batched_glu_mma_kernel<P, T, Act>, lc, stream, a, ws);
    } else {
      return detail::launch_kernel(batched_glu_gemv_kernel<P, T, Act>, lc, stream, a, ws);
    }
  }
};

// ================================================================ Stage 2: down
/**
 * @brief Arguments of the batched sparse down GEMV. All pointers are device pointers.
 */
template <class T>
struct BatchedDownGemvArgs {
  const float* s = nullptr;  //!< [tokens][d_ff]: each token's s, +0 where it did not select the channel
  const std::uint32_t* union_mask = nullptr;  //!< [d_ff/32] the rows to read
  const T* w_down_t = nullptr;                //!< [d_ff][d_model] = W_down^T, 16-byte aligned
  int tokens = 0;                             //!< 1..the op's kTokens
  int d_model = 0;                            //!< a multiple of 8, 8..2^20
  int d_ff = 0;                               //!< a multiple of 32, 32..2^20
  T* y = nullptr;                             //!< out [tokens][d_model]; every element written
};

/**
 * @brief Policy of the batched down GEMV: 128-output tiles (16 threads x 8 outputs per row), Chunk
 * channels per block (split-K), Unroll rows in flight per thread; each thread accumulates its 8
 * outputs for every token (8 x Tokens fp32). OneWave: a default candidate only where its grid fits in
 * one wave (dispatch.cuh); the tuner measures it everywhere.
 */
template <int Tokens, int Threads, int Chunk, int Unroll, int MinBlocks, bool OneWave = false>
struct BatchedDownPolicy {
  static constexpr int kTokens = Tokens;
  static constexpr int kThreads = Threads;
  static constexpr int kTile = 128;
  static constexpr int kChunk = Chunk;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr bool kOneWave = OneWave;
  static constexpr bool kMma = false;
  static_assert(Chunk % 32 == 0 && Threads % 16 == 0, "policy shape");
  static std::string name() {
    return "bdown_b" + std::to_string(Tokens) + "_t" + std::to_string(Threads) + "_c" + std::to_string(Chunk) + "_u" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks) + (OneWave ? "_w1" : "");
  }
};

/**
 * @brief Policy of the batched down GEMV on the tensor cores: y^T[d][b] = sum_j W_down^T[j][d] s[b][j] as
 * m16n8k16 tiles (16 outputs x 8 tokens, 16 union rows per step). A warp owns 64 outputs (8 per lane, one
 * 16-byte piece of each of 4 rows per step); ColWarps warps side by side make the tile (64 ColWarps
 * outputs), the block's other warps split the chunk's rows between them (reduced in warp order). Chunk
 * channels per block (split-K), Unroll steps of 16 rows per pipeline stage.
 */
template <int Tokens, int Threads, int Chunk, int ColWarps, int Unroll, int MinBlocks, bool OneWave = false>
struct BatchedDownMmaPolicy {
  static constexpr int kTokens = Tokens;
  static constexpr int kThreads = Threads;
  static constexpr int kColWarps = ColWarps;
  static constexpr int kTile = 64 * ColWarps;
  static constexpr int kChunk = Chunk;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr bool kOneWave = OneWave;
  static constexpr bool kMma = true;
  static_assert(Tokens <= 8, "the mma's n is 8 tokens");
  static_assert(Chunk % 32 == 0 && Threads % 32 == 0 && (Threads / 32) % ColWarps == 0, "policy shape");
  static std::string name() {
    return "bdown_mma_b" + std::to_string(Tokens) + "_t" + std::to_string(Threads) + "_c" + std::to_string(Chunk) +
           "_d" + std::to_string(64 * ColWarps) + "_u" + std::to_string(Unroll) + "_m" + std::to_string(MinBlocks) +
           (OneWave ? "_w1" : "");
  }
};

//! Candidates per token capacity (dispatch.cuh: the fewest waves, then the most blocks): long chunks, so
//! that a block streams its union rows in more than a few steps (as Stage 1's, measured with ncu). B = 4's
//! 1536-channel chunks make the Qwen3-8B grid one wave (256 blocks, not 384 in 1.45 waves): its FFN
//! 2.6 % faster. Where they only take a multi-wave grid to fewer waves they do not pay (Qwen3-14B -0.3 %,
//! 32B +0.7 %, H100, docs/history.md), hence OneWave. B = 8 runs on the tensor cores, where the CUDA-core
//! kernel is bound by its 8 x 8 multiply-adds per 16-byte piece (ncu, Qwen3-8B e = 70 %: down GEMV 60 ->
//! 45-48 us, 45 -> 55-60 % of DRAM peak; FFN 7.7-8.8 % faster on every Qwen3 shape); at B = 2 and 4 the
//! tensor-core kernel was slower (8B B = 4: 29-32 -> 33-40 us), so they stay on the CUDA cores. The one-wave
//! 256-output candidate wins on Qwen3-8B (down 44-45 us against 47-50 us for candidate 0) and lost on 14B,
//! where it only takes 2.6 waves to 1.3 (80 against 74 us). B = 2's 3072-channel chunks make the Qwen3-14B
//! grid one wave (40 tiles x 6 chunks = 240 blocks, not 360 in 1.36 waves): its FFN at B = 2 2.0-2.9 %
//! faster at e = 40-70 %, fp16 and bf16; every other Qwen3 shape keeps candidate 0 (8B, 4B and 1.7B fill one
//! wave with it after the balanced split, 32B would need 1.36 waves); at B = 4 they do the same on 14B (77 KB
//! of shared memory, dynamic): the FFN at B = 4 1.2-2.2 % faster there. Three blocks per SM instead (2048-
//! channel chunks, 80 registers) also made 14B one wave, 2.1 % faster, but were 0.6-1.6 % slower where
//! their extra blocks won the tie (8B, 4B, 1.7B): the down GEMV at 15 or 22 warps per SM streamed the
//! Qwen3-8B union at the same 2.0 TB/s (ncu, H100, docs/history.md).
template <int Tokens>
struct BatchedDownPoliciesFor;
template <>
struct BatchedDownPoliciesFor<2> {
  using type = PolicyList<BatchedDownPolicy<2, 256, 2048, 4, 2>, BatchedDownPolicy<2, 256, 512, 4, 2>,
                         BatchedDownPolicy<2, 256, 3072, 4, 2, true>>;
};
template <>
struct BatchedDownPoliciesFor<4> {
  using type = PolicyList<BatchedDownPolicy<4, 256, 1024, 4, 2>, BatchedDownPolicy<4, 256, 512, 4, 2>,
                         BatchedDownPolicy<4, 256, 1536, 4, 2, true>, BatchedDownPolicy<4, 256, 3072, 4, 2, true>>;
};
template <>
struct BatchedDownPoliciesFor<8> {
  using type =
      PolicyList<BatchedDownMmaPolicy<8, 256, 1024, 2, 1, 2>, BatchedDownMmaPolicy<8, 256, 1024, 4, 2, 2, true>>;
};

namespace detail {
/**
 * @brief A batched down tile's split-K combine (Reducer::split_k over `parts` partials of every token,
 * counter `counter`) and, in the tile's last block, every token's y[b][d0, d0 + tile). All threads call it,
 * once the block's tile sums are in the reducer's at(). Shared by the batched down kernels and the fused
 * batched Stage 2.
 */
template <int kTile, class Reducer, class T>
PROX_DEVICE PROX_FORCEINLINE void batched_tile_combine(typename Reducer::Storage& s_red, T* y, int tokens,
                                                       int d_model, float* scratch, std::uint32_t* counter, int d0,
                                                       int part, int parts) {
  constexpr int kThreads = Reducer::kWarps * kWarpSize;
  const int ncols = min(kTile, d_model - d0);
  if (!Reducer::split_k(s_red, scratch, counter, d_model, d0, ncols, part, parts)) return;
  for (int i = static_cast<int>(threadIdx.x); i < tokens * ncols; i += kThreads) {
    const int b = i / ncols;
    const int ch = i % ncols;
    y[static_cast<std::size_t>(b) * d_model + d0 + ch] = from_float<T>(Reducer::at(s_red, b, ch));
  }
}

/**
 * @brief The end of both batched down kernels, once the block's tile sums of every token are in the
 * reducer's at() (all threads call it). On a workspace that is not ready: the counters are not used but
 * zeroed for the next launch, y = NaN, the header flagged. Else the split-K combine over the grid's y
 * blocks and, in the tile's last block, every token's y.
 */
template <int kTile, class Reducer, class T>
PROX_DEVICE PROX_FORCEINLINE void batched_down_finish(typename Reducer::Storage& s_red, const BatchedDownGemvArgs<T>& a,
                                                      const OpWorkspace& ws, bool ready) {
  constexpr int kThreads = Reducer::kWarps * kWarpSize;
  const int tid = static_cast<int>(threadIdx.x);
  const int tile = static_cast<int>(blockIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int d0 = tile * kTile;
  const int ncols = min(kTile, a.d_model - d0);
  if (!ready) {
    down_not_ready<kTile>(ws, a.d_model, d0, ncols, chunk, a.y);  // token 0's y
    if (chunk != 0) return;
    for (int i = tid; i < (a.tokens - 1) * ncols; i += kThreads)
      a.y[static_cast<std::size_t>(1 + i / ncols) * a.d_model + d0 + i % ncols] =
          from_float<T>(__int_as_float(0x7fc00000));
    return;
  }
  batched_tile_combine<kTile, Reducer>(s_red, a.y, a.tokens, a.d_model, static_cast<float*>(ws.scratch), ws.sync + tile,
                                       d0, chunk, static_cast<int>(gridDim.y));
}

/**
 * @brief The CUDA-core batched down GEMV's row stream, shared by batched_down_gemv_kernel and the fused
 * batched Stage 2: acc[b][c] += sum_i vals[b][i] W_down^T[rows[i], d0 + slot * 8 + c] over i < count
 * (vals [kB][kStride], rows and vals in shared memory), a 128-output tile (16 threads x 8 outputs per row),
 * double-buffered steps of kU rows per thread. The loads of the first kAhead steps (1 or 2) are issued
 * before `before_compute()` runs (block-uniform; it may wait and fill `vals`), so a caller can overlap a
 * wait with them.
 */
template <int kB, int kThreads, int kU, class T>
struct BatchedDownRows {
  static constexpr int kTile = 128;
  static constexpr int kTn = kTile / 8;
  static constexpr int kGroups = kThreads / kTn;
  static_assert(kThreads % kTn == 0, "block must hold whole row groups");

  template <int kStride, int kAhead = 1, class BeforeCompute>
  PROX_DEVICE static PROX_FORCEINLINE void run(const T* __restrict__ w_down_t, int d_model, int d0, const int* rows,
                                               const float* vals, int count, float (&acc)[kB][8],
                                               BeforeCompute&& before_compute) {
    const int tid = static_cast<int>(threadIdx.x);
    const int slot = tid % kTn;
    const int group = tid / kTn;
    const int d = d0 + slot * 8;
    const bool col_ok = d < d_model;
    const std::size_t ld = static_cast<std::size_t>(d_model);
    const T* base = w_down_t + d;
    struct Step {
      uint4 v[kU];
    };
    const int steps = (count + kGroups * kU - 1) / (kGroups * kU);
    const auto load_step = [&](int it, Step& st) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        const bool ok = col_ok && r < count;
        st.v[u] = ld_stream_16(base + static_cast<std::size_t>(rows[ok ? r : 0]) * ld, ok);
      }
    };
    const auto compute_step = [&](int it, const Step& st) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        float w[8];
        unpack8<T>(st.v[u], w);
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          const float sv = r < count ? vals[b * kStride + r] : 0.0f;
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[b][c] = fmaf(sv, w[c], acc[b][c]);
        }
      }
    };
    Step b0;
    Step b1;
    static_assert(kAhead == 1 || kAhead == 2, "one or two steps ahead");
    load_step(0, b0);
    if constexpr (kAhead == 2) load_step(1, b1);
    before_compute();
    int it = 0;
#pragma unroll 1
    for (; it + 1 < steps; it += 2) {
      if constexpr (kAhead == 1) load_step(it + 1, b1);
      compute_step(it, b0);
      load_step(it + 2, b0);  // past the end: every predicate is false, nothing is read
      compute_step(it + 1, b1);
      if constexpr (kAhead == 2) load_step(it + 3, b1);
    }
    if (it < steps) compute_step(it, b0);
  }
};
/**
 * @brief The start of both batched down kernels. Block (tile, blockIdx.y) takes the chunk [c0, c0 +
 * chunk_len) of d_ff (detail::split_chunk_length over the grid's chunks). After the PDL wait (then the
 * next kernel may launch) it loads the header words, and, all together (one memory latency), the
 * union-mask bit of each of this thread's kPer channels of the chunk and every token's s there. s is read
 * for every channel of the chunk; the kernels use it only where the union selected the channel. Returns the
 * header words; `*c0` gets the chunk's first channel.
 */
template <int kB, int kThreads, int kChunk, int kPer, class T>
PROX_DEVICE PROX_FORCEINLINE HeaderWords batched_down_begin(const BatchedDownGemvArgs<T>& a, const OpWorkspace& ws,
                                                            int* c0, bool (&sel)[kPer], float (&val)[kB][kPer]) {
  const int tid = static_cast<int>(threadIdx.x);
  const int chunk_len = split_chunk_length(a.d_ff, static_cast<int>(gridDim.y), kChunk, 32);
  *c0 = static_cast<int>(blockIdx.y) * chunk_len;
  pdl_wait();
  pdl_launch_dependents();
  const HeaderWords header = workspace_header(ws.guard, blockIdx.x + blockIdx.y);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int t = i * kThreads + tid;
    const int j = *c0 + t;
    const bool in = t < chunk_len && j < a.d_ff;
    const std::uint32_t word = in ? a.union_mask[j / kWarpSize] : 0u;
    sel[i] = (word >> (j % kWarpSize)) & 1u;
#pragma unroll
    for (int b = 0; b < kB; ++b)
      val[b][i] = in && b < a.tokens ? a.s[static_cast<std::size_t>(b) * a.d_ff + j] : 0.0f;
  }
  return header;
}
}  // namespace detail

namespace detail {
//! The CUDA-core batched down GEMV's shared arrays, in dynamic shared memory (BatchedDownGemvOp::configure
//! sizes it; above 48 KB for the 3072-channel chunks at capacity 4): the chunk's union rows, every token's s
//! of them, the tile reduction and the compaction's per-warp counts (all of it dynamic, so that the opt-in
//! above 48 KB covers the whole block).
template <class Policy>
struct BatchedDownSmem {
  using Reducer = TileReducer<Policy::kThreads, Policy::kTile / 8, 8, Policy::kTokens>;
  static constexpr int kPer = (Policy::kChunk + Policy::kThreads - 1) / Policy::kThreads;
  int rows[Policy::kChunk];
  float val[Policy::kTokens][Policy::kChunk];
  typename Reducer::Storage red;
  int warp[kPer * (Policy::kThreads / kWarpSize)];
};
//! Whether BatchedDownSmem exceeds the 48 KB a kernel may hold without opting in (then it is dynamic).
template <class Policy>
struct BatchedDownSmemDynamic : std::bool_constant<(sizeof(BatchedDownSmem<Policy>) > kDefaultDynamicSmem)> {};
}  // namespace detail

template <class Policy, class T>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_down_gemv_kernel(
    const BatchedDownGemvArgs<T> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  constexpr int kU = Policy::kUnroll;
  constexpr int kTn = kTile / 8;
  using Smem = detail::BatchedDownSmem<Policy>;
  using Reducer = typename Smem::Reducer;
  static_assert(std::is_same_v<Reducer, detail::TileReducer<kThreads, kTn, 8, kB>>, "reducer shape");
  constexpr int kPer = Smem::kPer;  // chunk channels per thread in the compaction
  static_assert(kTile == detail::BatchedDownRows<kB, kThreads, kU, T>::kTile, "the row stream's tile");

  // Separate static arrays where they fit the default 48 KB (the code of the kernel before the 3072-channel
  // candidates: as one struct, static or dynamic, the 2048- and 512-channel ones took up to 8 registers
  // more), one dynamic BatchedDownSmem above it (configure() opts in).
  int* rows_at;
  float* val_at;
  typename Reducer::Storage* red_at;
  int* warp_at;
  if constexpr (detail::BatchedDownSmemDynamic<Policy>::value) {
    extern __shared__ __align__(16) unsigned char prox_batched_down_smem[];
    Smem& sm = *reinterpret_cast<Smem*>(prox_batched_down_smem);
    rows_at = sm.rows;
    val_at = &sm.val[0][0];
    red_at = &sm.red;
    warp_at = sm.warp;
  } else {
    __shared__ int rows[kChunk];
    __shared__ float val[kB][kChunk];
    __shared__ int warp[kPer * (kThreads / kWarpSize)];
    __shared__ typename Reducer::Storage red;
    rows_at = rows;
    val_at = &val[0][0];
    red_at = &red;
    warp_at = warp;
  }
  int* const s_rows = rows_at;
  float(&s_val)[kB][kChunk] = *reinterpret_cast<float(*)[kB][kChunk]>(val_at);
  typename Reducer::Storage& s_red = *red_at;
  int* const s_warp = warp_at;

  const int tid = static_cast<int>(threadIdx.x);
  const int d0 = static_cast<int>(blockIdx.x) * kTile;
  int c0 = 0;
  bool sel[kPer];
  float val[kB][kPer];
  const detail::HeaderWords header = detail::batched_down_begin<kB, kThreads, kChunk>(a, ws, &c0, sel, val);
  int pos[kPer];
  int totals[kPer];
  block_compact_positions<kThreads, kPer>(sel, s_warp, pos, totals);
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (sel[i]) {
      s_rows[count + pos[i]] = c0 + i * kThreads + tid;
#pragma unroll
      for (int b = 0; b < kB; ++b) s_val[b][count + pos[i]] = val[b][i];
    }
    count += totals[i];
  }
  __syncthreads();
  const bool ready = detail::workspace_ready(header, ws.guard);

  float acc[kB][8];
#pragma unroll
  for (int b = 0; b < kB; ++b) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[b][c] = 0.0f;
  }
  detail::BatchedDownRows<kB, kThreads, kU, T>::template run<kChunk>(a.w_down_t, a.d_model, d0, s_rows, &s_val[0][0],
                                                                     count, acc, [] {});

  Reducer::reduce(s_red, acc);
  detail::batched_down_finish<kTile, Reducer>(s_red, a, ws, ready);
}

namespace detail {
//! The batched down GEMV's s on the tensor cores: for every pair of union rows of the chunk and each of 8
//! token slots, s x 2^k as the sum of two T values (hi + lo, two T per 32-bit word, the lower row in the
//! low half), [hi, lo][row pair][token], the mma's B fragments. The power of two 2^k, per block, keeps
//! fp16 in range: the block's largest |s| x 2^k lies in [2^13, 2^14) (bf16 has fp32's range: k = 0). hi + lo
//! carries s to 2^-22 of its value or 2^-38 of the block's largest |s| (fp16: lo may be subnormal),
//! whichever is larger, or to 2^-16 of its value (bf16): below the error bound of s itself.
template <int kChunk>
struct BatchedDownMmaSmem {
  int rows[kChunk];
  std::uint32_t s[2][kChunk / 2][8];
};

//! The power of two k for a block whose largest |s| is `mx` (fp16; see BatchedDownMmaSmem).
PROX_DEVICE PROX_FORCEINLINE int fp16_s_exponent(float mx) {
  if (!(mx > 0.0f) || !isfinite(mx)) return 0;  // nothing selected, or a non-finite s: no scaling
  int e = 0;
  frexpf(mx, &e);  // mx = f 2^e, f in [0.5, 1)
  return max(-126, min(126, 14 - e));
}
}  // namespace detail

//! The batched down GEMV on the tensor cores (BatchedDownMmaPolicy): same arguments, outputs and split-K
//! combine as batched_down_gemv_kernel. Every addition has a fixed order (the mma's k within a step, steps
//! in row order per warp, the warps of a tile column in index order, then the splits): the same bits from
//! run to run.
template <class Policy, class T>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_down_mma_kernel(
    const BatchedDownGemvArgs<T> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  constexpr int kU = Policy::kUnroll;
  constexpr int kCW = Policy::kColWarps;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kRW = kWarps / kCW;  // warps splitting the rows of one 64-output column
  using Reducer = detail::TileReducer<kThreads, kTile / 8, 8, kB, kRW>;  // one row per warp of a column
  using Stream = detail::BatchedDownMmaSmem<kChunk>;
  constexpr int kPer = (kChunk + kThreads - 1) / kThreads;
  constexpr bool kScale = std::is_same_v<T, __half>;

  // The row stream's arrays and the reduction are never live together.
  union Smem {
    Stream st;
    typename Reducer::Storage red;
  };
  __shared__ Smem sm;
  __shared__ int s_warp[kPer * kWarps];
  __shared__ float s_max[kWarps];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int d0 = static_cast<int>(blockIdx.x) * kTile;
  int c0 = 0;
  bool sel[kPer];
  float val[kB][kPer];
  const detail::HeaderWords header = detail::batched_down_begin<kB, kThreads, kChunk>(a, ws, &c0, sel, val);
  float mx = 0.0f;  // the largest |s| of the rows this block streams
  if constexpr (kScale) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
#pragma unroll
      for (int b = 0; b < kB; ++b) mx = sel[i] ? fmaxf(mx, fabsf(val[b][i])) : mx;
    }
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) s_max[warp] = mx;
  }
  int pos[kPer];
  int totals[kPer];
  block_compact_positions<kThreads, kPer>(sel, s_warp, pos, totals);  // its barrier publishes s_max too
  int k = 0;
  if constexpr (kScale) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_max[w]);
    k = detail::fp16_s_exponent(mx);
  }
  const float scale = ldexpf(1.0f, k);
  T* s_half = reinterpret_cast<T*>(&sm.st.s[0][0][0]);  // [hi, lo][row pair][token][row & 1]
  constexpr int kLoOffset = kChunk * 8;                 // halves from hi to lo
  const auto s_slot = [](int row, int b) { return ((row >> 1) * 8 + b) * 2 + (row & 1); };
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (sel[i]) {
      const int q = count + pos[i];
      sm.st.rows[q] = c0 + i * kThreads + tid;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const float v = b < kB ? val[b < kB ? b : 0][i] * scale : 0.0f;
        const T hi = from_float<T>(v);
        s_half[s_slot(q, b)] = hi;
        s_half[kLoOffset + s_slot(q, b)] = from_float<T>(v - to_float(hi));
      }
    }
    count += totals[i];
  }
  // The last step's rows past the union: s = 0 (their weights load as 0; 0 x stale NaN would not be 0).
  const int padded = min(kChunk, round_up(count, 16));
  for (int i = count * 8 + tid; i < padded * 8; i += kThreads) {
    const int q = i / 8;
    const int b = i % 8;
    s_half[s_slot(q, b)] = from_float<T>(0.0f);
    s_half[kLoOffset + s_slot(q, b)] = from_float<T>(0.0f);
  }
  __syncthreads();
  const bool ready = detail::workspace_ready(header, ws.guard);

  // Lane (g, t) = (lane / 4, lane % 4) loads outputs [8g, 8g + 8) of its warp's 64 from the step's rows 2t,
  // 2t + 1, 2t + 8, 2t + 9: A's k (rows) in pairs per register, outputs 8g + 2p and 8g + 2p + 1 as the
  // fragment rows g and g + 8 of mma p (byte permutes of the two rows' word p); B is s of rows 2t.. for
  // token g. The mma's m order is free: d[p] holds outputs 8g + 2p (d0, d1) and 8g + 2p + 1 (d2, d3), for
  // tokens 2t and 2t + 1.
  const int g = lane >> 2;
  const int t = lane & 3;
  const int cw = warp % kCW;
  const int rw = warp / kCW;
  const int col = cw * 64 + g * 8;
  const bool col_ok = d0 + col < a.d_model;
  const std::size_t ld = static_cast<std::size_t>(a.d_model);
  const T* base = a.w_down_t + d0 + col;
  const int ksteps = (count + 15) / 16;
  const int my_steps = ksteps > rw ? (ksteps - rw + kRW - 1) / kRW : 0;  // steps rw, rw + kRW, ...
  const int stages = (my_steps + kU - 1) / kU;
  float acc[4][4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[p][e] = 0.0f;
  }
  struct Step {
    uint4 v[kU][4];
  };
  const auto load_step = [&](int it, Step& st) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int r0 = (rw + (it * kU + u) * kRW) * 16 + 2 * t;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = r0 + (q & 1) + (q >> 1) * 8;
        const bool ok = col_ok && r < count;
        st.v[u][q] = ld_stream_16(base + static_cast<std::size_t>(sm.st.rows[ok ? r : 0]) * ld, ok);
      }
    }
  };
  const auto compute_step = [&](int it, const Step& st) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ks = rw + (it * kU + u) * kRW;
      if (ks < ksteps) {  // warp-uniform
        const std::uint32_t bh0 = sm.st.s[0][ks * 8 + t][g];
        const std::uint32_t bh1 = sm.st.s[0][ks * 8 + 4 + t][g];
        const std::uint32_t bl0 = sm.st.s[1][ks * 8 + t][g];
        const std::uint32_t bl1 = sm.st.s[1][ks * 8 + 4 + t][g];
        const std::uint32_t* w0 = reinterpret_cast<const std::uint32_t*>(&st.v[u][0]);
        const std::uint32_t* w1 = reinterpret_cast<const std::uint32_t*>(&st.v[u][1]);
        const std::uint32_t* w2 = reinterpret_cast<const std::uint32_t*>(&st.v[u][2]);
        const std::uint32_t* w3 = reinterpret_cast<const std::uint32_t*>(&st.v[u][3]);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const std::uint32_t a0 = __byte_perm(w0[p], w1[p], 0x5410);
          const std::uint32_t a1 = __byte_perm(w0[p], w1[p], 0x7632);
          const std::uint32_t a2 = __byte_perm(w2[p], w3[p], 0x5410);
          const std::uint32_t a3 = __byte_perm(w2[p], w3[p], 0x7632);
          detail::mma_16816_bits<T>(acc[p], a0, a1, a2, a3, bh0, bh1);
          detail::mma_16816_bits<T>(acc[p], a0, a1, a2, a3, bl0, bl1);
        }
      }
    }
  };
  Step b0;
  Step b1;
  if (stages > 0) load_step(0, b0);
  int it = 0;
#pragma unroll 1
  for (; it + 1 < stages; it += 2) {
    load_step(it + 1, b1);
    compute_step(it, b0);
    if (it + 2 < stages) load_step(it + 2, b0);
    compute_step(it + 1, b1);
  }
  if (it < stages) compute_step(it, b0);

  // Tile sums: each warp's 64 outputs x kB tokens to row rw of the reduction (the warps of one row split
  // the tile's columns), then the kRW rows added in order into row 0 (in place: the thread of (token,
  // output) alone reads and writes it).
  __syncthreads();  // every warp is done with the stream's arrays (the union)
  const float unscale = ldexpf(1.0f, -k);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int b = 2 * t + (e & 1);
      const int ch = col + 2 * p + (e >> 1);
      if (b < kB) sm.red.red[rw][b][Reducer::pad(ch)] = acc[p][e] * unscale;
    }
  }
  __syncthreads();
  for (int v = tid; v < kB * kTile; v += kThreads) {
    const int b = v / kTile;
    const int ch = v % kTile;
    float sum = 0.0f;
#pragma unroll
    for (int r = 0; r < kRW; ++r) sum += sm.red.red[r][b][Reducer::pad(ch)];
    sm.red.red[0][b][Reducer::pad(ch)] = sum;
  }
  __syncthreads();
  detail::batched_down_finish<kTile, Reducer>(sm.red, a, ws, ready);
}

/**
 * @brief The batched sparse down GEMV as a planned op (operator.cuh's contract).
 */
template <class T, int Tokens = 2>
struct BatchedDownGemvOp {
  static constexpr const char* kName = "batched_down_gemv";
  static constexpr int kTokens = Tokens;
  using Args = BatchedDownGemvArgs<T>;
  using Policies = typename BatchedDownPoliciesFor<Tokens>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };
  template <class P>
  static constexpr int num_tiles(int d_model) noexcept {
    return ceil_div(d_model, P::kTile);
  }
  //! Split-K chunks of d_ff: more, shorter ones where the policy's own split leaves a grid of less than
  //! one wave (detail::balanced_chunks).
  template <class P>
  static constexpr int num_chunks(int d_model, int d_ff, int sm_count) noexcept {
    return detail::balanced_chunks(d_ff, P::kChunk, 32, num_tiles<P>(d_model),
                                   static_cast<long>(sm_count) * P::kMinBlocks);
  }
  //! The most chunks num_chunks() gives on any device (what the workspace's partials are sized for).
  template <class P>
  static constexpr int max_chunks(int d_model, int d_ff) noexcept {
    return detail::max_balanced_chunks(d_ff, P::kChunk, 32, num_tiles<P>(d_model));
  }
  template <class P>
  static constexpr long num_blocks(int d_model, int d_ff, int sm_count) noexcept {
    return static_cast<long>(num_tiles<P>(d_model)) * num_chunks<P>(d_model, d_ff, sm_count);
  }
  //! DownGemvOp's rules, tokens in [1, Tokens].
  static Status can_implement(const Args& a) noexcept {
    if (a.s == nullptr || a.union_mask == nullptr || a.w_down_t == nullptr || a.y == nullptr)
      return Status::kErrorNullPointer;
    if (a.tokens < 1 || a.tokens > Tokens) return Status::kErrorInvalidArgument;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    if (!is_aligned(a.w_down_t, 16) || !is_aligned(a.s, 4) || !is_aligned(a.union_mask, 4) ||
        !is_aligned(a.y, sizeof(T)))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }
  //! Tile counters in DownGemvOp's region, and the split-K partials (chunks x Tokens x d_model).
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    WorkspaceNeeds w;
    w.sync = detail::tile_counter_bytes<detail::kMinTileWidth>(a.d_model);
    for_each_policy<Policies>([&](auto p, int) {
      const int chunks = max_chunks<decltype(p)>(a.d_model, a.d_ff);
      const std::size_t parts =
          chunks > 1 ? sizeof(float) * static_cast<std::size_t>(chunks) * Tokens * a.d_model : 0;
      w.scratch = parts > w.scratch ? parts : w.scratch;
    });
    return w;
  }
  template <class P>
  static Status configure(const Args& a, const Options&, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(num_tiles<P>(a.d_model)),
                    static_cast<unsigned>(num_chunks<P>(a.d_model, a.d_ff, d.sm_count)));
    lc->block = dim3(P::kThreads);
    if (lc->grid.y > 65535u) return Status::kErrorInvalidShape;
    if constexpr (P::kMma) {
      return Status::kSuccess;
    } else {
      if constexpr (!detail::BatchedDownSmemDynamic<P>::value) return Status::kSuccess;
      lc->smem = sizeof(detail::BatchedDownSmem<P>);
      return detail::allow_dynamic_smem<batched_down_gemv_kernel<P, T>>(d.device, lc->smem);
    }
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    if constexpr (P::kMma) {
      return detail::launch_kernel(batched_down_mma_kernel<P, T>, lc, stream, a, ws);
    } else {
      return detail::launch_kernel(batched_down_gemv_kernel<P, T>, lc, stream, a, ws);
    }
  }
};

PROX_NAMESPACE_END
