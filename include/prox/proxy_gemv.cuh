// SPDX-License-Identifier: Apache-2.0
//! @file proxy_gemv.cuh  Op 2, Stage 1: the fused split-N proxy GEMV.
//!
//! For one token x [d_model]: keep coordinates with |x_k| >= tau_x, compute the gate and up proxies
//! over the kept rows only (one pass over x, both matrices in the same loop), rescale per channel,
//! form s~ = u~ * act(g~) in registers and keep channels with |s~_j| >= tau_s. Output: the channel
//! bitmask (what Stage 2 reads) and, in the values mode, s~ itself (calibration, analysis).
//!
//! Grid: x = column tiles of kTileN channels (split-N), y = chunks of kChunkK input coordinates
//! (split-K). Each block thresholds and compacts its own chunk of x in shared memory, so a dropped
//! coordinate costs no weight bytes, then streams the kept rows of its tile. Split-K blocks of a tile
//! combine deterministically (detail::TileReducer): through global memory (the last block to arrive
//! finishes the tile), or on sm_90+ with LaunchOptions::cluster and 2..8 splits, as one thread-block
//! cluster per tile through distributed shared memory (each block finishes a slice of the tile).
//! Both give bit-identical results.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/shape.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "detail/tile_reduce.cuh"
#include "int4.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

// ---------------------------------------------------------------- weight formats (L1)
/**
 * @brief INT4 proxy weights (the method): packed [d_model][d_ff/8] uint32, layout int4_format.hpp,
 * with float scales [d_ff]. One 16-byte piece holds 32 channels of one input row.
 */
struct Int4Weights {
  static constexpr const char* kName = "int4";
  static constexpr int kVecBytes = 8;  //!< 8-byte pieces: 16 channels, 32 fp32 accumulators for gate+up
  static constexpr int kChannelsPerVec = 16;
  static constexpr bool kNeedsScales = true;
  PROX_HOST_DEVICE static constexpr std::size_t row_bytes(int d_ff) noexcept {
    return static_cast<std::size_t>(d_ff) / 2;
  }
  PROX_HOST_DEVICE static constexpr std::size_t col_bytes(int n) noexcept { return static_cast<std::size_t>(n) / 2; }
  //! Word whose every nibble decodes to 0 (fills predicated-off loads).
  static constexpr uint32_t kFill = 0x88888888u;
  //! Most rows one step may sum in fp16 (see fma_step): kMaxStepRows * 1024 * 8 stays finite.
  static constexpr int kMaxStepRows = 4;
  //! x is scaled by 2^-6 before the fp16 products (every finite fp16 |x| <= 65504 becomes <= 1024)
  //! and the step's sums by 2^6 after: both exact powers of two.
  static constexpr float kXScale = 0.015625f;
  static constexpr float kXUnscale = 64.0f;
#if defined(__CUDACC__)
  //! A kept x as a step consumes it: x 2^-6 in both halves (converted when the step is loaded).
  using XReg = __half2;
  PROX_DEVICE static PROX_FORCEINLINE XReg make_x(float x) { return __float2half2_rn(x * kXScale); }

  /**
   * @brief acc[c] += sum_u xs[u] * q_{u,c} over the kU rows of one step.
   *
   * The decode is what limits the INT4 proxy (it moves a quarter of the bytes of an fp16 GEMV per
   * weight), so the step is summed in fp16 pairs: per 32-bit word, 4 lop3 + 1 shift + 4 half2 ops
   * decode q exactly and 4 HFMA2 accumulate (x 2^-6) * q, against 8 conversions + 8 FFMA in fp32;
   * the kU-row partial sums then go to the fp32 accumulators once per step. The fp16 rounding
   * (relative 2^-11 per operation, kU <= 4 rows) is far below the INT4 quantization error of the
   * proxy itself, and tests/reference bounds it. |x 2^-6| <= 1024, |q| <= 8, kU <= 4 rows: no
   * partial sum can overflow for any finite fp16 x (bf16 x above 2^26 in magnitude would).
   */
  template <int kU>
  PROX_DEVICE static PROX_FORCEINLINE void fma_step(float (&acc)[kChannelsPerVec], const Piece<kVecBytes> (&v)[kU],
                                                    const __half2 (&x2)[kU]) {
    static_assert(kU >= 1 && kU <= kMaxStepRows, "fp16 step sums hold at most kMaxStepRows rows");
    // One word (8 channels) at a time keeps 4 partial-sum registers live, not 8 (the kernel runs at
    // 3 blocks of 256 threads per SM: 80 registers).
#pragma unroll
    for (int i = 0; i < Piece<kVecBytes>::kWords; ++i) {
      __half2 h[4];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        __half2 q[4];
        int4::dequant_word(v[u].w[i], q);  // channel pairs (8i + 2c, 8i + 2c + 1)
#pragma unroll
        for (int c = 0; c < 4; ++c) h[c] = u == 0 ? __hmul2(x2[u], q[c]) : __hfma2(x2[u], q[c], h[c]);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float2 f = __half22float2(h[c]);
        acc[8 * i + 2 * c] = fmaf(f.x, kXUnscale, acc[8 * i + 2 * c]);
        acc[8 * i + 2 * c + 1] = fmaf(f.y, kXUnscale, acc[8 * i + 2 * c + 1]);
      }
    }
  }
#endif
};

/**
 * @brief fp16/bf16 proxy weights, input-major [d_model][d_ff] (the paper's A1 ablation and the
 * denominator of the alpha ratio). Scales are optional (nullptr means 1). Make the layout from
 * nn.Linear weights with transpose_host / transpose_device.
 */
template <class W>
struct DenseWeights {
  static constexpr const char* kName = DTypeTraits<W>::kName;
  static constexpr int kVecBytes = 16;
  static constexpr int kChannelsPerVec = 8;
  static constexpr bool kNeedsScales = false;
  PROX_HOST_DEVICE static constexpr std::size_t row_bytes(int d_ff) noexcept {
    return static_cast<std::size_t>(d_ff) * sizeof(W);
  }
  PROX_HOST_DEVICE static constexpr std::size_t col_bytes(int n) noexcept {
    return static_cast<std::size_t>(n) * sizeof(W);
  }
  static constexpr uint32_t kFill = 0u;
#if defined(__CUDACC__)
  using XReg = float;
  PROX_DEVICE static PROX_FORCEINLINE XReg make_x(float x) { return x; }
  //! acc[c] += sum_u xs[u] * w_{u,c} over the kU rows of one step, in fp32.
  template <int kU>
  PROX_DEVICE static PROX_FORCEINLINE void fma_step(float (&acc)[kChannelsPerVec], const Piece<kVecBytes> (&v)[kU],
                                                    const float (&xs)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float w[8];
      unpack8<W>(make_uint4(v[u].w[0], v[u].w[1], v[u].w[2], v[u].w[3]), w);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = fmaf(xs[u], w[c], acc[c]);
    }
  }
#endif
};

// ---------------------------------------------------------------- arguments and policy
/**
 * @brief Arguments of the Stage-1 proxy GEMV. All pointers are device pointers.
 * @tparam T activation type (`__half` / `__nv_bfloat16`).
 */
template <class T>
struct ProxyGemvArgs {
  const T* x = nullptr;               //!< [d_model] token activations
  int d_model = 0;                    //!< input size K, 1..2^20
  int d_ff = 0;                       //!< channels N, a multiple of 32, 32..2^20
  float tau_x = 0.0f;                 //!< input threshold (>= 0): keep |x_k| >= tau_x
  float tau_s = 0.0f;                 //!< channel threshold (>= 0): keep |s~_j| >= tau_s
  const void* w_gate = nullptr;       //!< gate proxy, format-specific layout, 16-byte aligned
  const void* w_up = nullptr;         //!< up proxy, same layout
  const float* scale_gate = nullptr;  //!< [d_ff] per-channel scales (required for Int4Weights)
  const float* scale_up = nullptr;    //!< [d_ff]
  std::uint32_t* channel_mask = nullptr;  //!< out [d_ff/32]: bit j%32 of word j/32 set iff channel j selected
  float* s_proxy = nullptr;           //!< out [d_ff] (values mode, optional): s~ of every channel
  SparsityCounters* counters = nullptr;  //!< optional runtime statistics (accumulated)
};

/**
 * @brief Tile policy of the proxy GEMV.
 * @tparam Threads   threads per block
 * @tparam TileN     channels per block (split-N); TileN / kChannelsPerVec threads share a row
 * @tparam ChunkK    input coordinates per block (split-K); thresholded in shared memory
 * @tparam Unroll    kept rows each thread has in flight (2 x 16-byte loads each)
 */
template <int Threads, int TileN, int ChunkK, int Unroll, int MinBlocks = 1, int Stages = 0>
struct ProxyGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kTileN = TileN;
  static constexpr int kChunkK = ChunkK;
  static constexpr int kUnroll = Unroll;
  static constexpr int kMinBlocks = MinBlocks;  //!< __launch_bounds__ minimum resident blocks per SM
  //! 0: register double buffering (two steps in flight per thread). >= 2: a cp.async pipeline of
  //! Stages steps through shared memory (Stages - 1 in flight), which holds more bytes in flight
  //! than the registers can at 3 blocks per SM.
  static constexpr int kStages = Stages;
  static_assert(Stages == 0 || Stages >= 2, "a cp.async pipeline needs at least 2 stages");
  static std::string name() {
    return "proxy_t" + std::to_string(Threads) + "_n" + std::to_string(TileN) + "_k" + std::to_string(ChunkK) + "_u" +
           std::to_string(Unroll) + "_m" + std::to_string(MinBlocks) +
           (Stages > 0 ? "_s" + std::to_string(Stages) : "");
  }
};

//! Candidates for INT4 weights (index 0 is the fallback/default). 8-byte pieces: 16 threads cover a
//! 256-channel tile, i.e. 128 contiguous bytes of each kept row per matrix. Measured on the H100
//! (docs/benchmarks.md): register-buffered steps of 2-3 rows at 3 blocks per SM are the fastest on
//! the Qwen3 1.7B-14B shapes (4-row steps spill at 80 registers); the 3-stage cp.async pipeline on
//! the 32B shape, whose grid needs two waves (the plan-time rule, proxy_gemv_default_policy,
//! picks it there; prox-tune chooses per shape and density).
using ProxyGemvPolicies =
    PolicyList<ProxyGemvPolicy<256, 256, 512, 2, 3>, ProxyGemvPolicy<256, 256, 1024, 3, 3>,
               ProxyGemvPolicy<256, 256, 256, 2, 3>, ProxyGemvPolicy<256, 256, 1024, 3, 3, 3>>;
//! Candidates for fp16/bf16 proxy weights (16-byte pieces of 8 channels).
using DenseProxyGemvPolicies =
    PolicyList<ProxyGemvPolicy<256, 256, 256, 4, 2>, ProxyGemvPolicy<256, 128, 256, 4, 2>>;

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Fmt, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void proxy_gemv_kernel(
    const ProxyGemvArgs<T> a, float* partials, unsigned* tile_counters) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTileN = Policy::kTileN;
  constexpr int kChunkK = Policy::kChunkK;
  constexpr int kU = Policy::kUnroll;
  constexpr int kCpv = Fmt::kChannelsPerVec;
  constexpr int kTn = kTileN / kCpv;
  constexpr int kGroups = kThreads / kTn;
  static_assert(kTileN % kCpv == 0 && kTileN % kWarpSize == 0, "tile must hold whole pieces and mask words");
  using Reducer = detail::TileReducer<kThreads, kTn, kCpv, 2>;

  using P = Piece<Fmt::kVecBytes>;
  constexpr int kStages = Policy::kStages;
  // The cp.async stages and the block reduction never live at the same time: one buffer serves both.
  // Register-buffered policies (kStages == 0) need no stage buffer: a 1-element stand-in keeps the
  // union's shape without taking shared memory.
  union StreamOrReduce {
    P stage[kStages > 0 ? kStages : 1][kStages > 0 ? kU : 1][2][kStages > 0 ? kThreads : 1];
    typename Reducer::Storage red;
  };
  __shared__ int s_rows[kChunkK];
  __shared__ float s_x[kChunkK];
  constexpr int kXPerThread = (kChunkK + kThreads - 1) / kThreads;  // x values per thread (step 1)
  __shared__ int s_warp[kXPerThread * (kThreads / kWarpSize)];  // block_compact_append
  __shared__ StreamOrReduce s_buf;
  typename Reducer::Storage& s_red = s_buf.red;

  const int tid = static_cast<int>(threadIdx.x);
  const int tile = static_cast<int>(blockIdx.x);
  const int chunk = static_cast<int>(blockIdx.y);
  const int n0 = tile * kTileN;
  const int k0 = chunk * kChunkK;

  const int ncols = min(kTileN, a.d_ff - n0);  // channels of this tile, a multiple of 32

  // Split-K combine: through distributed shared memory when the launcher made the tile's split-K
  // blocks one cluster (sm_90+; read at run time), else through global memory. Tile channels
  // [lo, hi) are the ones this block finishes in the epilogue: all of them when it is the last block
  // of the tile to arrive (global), its own slice of whole mask words (cluster).
  const int cluster_splits = Reducer::cluster_splits(static_cast<int>(gridDim.y));
  int lo = 0;
  int hi = ncols;
  if (cluster_splits > 1) Reducer::cluster_slice(chunk, cluster_splits, ncols, lo, hi);

  pdl_wait();  // x may come from the previous kernel
  pdl_launch_dependents();

  // Scales of the channels this thread finishes in the epilogue, loaded now so that no block waits
  // for them at the end (kScalesPerThread channels per thread; in the global combine only the last
  // block of a tile uses them).
  constexpr int kScalesPerThread = (kTileN + kThreads - 1) / kThreads;
  float sc_g[kScalesPerThread];
  float sc_u[kScalesPerThread];
#pragma unroll
  for (int i = 0; i < kScalesPerThread; ++i) {
    const int ch = lo + i * kThreads + tid;
    const int j = n0 + ch;
    const bool in = ch < hi;
    sc_g[i] = in && a.scale_gate != nullptr ? a.scale_gate[j] : 1.0f;
    sc_u[i] = in && a.scale_up != nullptr ? a.scale_up[j] : 1.0f;
  }

  // 1. Threshold this block's chunk of x and compact the kept coordinates, in order. All loads of x
  //    are issued before the first compaction step: one memory latency, not one per step.
  float xv[kXPerThread];
  bool keep[kXPerThread];
#pragma unroll
  for (int i = 0; i < kXPerThread; ++i) {
    const int kk = i * kThreads + tid;
    const int k = k0 + kk;
    const bool in = kk < kChunkK && k < a.d_model;
    xv[i] = in ? to_float(a.x[k]) : 0.0f;
    keep[i] = in && keep_magnitude(xv[i], a.tau_x);
  }
  const int count = block_compact_append<kThreads>(keep, k0, xv, s_rows, s_x, s_warp);
  __syncthreads();
  if (a.counters != nullptr && tid == 0) {
    if (tile == 0) atomicAdd(&a.counters->kept_inputs, static_cast<unsigned long long>(count));
    if (tile == 0 && chunk == 0) atomicAdd(&a.counters->calls, 1ull);
  }

  // 2. Stream the kept rows of this tile: kU rows in flight per thread, gate and up together.
  const int slot = tid % kTn;
  const int group = tid / kTn;
  const int n = n0 + slot * kCpv;
  const bool col_ok = n < a.d_ff;
  const std::size_t row_stride = Fmt::row_bytes(a.d_ff);
  const char* pg = static_cast<const char*>(a.w_gate) + Fmt::col_bytes(n);
  const char* pu = static_cast<const char*>(a.w_up) + Fmt::col_bytes(n);

  float acc[2][kCpv];
#pragma unroll
  for (int c = 0; c < kCpv; ++c) acc[0][c] = acc[1][c] = 0.0f;

  // Step it covers rows group + (it kU + u) kGroups, u < kU. Loads of step it + 1 are issued before
  // the arithmetic of step it (register double buffering, branch-free so ptxas keeps the order).
  using XReg = typename Fmt::XReg;
  struct Step {
    P vg[kU];
    P vu[kU];
    XReg xs[kU];
  };
  const int steps = (count + kGroups * kU - 1) / (kGroups * kU);
  const auto load_step = [&](int it, Step& d) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int r = group + (it * kU + u) * kGroups;
      const bool ok = col_ok && r < count;
      const int rr = ok ? r : 0;
      const std::size_t off = static_cast<std::size_t>(s_rows[rr]) * row_stride;
      d.vg[u] = ld_stream_piece<Fmt::kVecBytes>(pg + off, ok, Fmt::kFill);
      d.vu[u] = ld_stream_piece<Fmt::kVecBytes>(pu + off, ok, Fmt::kFill);
      d.xs[u] = Fmt::make_x(ok ? s_x[rr] : 0.0f);
    }
  };
  const auto compute_step = [&](const Step& d) {
    Fmt::template fma_step<kU>(acc[0], d.vg, d.xs);
    Fmt::template fma_step<kU>(acc[1], d.vu, d.xs);
  };
  if constexpr (kStages == 0) {
    if (count > 0) {  // block-uniform; s_rows[0] is valid below
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
      // An odd last step (loaded into b0 by the last pair) is summed here, after the loop, so no pair
      // sums an empty step (a sixth of the arithmetic at s1 = 70 %: about 150 kept rows, 5 steps)
      // and the loop body stays branch-free (a branch inside it cost 0.35-0.7 us at s1 = 0, measured
      // on the H100).
      if (it < steps) compute_step(b0);
    }
  } else if (count > 0) {
    // cp.async pipeline: step it goes to stage it % kStages; kStages - 1 steps are in flight while
    // one is summed. Each thread reads back only the pieces it copied itself, so a per-thread
    // wait_group is the only synchronization. Rows past the end are zero-filled and get x = 0
    // (an INT4 zero word decodes to -8: 0 * -8 adds an exact zero).
    const auto issue = [&](int it) {
      P(&st)[kU][2][kThreads] = s_buf.stage[it % kStages];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        const bool ok = col_ok && r < count;
        const std::size_t off = static_cast<std::size_t>(s_rows[ok ? r : 0]) * row_stride;
        cp_async<Fmt::kVecBytes>(&st[u][0][tid], pg + off, ok);
        cp_async<Fmt::kVecBytes>(&st[u][1][tid], pu + off, ok);
      }
      cp_async_commit();  // one group per step, empty or not, so wait_group counts steps
    };
#pragma unroll
    for (int it = 0; it < kStages - 1; ++it) issue(it);
#pragma unroll 1
    for (int it = 0; it < steps; ++it) {
      issue(it + kStages - 1);
      cp_async_wait<kStages - 1>();  // step it has landed
      const P(&st)[kU][2][kThreads] = s_buf.stage[it % kStages];
      Step d;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int r = group + (it * kU + u) * kGroups;
        const bool ok = col_ok && r < count;
        d.vg[u] = st[u][0][tid];
        d.vu[u] = st[u][1][tid];
        d.xs[u] = Fmt::make_x(ok ? s_x[r] : 0.0f);
      }
      compute_step(d);
    }
    cp_async_wait<0>();
    __syncthreads();  // the stages become the reduction buffer below
  }

  // 3. Block reduction over row groups, then the split-K combine across chunks: at() of s_red then
  //    holds the full sums of channels [lo, hi).
  Reducer::reduce(s_red, acc);
  if (cluster_splits > 1) {
    Reducer::cluster_combine(s_red, lo, hi, cluster_splits);  // no early exit: cluster_done() below
  } else if (!Reducer::split_k(s_red, partials, tile_counters + tile, a.d_ff, n0, ncols, chunk,
                               static_cast<int>(gridDim.y))) {
    return;
  }

  // 4. Epilogue in registers: rescale, s~ = u~ * act(g~), threshold, bitmask. lo is a multiple of 32,
  //    so each warp's ballot is exactly one mask word (whole warps are in or out of [lo, hi)).
  const Act act{};
  const int lane = lane_id();
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
      sel = keep_magnitude(s, a.tau_s);
      if (a.s_proxy != nullptr) a.s_proxy[j] = s;
    }
    const unsigned word = __ballot_sync(0xffffffffu, sel);
    if (lane == 0 && in) {
      if (a.channel_mask != nullptr) a.channel_mask[j / kWarpSize] = word;
      if (a.counters != nullptr && word != 0u)
        atomicAdd(&a.counters->selected_channels, static_cast<unsigned long long>(__popc(word)));
    }
  }
  if (cluster_splits > 1) Reducer::cluster_done();  // the others may still read this block's s_red
}

// ---------------------------------------------------------------- L3: op
namespace proxy_gemv {

template <class Policy>
constexpr int num_tiles(int d_ff) noexcept {
  return ceil_div(d_ff, Policy::kTileN);
}
template <class Policy>
constexpr int num_chunks(int d_model) noexcept {
  return ceil_div(d_model, Policy::kChunkK);
}

//! Blocks of the launch grid: column tiles x split-K chunks.
template <class Policy>
constexpr long num_blocks(int d_model, int d_ff) noexcept {
  return static_cast<long>(num_tiles<Policy>(d_ff)) * num_chunks<Policy>(d_model);
}

/**
 * @brief The unused dynamic shared memory launch() gives a grid (LaunchOptions::spread, without
 * clusters): at most ceil(blocks / SMs) blocks per SM, 0 for a grid that needs the full occupancy
 * (detail::spread_smem_bytes). Reads driver facts once per device; SparseFfn::plan calls it so that
 * no launch under graph capture is the first.
 */
template <class Policy, class Fmt, class Act, class T>
Status spread_bytes(int d_model, int d_ff, std::size_t* out) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  return detail::spread_smem_for<proxy_gemv_kernel<Policy, T, Fmt, Act>, Policy::kThreads>(
      num_blocks<Policy>(d_model, d_ff), out);
}

/**
 * @brief Validate without launching. Shape rule: 1 <= d_model <= 2^20; d_ff a multiple of 32 in
 * [32, 2^20]. Weights 16-byte aligned; scales, mask, s_proxy 4-byte aligned; thresholds >= 0 and
 * not NaN; at least one of channel_mask / s_proxy given.
 */
template <class Fmt, class T>
Status can_implement(const ProxyGemvArgs<T>& a) noexcept {
  if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr) return Status::kErrorNullPointer;
  if (Fmt::kNeedsScales && (a.scale_gate == nullptr || a.scale_up == nullptr)) return Status::kErrorNullPointer;
  if (a.channel_mask == nullptr && a.s_proxy == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_proxy_shape(a.d_model, a.d_ff));
  if (!valid_threshold(a.tau_x) || !valid_threshold(a.tau_s)) return Status::kErrorInvalidThreshold;
  if (!is_aligned(a.x, sizeof(T)) || !is_aligned(a.w_gate, 16) || !is_aligned(a.w_up, 16) ||
      !is_aligned(a.scale_gate, 4) || !is_aligned(a.scale_up, 4) || !is_aligned(a.channel_mask, 4) ||
      !is_aligned(a.s_proxy, 4) || !is_aligned(a.counters, 8)) {
    return Status::kErrorMisalignedPointer;
  }
  return Status::kSuccess;
}

//! Workspace: tile counters (zero before first use; left zero), in a region of the same size for
//! every policy (detail::tile_counter_bytes), then split-K partials. Sized for the global split-K
//! combine whether or not the launch uses clusters (the cluster combine touches none of it), so one
//! workspace serves both, and every policy of the same shape.
template <class Policy, class T>
constexpr std::size_t workspace_bytes(const ProxyGemvArgs<T>& a) noexcept {
  const std::size_t counters = detail::tile_counter_bytes<Policy::kTileN>(a.d_ff);
  const int chunks = num_chunks<Policy>(a.d_model);
  const std::size_t parts = chunks > 1 ? sizeof(float) * 2 * static_cast<std::size_t>(chunks) * a.d_ff : 0;
  return counters + parts;
}

/**
 * @brief Launch Stage 1 on `stream`.
 * @tparam Policy a ProxyGemvPolicy; @tparam Fmt Int4Weights or DenseWeights<W>; @tparam Act SiLU / GeluTanh.
 * @param workspace device memory of at least workspace_bytes<Policy>(a), 16-byte aligned, zeroed
 *        once before its first use (prox kernels leave it zeroed).
 * @param opts  pdl; cluster: on a device that supports thread-block clusters (sm_90+) and with
 *        2..8 split-K chunks (ceil(d_model / kChunkK)), launch the chunks of each column tile as one
 *        cluster and combine them through distributed shared memory (bit-identical results);
 *        spread: a grid of fewer blocks than the GPU holds runs at most ceil(blocks / SMs) per SM.
 * @code
 * prox::ProxyGemvArgs<__half> a{d_x, K, N, tau_x, tau_s, d_qg, d_qu, d_sg, d_su, d_mask};
 * using P = prox::PolicyAt<0, prox::ProxyGemvPolicies>;
 * auto st = prox::proxy_gemv::launch<P, prox::Int4Weights, prox::SiLU>(a, ws, ws_bytes, stream);
 * @endcode
 */
template <class Policy, class Fmt, class Act, class T>
Status launch(const ProxyGemvArgs<T>& a, void* workspace, std::size_t workspace_size, cudaStream_t stream,
              const LaunchOptions& opts = {}) noexcept {
  PROX_RETURN_IF_ERROR(can_implement<Fmt>(a));
  const std::size_t need = workspace_bytes<Policy>(a);
  if (workspace == nullptr) return Status::kErrorNullPointer;
  if (workspace_size < need) return Status::kErrorWorkspaceTooSmall;
  if (!is_aligned(workspace, 16)) return Status::kErrorMisalignedPointer;
  auto* counters = static_cast<unsigned*>(workspace);
  float* partials =
      reinterpret_cast<float*>(static_cast<char*>(workspace) + detail::tile_counter_bytes<Policy::kTileN>(a.d_ff));
  const dim3 grid(static_cast<unsigned>(num_tiles<Policy>(a.d_ff)),
                  static_cast<unsigned>(num_chunks<Policy>(a.d_model)));
  if (grid.y > 65535u) return Status::kErrorInvalidShape;
  // Clusters of (1, chunks, 1): all split-K blocks of one column tile. The host cannot see which code
  // the device runs, so it checks that the device can launch clusters at all (an sm_80 device fails
  // the launch; the attribute is read once per device); the kernel reads the cluster shape and falls
  // back to the global combine by itself (code older than sm_90, e.g. JIT from compute_80 PTX). No
  // occupancy query: a cluster of <= 8 of these blocks (256 threads, <= 45 KB static shared memory,
  // 2-3 resident per SM) needs 3-4 SMs, far fewer than one GPC of an sm_90 part holds.
  unsigned cluster_y = 0;
  if (opts.cluster && grid.y >= 2u && grid.y <= static_cast<unsigned>(detail::kMaxClusterSplits)) {
    int has_clusters = 0;
    if (detail::current_device_attribute<cudaDevAttrClusterLaunch>(&has_clusters) == Status::kSuccess &&
        has_clusters != 0) {
      cluster_y = grid.y;
    }
  }
  // A grid smaller than the GPU holds is spread over the SMs (LaunchOptions::spread); a cluster
  // launch is placed by clusters, so it is left as it is.
  std::size_t smem = 0;
  if (opts.spread && cluster_y == 0) {
    PROX_RETURN_IF_ERROR((spread_bytes<Policy, Fmt, Act, T>(a.d_model, a.d_ff, &smem)));
  }
  return detail::launch_kernel_ex(proxy_gemv_kernel<Policy, T, Fmt, Act>, grid, dim3(Policy::kThreads), smem, stream,
                                  opts, detail::LaunchExtras{cluster_y, false}, a, partials, counters);
}

}  // namespace proxy_gemv

PROX_NAMESPACE_END
