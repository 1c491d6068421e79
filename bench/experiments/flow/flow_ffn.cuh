// SPDX-License-Identifier: Apache-2.0
//! @file flow_ffn.cuh  (experiment, issue 46; not part of the library: docs/history.md, "a one-kernel FFN with one
//! cross-block step") The FFN of one token in one kernel, with one step that waits on other blocks
//! (sm_90+). Prox's two stages, as a dataflow over a persistent grid of one block per SM:
//!
//!   Stage 1 tiles  a block computes the whole proxy dot products of a tile of 64 channels (INT4 proxies in
//!                  the tiled layout, int4_tiled.cuh) over the kept inputs (x thresholded and compacted once
//!                  per block, in shared memory), forms s~ and publishes the selected channels to a queue in
//!                  the workspace. No block waits for another to know its channels: no split-K combine.
//!   Stage 2 items  any block claims a few queued channels and streams their W_gate, W_up and W_down^T rows
//!                  into a shared-memory ring with bulk asynchronous copies (core/bulk.cuh: 8-10 KB a row,
//!                  one instruction, no registers), computes s_j = u_j act(g_j) exactly and adds s_j W_down^T[j]
//!                  to a y partial in registers. No grid barrier separates the GLU from the down rows.
//!   y              the one step that waits on other blocks: each block adds its partial into an fp32
//!                  accumulator in the workspace (vector reductions), and the last block to arrive converts y,
//!                  writes it and re-zeroes the accumulator and the counters (the next replay of a captured
//!                  graph starts clean).
//!
//! Scheduling: thread 0 of each block keeps the ring full from the queue (claims sized by what is left, so the
//! last channels spread over the grid), and between ring stages the block takes Stage-1 tiles (its first tile
//! is its block index; the rest come from an atomic counter). Channels are published as tiles finish, so
//! Stage 2 starts while Stage 1 is still running and no block idles while work is queued.
//!
//! Results: the channel set and every s_j are computed in a fixed order (bit-identical run to run); y is the
//! sum of the blocks' partials in the order they arrive, so its last bits can differ between runs (fp32
//! rounding of a reordered sum). SparseFfn::PlanOptions::deterministic plans the two-kernel FFN instead.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <prox/activation.cuh>
#include <prox/core/config.hpp>
#include <prox/core/device.hpp>
#include <prox/core/launch.cuh>
#include <prox/core/math.hpp>
#include <prox/core/policy.hpp>
#include <prox/core/shape.hpp>
#include <prox/core/status.hpp>
#include <prox/core/tune_key.hpp>
#include <prox/core/types.cuh>
#include <prox/core/vec.cuh>
#include <prox/core/warp.cuh>
#include <prox/core/workspace.cuh>
#include <prox/detail/tile_reduce.cuh>
#include <prox/int4.cuh>
#include <prox/proxy_gemv.cuh>
#include <prox/stage2_weights.cuh>
#include <prox/stats.cuh>
#include <prox/threshold.cuh>

#include "bulk.cuh"
#include "int4_tiled.cuh"

namespace prox_flow {
using namespace prox;

/**
 * @brief Arguments of the one-kernel FFN. All pointers are device pointers.
 * @tparam T   `__half` or `__nv_bfloat16` (x, y, and the exact weights of NativeWeights<T>)
 * @tparam Fmt the Stage-2 weight format (stage2_weights.cuh, fp8_weights.cuh)
 */
template <class T, class Fmt = NativeWeights<T>>
struct FlowFfnArgs {
  using Matrix = typename Fmt::Matrix;
  const T* x = nullptr;  //!< [d_model], 16-byte aligned
  T* y = nullptr;        //!< out [d_model], 16-byte aligned, every element written; must not alias x
  int d_model = 0;       //!< a multiple of 8 (of Fmt::kElemsPerVec), at most kFlowMaxDModel
  int d_ff = 0;          //!< a multiple of 64
  float tau_x = 0.0f;    //!< input threshold (>= 0)
  float tau_s = 0.0f;    //!< channel threshold (>= 0)
  const float* thresholds = nullptr;  //!< optional device {tau_x, tau_s}, read by every launch (as Stage 1's)
  Int4TiledWeights::Matrix proxy_gate{};  //!< INT4 proxy of W_gate, tiled layout (tiled::tile_host/device)
  Int4TiledWeights::Matrix proxy_up{};
  Matrix w_gate{};    //!< [d_ff][d_model] row-major (nn.Linear), 16-byte aligned
  Matrix w_up{};      //!< [d_ff][d_model]
  Matrix w_down_t{};  //!< [d_ff][d_model] = W_down^T
  std::uint32_t* channel_mask = nullptr;  //!< optional out [d_ff/32]: the selected channels
  float* s_proxy = nullptr;               //!< optional out [d_ff]: s~ of every channel
  float* s = nullptr;                     //!< optional out [d_ff]: s_j for selected j, +0 for the others
  SparsityCounters* counters = nullptr;   //!< optional runtime statistics (accumulated)
  //! Optional: a byte range the kernel brings into L2 while its blocks wait at its end (the caller's next
  //! weights, e.g. the next layer's QKV); 16-byte aligned, a multiple of 16 bytes; null with 0 bytes = none.
  const void* prefetch = nullptr;
  std::size_t prefetch_bytes = 0;
};

//! Largest d_model the one-kernel FFN takes (the y partial a thread holds is sized for it).
constexpr int kFlowMaxDModel = 7680;

/**
 * @brief Policy of the one-kernel FFN (vocabulary: core/policy.hpp).
 * @tparam Threads       threads per block (one block per SM)
 * @tparam StageChannels channels per ring stage (their three rows)
 * @tparam MaxStages     ring stages at most (as many as shared memory holds, at least 2)
 * @tparam Unroll        Stage-1 kept rows each thread has in flight per step
 */
template <int Threads, int StageChannels, int MaxStages, int Unroll>
struct FlowFfnPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kStageChannels = StageChannels;
  static constexpr int kMaxStages = MaxStages;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = 1;
  static constexpr int kTile = tiled::kTileChannels;
  //! Most channels one claim takes from the queue (claims shrink to 1 as the queue empties).
  static constexpr int kMaxClaim = 8;
  static_assert(Threads % 128 == 0 && StageChannels >= 1 && StageChannels <= 4 && MaxStages >= 2 &&
                    MaxStages <= 8 && kMaxClaim >= StageChannels,
                "policy shape");
  static std::string name() {
    return "flow_t" + std::to_string(Threads) + "_c" + std::to_string(StageChannels) + "_s" +
           std::to_string(MaxStages) + "_u" + std::to_string(Unroll);
  }
};

//! Candidates (index 0 is the default; see default_policy below).
using FlowFfnPolicies = PolicyList<FlowFfnPolicy<512, 2, 4, 4>, FlowFfnPolicy<512, 1, 8, 4>>;

namespace fx {

//! Words of the flow state in the workspace's sync region (zero before a launch, left zero after it): the
//! counters, each on its own 128-byte line, then the queue (channel + 1, 0 = empty) and the fp32 y accumulator.
struct FlowWords {
  static constexpr int kTilesDone = 32;  //!< Stage-1 tiles finished (release)
  static constexpr int kHead = 64;       //!< queue tickets taken (may pass kTail: void tickets)
  static constexpr int kTail = 96;       //!< queue entries reserved by producers
  static constexpr int kBlocksDone = 128;  //!< blocks that have added their y partial
  static constexpr int kQueue = 160;
  //! Copies of the y accumulator: block b adds into copy b % kYCopies, so that the reductions of a grid's blocks
  //! spread over kYCopies times the L2 lines (one copy took 3.8 us on Qwen3-8B, H200: every line's additions
  //! are serialized at its L2 slice); the last block sums the copies.
  static constexpr int kYCopies = 8;
  PROX_HOST_DEVICE static constexpr int yacc(int d_ff) noexcept { return round_up(kQueue + d_ff, 32); }
  PROX_HOST_DEVICE static constexpr std::size_t bytes(int d_model, int d_ff) noexcept {
    return sizeof(std::uint32_t) * static_cast<std::size_t>(yacc(d_ff) + kYCopies * d_model);
  }
};

/**
 * @brief The dynamic shared memory of the one-kernel FFN at one d_model (host and device): x as T, the kept
 * rows and their values (Stage 1), then the ring of stages, each kStageChannels x {gate, up, down} rows.
 */
template <class Policy, class T, class Fmt>
struct FlowSmem {
  std::size_t x = 0, rows = 0, vals = 0, ring = 0, row_bytes = 0, stage_bytes = 0;
  PROX_HOST_DEVICE explicit FlowSmem(int d_model) noexcept {
    row_bytes = static_cast<std::size_t>(d_model) * sizeof(typename Fmt::Element);
    stage_bytes = round_up<std::size_t>(static_cast<std::size_t>(Policy::kStageChannels) * 3 * row_bytes, 128);
    rows = round_up<std::size_t>(sizeof(T) * static_cast<std::size_t>(d_model), 128);
    vals = rows + round_up<std::size_t>(sizeof(int) * static_cast<std::size_t>(d_model), 128);
    ring = vals + round_up<std::size_t>(sizeof(float) * static_cast<std::size_t>(d_model), 128);
  }
  //! Ring stages that `dynamic_bytes` of dynamic shared memory hold (at most kMaxStages).
  PROX_HOST_DEVICE int stages(std::size_t dynamic_bytes) const noexcept {
    if (dynamic_bytes <= ring) return 0;
    const std::size_t s = (dynamic_bytes - ring) / stage_bytes;
    return s < static_cast<std::size_t>(Policy::kMaxStages) ? static_cast<int>(s) : Policy::kMaxStages;
  }
  //! Dynamic shared memory for `n` stages.
  PROX_HOST_DEVICE std::size_t bytes(int n) const noexcept { return ring + static_cast<std::size_t>(n) * stage_bytes; }
};

#if defined(__CUDACC__)
//! A barrier of the first kN threads of a block (named barrier kId; 0 is __syncthreads): the worker warps.
template <int kId, int kN>
struct NamedSync {
  static_assert(kId >= 1 && kId <= 15 && kN % kWarpSize == 0, "named barrier");
  PROX_DEVICE static PROX_FORCEINLINE void sync() { asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kN) : "memory"); }
};

/**
 * @brief TileReducer::reduce() (prox/detail/tile_reduce.cuh: recursive halving in the warp, warps added in order)
 * for the worker warps alone: the same additions in the same order, with Sync in place of __syncthreads().
 */
template <class Reducer, class Sync, int kThreads, int kTn, int kCpv>
PROX_DEVICE void reduce_tile(typename Reducer::Storage& st, float (&acc)[2][kCpv]) {
  constexpr int kVals = 2 * kCpv;
  constexpr int kGroupsPerWarp = kWarpSize / kTn;
  constexpr int kTile = kTn * kCpv;
  static_assert(kGroupsPerWarp > 1 && kVals % kGroupsPerWarp == 0, "the halving path of TileReducer::reduce");
  float v[kVals];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int c = 0; c < kCpv; ++c) v[m * kCpv + c] = acc[m][c];
  }
  int base = 0;
  Reducer::template halve_steps<0, log2_pow2(kGroupsPerWarp)>(v, base);
  const int slot = lane_id() % kTn;
  const int warp = warp_id();
#pragma unroll
  for (int j = 0; j < kVals / kGroupsPerWarp; ++j) {
    const int i = base + j;
    st.red[warp][i / kCpv][Reducer::pad(slot * kCpv + i % kCpv)] = v[j];
  }
  Sync::sync();
  for (int i = static_cast<int>(threadIdx.x); i < 2 * kTile; i += kThreads) {
    const int m = i / kTile;
    const int ch = i % kTile;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / kWarpSize; ++w) sum += st.red[w][m][Reducer::pad(ch)];
    st.red[0][m][Reducer::pad(ch)] = sum;
  }
  Sync::sync();
}

//! The dynamic shared memory this launch has (the planned ring size is read back from it).
PROX_DEVICE PROX_FORCEINLINE unsigned dynamic_smem_size() {
  unsigned v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}
#endif

}  // namespace fx

// ---------------------------------------------------------------- L2: kernel
#if defined(__CUDACC__)
namespace fx {
// Development trace (bench/experiments/flow_ffn_bench.cu, built with PROX_FLOW_TRACE): two threads of each block
// (role 0: worker thread 0; role 1: the producer lane) record {%globaltimer, kind << 32 | value} events into
// g_flow_trace[block][role][kFlowTraceEvents][2]. Off (the default), the events compile to nothing.
enum FlowTraceEvent : int {
  kFlowEvStart = 1, kFlowEvXDone, kFlowEvTile, kFlowEvTileEnd, kFlowEvWait, kFlowEvConsume, kFlowEvConsumeEnd,
  kFlowEvWorkDone, kFlowEvFill, kFlowEvFillDone, kFlowEvArrived, kFlowEvFinal, kFlowEvXLoaded, kFlowEvXRound
};
#if defined(PROX_FLOW_TRACE)
__device__ unsigned long long* g_flow_trace = nullptr;
constexpr int kFlowTraceEvents = 2048;
struct FlowTracer {
  int n = 0;
  int role = 0;
  PROX_DEVICE PROX_FORCEINLINE void operator()(int kind, unsigned value) {
    if (g_flow_trace == nullptr || n >= kFlowTraceEvents) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    unsigned long long* e = g_flow_trace + ((static_cast<std::size_t>(blockIdx.x) * 2 + role) * kFlowTraceEvents + n++) * 2;
    e[0] = t;
    e[1] = (static_cast<unsigned long long>(kind) << 32) | value;
  }
};
#else
struct FlowTracer {
  int role = 0;
  PROX_DEVICE PROX_FORCEINLINE void operator()(int, unsigned) {}
};
#endif
}  // namespace fx

/**
 * Roles: warps 0 .. W-2 are workers (Stage-1 tiles, then the compute of ring stages, with a named barrier among
 * them); the last warp's lane 0 is the producer: it takes queue tickets, resolves them to channels and issues the
 * bulk copies of each ring stage, so no worker waits on the queue's round trips. Stages complete on `full`
 * mbarriers (the copies' bytes) and are handed back on `empty` ones (worker 0, after the workers' barrier); a
 * stage of -1 channels ends the workers' loop.
 */
template <class Policy, class T, class Act, class Fmt>
PROX_KERNEL __launch_bounds__(Policy::kThreads, 1) void flow_ffn_kernel(const FlowFfnArgs<T, Fmt> a,
                                                                       const OpWorkspace ws) {
#if PROX_ARCH_SM90
  constexpr int kThreads = Policy::kThreads;
  constexpr int kWorkers = kThreads - kWarpSize;
  constexpr int kWorkerWarps = kWorkers / kWarpSize;
  constexpr int kC = Policy::kStageChannels;
  constexpr int kS = Policy::kMaxStages;
  constexpr int kTile = Policy::kTile;
  constexpr int kE = Fmt::kElemsPerVec;                               // elements of one 16-byte weight piece
  constexpr int kYPieces = ceil_div(kFlowMaxDModel / kE, kWorkers);  // y pieces a worker owns at most
  constexpr int kXPer = 4;                                            // x elements per compaction round
  constexpr int kXMax = round_up(ceil_div(kFlowMaxDModel, kThreads), kXPer);  // x elements per thread at most
  using WorkSync = fx::NamedSync<1, kWorkers>;
  using Stage1Policy = ProxyGemvPolicy<kWorkers, kTile, kTile, Policy::kUnroll, 1, 0>;
  using Rows = prox::detail::ProxyRows<Stage1Policy, Int4Weights>;
  using Reducer = prox::detail::TileReducer<kWorkers, Rows::kTn, Rows::kCpv, 2>;  // its storage and at()
  using W = fx::FlowWords;
  using Smem = fx::FlowSmem<Policy, T, Fmt>;
  static_assert(kXMax % kXPer == 0, "compaction rounds");

  extern __shared__ __align__(128) unsigned char flow_smem[];
  __shared__ typename Reducer::Storage s_red;
  __shared__ typename Rows::Storage s_rows_st;  // unused by register-buffered Stage-1 policies (1 element)
  __shared__ __align__(8) std::uint64_t s_full[kS];
  __shared__ __align__(8) std::uint64_t s_empty[kS];
  __shared__ __align__(8) std::uint64_t s_tiles;  // the workers have done this block's Stage-1 tiles
  __shared__ int s_stage_ch[kS][kC];
  __shared__ int s_stage_n[kS];
  __shared__ int s_backlog[Policy::kMaxClaim];
  __shared__ int s_warp[kXPer * (kThreads / kWarpSize)];
  __shared__ float s_glu[kWorkerWarps][2 * kC];
  __shared__ float s_sval[kC];
  __shared__ unsigned s_words[kTile / kWarpSize];
  __shared__ int s_ctl[4];  // header verdict, a queue base, the last-arriver verdict

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const unsigned grid = gridDim.x;
  const int d_model = a.d_model;
  const int d_ff = a.d_ff;
  const int n_tiles = d_ff / kTile;
  const Smem sm(d_model);
  const int stages = sm.stages(fx::dynamic_smem_size());
  T* s_x = reinterpret_cast<T*>(flow_smem);
  int* s_rows = reinterpret_cast<int*>(flow_smem + sm.rows);
  float* s_vals = reinterpret_cast<float*>(flow_smem + sm.vals);
  unsigned char* s_ring = flow_smem + sm.ring;
  unsigned* const words = ws.sync;
  unsigned* const queue = words + W::kQueue;
  float* const yacc = reinterpret_cast<float*>(words + W::yacc(d_ff));
  fx::FlowTracer trace;
  trace.role = warp == kWorkerWarps ? 1 : 0;

  if (tid == 0) {
    for (int i = 0; i < stages; ++i) {
      bulk::mbar_init(&s_full[i], 1);
      bulk::mbar_init(&s_empty[i], 1);
    }
    bulk::mbar_init(&s_tiles, 1);
    bulk::fence_mbar_init();
  }
  pdl_wait();  // x, the device thresholds and the workspace may come from the previous kernel
  if (tid == 0) trace(fx::kFlowEvStart, 0);
  const float tau_x = a.thresholds != nullptr ? __ldg(a.thresholds) : a.tau_x;
  const float tau_s = a.thresholds != nullptr ? __ldg(a.thresholds + 1) : a.tau_s;
  const prox::detail::HeaderWords header = tid == 0 ? prox::detail::workspace_header(ws.guard, blockIdx.x) : prox::detail::HeaderWords{};

  // x into shared memory (as T, for Stage 2), thresholded and compacted in order (for Stage 1), once per block;
  // every load issued before the first compaction round (one memory latency).
  T xr[kXMax];
#pragma unroll
  for (int i = 0; i < kXMax; ++i) {
    const int k = i * kThreads + tid;
    xr[i] = k < d_model ? a.x[k] : from_float<T>(0.0f);
  }
  int count = 0;
#pragma unroll
  for (int r = 0; r < kXMax / kXPer; ++r) {
    if (r * kXPer * kThreads >= d_model) break;  // block-uniform
    float xv[kXPer];
    bool keep[kXPer];
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      const int k = (r * kXPer + i) * kThreads + tid;
      const bool in = k < d_model;
      if (in) s_x[k] = xr[r * kXPer + i];
      xv[i] = to_float(xr[r * kXPer + i]);
      keep[i] = in && keep_magnitude(xv[i], tau_x);
    }
    if (r == 0 && tid == 0) trace(fx::kFlowEvXLoaded, 0);
    count += block_compact_append<kThreads, kXPer>(keep, r * kXPer * kThreads, xv, s_rows + count, s_vals + count,
                                                   s_warp);
    __syncthreads();  // s_warp is reused by the next round
    if (tid == 0) trace(fx::kFlowEvXRound, static_cast<unsigned>(r));
  }
  if (tid == 0) s_ctl[0] = prox::detail::workspace_ready(header, ws.guard);
  __syncthreads();
  if (s_ctl[0] == 0) {
    // Never initialized, garbage, or another layout's: the counters and the queue cannot be trusted (the whole
    // grid agrees). Zero the flow state for the next launch, flag the header, write NaN y.
    if (tid == 0) prox::detail::flag_dirty(ws.guard);
    prox::detail::grid_zero(words, static_cast<int>(W::bytes(d_model, d_ff) / sizeof(unsigned)));
    for (int i = static_cast<int>(blockIdx.x) * kThreads + tid; i < d_model; i += static_cast<int>(grid) * kThreads)
      a.y[i] = from_float<T>(__int_as_float(0x7fc00000));
    pdl_launch_dependents();
    return;
  }
  if (a.counters != nullptr && blockIdx.x == 0 && tid == 0) {
    atomicAdd(&a.counters->calls, 1ull);
    atomicAdd(&a.counters->kept_inputs, static_cast<unsigned long long>(count));
  }
  if (tid == 0) trace(fx::kFlowEvXDone, static_cast<unsigned>(count));

  float yp[kYPieces][kE];
#pragma unroll
  for (int p = 0; p < kYPieces; ++p) {
#pragma unroll
    for (int e = 0; e < kE; ++e) yp[p][e] = 0.0f;
  }
  bool processed = false;           // the block added some channel's down row to its y partial (workers)
  const int pieces = d_model / kE;  // 16-byte pieces of a row

  if (warp == kWorkerWarps) {
    // ================= The producer (lane 0): queue tickets -> channels -> bulk copies into the ring.
    if (lane == 0) {
      const std::uint64_t policy = bulk::evict_first_policy();
      int bl_pos = 0;  // resolved channels not yet in the ring: s_backlog[bl_pos, bl_n)
      int bl_n = 0;
      unsigned tk_base = 0;  // tickets held: queue entries tk_base + i for the set bits i of tk_mask
      unsigned tk_mask = 0;
      // Held tickets -> backlog channels. An entry is written by the producer that reserved it, soon after its
      // reservation; a ticket at or past the final queue length (every tile done) is void.
      const auto resolve = [&]() {
        if (tk_mask == 0u) return;
        unsigned v[Policy::kMaxClaim];
#pragma unroll
        for (int i = 0; i < Policy::kMaxClaim; ++i)
          v[i] = (tk_mask >> i) & 1u ? bulk::ld_relaxed(queue + tk_base + i) : 0u;
#pragma unroll
        for (int i = 0; i < Policy::kMaxClaim; ++i) {
          if (v[i] != 0u) {
            bulk::st_relaxed(queue + tk_base + i, 0u);  // empty again for the next launch
            tk_mask &= ~(1u << i);
            const unsigned ch = v[i] - 1u;
            if (ch < static_cast<unsigned>(d_ff)) s_backlog[bl_n++] = static_cast<int>(ch);  // garbage dropped
          }
        }
        if (tk_mask != 0u && bulk::ld_acquire(words + W::kTilesDone) >= static_cast<unsigned>(n_tiles)) {
          const unsigned t = bulk::ld_relaxed(words + W::kTail);
#pragma unroll
          for (int i = 0; i < Policy::kMaxClaim; ++i)
            if (tk_base + i >= t) tk_mask &= ~(1u << i);
        }
      };
      // Tickets for entries nobody holds yet (a share of them: 1 at the end), then resolved.
      const auto take = [&]() {
        const unsigned h = bulk::ld_relaxed(words + W::kHead);
        const unsigned t = bulk::ld_relaxed(words + W::kTail);
        if (t <= h) return;
        unsigned n = (t - h) / grid;
        n = n < 1u ? 1u : n > static_cast<unsigned>(Policy::kMaxClaim) ? static_cast<unsigned>(Policy::kMaxClaim) : n;
        tk_base = atomicAdd(words + W::kHead, n);
        tk_mask = (1u << n) - 1u;
        resolve();
      };
      // Every tile is done and every queue entry is held by some block: no more work will appear.
      const auto finished = [&]() -> bool {
        if (bulk::ld_acquire(words + W::kTilesDone) < static_cast<unsigned>(n_tiles)) return false;
        return bulk::ld_relaxed(words + W::kHead) >= bulk::ld_relaxed(words + W::kTail);
      };
      // The ring is filled once this block's Stage-1 tiles are done: bulk copies issued meanwhile would queue
      // ahead of the tiles' row loads in this SM's memory pipeline (a tile took 7.5 us instead of ~3 on Qwen3-8B
      // at e = 70 %, H200), and the tiles feed every block's queue.
      bulk::mbar_wait(&s_tiles, 0u);
#pragma unroll 1
      for (int k = 0;; ++k) {
        const int slot = k % stages;
        if (k >= stages) bulk::mbar_wait(&s_empty[slot], static_cast<unsigned>((k / stages - 1) & 1));
        int n = 0;
        while (true) {
          while (n < kC && bl_pos < bl_n) s_stage_ch[slot][n++] = s_backlog[bl_pos++];
          if (n == kC) break;
          if (bl_pos == bl_n) {
            bl_pos = bl_n = 0;
            resolve();
            if (bl_n == 0 && tk_mask == 0u) take();
            if (bl_n > 0) continue;
          }
          if (n > 0) break;  // ship what there is
          if (tk_mask == 0u && finished()) {
            n = -1;
            break;
          }
          __nanosleep(128);  // tiles of other blocks are about to publish channels
        }
        s_stage_n[slot] = n;
        trace(fx::kFlowEvFill, static_cast<unsigned>(n));
        if (n < 0) {
          bulk::mbar_arrive(&s_full[slot]);  // the end: no bytes, the workers leave their loop
          break;
        }
        const unsigned rb = static_cast<unsigned>(sm.row_bytes);
        bulk::mbar_arrive_expect_tx(&s_full[slot], static_cast<unsigned>(n) * 3u * rb);
        unsigned char* dst = s_ring + static_cast<std::size_t>(slot) * sm.stage_bytes;
        for (int c = 0; c < n; ++c) {
          const std::size_t row = static_cast<std::size_t>(s_stage_ch[slot][c]) * static_cast<std::size_t>(d_model);
          bulk::copy_g2s(dst + (3 * c + 0) * sm.row_bytes, Fmt::data(a.w_gate) + row, rb, &s_full[slot], policy);
          bulk::copy_g2s(dst + (3 * c + 1) * sm.row_bytes, Fmt::data(a.w_up) + row, rb, &s_full[slot], policy);
          bulk::copy_g2s(dst + (3 * c + 2) * sm.row_bytes, Fmt::data(a.w_down_t) + row, rb, &s_full[slot], policy);
        }
      }
      trace(fx::kFlowEvFillDone, 0);
      if (a.prefetch != nullptr && a.prefetch_bytes >= 16) {
        // This block's share of the caller's range, in pieces the copy engine takes, while the grid converges.
        const std::size_t total = a.prefetch_bytes & ~static_cast<std::size_t>(15);
        const std::size_t share = ((total + grid - 1) / grid + 15) & ~static_cast<std::size_t>(15);
        const std::size_t lo = share * blockIdx.x;
        const std::size_t hi = lo + share < total ? lo + share : total;
        constexpr std::size_t kPiece = std::size_t(1) << 16;
        for (std::size_t o = lo; o < hi; o += kPiece)
          bulk::prefetch_l2(static_cast<const char*>(a.prefetch) + o,
                            static_cast<unsigned>(hi - o < kPiece ? hi - o : kPiece));
      }
    }
  } else {
    // ================= The workers: this block's Stage-1 tiles (b, b + grid, ...), then the ring's stages.
    const Act act{};
#pragma unroll 1
    for (int tile = static_cast<int>(blockIdx.x); tile < n_tiles; tile += static_cast<int>(grid)) {
      if (tid == 0) trace(fx::kFlowEvTile, static_cast<unsigned>(tile));
      const int n0 = tile * kTile;
      const bool epi = tid < kTile;  // the epilogue's threads: one channel each
      const float sc_g = epi ? __ldg(a.proxy_gate.scales + n0 + tid) : 0.0f;
      const float sc_u = epi ? __ldg(a.proxy_up.scales + n0 + tid) : 0.0f;
      const std::size_t off = static_cast<std::size_t>(tile) * Int4TiledWeights::tile_bytes(d_model) +
                              static_cast<std::size_t>(tid % Rows::kTn) * Int4Weights::col_bytes(Rows::kCpv);
      float acc[2][Rows::kCpv];
#pragma unroll
      for (int c = 0; c < Rows::kCpv; ++c) acc[0][c] = acc[1][c] = 0.0f;
      Rows::run(static_cast<const char*>(Int4TiledWeights::data(a.proxy_gate)) + off,
                static_cast<const char*>(Int4TiledWeights::data(a.proxy_up)) + off, Int4TiledWeights::kRowBytes, true,
                s_rows, s_vals, count, acc, s_rows_st);
      fx::reduce_tile<Reducer, WorkSync, kWorkers, Rows::kTn, Rows::kCpv>(s_red, acc);
      bool sel = false;
      if (epi) {
        const int j = n0 + tid;
        const float g = Reducer::at(s_red, 0, tid) * sc_g;
        const float u = Reducer::at(s_red, 1, tid) * sc_u;
        const float sp = u * act(g);
        sel = keep_magnitude(sp, tau_s);
        if (a.s_proxy != nullptr) a.s_proxy[j] = sp;
        if (a.s != nullptr && !sel) a.s[j] = 0.0f;
        const unsigned word = __ballot_sync(0xffffffffu, sel);
        if (lane == 0) {
          s_words[warp] = word;
          if (a.channel_mask != nullptr) a.channel_mask[j / kWarpSize] = word;
        }
      }
      WorkSync::sync();
      int nsel = 0;
#pragma unroll
      for (int w = 0; w < kTile / kWarpSize; ++w) nsel += __popc(s_words[w]);
      if (nsel > 0) {  // uniform over the workers
        if (tid == 0) {
          s_ctl[1] = static_cast<int>(atomicAdd(words + W::kTail, static_cast<unsigned>(nsel)));
          if (a.counters != nullptr) atomicAdd(&a.counters->selected_channels, static_cast<unsigned long long>(nsel));
        }
        WorkSync::sync();
        if (sel) {
          int pos = __popc(s_words[warp] & ((1u << lane) - 1u));
          for (int w = 0; w < warp; ++w) pos += __popc(s_words[w]);
          bulk::st_relaxed(queue + s_ctl[1] + pos, static_cast<unsigned>(n0 + tid + 1));
        }
      }
      // The tile's count after its reservation (thread 0's program order; producers acquire it): a block that
      // sees every tile done sees the final queue length.
      if (tid == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(words + W::kTilesDone) : "memory");
        trace(fx::kFlowEvTileEnd, static_cast<unsigned>(nsel));
      }
      WorkSync::sync();  // s_words, s_ctl and the reduction storage are reused by the next tile
    }
    if (tid == 0) bulk::mbar_arrive(&s_tiles);
#pragma unroll 1
    for (int k = 0;; ++k) {
      // ---- Ring stage k: s_j of its channels, then their down rows into the y partial.
      const int slot = k % stages;
      if (tid == 0) trace(fx::kFlowEvWait, static_cast<unsigned>(k));
      bulk::mbar_wait(&s_full[slot], static_cast<unsigned>((k / stages) & 1));
      const int n = s_stage_n[slot];
      if (n < 0) break;
      if (tid == 0) trace(fx::kFlowEvConsume, static_cast<unsigned>(n));
      const unsigned char* st = s_ring + static_cast<std::size_t>(slot) * sm.stage_bytes;
      float part[2 * kC];
#pragma unroll
      for (int i = 0; i < 2 * kC; ++i) part[i] = 0.0f;
      for (int q = tid; q < pieces; q += kWorkers) {
        float xf[kE];
#pragma unroll
        for (int h = 0; h < kE / 8; ++h) {
          float x8[8];
          unpack8<T>(reinterpret_cast<const uint4*>(s_x)[q * (kE / 8) + h], x8);
#pragma unroll
          for (int e = 0; e < 8; ++e) xf[8 * h + e] = x8[e];
        }
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          if (c < n) {
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              float wv[kE];
              Fmt::dequant(reinterpret_cast<const uint4*>(st + (3 * c + m) * sm.row_bytes)[q], wv);
              float d = 0.0f;
#pragma unroll
              for (int e = 0; e < kE; ++e) d = fmaf(wv[e], xf[e], d);
              if constexpr (Fmt::kPieceScales) {
                d *= Fmt::piece_scale(m == 0 ? a.w_gate : a.w_up, s_stage_ch[slot][c], q, d_model);
              }
              part[2 * c + m] += d;
            }
          }
        }
      }
      const float r = warp_sum_many<2 * kC>(part);  // lane l: the sum of value l / (32 / (2 kC))
      constexpr int kLanesPer = kWarpSize / (2 * kC);
      if (lane % kLanesPer == 0) s_glu[warp][lane / kLanesPer] = r;
      WorkSync::sync();
      if (tid < n) {
        const int j = s_stage_ch[slot][tid];
        float g = 0.0f;
        float u = 0.0f;
#pragma unroll
        for (int w = 0; w < kWorkerWarps; ++w) {
          g += s_glu[w][2 * tid];
          u += s_glu[w][2 * tid + 1];
        }
        const float s = Fmt::glu_out(a.w_up, j, u) * act(Fmt::glu_out(a.w_gate, j, g));
        s_sval[tid] = s;
        if (a.s != nullptr) a.s[j] = s;
      }
      WorkSync::sync();
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if (c < n) {
          const int j = s_stage_ch[slot][c];
          const float sv = s_sval[c];
          const uint4* row = reinterpret_cast<const uint4*>(st + (3 * c + 2) * sm.row_bytes);
#pragma unroll
          for (int p = 0; p < kYPieces; ++p) {
            const int q = tid + p * kWorkers;
            if (q < pieces) {
              float wv[kE];
              Fmt::dequant(row[q], wv);
              const float sd = Fmt::down_s(a.w_down_t, j, q * kE, d_model, sv);
#pragma unroll
              for (int e = 0; e < kE; ++e) yp[p][e] = fmaf(sd, wv[e], yp[p][e]);
            }
          }
        }
      }
      processed = true;
      WorkSync::sync();  // every worker is done with the stage (and with s_glu, s_sval)
      if (tid == 0) {
        bulk::mbar_arrive(&s_empty[slot]);
        trace(fx::kFlowEvConsumeEnd, 0);
      }
    }
    if (tid == 0) trace(fx::kFlowEvWorkDone, 0);
  }

  // ---- The one step that waits on other blocks: y partials into the accumulator, the last block writes y.
  pdl_launch_dependents();  // every weight load of this block is done (or issued: the producer's prefetch)
  if (processed) {
    float* const mine = yacc + static_cast<std::size_t>(blockIdx.x % W::kYCopies) * d_model;
#pragma unroll
    for (int p = 0; p < kYPieces; ++p) {
      const int q = tid + p * kWorkers;
      if (q < pieces) {
#pragma unroll
        for (int e = 0; e < kE; e += 4)
          bulk::red_add_v4(mine + q * kE + e, yp[p][e], yp[p][e + 1], yp[p][e + 2], yp[p][e + 3]);
      }
    }
  }
  __syncthreads();  // every reduction of the block precedes thread 0's release
  if (tid == 0) s_ctl[2] = bulk::atom_add_acq_rel(words + W::kBlocksDone, 1u) == grid - 1u;
  __syncthreads();
  if (tid == 0) trace(fx::kFlowEvArrived, static_cast<unsigned>(s_ctl[2]));
  if (s_ctl[2] != 0) {
    for (int i = 4 * tid; i < d_model; i += 4 * kThreads) {
      float4 c[W::kYCopies];
#pragma unroll
      for (int r = 0; r < W::kYCopies; ++r)
        c[r] = __ldcg(reinterpret_cast<const float4*>(yacc + static_cast<std::size_t>(r) * d_model + i));
      float4 v = c[0];
#pragma unroll
      for (int r = 1; r < W::kYCopies; ++r) {
        v.x += c[r].x;
        v.y += c[r].y;
        v.z += c[r].z;
        v.w += c[r].w;
      }
      a.y[i] = from_float<T>(Fmt::down_out(a.w_down_t, i, v.x));
      a.y[i + 1] = from_float<T>(Fmt::down_out(a.w_down_t, i + 1, v.y));
      a.y[i + 2] = from_float<T>(Fmt::down_out(a.w_down_t, i + 2, v.z));
      a.y[i + 3] = from_float<T>(Fmt::down_out(a.w_down_t, i + 3, v.w));
#pragma unroll
      for (int r = 0; r < W::kYCopies; ++r)
        __stcg(reinterpret_cast<float4*>(yacc + static_cast<std::size_t>(r) * d_model + i),
               make_float4(0.0f, 0.0f, 0.0f, 0.0f));
    }
    if (tid == 0) {
      words[W::kTilesDone] = 0u;
      words[W::kHead] = 0u;
      words[W::kTail] = 0u;
      words[W::kBlocksDone] = 0u;
      trace(fx::kFlowEvFinal, 0);
    }
    prox::detail::stamp_header(ws.guard, static_cast<unsigned>(tid));  // ready for the next launch (SparseFfn's tag)
  }
#else
  (void)a;
  (void)ws;
#endif
}
#endif  // __CUDACC__

// ---------------------------------------------------------------- L3: op
/**
 * @brief The one-kernel FFN as a planned op (drive it with prox::Operator; contract in operator.cuh).
 * sm_90+ (bulk copies, PDL): plan refuses older devices with kErrorUnsupportedDevice.
 */
template <class T, class Act = SiLU, class Fmt = NativeWeights<T>>
struct FlowFfnOp {
  static constexpr const char* kName = "flow_ffn";
  using Format = Fmt;
  static constexpr TuneKeyFields kTuneKey{"flow_ffn", DTypeTraits<T>::kName, Fmt::kKeyName, Act::kName, true};
  using Args = FlowFfnArgs<T, Fmt>;
  using Policies = FlowFfnPolicies;
  struct Options {
    bool pdl = false;         //!< launch with PDL (sm_90+)
    bool cooperative = true;  //!< every block resident or the launch fails (blocks poll for each other's work)
  };

  /**
   * @brief Validate without launching: shape (d_model a multiple of 8 and of Fmt::kElemsPerVec, at most
   * kFlowMaxDModel; d_ff a multiple of 64), pointers (x, y, proxies and scales, the three exact matrices
   * as Fmt::check), alignment, thresholds (>= 0, not NaN), y not aliasing x, the prefetch range.
   */
  static Status can_implement(const Args& a) noexcept {
    if (a.x == nullptr || a.y == nullptr || a.proxy_gate.packed == nullptr || a.proxy_up.packed == nullptr ||
        a.proxy_gate.scales == nullptr || a.proxy_up.scales == nullptr)
      return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(check_ffn_shape(a.d_model, a.d_ff));
    PROX_RETURN_IF_ERROR(tiled::check_tiled_shape(a.d_model, a.d_ff));
    if (a.d_model > kFlowMaxDModel || a.d_model % Fmt::kElemsPerVec != 0) return Status::kErrorInvalidShape;
    PROX_RETURN_IF_ERROR(Fmt::check(a.w_gate, a.d_ff, a.d_model, WeightOrientation::kOutIn));
    PROX_RETURN_IF_ERROR(Fmt::check(a.w_up, a.d_ff, a.d_model, WeightOrientation::kOutIn));
    PROX_RETURN_IF_ERROR(Fmt::check(a.w_down_t, a.d_ff, a.d_model, WeightOrientation::kInOut));
    if (!valid_threshold(a.tau_x) || !valid_threshold(a.tau_s)) return Status::kErrorInvalidThreshold;
    if (!is_aligned(a.x, 16) || !is_aligned(a.y, 16) || !is_aligned(a.proxy_gate.packed, 16) ||
        !is_aligned(a.proxy_up.packed, 16) || !is_aligned(a.proxy_gate.scales, 4) || !is_aligned(a.proxy_up.scales, 4) ||
        !is_aligned(a.channel_mask, 4) || !is_aligned(a.s_proxy, 4) || !is_aligned(a.s, 4) ||
        !is_aligned(a.thresholds, 4) || !is_aligned(a.counters, 8))
      return Status::kErrorMisalignedPointer;
    if (static_cast<const void*>(a.x) == static_cast<const void*>(a.y)) return Status::kErrorInvalidArgument;
    return check_prefetch(a.prefetch, a.prefetch_bytes);
  }
  //! A prefetch range: none (null, 0 bytes), or non-null, 16-byte aligned, a multiple of 16 bytes.
  static Status check_prefetch(const void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return bytes == 0 ? Status::kSuccess : Status::kErrorNullPointer;
    if (!is_aligned(p, 16) || bytes % 16 != 0) return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }
  static bool same_shape(const Args& a, const Args& b) noexcept { return a.d_model == b.d_model && a.d_ff == b.d_ff; }
  static Status check_options(const Options&) noexcept { return Status::kSuccess; }

  //! The flow state (counters, queue, y accumulator): zero before a launch, left zero after it.
  static WorkspaceNeeds workspace_needs(const Args& a) noexcept {
    WorkspaceNeeds w;
    w.sync = fx::FlowWords::bytes(a.d_model, a.d_ff);
    return w;
  }

  //! Ring stages policy P gets at d_model on device `d` (0: the device cannot run it). Plan time (the driver
  //! facts are read once per device).
  template <class P>
  static Status stages(int d_model, const DeviceInfo& d, int* out) noexcept {
    *out = 0;
    if (d.cc_major < 9) return Status::kSuccess;
    int optin = 0;
    int static_bytes = 0;
    PROX_RETURN_IF_ERROR(prox::detail::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(d.device, &optin));
    static std::atomic<int> cache[prox::detail::kMaxCachedDevices];
    PROX_RETURN_IF_ERROR(prox::detail::cached_for_device(
        cache, d.device,
        [](int, int* v) {
          cudaFuncAttributes fa{};
          if (cudaFuncGetAttributes(&fa, flow_ffn_kernel<P, T, Act, Fmt>) != cudaSuccess) return Status::kErrorCudaRuntime;
          *v = static_cast<int>(fa.sharedSizeBytes);
          return Status::kSuccess;
        },
        &static_bytes));
    if (optin <= static_bytes) return Status::kSuccess;
    *out = fx::FlowSmem<P, T, Fmt>(d_model).stages(static_cast<std::size_t>(optin - static_bytes));
    return Status::kSuccess;
  }

  template <class P>
  static Status configure(const Args& a, const Options& o, const DeviceInfo& d, LaunchConfig* lc) noexcept {
    if (d.cc_major < 9) return Status::kErrorUnsupportedDevice;
    int n = 0;
    PROX_RETURN_IF_ERROR(stages<P>(a.d_model, d, &n));
    if (n < 2) return Status::kErrorInvalidShape;  // rows of d_model do not fit a two-stage ring
    lc->smem = fx::FlowSmem<P, T, Fmt>(a.d_model).bytes(n);
    PROX_RETURN_IF_ERROR(prox::detail::allow_dynamic_smem<flow_ffn_kernel<P, T, Act, Fmt>>(d.device, lc->smem));
    int fit = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, flow_ffn_kernel<P, T, Act, Fmt>, P::kThreads, lc->smem) !=
        cudaSuccess)
      return Status::kErrorCudaRuntime;
    if (fit < 1) return Status::kErrorUnsupportedDevice;
    lc->grid = dim3(static_cast<unsigned>(d.sm_count));
    lc->block = dim3(P::kThreads);
    lc->cooperative = o.cooperative;
    return Status::kSuccess;
  }
  template <class P>
  static Status launch(const Args& a, const LaunchConfig& lc, const OpWorkspace& ws, cudaStream_t stream) noexcept {
    return prox::detail::launch_kernel(flow_ffn_kernel<P, T, Act, Fmt>, lc, stream, a, ws);
  }
};

/**
 * @brief The one-kernel FFN: the candidate with the most rows in flight that holds at least 3 ring stages
 * (2 channels a stage where 3 stages of them fit, else 1 channel a stage), ties to the lower index. Plan time.
 */
template <class T, class Act, class Fmt>
int default_policy(FlowFfnOp<T, Act, Fmt>, const DeviceInfo& d, const FlowFfnArgs<T, Fmt>& a) noexcept {
  int n = 0;
  using Op = FlowFfnOp<T, Act, Fmt>;
  if (Op::template stages<PolicyAt<0, FlowFfnPolicies>>(a.d_model, d, &n) == Status::kSuccess && n >= 3) return 0;
  return 1;
}

}  // namespace prox_flow
