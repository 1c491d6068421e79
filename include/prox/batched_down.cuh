// SPDX-License-Identifier: Apache-2.0
//! @file batched_down.cuh  Batched decode, Stage 2's down GEMV (BatchedDownGemvOp): the union of 2..8 tokens'
//! channel sets streamed from W_down^T, each token weighted by its own s (0 where it did not select the
//! channel; batched.cuh says what the batched ops share). On the CUDA cores the row stream is down_gemv.cuh's
//! detail::DownRows with a token count; at capacity 8 the native weights run on the tensor cores
//! (batched_down_mma_kernel), a format without them on the CUDA cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

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
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "down_gemv.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the batched sparse down GEMV. All pointers are device pointers.
 * @tparam T activations (y); @tparam Fmt the Stage-2 weight format (stage2_weights.cuh).
 */
template <class T, class Fmt = NativeWeights<T>>
struct BatchedDownGemvArgs {
  using Matrix = typename Fmt::Matrix;
  const float* s = nullptr;  //!< [tokens][d_ff]: each token's s, +0 where it did not select the channel
  const std::uint32_t* union_mask = nullptr;  //!< [d_ff/32] the rows to read
  Matrix w_down_t{};                          //!< [d_ff][d_model] = W_down^T, 16-byte aligned
  int tokens = 0;                             //!< 1..the op's kTokens
  int d_model = 0;                            //!< a multiple of 8 (of Fmt::kElemsPerVec), 8..2^20
  int d_ff = 0;                               //!< a multiple of 32, 32..2^20
  T* y = nullptr;                             //!< out [tokens][d_model]; every element written
};

/**
 * @brief Policy of the batched down GEMV on the CUDA cores (detail::DownRows with a token count): 128-output
 * tiles (16 threads x 8 outputs per row of fp16/bf16 weights; Fmt::kElemsPerVec outputs per thread), Chunk
 * channels per block (split-K), Unroll rows in flight per thread; each thread accumulates its outputs for
 * every token (kElemsPerVec x Tokens fp32). OneWave: a default candidate only where its grid fits in
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
  static_assert(Chunk % 32 == 0 && Threads % 16 == 0, "policy shape");  // the rest per format: detail::DownRows
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
struct NativeBatchedDownPolicies;
template <>
struct NativeBatchedDownPolicies<2> {
  using type = PolicyList<BatchedDownPolicy<2, 256, 2048, 4, 2>, BatchedDownPolicy<2, 256, 512, 4, 2>,
                         BatchedDownPolicy<2, 256, 3072, 4, 2, true>>;
};
template <>
struct NativeBatchedDownPolicies<4> {
  using type = PolicyList<BatchedDownPolicy<4, 256, 1024, 4, 2>, BatchedDownPolicy<4, 256, 512, 4, 2>,
                         BatchedDownPolicy<4, 256, 1536, 4, 2, true>, BatchedDownPolicy<4, 256, 3072, 4, 2, true>>;
};
template <>
struct NativeBatchedDownPolicies<8> {
  using type =
      PolicyList<BatchedDownMmaPolicy<8, 256, 1024, 2, 1, 2>, BatchedDownMmaPolicy<8, 256, 1024, 4, 2, 2, true>>;
};

//! The candidates of capacity Tokens for Stage-2 format Fmt: the native lists, and at capacity 8 for a format
//! without the tensor-core kernel (Fmt::kHasMma false) the CUDA-core kernel with 2 rows in flight (8 tokens'
//! accumulators per thread).
template <int Tokens, class Fmt = NativeWeights<__half>>
struct BatchedDownPoliciesFor {
  using type = std::conditional_t<Fmt::kHasMma || Tokens < 8, typename NativeBatchedDownPolicies<Tokens>::type,
                                  PolicyList<BatchedDownPolicy<8, 256, 1024, 2, 1>>>;
};

namespace detail {
/**
 * @brief A batched down tile's split-K combine (Reducer::split_k over `parts` partials of every token,
 * counter `counter`) and, in the tile's last block, every token's y[b][d0, d0 + tile). All threads call it,
 * once the block's tile sums are in the reducer's at(). Shared by the batched down kernels and the fused
 * batched Stage 2.
 */
template <int kTile, class Reducer, class Fmt, class T>
PROX_DEVICE PROX_FORCEINLINE void batched_tile_combine(typename Reducer::Storage& s_red, const typename Fmt::Matrix& w,
                                                       T* y, int tokens, int d_model, float* scratch,
                                                       std::uint32_t* counter, int d0, int part, int parts) {
  constexpr int kThreads = Reducer::kWarps * kWarpSize;
  const int ncols = min(kTile, d_model - d0);
  if (!Reducer::split_k(s_red, scratch, counter, d_model, d0, ncols, part, parts)) return;
  for (int i = static_cast<int>(threadIdx.x); i < tokens * ncols; i += kThreads) {
    const int b = i / ncols;
    const int ch = i % ncols;
    y[static_cast<std::size_t>(b) * d_model + d0 + ch] = from_float<T>(Fmt::down_out(w, d0 + ch, Reducer::at(s_red, b, ch)));
  }
}

/**
 * @brief The end of both batched down kernels, once the block's tile sums of every token are in the
 * reducer's at() (all threads call it). On a workspace that is not ready: the counters are not used but
 * zeroed for the next launch, y = NaN, the header flagged. Else the split-K combine over the grid's y
 * blocks and, in the tile's last block, every token's y.
 */
template <int kTile, class Reducer, class T, class Fmt>
PROX_DEVICE PROX_FORCEINLINE void batched_down_finish(typename Reducer::Storage& s_red,
                                                      const BatchedDownGemvArgs<T, Fmt>& a, const OpWorkspace& ws,
                                                      bool ready) {
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
  batched_tile_combine<kTile, Reducer, Fmt>(s_red, a.w_down_t, a.y, a.tokens, a.d_model,
                                            static_cast<float*>(ws.scratch), ws.sync + tile, d0, chunk,
                                            static_cast<int>(gridDim.y));
}

/**
 * @brief The start of both batched down kernels. Block (tile, blockIdx.y) takes the chunk [c0, c0 +
 * chunk_len) of d_ff (detail::split_chunk_length over the grid's chunks). After the PDL wait (then the
 * next kernel may launch) it loads the header words, and, all together (one memory latency), the
 * union-mask bit of each of this thread's kPer channels of the chunk and every token's s there (as the tile
 * at column d0 weights its row: Fmt::down_s). s is read for every channel of the chunk; the kernels use it
 * only where the union selected the channel. Returns the header words; `*c0` gets the chunk's first channel.
 */
template <int kB, int kThreads, int kChunk, int kPer, class T, class Fmt>
PROX_DEVICE PROX_FORCEINLINE HeaderWords batched_down_begin(const BatchedDownGemvArgs<T, Fmt>& a, const OpWorkspace& ws,
                                                            int d0, int* c0, bool (&sel)[kPer],
                                                            float (&val)[kB][kPer]) {
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
      val[b][i] = in && b < a.tokens
                      ? Fmt::down_s(a.w_down_t, j, d0, a.d_model, a.s[static_cast<std::size_t>(b) * a.d_ff + j])
                      : 0.0f;
  }
  return header;
}
}  // namespace detail

namespace detail {
//! The CUDA-core batched down GEMV's shared arrays, in dynamic shared memory (BatchedDownGemvOp::configure
//! sizes it; above 48 KB for the 3072-channel chunks at capacity 4): the chunk's union rows, every token's s
//! of them, the tile reduction and the compaction's per-warp counts (all of it dynamic, so that the opt-in
//! above 48 KB covers the whole block).
template <class Policy, class Fmt = NativeWeights<__half>>
struct BatchedDownSmem {
  using Reducer = TileReducer<Policy::kThreads, Policy::kTile / Fmt::kElemsPerVec, Fmt::kElemsPerVec, Policy::kTokens>;
  static constexpr int kPer = (Policy::kChunk + Policy::kThreads - 1) / Policy::kThreads;
  int rows[Policy::kChunk];
  float val[Policy::kTokens][Policy::kChunk];
  typename Reducer::Storage red;
  int warp[kPer * (Policy::kThreads / kWarpSize)];
};
//! Whether BatchedDownSmem exceeds the 48 KB a kernel may hold without opting in (then it is dynamic).
template <class Policy, class Fmt = NativeWeights<__half>>
struct BatchedDownSmemDynamic : std::bool_constant<(sizeof(BatchedDownSmem<Policy, Fmt>) > kDefaultDynamicSmem)> {};
}  // namespace detail

template <class Policy, class T, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_down_gemv_kernel(
    const BatchedDownGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  constexpr int kB = Policy::kTokens;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  constexpr int kU = Policy::kUnroll;
  using Rows = detail::DownRows<kThreads, kTile, kU, kB, Fmt>;
  constexpr int kE = Rows::kE;
  using Smem = detail::BatchedDownSmem<Policy, Fmt>;
  using Reducer = typename Smem::Reducer;
  static_assert(std::is_same_v<Reducer, detail::TileReducer<kThreads, Rows::kTn, kE, kB>>, "reducer shape");
  constexpr int kPer = Smem::kPer;  // chunk channels per thread in the compaction

  // Separate static arrays where they fit the default 48 KB (the code of the kernel before the 3072-channel
  // candidates: as one struct, static or dynamic, the 2048- and 512-channel ones took up to 8 registers
  // more), one dynamic BatchedDownSmem above it (configure() opts in).
  int* rows_at;
  float* val_at;
  typename Reducer::Storage* red_at;
  int* warp_at;
  if constexpr (detail::BatchedDownSmemDynamic<Policy, Fmt>::value) {
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
  const detail::HeaderWords header = detail::batched_down_begin<kB, kThreads, kChunk>(a, ws, d0, &c0, sel, val);
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

  float acc[kB][kE];
#pragma unroll
  for (int b = 0; b < kB; ++b) {
#pragma unroll
    for (int c = 0; c < kE; ++c) acc[b][c] = 0.0f;
  }
  Rows::template run<kChunk, 1>(Fmt::data(a.w_down_t), a.d_model, d0, s_rows, &s_val[0][0], count, acc, [] {});

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
template <class Policy, class T, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void batched_down_mma_kernel(
    const BatchedDownGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  static_assert(Fmt::kHasMma && std::is_same_v<typename Fmt::Element, T>, "tensor cores: weights of the activation type");
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
  const detail::HeaderWords header = detail::batched_down_begin<kB, kThreads, kChunk>(a, ws, d0, &c0, sel, val);
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
  const T* base = Fmt::data(a.w_down_t) + d0 + col;
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
 * @brief The batched sparse down GEMV as a planned op (operator.cuh's contract). Its grid: column tiles over
 * d_model x split-K chunks of d_ff, balanced (detail::BatchedSplitGrid).
 * @tparam T activations (y); @tparam Tokens capacity 2, 4, 8; @tparam Fmt the Stage-2 weight format.
 */
template <class T, int Tokens = 2, class Fmt = NativeWeights<T>>
struct BatchedDownGemvOp : detail::BatchedSplitGrid<32, false> {
  static constexpr const char* kName = "batched_down_gemv";
  static constexpr int kTokens = Tokens;
  using Format = Fmt;
  using Args = BatchedDownGemvArgs<T, Fmt>;
  using Policies = typename BatchedDownPoliciesFor<Tokens, Fmt>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };
  //! DownGemvOp's rules (on the union mask), tokens in [1, Tokens].
  static Status can_implement(const Args& a) noexcept {
    return detail::check_down_args<T, Fmt>(a, a.union_mask, a.tokens, Tokens);
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
      if constexpr (!detail::BatchedDownSmemDynamic<P, Fmt>::value) return Status::kSuccess;
      lc->smem = sizeof(detail::BatchedDownSmem<P, Fmt>);
      return detail::allow_dynamic_smem<batched_down_gemv_kernel<P, T, Fmt>>(d.device, lc->smem);
    }
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    if constexpr (P::kMma) {
      return detail::launch_kernel(batched_down_mma_kernel<P, T, Fmt>, lc, stream, a, ws);
    } else {
      return detail::launch_kernel(batched_down_gemv_kernel<P, T, Fmt>, lc, stream, a, ws);
    }
  }
};

//! Batched down GEMV: the fewest waves, then the most blocks, as the batch-1 ops (detail::default_fewest_waves).
template <class T, int B, class Fmt>
int default_policy(BatchedDownGemvOp<T, B, Fmt>, const DeviceInfo& d, const BatchedDownGemvArgs<T, Fmt>& a) noexcept {
  using Op = BatchedDownGemvOp<T, B, Fmt>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff, d.sm_count); });
}

PROX_NAMESPACE_END
