// SPDX-License-Identifier: Apache-2.0
//! @file proxy_gemv.cuh  Op 2, Stage 1: the fused split-N proxy GEMV.
//!
//! For one token x [d_model]: keep coordinates with |x_k| >= tau_x, compute the gate and up proxies
//! over the kept rows only (one pass over x, both matrices in the same loop), rescale per channel,
//! form s~ = u~ * act(g~) in registers and keep channels with |s~_j| >= tau_s. Output: the channel
//! bitmask (what Stage 2 reads) and, in the values mode, s~ itself (calibration, analysis).
//!
//! Grid: x = column tiles of kTile channels (split-N), y = chunks of kChunk input coordinates
//! (split-K). Each block thresholds and compacts its own chunk of x in shared memory, so a dropped
//! coordinate costs no weight bytes, then streams the kept rows of its tile (detail::ProxyRows).
//! Split-K blocks of a tile combine deterministically (detail::TileReducer): through global memory
//! (the last block to arrive finishes the tile), or on sm_90+ with Options::cluster and 2..8 splits,
//! as one thread-block cluster per tile through distributed shared memory (each block finishes a
//! slice of the tile). Both give bit-identical results.
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
#include "core/tune_key.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "core/workspace.cuh"
#include "dense_weights.cuh"
#include "detail/tile_reduce.cuh"
#include "dispatch.cuh"
#include "int4.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the Stage-1 proxy GEMV. All pointers are device pointers.
 * @tparam T   activation type (`__half` / `__nv_bfloat16`)
 * @tparam Fmt proxy weight format: Int4Weights (the method) or DenseWeights<W>
 */
template <class T, class Fmt = Int4Weights>
struct ProxyGemvArgs {
  using Matrix = typename Fmt::Matrix;
  const T* x = nullptr;  //!< [d_model] token activations, element-aligned
  int d_model = 0;       //!< input size K, 1..2^20
  int d_ff = 0;          //!< channels N, a multiple of 32, 32..2^20
  float tau_x = 0.0f;    //!< input threshold (>= 0): keep |x_k| >= tau_x
  float tau_s = 0.0f;    //!< channel threshold (>= 0): keep |s~_j| >= tau_s
  //! Optional device float[2] {tau_x, tau_s}, read by every launch instead of tau_x / tau_s (a runtime
  //! sparsity knob that a captured graph follows). Validated by the host only when given as scalars:
  //! a NaN read here keeps nothing, a negative one keeps everything; neither reads out of bounds.
  const float* thresholds = nullptr;
  Matrix gate{};                          //!< gate proxy in Fmt's layout
  Matrix up{};                            //!< up proxy in Fmt's layout
  std::uint32_t* channel_mask = nullptr;  //!< out [d_ff/32]: bit j%32 of word j/32 set iff channel j selected
  float* s_proxy = nullptr;               //!< out [d_ff] (values mode, optional): s~ of every channel
  SparsityCounters* counters = nullptr;   //!< optional runtime statistics (accumulated)
};

/**
 * @brief Tile policy of the proxy GEMV (vocabulary: core/policy.hpp).
 * @tparam Threads   threads per block
 * @tparam Tile      channels per block (split-N); Tile / Fmt::kChannelsPerVec threads share a row
 * @tparam Chunk     input coordinates per block (split-K); thresholded in shared memory
 * @tparam Unroll    kept rows each thread has in flight per step (a piece of gate and of up each)
 * @tparam MinBlocks __launch_bounds__ minimum resident blocks per SM
 * @tparam Stages    0: register double buffering (two steps in flight per thread); >= 2: a cp.async
 *                   pipeline of Stages steps through shared memory (Stages - 1 in flight), which holds
 *                   more bytes in flight than the registers can at 3 blocks per SM
 */
template <int Threads, int Tile, int Chunk, int Unroll, int MinBlocks = 1, int Stages = 0>
struct ProxyGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kTile = Tile;
  static constexpr int kChunk = Chunk;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr int kStages = Stages;
  static_assert(Stages == 0 || Stages >= 2, "a cp.async pipeline needs at least 2 stages");
  static std::string name() {
    return "proxy_t" + std::to_string(Threads) + "_n" + std::to_string(Tile) + "_k" + std::to_string(Chunk) + "_u" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks) +
           (Stages > 0 ? "_s" + std::to_string(Stages) : "");
  }
};

//! Candidates for INT4 weights (index 0 is the fallback). 8-byte pieces: 16 threads cover a 256-channel
//! tile, 128 contiguous bytes of each kept row per matrix. Measured on the H100 (docs/benchmarks.md):
using ProxyGemvPolicies = PolicyList<
    ProxyGemvPolicy<256, 256, 512, 2, 3>,      // Qwen3 1.7B-14B: 2-row steps at 3 blocks/SM (4 rows spill)
    ProxyGemvPolicy<256, 256, 1024, 3, 3>,     // fewer, longer chunks: high input density on 14B
    ProxyGemvPolicy<256, 256, 256, 2, 3>,      // more chunks: grids of 1.7B / 4B fill the SMs
    ProxyGemvPolicy<256, 256, 1024, 3, 3, 3>>; // Qwen3-32B: 2-wave grid, cp.async 3-8 us faster
//! Candidates for fp16/bf16 proxy weights (16-byte pieces of 8 channels).
using DenseProxyGemvPolicies =
    PolicyList<ProxyGemvPolicy<256, 256, 256, 4, 2>, ProxyGemvPolicy<256, 128, 256, 4, 2>>;

//! The candidate list of a proxy weight format, and its name in a tuning cache.
template <class Fmt>
struct ProxyGemvPoliciesFor {
  using type = ProxyGemvPolicies;
  static constexpr const char* kName = "proxy_gemv";
};
template <class W>
struct ProxyGemvPoliciesFor<DenseWeights<W>> {
  using type = DenseProxyGemvPolicies;
  static constexpr const char* kName = "proxy_gemv_dense";
};

// ---------------------------------------------------------------- L1: row streaming
namespace detail {

/**
 * @brief The kept rows of one column tile streamed by one block, gate and up together, for
 * proxy_gemv_kernel. Thread t owns channels (t % kTn) * kCpv .. + kCpv of the tile and the rows
 * group + (it kU + u) kGroups (group = t / kTn) of the block's kept-row list.
 */
template <class Policy, class Fmt>
struct ProxyRows {
  static constexpr int kThreads = Policy::kThreads;
  static constexpr int kU = Policy::kUnroll;
  static constexpr int kStages = Policy::kStages;
  static constexpr int kCpv = Fmt::kChannelsPerVec;
  static constexpr int kTn = Policy::kTile / kCpv;
  static constexpr int kGroups = kThreads / kTn;
  static_assert(Policy::kTile % kCpv == 0 && Policy::kTile % kWarpSize == 0,
                "tile must hold whole pieces and mask words");
  using P = Piece<Fmt::kVecBytes>;
  using XReg = typename Fmt::XReg;

  //! Shared memory of the cp.async pipeline (a register-buffered policy needs none: a 1-element
  //! stand-in keeps the type, so callers can put it in a union with what comes after the stream).
  struct Storage {
    P stage[kStages > 0 ? kStages : 1][kStages > 0 ? kU : 1][2][kStages > 0 ? kThreads : 1];
  };

  /**
   * @brief acc[0][c] += sum_i x_i * gate[rows[i], n + c], acc[1][c] likewise for up, over i < count;
   * pg / pu point at column n of row 0, `row_stride` bytes apart. `rows` / `xs` are the block's
   * compacted kept rows and values (shared memory), `count` block-uniform. Ends with every cp.async
   * copy landed and a block barrier (the caller may reuse `st`).
   */
  PROX_DEVICE static void run(const char* pg, const char* pu, std::size_t row_stride, bool col_ok, const int* rows,
                              const float* xs, int count, float (&acc)[2][kCpv], Storage& st) {
    const int tid = static_cast<int>(threadIdx.x);
    const int group = tid / kTn;
    struct Step {
      P vg[kU];
      P vu[kU];
      XReg xs[kU];
    };
    const int steps = (count + kGroups * kU - 1) / (kGroups * kU);
    const auto compute_step = [&](const Step& d) {
      Fmt::template fma_step<kU>(acc[0], d.vg, d.xs);
      Fmt::template fma_step<kU>(acc[1], d.vu, d.xs);
    };
    if (count <= 0) return;  // block-uniform; rows[0] is valid below
    if constexpr (kStages == 0) {
      // Loads of step it + 1 are issued before the arithmetic of step it (register double buffering,
      // branch-free so ptxas keeps the order).
      const auto load_step = [&](int it, Step& d) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = group + (it * kU + u) * kGroups;
          const bool ok = col_ok && r < count;
          const int rr = ok ? r : 0;
          const std::size_t off = static_cast<std::size_t>(rows[rr]) * row_stride;
          d.vg[u] = ld_stream_piece<Fmt::kVecBytes>(pg + off, ok, Fmt::kFill);
          d.vu[u] = ld_stream_piece<Fmt::kVecBytes>(pu + off, ok, Fmt::kFill);
          d.xs[u] = Fmt::make_x(ok ? xs[rr] : 0.0f);
        }
      };
      Step b0;
      Step b1;
      load_step(0, b0);
      int it = 0;
#pragma unroll 1
      for (; it + 1 < steps; it += 2) {  // whole pairs of steps
        load_step(it + 1, b1);
        compute_step(b0);
        load_step(it + 2, b0);  // past the end: every predicate is false, nothing is read
        compute_step(b1);
      }
      // An odd last step (loaded into b0 by the last pair) is summed after the loop, so no pair sums
      // an empty step and the loop body stays branch-free (a branch inside it cost 0.35-0.7 us at
      // s1 = 0 on the H100).
      if (it < steps) compute_step(b0);
    } else {
      // cp.async pipeline: step it goes to stage it % kStages; kStages - 1 steps are in flight while
      // one is summed. Each thread reads back only the pieces it copied itself, so a per-thread
      // wait_group is the only synchronization. Rows past the end are zero-filled and get x = 0
      // (an INT4 zero word decodes to -8: 0 * -8 adds an exact zero).
      const auto issue = [&](int it) {
        P(&s)[kU][2][kThreads] = st.stage[it % kStages];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = group + (it * kU + u) * kGroups;
          const bool ok = col_ok && r < count;
          const std::size_t off = static_cast<std::size_t>(rows[ok ? r : 0]) * row_stride;
          cp_async<Fmt::kVecBytes>(&s[u][0][tid], pg + off, ok);
          cp_async<Fmt::kVecBytes>(&s[u][1][tid], pu + off, ok);
        }
        cp_async_commit();  // one group per step, empty or not, so wait_group counts steps
      };
#pragma unroll
      for (int it = 0; it < kStages - 1; ++it) issue(it);
#pragma unroll 1
      for (int it = 0; it < steps; ++it) {
        issue(it + kStages - 1);
        cp_async_wait<kStages - 1>();  // step it has landed
        const P(&s)[kU][2][kThreads] = st.stage[it % kStages];
        Step d;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int r = group + (it * kU + u) * kGroups;
          const bool ok = col_ok && r < count;
          d.vg[u] = s[u][0][tid];
          d.vu[u] = s[u][1][tid];
          d.xs[u] = Fmt::make_x(ok ? xs[r] : 0.0f);
        }
        compute_step(d);
      }
      cp_async_wait<0>();
      __syncthreads();  // the stages become the caller's reduction buffer
    }
  }
};

/**
 * @brief Stage 1 on a workspace that is not ready (the header check failed; the whole grid agrees): its
 * counters are not used. Zero them and the next kernel's sync words (WorkspaceGuard::reset) for the next
 * launch and flag the header; with `select_all` (the global combine, which needs the counters), the
 * chunk-0 block of each tile selects every channel of it (Stage 2 then computes the exact dense FFN) and
 * writes NaN s~. Inlined: as a call (__noinline__) Stage 1 measured 0.1-0.5 us slower with s1 = 70 % on
 * the Qwen3 1.7B-14B shapes (H100, A/B in one process), the ptxas schedule of the streaming loop changing.
 */
template <int kTile>
PROX_DEVICE PROX_FORCEINLINE void proxy_not_ready(OpWorkspace ws, int d_ff, int n0, int ncols, int chunk, bool select_all,
                                             std::uint32_t* channel_mask, float* s_proxy,
                                             SparsityCounters* counters) {
  if (threadIdx.x == 0) flag_dirty(ws.guard);
  grid_zero(ws.sync, static_cast<int>(tile_counter_bytes<kTile>(d_ff) / sizeof(std::uint32_t)));
  grid_zero(ws.guard.reset, ws.guard.reset_words);
  if (!select_all || chunk != 0) return;
  for (int ch = static_cast<int>(threadIdx.x); ch < ncols; ch += static_cast<int>(blockDim.x)) {
    if (ch % kWarpSize == 0 && channel_mask != nullptr) channel_mask[(n0 + ch) / kWarpSize] = 0xffffffffu;
    if (s_proxy != nullptr) s_proxy[n0 + ch] = __int_as_float(0x7fc00000);  // quiet NaN
  }
  if (counters != nullptr && threadIdx.x == 0)
    atomicAdd(&counters->selected_channels, static_cast<unsigned long long>(ncols));
}

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void proxy_gemv_kernel(
    const ProxyGemvArgs<T, Fmt> a, const OpWorkspace ws) {
  using Rows = detail::ProxyRows<Policy, Fmt>;
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTile = Policy::kTile;
  constexpr int kChunk = Policy::kChunk;
  constexpr int kCpv = Rows::kCpv;
  using Reducer = detail::TileReducer<kThreads, Rows::kTn, kCpv, 2>;
  // The cp.async stages and the block reduction never live at the same time: one buffer serves both.
  union StreamOrReduce {
    typename Rows::Storage stream;
    typename Reducer::Storage red;
  };
  __shared__ int s_rows[kChunk];
  __shared__ float s_x[kChunk];
  constexpr int kXPerThread = (kChunk + kThreads - 1) / kThreads;  // x values per thread (step 1)
  __shared__ int s_warp[kXPerThread * (kThreads / kWarpSize)];    // block_compact_append
  __shared__ StreamOrReduce s_buf;
  __shared__ int s_ready;  // the workspace header's verdict (thread 0)

  const int tid = static_cast<int>(threadIdx.x);
  const int tile = static_cast<int>(blockIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int n0 = tile * kTile;
  const int k0 = chunk * kChunk;
  const int ncols = min(kTile, a.d_ff - n0);  // channels of this tile, a multiple of 32

  // Split-K combine: through distributed shared memory when the launcher made the tile's split-K
  // blocks one cluster (sm_90+; read at run time), else through global memory. Tile channels
  // [lo, hi) are the ones this block finishes in the epilogue: all of them when it is the last block
  // of the tile to arrive (global), its own slice of whole mask words (cluster).
  const int cluster_splits = Reducer::cluster_splits(static_cast<int>(gridDim.y));
  int lo = 0;
  int hi = ncols;
  if (cluster_splits > 1) Reducer::cluster_slice(chunk, cluster_splits, ncols, lo, hi);

  pdl_wait();  // x (and device thresholds, and the workspace) may come from the previous kernel
  pdl_launch_dependents();
  const float tau_x = a.thresholds != nullptr ? __ldg(a.thresholds) : a.tau_x;
  const float tau_s = a.thresholds != nullptr ? __ldg(a.thresholds + 1) : a.tau_s;
  // Block-uniform (no kernel of this launch writes magic or tag): thread 0 loads the header with its
  // first loads and judges it at the compaction's barrier; the block reads the verdict at the combine.
  // Block (x, y) reads header copy x + y: the copies spread the grid's requests over kHeaderCopies L2
  // lines. (Every thread loading one header word cost Stage 1 0.35-0.7 us on the H100.)
  const detail::HeaderWords header =
      tid == 0 ? detail::workspace_header(ws.guard, blockIdx.x + blockIdx.y) : detail::HeaderWords{};

  // Scales of the channels this thread finishes in the epilogue, loaded now so that no block waits
  // for them at the end (in the global combine only the last block of a tile uses them).
  constexpr int kScalesPerThread = (kTile + kThreads - 1) / kThreads;
  float sc_g[kScalesPerThread];
  float sc_u[kScalesPerThread];
#pragma unroll
  for (int i = 0; i < kScalesPerThread; ++i) {
    const int ch = lo + i * kThreads + tid;
    const bool in = ch < hi;
    sc_g[i] = in && a.gate.scales != nullptr ? a.gate.scales[n0 + ch] : 1.0f;
    sc_u[i] = in && a.up.scales != nullptr ? a.up.scales[n0 + ch] : 1.0f;
  }

  // 1. Threshold this block's chunk of x and compact the kept coordinates, in order. All loads of x
  //    are issued before the first compaction step: one memory latency, not one per step.
  float xv[kXPerThread];
  bool keep[kXPerThread];
#pragma unroll
  for (int i = 0; i < kXPerThread; ++i) {
    const int kk = i * kThreads + tid;
    const int k = k0 + kk;
    const bool in = kk < kChunk && k < a.d_model;
    xv[i] = in ? to_float(a.x[k]) : 0.0f;
    keep[i] = in && keep_magnitude(xv[i], tau_x);
  }
  const int count = block_compact_append<kThreads>(keep, k0, xv, s_rows, s_x, s_warp);
  if (tid == 0) s_ready = detail::workspace_ready(header, ws.guard);
  __syncthreads();
  const bool ready = s_ready != 0;
  if (a.counters != nullptr && tid == 0) {
    if (tile == 0) atomicAdd(&a.counters->kept_inputs, static_cast<unsigned long long>(count));
    if (tile == 0 && chunk == 0) atomicAdd(&a.counters->calls, 1ull);
  }

  // 2. Stream the kept rows of this tile.
  const int n = n0 + (tid % Rows::kTn) * kCpv;
  float acc[2][kCpv];
#pragma unroll
  for (int c = 0; c < kCpv; ++c) acc[0][c] = acc[1][c] = 0.0f;
  Rows::run(static_cast<const char*>(Fmt::data(a.gate)) + Fmt::col_bytes(n),
            static_cast<const char*>(Fmt::data(a.up)) + Fmt::col_bytes(n), Fmt::row_bytes(a.d_ff), n < a.d_ff,
            s_rows, s_x, count, acc, s_buf.stream);

  // 3. Block reduction over row groups, then the split-K combine across chunks: at() of s_red then
  //    holds the full sums of channels [lo, hi).
  typename Reducer::Storage& s_red = s_buf.red;
  Reducer::reduce(s_red, acc);
  if (!ready) {
    // The workspace was not initialized or last served another layout: its counters cannot be trusted
    // (every block of the launch takes this branch). Without clusters the tile selects every channel.
    detail::proxy_not_ready<kTile>(ws, a.d_ff, n0, ncols, chunk, cluster_splits <= 1, a.channel_mask, a.s_proxy,
                                   a.counters);
    if (cluster_splits <= 1) return;  // with clusters (no workspace needed) the combine below is right
  }
  if (cluster_splits > 1) {
    Reducer::cluster_combine(s_red, lo, hi, cluster_splits);  // no early exit: cluster_done() below
  } else if (!Reducer::split_k(s_red, static_cast<float*>(ws.scratch), ws.sync + tile, a.d_ff, n0, ncols, chunk,
                               static_cast<int>(gridDim.y))) {
    return;
  }

  // 4. Epilogue in registers: rescale, s~ = u~ * act(g~), threshold, bitmask. lo is a multiple of 32,
  //    so each warp's ballot is exactly one mask word (whole warps are in or out of [lo, hi)).
  const Act act{};
#pragma unroll
  for (int i = 0; i < kScalesPerThread; ++i) {
    const int ch = lo + i * kThreads + tid;
    const int j = n0 + ch;
    const bool in = ch < hi;
    bool sel = false;
    if (in) {
      const float g = Reducer::at(s_red, 0, ch) * sc_g[i];
      const float u = Reducer::at(s_red, 1, ch) * sc_u[i];
      const float s = u * act(g);
      sel = keep_magnitude(s, tau_s);
      if (a.s_proxy != nullptr) a.s_proxy[j] = s;
    }
    const unsigned word = __ballot_sync(0xffffffffu, sel);
    if (lane_id() == 0 && in) {
      if (a.channel_mask != nullptr) a.channel_mask[j / kWarpSize] = word;
      if (a.counters != nullptr && word != 0u)
        atomicAdd(&a.counters->selected_channels, static_cast<unsigned long long>(__popc(word)));
    }
  }
  if (cluster_splits > 1) Reducer::cluster_done();  // the others may still read this block's s_red
}

// ---------------------------------------------------------------- L3: op
/**
 * @brief Stage 1 as a planned op (the contract of every prox op; drive it with prox::Operator):
 * Args, Policies, Options, can_implement, workspace_needs, configure<Policy> (plan time) and
 * launch<Policy> (run time: launches only).
 * @tparam T `__half` / `__nv_bfloat16`; @tparam Act SiLU / GeluTanh; @tparam Fmt Int4Weights / DenseWeights<W>;
 * @tparam List the candidate policies (default: the format's list).
 */
template <class T, class Act = SiLU, class Fmt = Int4Weights, class List = typename ProxyGemvPoliciesFor<Fmt>::type>
struct ProxyGemvOp {
  static constexpr const char* kName = "proxy_gemv";
  using Args = ProxyGemvArgs<T, Fmt>;
  using Policies = List;  //!< the candidates (a list of one's own: experiments, tests)
  //! Its tuning-cache key (prox/tuning/choose.cuh): the format's candidate list and layout. With a
  //! list of its own it has none (op nullptr): the cached names are those of the format's list.
  static constexpr TuneKeyFields kTuneKey{
      std::is_same<List, typename ProxyGemvPoliciesFor<Fmt>::type>::value ? ProxyGemvPoliciesFor<Fmt>::kName : nullptr,
      DTypeTraits<T>::kName, Fmt::kKeyName, Act::kName, true};

  struct Options {
    bool pdl = false;  //!< launch with PDL (sm_90+)
    //! sm_90+: with 2..8 split-K chunks, launch the chunks of each column tile as one thread-block
    //! cluster and combine them through distributed shared memory (bit-identical results).
    bool cluster = false;
    //! A grid of fewer blocks than the GPU holds runs at most ceil(blocks / SMs) per SM
    //! (detail::spread_smem_bytes); results are bit-identical either way.
    bool spread = true;
  };

  template <class P>
  static constexpr int num_tiles(int d_ff) noexcept {
    return ceil_div(d_ff, P::kTile);
  }
  template <class P>
  static constexpr int num_chunks(int d_model) noexcept {
    return ceil_div(d_model, P::kChunk);
  }
  //! Blocks of the launch grid: column tiles x split-K chunks.
  template <class P>
  static constexpr long num_blocks(int d_model, int d_ff) noexcept {
    return static_cast<long>(num_tiles<P>(d_ff)) * num_chunks<P>(d_model);
  }

  /**
   * @brief Validate without launching. Shape rule: 1 <= d_model <= 2^20; d_ff a multiple of 32 in
   * [32, 2^20]. x element-aligned; weights 16-byte aligned; scales, mask, s_proxy, thresholds 4-byte
   * aligned; counters 8-byte aligned; thresholds >= 0 and not NaN; at least one of channel_mask /
   * s_proxy given.
   */
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || Fmt::data(a.gate) == nullptr || Fmt::data(a.up) == nullptr) return Status::kErrorNullPointer;
    if (Fmt::kNeedsScales && (a.gate.scales == nullptr || a.up.scales == nullptr)) return Status::kErrorNullPointer;
    if (a.channel_mask == nullptr && a.s_proxy == nullptr) return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(check_proxy_shape(a.d_model, a.d_ff));
    if (!valid_threshold(a.tau_x) || !valid_threshold(a.tau_s)) return Status::kErrorInvalidThreshold;
    if (!is_aligned(a.x, sizeof(T)) || !is_aligned(Fmt::data(a.gate), 16) || !is_aligned(Fmt::data(a.up), 16) ||
        !is_aligned(a.gate.scales, 4) || !is_aligned(a.up.scales, 4) || !is_aligned(a.channel_mask, 4) ||
        !is_aligned(a.s_proxy, 4) || !is_aligned(a.thresholds, 4) || !is_aligned(a.counters, 8)) {
      return Status::kErrorMisalignedPointer;
    }
    return Status::kSuccess;
  }

  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }

  //! Tile counters (a region of the same size for every policy) and the split-K partials of the
  //! policy with the most chunks (sized for the global combine, which clusters do not use).
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    WorkspaceNeeds w;
    w.sync = detail::tile_counter_bytes<detail::kMinTileWidth>(a.d_ff);
    for_each_policy<Policies>([&](auto p, int) {
      const int chunks = num_chunks<decltype(p)>(a.d_model);
      const std::size_t parts = chunks > 1 ? sizeof(float) * 2 * static_cast<std::size_t>(chunks) * a.d_ff : 0;
      w.scratch = parts > w.scratch ? parts : w.scratch;
    });
    return w;
  }

  /**
   * @brief Plan time: the launch of policy P for this shape on device `d`: grid (tiles, chunks);
   * clusters of the chunks where asked and possible (the kernel falls back to the global combine
   * where the code it runs is older than sm_90); the spread's shared memory where asked (driver
   * facts read once per device).
   */
  template <class P>
  static Status configure(const Args& a, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    lc->grid = dim3(static_cast<unsigned>(num_tiles<P>(a.d_ff)), static_cast<unsigned>(num_chunks<P>(a.d_model)));
    lc->block = dim3(P::kThreads);
    if (lc->grid.y > 65535u) return Status::kErrorInvalidShape;
    // A cluster of <= 8 of these blocks (256 threads, <= 45 KB static shared memory, 2-3 resident per
    // SM) needs 3-4 SMs, far fewer than one GPC of an sm_90 part holds: no occupancy query.
    lc->cluster_y = o.cluster && d.cluster_launch && lc->grid.y >= 2u &&
                            lc->grid.y <= static_cast<unsigned>(detail::kMaxClusterSplits)
                        ? lc->grid.y
                        : 0u;
    lc->smem = 0;
    if (o.spread && lc->cluster_y == 0) {  // a cluster launch is placed by clusters
      PROX_RETURN_IF_ERROR((detail::spread_smem_for<proxy_gemv_kernel<P, T, Act, Fmt>, P::kThreads>(
          d.device, num_blocks<P>(a.d_model, a.d_ff), &lc->smem)));
    }
    return Status::kSuccess;
  }

  //! Run time: launch policy P with the planned configuration (no validation, no device query).
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return detail::launch_kernel(proxy_gemv_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
  }
};

//! Stage 1: the fewest waves, preferring a cp.async-pipelined candidate (kStages > 0) when the grid
//! needs more than one wave, then the most blocks (detail::default_fewest_waves).
template <class T, class Act, class Fmt, class List>
int default_policy(ProxyGemvOp<T, Act, Fmt, List>, const DeviceInfo& d, const ProxyGemvArgs<T, Fmt>& a) noexcept {
  using Op = ProxyGemvOp<T, Act, Fmt, List>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff); },
      [](auto p) { return decltype(p)::kStages > 0; });
}

PROX_NAMESPACE_END
