// SPDX-License-Identifier: Apache-2.0
//! @file down_gemv.cuh  Op 4, Stage 2: the input-sparse down GEMV, y = sum_{j selected} s_j W_down^T[j,:].
//! Reads only the selected rows of W_down^T [d_ff][d_model] (row j contiguous over d_model).
//!
//! Grid: x = column tiles of kTile outputs, y = chunks of kChunk channels (split-K). A block
//! compacts the selected channels of its chunk (and their s_j) in shared memory, streams their rows
//! over its column tile, and the split-K blocks of a tile combine deterministically.
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

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the sparse down GEMV. All pointers are device pointers.
 * @tparam T `__half` or `__nv_bfloat16` (weights and output).
 */
template <class T>
struct DownGemvArgs {
  //! [d_ff] intermediate values; every entry is read, unselected ones are ignored
  const float* s = nullptr;
  const std::uint32_t* channel_mask = nullptr;  //!< [d_ff/32] selected channels
  const T* w_down_t = nullptr;                  //!< [d_ff][d_model] row-major = W_down^T, 16-byte aligned
  int d_model = 0;                              //!< outputs, a multiple of 8, 8..2^20
  int d_ff = 0;                                 //!< a multiple of 32, 32..2^20
  T* y = nullptr;                               //!< out [d_model]; every element is written
};

/**
 * @brief Tile policy of the down GEMV (vocabulary: core/policy.hpp).
 * @tparam Threads threads per block; @tparam Tile outputs per block (Tile/8 threads share a row, at
 * most 32); @tparam Chunk channels per block (split-K); @tparam Unroll rows in flight per thread;
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__).
 */
template <int Threads, int Tile, int Chunk, int Unroll, int MinBlocks = 1>
struct DownGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kTile = Tile;
  static constexpr int kChunk = Chunk;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static_assert(Chunk % 32 == 0 && Tile % 8 == 0 && Tile / 8 <= 32, "policy shape");
  static std::string name() {
    return "down_t" + std::to_string(Threads) + "_d" + std::to_string(Tile) + "_c" + std::to_string(Chunk) + "_u" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks);
  }
};

//! Candidates (index 0 is the fallback) of the unfused Stage 2. prox-tune on the H100 picks each for
//! some Qwen3 shape (docs/data/prox-tune-h100.tsv): 1 (128-column tiles) on 1.7B and 4B, 0 on 8B
//! and 32B, 2 (1024-channel chunks) on 14B; the plan's default follows the grid (dispatch.cuh).
using DownGemvPolicies = PolicyList<DownGemvPolicy<256, 256, 512, 4, 3>, DownGemvPolicy<256, 128, 512, 4, 3>,
                                    DownGemvPolicy<256, 256, 1024, 4, 3>>;

// ---------------------------------------------------------------- L1: block building block
namespace detail {

/**
 * @brief Rows of W_down^T streamed over one column tile, shared by down_gemv_kernel and the fused
 * Stage-2 kernel (glu_down_gemv.cuh). Thread t owns columns d0 + (t % kTn) * 8 .. + 8 and the rows
 * group + i kGroups of the list (group = t / kTn).
 */
template <int kThreads, int kTile, int kU, class T>
struct DownRows {
  static constexpr int kTn = kTile / 8;
  static constexpr int kGroups = kThreads / kTn;
  static_assert(kThreads % kTn == 0, "block must hold whole row groups");

  /**
   * @brief acc[c] += sum_i vals[i] * W_down^T[rows[i], d0 + slot * 8 + c] over i < count.
   * The loads of the first two steps are issued before `before_compute()` runs (block-uniform; it
   * may wait and fill `vals`), so a caller can overlap a wait with them. Double-buffered steps of
   * kU rows, branch-free (see proxy_gemv_kernel). `rows`/`vals` are shared memory.
   */
  template <class BeforeCompute>
  PROX_DEVICE static void run(const T* __restrict__ w_down_t, int d_model, int d0, const int* rows,
                              const float* vals, int count, float (&acc)[8], BeforeCompute&& before_compute) {
    const int tid = static_cast<int>(threadIdx.x);
    const int slot = tid % kTn;
    const int group = tid / kTn;
    const int d = d0 + slot * 8;
    const bool col_ok = d < d_model;
    const std::size_t ld = static_cast<std::size_t>(d_model);
    const T* base_ptr = w_down_t + d;
    struct Step {
      uint4 v[kU];
    };
    const int steps = (count + kGroups * kU - 1) / (kGroups * kU);
    const auto load_step = [&](int it, Step& st) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        const bool ok = col_ok && r < count;
        st.v[u] = ld_stream_16(base_ptr + static_cast<std::size_t>(rows[ok ? r : 0]) * ld, ok);
      }
    };
    const auto compute_step = [&](int it, const Step& st) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        const float sv = r < count ? vals[r] : 0.0f;
        float w[8];
        unpack8<T>(st.v[u], w);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = fmaf(sv, w[c], acc[c]);
      }
    };
    Step b0;
    Step b1;
    load_step(0, b0);
    load_step(1, b1);
    before_compute();
    int it = 0;
#pragma unroll 1
    for (; it + 1 < steps; it += 2) {  // whole pairs; the body stays branch-free
      compute_step(it, b0);
      load_step(it + 2, b0);  // past the end: every predicate is false, nothing is read
      compute_step(it + 1, b1);
      load_step(it + 3, b1);
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

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void down_gemv_kernel(const DownGemvArgs<T> a,
                                                                                          const OpWorkspace ws) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  using Rows = detail::DownRows<kThreads, kTile, Policy::kUnroll, T>;
  using Reducer = detail::TileReducer<kThreads, Rows::kTn, 8, 1>;

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
  // selected channels are compacted in order.
  bool sel[kPerThread];
  float val[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int t = i * kThreads + tid;
    const int j = c0 + t;
    const bool in = t < kChunk && j < a.d_ff;
    const std::uint32_t word = in ? a.channel_mask[j / kWarpSize] : 0u;
    val[i] = in ? a.s[j] : 0.0f;  // read for every channel of the chunk: unselected s may be stale, never used
    sel[i] = (word >> (j % kWarpSize)) & 1u;
  }
  const int count = block_compact_append<kThreads>(sel, c0, val, s_rows, s_val, s_warp);
  __syncthreads();
  const bool ready = detail::workspace_ready(header, ws.guard);  // block-uniform

  float acc[1][8];
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[0][c] = 0.0f;
  if (count > 0) Rows::run(a.w_down_t, a.d_model, d0, s_rows, s_val, count, acc[0], [] {});

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
  for (int ch = tid; ch < ncols; ch += kThreads) a.y[d0 + ch] = from_float<T>(Reducer::at(s_red, 0, ch));
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief The sparse down GEMV as a planned op (drive it with prox::Operator; contract in
 * proxy_gemv.cuh's ProxyGemvOp).
 */
template <class T>
struct DownGemvOp {
  static constexpr const char* kName = "down_gemv";
  //! Its tuning-cache key (prox/tuning/choose.cuh): W_down^T is T; no activation.
  static constexpr TuneKeyFields kTuneKey{"down_gemv", DTypeTraits<T>::kName, DTypeTraits<T>::kName, "-", true};
  using Args = DownGemvArgs<T>;
  using Policies = DownGemvPolicies;
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
   * @brief Validate without launching. Shape rule: d_model a multiple of 8 in [8, 2^20]; d_ff a
   * multiple of 32 in [32, 2^20]; w_down_t 16-byte aligned; s, mask 4-byte aligned; y element-aligned.
   */
  static Status can_implement(const Args& a) noexcept {
    if (a.s == nullptr || a.channel_mask == nullptr || a.w_down_t == nullptr || a.y == nullptr)
      return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    if (!is_aligned(a.w_down_t, 16) || !is_aligned(a.s, 4) || !is_aligned(a.channel_mask, 4) ||
        !is_aligned(a.y, sizeof(T)))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
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
    return detail::launch_kernel(down_gemv_kernel<P, T>, lc, stream, a, ws);
  }
};

PROX_NAMESPACE_END
