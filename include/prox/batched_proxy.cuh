// SPDX-License-Identifier: Apache-2.0
//! @file batched_proxy.cuh  Batched decode, Stage 1 (BatchedProxyGemvOp): the INT4 proxy GEMV over the union
//! of 2..8 tokens' kept inputs (batched.cuh says what the batched ops share). A token's x is 0 on a row it did
//! not keep, so the row adds nothing to its sums; each token gets its own channel mask, and their union goes
//! to Stage 2. INT4 proxy weights only (the method); the A1 ablation's fp16 proxies stay batch-1.
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
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "int4.cuh"
#include "proxy_gemv.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

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

namespace detail {
/**
 * @brief The L1 pieces of the batched Stage 1, in the order batched_proxy_gemv_kernel calls them: gather the
 * union's kept inputs of a chunk, count them, (the tensor-core row stream, inline in the kernel), then either
 * the not-ready exit or, after the split-K combine, the epilogue. Every thread of the block calls each.
 */
template <class Policy, class T>
struct BatchedProxyBlock {
  static constexpr int kB = Policy::kTokens;
  static constexpr int kTpt = Policy::kTokensPerThread;
  static constexpr int kThreads = Policy::kThreads;
  static constexpr int kChunk = Policy::kChunk;
  static constexpr int kTile = Policy::kTile;  // channels of a tile
  static constexpr int kWarps = kThreads / kWarpSize;
  using Reducer = typename BatchedProxySmem<Policy>::Reducer;
  static constexpr int kXPer = kChunk / kThreads;  // coordinates of x per thread and token
  static_assert(kChunk % kThreads == 0 && (kXPer == 2 || kXPer == 4 || kXPer == 8), "runs of 2, 4 or 8");

  /**
   * @brief 1. Threshold every token's chunk [k0, k0 + chunk_len) of x and compact the union of the kept
   * coordinates, in order: s_rows the rows, s_x every token's x 2^-6 on them (0 where the token did not keep
   * the row, and on the rows past the union up to the next multiple of 16). Also clears the tile's union
   * mask words (s_union). keep[b][i]: token b kept this thread's coordinate i. Returns the union's row count.
   * Contains a block barrier; the caller syncs before reading s_rows, s_x or s_union.
   */
  PROX_DEVICE static PROX_FORCEINLINE int gather(const BatchedProxyGemvArgs<T>& a, int tokens, int k0, int chunk_len,
                                                 float tau_x, int (&s_rows)[kChunk], __half (&s_x)[kB][kChunk],
                                                 int* s_warp, std::uint32_t* s_union, bool (&keep)[kB][kXPer]) {
    const int tid = static_cast<int>(threadIdx.x);
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
    return count;
  }

  //! The runtime statistics of the chunk (a.counters; tile 0's blocks): every token's kept inputs, the union's,
  //! and one call per token and for the union (chunk 0).
  PROX_DEVICE static PROX_FORCEINLINE void count_kept(const BatchedProxyGemvArgs<T>& a, int tokens, int count,
                                                     int chunk, const bool (&keep)[kB][kXPer]) {
    const int tid = static_cast<int>(threadIdx.x);
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

  //! 4. On a workspace that is not ready (the whole grid agrees): see the comment at the call.
  PROX_DEVICE static PROX_FORCEINLINE void not_ready(const BatchedProxyGemvArgs<T>& a, const OpWorkspace& ws,
                                                     int tokens, int n0, int ncols, int chunk) {
    const int tid = static_cast<int>(threadIdx.x);
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
  }


  /**
   * @brief 5. After the split-K combine (the tile's last block): every token's s~ of the thread's channel
   * (my_ch; its scales my_sg, my_su), the threshold, the masks (ballot per 32-channel word) and their union.
   */
  template <class Act>
  PROX_DEVICE static PROX_FORCEINLINE void epilogue(const BatchedProxyGemvArgs<T>& a, typename Reducer::Storage& s_red,
                                                    int tokens, int n0, int ncols, int my_ch, bool my_in, float my_sg,
                                                    float my_su, float tau_s, std::uint32_t* s_union) {
    const int tid = static_cast<int>(threadIdx.x);
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
  using Block = detail::BatchedProxyBlock<Policy, T>;  // the L1 pieces

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

  // 1. The union of the tokens' kept inputs of this chunk.
  bool keep[kB][Block::kXPer];
  const int count = Block::gather(a, tokens, k0, chunk_len, tau_x, s_rows, s_x, s_warp, s_union, keep);
  if (tid == 0) s_ready = detail::workspace_ready(header, ws.guard);
  __syncthreads();
  const bool ready = s_ready != 0;
  if (a.counters != nullptr && tile == 0) Block::count_kept(a, tokens, count, chunk, keep);

  // 2. Stream the union's rows of this tile, and 3. reduce over the block's row groups. (Inline: as a function
  // of its own the stream compiled to other register assignments, and this kernel's SASS is what was measured.)
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
    Block::not_ready(a, ws, tokens, n0, ncols, chunk);
    return;
  }
  if (!Reducer::split_k(s_red, static_cast<float*>(ws.scratch), ws.sync + tile, gridDim.x * kCols, tile * kCols,
                        kCols, chunk, static_cast<int>(gridDim.y))) {
    return;
  }

  // 5. Epilogue: each warp takes whole 32-channel words of one token: rescale, s~, threshold, ballot.
  Block::template epilogue<Act>(a, s_red, tokens, n0, ncols, my_ch, my_in, my_sg, my_su, tau_s, s_union);
}

/**
 * @brief The batched Stage 1 as a planned op (operator.cuh's contract). Its grid: column tiles over d_ff x
 * split-K chunks of d_model, balanced where the policy's kBalanced (B = 2 and 4: detail::BatchedSplitGrid).
 * @tparam T `__half` / `__nv_bfloat16`; @tparam Act SiLU / GeluTanh; @tparam Tokens capacity 2, 4, 8.
 */
template <class T, class Act = SiLU, int Tokens = 2>
struct BatchedProxyGemvOp : detail::BatchedSplitGrid<16, true> {
  static constexpr const char* kName = "batched_proxy_gemv";
  static constexpr int kTokens = Tokens;
  using Args = BatchedProxyGemvArgs<T>;
  using Policies = typename BatchedProxyPoliciesFor<Tokens>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };

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

//! Batched Stage 1: the fewest waves, then the most blocks, as the batch-1 ops (detail::default_fewest_waves).
template <class T, class Act, int B>
int default_policy(BatchedProxyGemvOp<T, Act, B>, const DeviceInfo& d, const BatchedProxyGemvArgs<T>& a) noexcept {
  using Op = BatchedProxyGemvOp<T, Act, B>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff, d.sm_count); });
}

PROX_NAMESPACE_END
