// SPDX-License-Identifier: Apache-2.0
//! @file down_gemv.cuh  Op 4, Stage 2: the input-sparse down GEMV, y = sum_{j selected} s_j W_down^T[j,:].
//! Reads only the selected rows of W_down^T [d_ff][d_model] (row j contiguous over d_model), in a Stage-2
//! weight format (stage2_weights.cuh).
//!
//! Grid: x = column tiles of kTile outputs, y = chunks of kChunk channels (split-K). A block
//! compacts the selected channels of its chunk (and their s_j) in shared memory, streams their rows
//! over its column tile, and the split-K blocks of a tile combine deterministically. detail::DownRows, the
//! row stream, serves one token and a batch of tokens alike (batched_down.cuh, both fused Stage 2s).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

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
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the sparse down GEMV. All pointers are device pointers.
 * @tparam T   `__half` or `__nv_bfloat16` (output)
 * @tparam Fmt the Stage-2 weight format (stage2_weights.cuh): NativeWeights<T> by default
 */
template <class T, class Fmt = NativeWeights<T>>
struct DownGemvArgs {
  using Matrix = typename Fmt::Matrix;
  //! [d_ff] intermediate values; every entry is read, unselected ones are ignored
  const float* s = nullptr;
  const std::uint32_t* channel_mask = nullptr;  //!< [d_ff/32] selected channels
  Matrix w_down_t{};                            //!< [d_ff][d_model] row-major = W_down^T, 16-byte aligned
  int d_model = 0;                              //!< outputs, a multiple of 8 (of Fmt::kElemsPerVec), 8..2^20
  int d_ff = 0;                                 //!< a multiple of 32, 32..2^20
  T* y = nullptr;                               //!< out [d_model]; every element is written
};

/**
 * @brief Tile policy of the down GEMV (vocabulary: core/policy.hpp).
 * @tparam Threads threads per block; @tparam Tile outputs per block (Tile / Fmt::kElemsPerVec threads share a
 * row, at most 32); @tparam Chunk channels per block (split-K); @tparam Unroll rows in flight per thread;
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__).
 */
template <int Threads, int Tile, int Chunk, int Unroll, int MinBlocks = 1>
struct DownGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kTile = Tile;
  static constexpr int kChunk = Chunk;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static_assert(Chunk % 32 == 0 && Tile % 8 == 0, "policy shape");
  static std::string name() {
    return "down_t" + std::to_string(Threads) + "_d" + std::to_string(Tile) + "_c" + std::to_string(Chunk) + "_u" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks);
  }
};

//! Candidates (index 0 is the fallback) of the unfused Stage 2. prox-tune on the H100 picks each for
//! some Qwen3 shape (docs/data/prox-tune-h100.tsv): 1 (128-column tiles) on 1.7B and 4B, 0 on 8B
//! and 32B, 2 (1024-channel chunks) on 14B; the plan's default follows the grid (default_policy below).
using DownGemvPolicies = PolicyList<DownGemvPolicy<256, 256, 512, 4, 3>, DownGemvPolicy<256, 128, 512, 4, 3>,
                                    DownGemvPolicy<256, 256, 1024, 4, 3>>;

//! The candidate list of a Stage-2 weight format, and its name in a tuning cache (the policy table's row).
template <class Fmt>
struct DownGemvPoliciesFor;
template <class W>
struct DownGemvPoliciesFor<NativeWeights<W>> {
  using type = DownGemvPolicies;
  static constexpr const char* kName = "down_gemv";
};

// ---------------------------------------------------------------- L1: block building blocks
namespace detail {

/**
 * @brief Rows of W_down^T streamed over one column tile, for one token (the down GEMV, the fused Stage 2) or
 * a batch of kTokens (the batched down GEMV, the fused batched Stage 2): every token's outputs from the same
 * weight bytes. Thread t owns columns d0 + (t % kTn) kE .. + kE (one 16-byte piece of a row, kE =
 * Fmt::kElemsPerVec) and the rows group + i kGroups of the list (group = t / kTn).
 */
template <int kThreads, int kTile, int kU, int kTokens, class Fmt>
struct DownRows {
  using Element = typename Fmt::Element;
  static constexpr int kE = Fmt::kElemsPerVec;  // columns per thread
  static constexpr int kTn = kTile / kE;
  static constexpr int kGroups = kThreads / kTn;
  static_assert(kTile % kE == 0 && kTn <= kWarpSize && kThreads % kTn == 0, "block must hold whole row groups");
  static_assert(Fmt::kDownTileDivides == 0 || Fmt::kDownTileDivides % kTile == 0,
                "a tile lies within one of the format's scale blocks (the block scale is folded into s)");

  /**
   * @brief acc[b][c] += sum_i vals[b kStride + i] * W_down^T[rows[i], d0 + slot kE + c] over i < count.
   * The loads of the first kAhead steps (1 or 2) are issued before `before_compute()` runs (block-uniform;
   * it may wait and fill `vals`), so a caller can overlap a wait with them. Double-buffered steps of kU
   * rows, branch-free (see proxy_gemv_kernel). `rows`/`vals` are shared memory.
   */
  template <int kStride, int kAhead, class BeforeCompute>
  PROX_DEVICE static PROX_FORCEINLINE void run(const Element* __restrict__ w_down_t, int d_model, int d0,
                                               const int* rows, const float* vals, int count,
                                               float (&acc)[kTokens][kE], BeforeCompute&& before_compute) {
    static_assert(kAhead == 1 || kAhead == 2, "one or two steps ahead");
    const int tid = static_cast<int>(threadIdx.x);
    const int slot = tid % kTn;
    const int group = tid / kTn;
    const int d = d0 + slot * kE;
    const bool col_ok = d < d_model;
    const std::size_t ld = static_cast<std::size_t>(d_model);
    const Element* base = w_down_t + d;
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
        // One token reads its s before the weights' unpack, a batch each token's after it: the orders the
        // kernels were measured with (the same arithmetic; ptxas schedules the two differently).
        const float s0 = kTokens == 1 && r < count ? vals[r] : 0.0f;
        float w[kE];
        Fmt::dequant(st.v[u], w);
#pragma unroll
        for (int b = 0; b < kTokens; ++b) {
          const float sv = kTokens == 1 ? s0 : r < count ? vals[b * kStride + r] : 0.0f;
#pragma unroll
          for (int c = 0; c < kE; ++c) acc[b][c] = fmaf(sv, w[c], acc[b][c]);
        }
      }
    };
    Step b0;
    Step b1;
    load_step(0, b0);
    if constexpr (kAhead == 2) load_step(1, b1);
    before_compute();
    int it = 0;
#pragma unroll 1
    for (; it + 1 < steps; it += 2) {  // whole pairs; the body stays branch-free
      if constexpr (kAhead == 1) load_step(it + 1, b1);
      compute_step(it, b0);
      load_step(it + 2, b0);  // past the end: every predicate is false, nothing is read
      compute_step(it + 1, b1);
      if constexpr (kAhead == 2) load_step(it + 3, b1);
    }
    if (it < steps) compute_step(it, b0);  // an odd last step: no pair sums an empty one
  }
};

//! The down GEMV on a workspace that is not ready (the whole grid agrees): its counters are zeroed for
//! the next launch, not used; y = NaN; the header flagged. Not inlined: kept out of the kernel's register
//! allocation (as fused_not_ready); Stage 1 inlines its own (proxy_not_ready says why).
template <int kTile, class T>
__device__ __noinline__ void down_not_ready(OpWorkspace ws, int d_model, int d0, int ncols, int chunk, T* y) {
  if (threadIdx.x == 0) flag_dirty(ws.guard);
  grid_zero(ws.sync, static_cast<int>(tile_counter_bytes<kTile>(d_model) / sizeof(std::uint32_t)));
  if (chunk != 0) return;
  for (int ch = static_cast<int>(threadIdx.x); ch < ncols; ch += static_cast<int>(blockDim.x))
    y[d0 + ch] = from_float<T>(__int_as_float(0x7fc00000));
}

/**
 * @brief The validation every down GEMV shares (DownGemvOp, BatchedDownGemvOp): s, the rows' mask (the
 * channel mask; a batch's union), W_down^T (Fmt::check) and y; tokens in [1, max_tokens]; the FFN shape rule.
 */
template <class T, class Fmt, class Args>
Status check_down_args(const Args& a, const std::uint32_t* mask, int tokens, int max_tokens) noexcept {
  if (a.s == nullptr || mask == nullptr || Fmt::data(a.w_down_t) == nullptr || a.y == nullptr)
    return Status::kErrorNullPointer;
  if (tokens < 1 || tokens > max_tokens) return Status::kErrorInvalidArgument;
  PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
  PROX_RETURN_IF_ERROR(Fmt::check(a.w_down_t, a.d_ff, a.d_model, WeightOrientation::kInOut));
  if (!is_aligned(a.s, 4) || !is_aligned(mask, 4) || !is_aligned(a.y, sizeof(T))) return Status::kErrorMisalignedPointer;
  return Status::kSuccess;
}

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void down_gemv_kernel(
    const DownGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  using Rows = detail::DownRows<kThreads, kTile, Policy::kUnroll, 1, Fmt>;
  constexpr int kE = Rows::kE;
  using Reducer = detail::TileReducer<kThreads, Rows::kTn, kE, 1>;

  __shared__ int s_rows[kChunk];
  __shared__ float s_val[kChunk];
  constexpr int kPerThread = (kChunk + kThreads - 1) / kThreads;  // channels per thread (compaction)
  __shared__ int s_warp[kPerThread * (kThreads / kWarpSize)];      // block_compact_append
  __shared__ typename Reducer::Storage s_red;

  const int tid = static_cast<int>(threadIdx.x);
  const int tile = static_cast<int>(blockIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int d0 = tile * kTile;
  const int c0 = chunk * kChunk;
  pdl_wait();  // mask and s come from the previous kernels
  pdl_launch_dependents();
  const detail::HeaderWords header = detail::workspace_header(ws.guard, blockIdx.x + blockIdx.y);  // judged later

  // Mask words and s values of the whole chunk are loaded together (one memory latency), then the
  // selected channels are compacted in order (s as the tile weights its row: Fmt::down_s).
  bool sel[kPerThread];
  float val[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = i * kThreads + tid;
    const int j = c0 + t;
    const bool in = t < kChunk && j < a.d_ff;
    const std::uint32_t word = in ? a.channel_mask[j / kWarpSize] : 0u;
    // read for every channel of the chunk: unselected s may be stale, never used
    val[i] = in ? Fmt::down_s(a.w_down_t, j, d0, a.d_model, a.s[j]) : 0.0f;
    sel[i] = (word >> (j % kWarpSize)) & 1u;
  }
  const int count = block_compact_append<kThreads>(sel, c0, val, s_rows, s_val, s_warp);
  __syncthreads();
  const bool ready = detail::workspace_ready(header, ws.guard);  // block-uniform

  float acc[1][kE];
#pragma unroll
  for (int c = 0; c < kE; ++c) acc[0][c] = 0.0f;
  if (count > 0) Rows::template run<kChunk, 2>(Fmt::data(a.w_down_t), a.d_model, d0, s_rows, s_val, count, acc, [] {});

  Reducer::reduce(s_red, acc);
  const int ncols = min(kTile, a.d_model - d0);
  if (!ready) {  // counters not to be trusted (workspace never initialized): not used
    detail::down_not_ready<kTile>(ws, a.d_model, d0, ncols, chunk, a.y);
    return;
  }
  if (!Reducer::split_k(s_red, static_cast<float*>(ws.scratch), ws.sync + tile, a.d_model, d0, ncols, chunk,
                        static_cast<int>(gridDim.y))) {
    return;
  }
  for (int ch = tid; ch < ncols; ch += kThreads)
    a.y[d0 + ch] = from_float<T>(Fmt::down_out(a.w_down_t, d0 + ch, Reducer::at(s_red, 0, ch)));
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The sparse down GEMV as a planned op (drive it with prox::Operator; contract in
 * proxy_gemv.cuh's ProxyGemvOp).
 * @tparam T activations (y); @tparam Fmt the Stage-2 weight format.
 */
template <class T, class Fmt = NativeWeights<T>>
struct DownGemvOp {
  static constexpr const char* kName = "down_gemv";
  using Format = Fmt;
  //! Its tuning-cache key (prox/tuning/choose.cuh): the format's candidate list and layout; no activation.
  static constexpr TuneKeyFields kTuneKey{DownGemvPoliciesFor<Fmt>::kName, DTypeTraits<T>::kName, Fmt::kKeyName, "-",
                                          true};
  using Args = DownGemvArgs<T, Fmt>;
  using Policies = typename DownGemvPoliciesFor<Fmt>::type;
  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
  };

  template <class P>
  static constexpr int num_tiles(int d_model) noexcept {
    return ceil_div(d_model, P::kTile);
  }
  template <class P>
  static constexpr int num_chunks(int d_ff) noexcept {
    return ceil_div(d_ff, P::kChunk);
  }
  //! Blocks of the launch grid: column tiles x split-K chunks.
  template <class P>
  static constexpr long num_blocks(int d_model, int d_ff) noexcept {
    return static_cast<long>(num_tiles<P>(d_model)) * num_chunks<P>(d_ff);
  }

  /**
   * @brief Validate without launching. Shape rule: d_model a multiple of 8 (of Fmt::kElemsPerVec) in
   * [8, 2^20]; d_ff a multiple of 32 in [32, 2^20]; W_down^T as Fmt::check; s, mask 4-byte aligned; y
   * element-aligned.
   */
  static Status can_implement(const Args& a) noexcept { return detail::check_down_args<T, Fmt>(a, a.channel_mask, 1, 1); }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }

  //! Tile counters (a region of the same size for every policy), then the split-K partials of the
  //! policy with the most chunks.
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    WorkspaceNeeds w;
    w.sync = detail::tile_counter_bytes<detail::kMinTileWidth>(a.d_model);
    for_each_policy<Policies>([&](auto p, int) {
      const int chunks = num_chunks<decltype(p)>(a.d_ff);
      const std::size_t parts = chunks > 1 ? sizeof(float) * static_cast<std::size_t>(chunks) * a.d_model : 0;
      w.scratch = parts > w.scratch ? parts : w.scratch;
    });
    return w;
  }

  template <class P>
  static Status configure(const Args& a, const Options&, const DeviceInfo&, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(num_tiles<P>(a.d_model)), static_cast<unsigned>(num_chunks<P>(a.d_ff)));
    lc->block = dim3(P::kThreads);
    return lc->grid.y > 65535u ? Status::kErrorInvalidShape : Status::kSuccess;
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(down_gemv_kernel<P, T, Fmt>, lc, stream, a, ws);
  }
};

//! Unfused down GEMV: the fewest waves, then the most blocks (detail::default_fewest_waves).
template <class T, class Fmt>
int default_policy(DownGemvOp<T, Fmt>, const DeviceInfo& d, const DownGemvArgs<T, Fmt>& a) noexcept {
  using Op = DownGemvOp<T, Fmt>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff); });
}

PROX_NAMESPACE_END
