// SPDX-License-Identifier: Apache-2.0
//! @file glu_down_gemv.cuh  Ops 3 + 4 fused, Stage 2 in one kernel: the masked GLU GEMV
//! (s_j = u_j * act(g_j) for the selected channels) and the input-sparse down GEMV
//! (y = sum_{j selected} s_j W_down^T[j,:]).
//!
//! Why fused: run as two kernels, each pays its own ramp-up (read the mask, find its rows, wait one
//! memory latency for the first bytes) and the down GEMV cannot issue a single weight load until
//! the last GLU block has finished, although which W_down rows it needs is known from the mask
//! alone. Here one grid does both: after its GLU rows a block announces that its s values are
//! written (arrive), issues the loads of its first down rows, and only then waits until every
//! block has arrived; the weights are in flight while the grid converges.
//!
//! The wait is a grid-wide barrier, so all blocks must be resident at once: the grid is at most
//! SMs x resident blocks per SM (checked at launch against the occupancy of this kernel), and it is
//! launched as a cooperative kernel, so a grid that cannot be co-resident fails to launch instead
//! of hanging.
//!
//! Work split: GLU rows by rank over all blocks (detail::GluRows); down as (column tile, rank
//! range) tasks, T tiles x R = max(1, G / T) ranges, combined over the R ranges of a tile by the
//! deterministic split-K of detail::TileReducer. Every addition has a fixed order: the output is
//! bit-identical from run to run.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/warp.cuh"
#include "detail/rank_range.cuh"
#include "detail/tile_reduce.cuh"
#include "down_gemv.cuh"
#include "glu_gemv.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the fused Stage-2 GEMV: those of the GLU GEMV (x, shape, W_gate, W_up, mask,
 * s) plus the down GEMV's W_down^T and y. All pointers are device pointers.
 * `grid_blocks` (inherited): 1..max_grid_blocks(), the grid the workspace is sized for; 0 =
 * max_grid_blocks().
 * @tparam T `__half` or `__nv_bfloat16`.
 */
template <class T>
struct GluDownGemvArgs : GluGemvArgs<T> {
  const T* w_down_t = nullptr;  //!< [d_ff][d_model] = W_down^T, 16-byte aligned
  T* y = nullptr;               //!< out [d_model]; every element is written
};

/**
 * @brief Policy of the fused Stage-2 GEMV: a GLU part (see GluSlicedPolicy) and a down part (see
 * DownGemvPolicy) sharing the block size and the residency.
 * @tparam Threads   threads per block
 * @tparam Channels  GLU rows a block holds at a time; @tparam Batch GLU rows processed together
 * @tparam TileD     down outputs per task (TileD/8 threads share a row, at most 32)
 * @tparam Rows      down rows a block holds at a time; @tparam Unroll down rows in flight per thread
 * @tparam MinBlocks resident blocks per SM (__launch_bounds__) and grid = SMs x MinBlocks
 */
template <int Threads, int Channels, int Batch, int TileD, int Rows, int Unroll, int MinBlocks>
struct GluDownPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr int kTileD = TileD;
  static constexpr int kRows = Rows;
  static constexpr int kUnroll = Unroll;
  using Glu = GluSlicedPolicy<Threads, Channels, Batch, 1, MinBlocks>;
  static_assert(TileD % 8 == 0 && TileD / 8 <= 32 && Threads % (TileD / 8) == 0 && Rows % 32 == 0, "policy shape");
  static std::string name() {
    return "glud_t" + std::to_string(Threads) + "_c" + std::to_string(Channels) + "_b" + std::to_string(Batch) + "_d" +
           std::to_string(TileD) + "_r" + std::to_string(Rows) + "_u" + std::to_string(Unroll) + "_m" +
           std::to_string(MinBlocks);
  }
};

//! Candidates (index 0 is the default). Rows = 1024: a down task of more rows than a block holds runs
//! in rounds, and each round starts its stream again from one memory latency (the pipeline drains at
//! its end). With 256 rows, the Qwen3-14B and 32B tasks (300-750 rows at e = 40-70 %) took 2-3 rounds;
//! 1024 holds them in one. Measured on the H100 (docs/benchmarks.md): Stage 2 1.0-1.7 us faster on
//! 14B and 1.4-4.2 us on 32B; on 8B 1.5 us at e = 40 % (290-row tasks), unchanged above.
//! Candidate 1 has 320 threads: a d_model of 2560 or 5120 (320 or 640 16-byte pieces a row) fills
//! its GLU steps exactly, where 256 threads leave 37.5 % or 16.7 % of the load slots idle (the plan's
//! default, glu_down_gemv::default_policy, picks by that). Measured on the H100: FFN 0.7-1.6 us
//! faster on 4B, 0.7-2.5 us on 14B and 32B; up to 0.9 us slower on 1.7B and 8B, where 256 fits.
//! The order is a preference: the tuner gives a near-tie to the lower index, and candidate 2 (3
//! blocks per SM), timed alone within 0.5 % of candidate 1 on the 14B shape (bf16, density 5/16),
//! made the FFN 1.6-1.8 us slower there.
using GluDownGemvPolicies =
    PolicyList<GluDownPolicy<256, 64, 4, 256, 1024, 4, 2>, GluDownPolicy<320, 64, 2, 256, 1024, 4, 2>,
               GluDownPolicy<256, 64, 2, 256, 1024, 4, 3>>;

namespace detail {

//! Grid barrier words in the workspace: [0] arrivals of the current launch, [1] generation.
//! Both start at zero (initialize_workspace) and the arrival count is left at zero.
struct GridBarrier {
  //! Thread 0: the generation this launch will complete (read before this block arrives).
  PROX_DEVICE static PROX_FORCEINLINE unsigned generation(const unsigned* bar) {
    unsigned g;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
    return g;
  }
  //! Thread 0, after a block barrier that follows the block's stores: publish them and count in
  //! (atom.acq_rel: a release cumulative over the block's stores, as in TileReducer::split_k).
  //! The last block to arrive resets the count and releases the new generation.
  PROX_DEVICE static PROX_FORCEINLINE void arrive(unsigned* bar, unsigned gen, unsigned blocks) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(bar) : "memory");
    if (prev == blocks - 1u) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1u) : "memory");
    }
  }
  //! Thread 0: wait until every block has arrived (then a block barrier publishes it to the block).
  PROX_DEVICE static PROX_FORCEINLINE void wait(const unsigned* bar, unsigned gen) {
    unsigned g;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
      if (g != gen) break;
      __nanosleep(20);
    }
  }
};

}  // namespace detail

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, Policy::kMinBlocks) void glu_down_gemv_kernel(
    const GluDownGemvArgs<T> a, float* partials, unsigned* tile_counters, unsigned* barrier) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kTileD = Policy::kTileD;
  constexpr int kRows = Policy::kRows;
  using Glu = detail::GluRows<typename Policy::Glu, T, Act>;
  using Down = detail::DownRows<kThreads, kTileD, Policy::kUnroll, T>;
  using Reducer = detail::TileReducer<kThreads, Down::kTn, 8, 1>;

  __shared__ typename Glu::Storage s_glu;
  __shared__ int s_rows[kRows];
  __shared__ float s_val[kRows];
  __shared__ int s_warp[kThreads / kWarpSize];
  __shared__ typename Reducer::Storage s_red;

  const int tid = static_cast<int>(threadIdx.x);
  const int block = static_cast<int>(blockIdx.x);
  const int blocks = static_cast<int>(gridDim.x);
  pdl_wait();  // the mask comes from Stage 1; the previous launch's barrier state is settled
  // No pdl_launch_dependents() here: the next kernel is let in once every block has streamed its
  // down rows (below), not at the start (see there).
  const unsigned gen = tid == 0 ? detail::GridBarrier::generation(barrier) : 0u;

  // GLU part: this block's rank range of the selected channels.
  const GluGemvArgs<T>& g = a;
  const int n_words = a.d_ff / kWarpSize;
  int total = 0;
  const int offset = detail::mask_rank_offset<kThreads>(a.channel_mask, n_words, s_warp, &total);
  int lo = 0;
  int hi = 0;
  detail::rank_range(total, block, blocks, &lo, &hi);
  Glu::zero_unselected(g, block, blocks);
  Glu::run(g, offset, lo, hi, s_glu);
  __syncthreads();  // every s store of the block (rows and zero fill) precedes thread 0's release
  if (tid == 0) detail::GridBarrier::arrive(barrier, gen, static_cast<unsigned>(blocks));

  // Down part: tasks (tile, part); the weights of a task's first rows are requested before the wait.
  const int tiles = ceil_div(a.d_model, kTileD);
  const int parts = max(1, blocks / tiles);
  bool waited = false;
#pragma unroll 1
  for (int task = block; task < tiles * parts; task += blocks) {
    const int tile = task % tiles;
    const int part = task / tiles;
    const int d0 = tile * kTileD;
    detail::rank_range(total, part, parts, &lo, &hi);
    float acc[1][8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[0][c] = 0.0f;
#pragma unroll 1
    for (int sub = lo; sub < hi; sub += kRows) {
      const int count = min(kRows, hi - sub);
      detail::gather_rank_range<kThreads>(a.channel_mask, n_words, offset, sub, sub + count, s_rows);
      __syncthreads();
      Down::run(a.w_down_t, a.d_model, d0, s_rows, s_val, count, acc[0], [&] {
        if (!waited) {  // block-uniform
          if (tid == 0) detail::GridBarrier::wait(barrier, gen);
          __syncthreads();
          waited = true;
        }
        // All of a thread's s loads before the first store: one L2 round trip, not one per row
        // (a loop with the run-time bound count would issue them one after another).
        constexpr int kValsPerThread = (kRows + kThreads - 1) / kThreads;
        float sv[kValsPerThread];
#pragma unroll
        for (int j = 0; j < kValsPerThread; ++j) {
          const int i = tid + j * kThreads;
          sv[j] = i < count ? __ldcg(a.s + s_rows[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kValsPerThread; ++j) {
          const int i = tid + j * kThreads;
          if (i < count) s_val[i] = sv[j];
        }
        __syncthreads();
      });
      __syncthreads();  // s_rows / s_val are reused by the next round
    }
    // Every weight load of this block is done: let the next kernel of the stream launch (PDL) while
    // the split-K combine runs. With the trigger at the start the FFN was 0.3-1.6 us slower on every
    // Qwen3 shape (1.7B-32B, e = 40-70 %; measured on the H100, docs/benchmarks.md); our reading, not
    // verified: the next kernel's blocks then crowd onto the first SMs this grid frees. Blocks
    // without a down task count as triggered when they exit.
    if (task + blocks >= tiles * parts) pdl_launch_dependents();
    Reducer::reduce(s_red, acc);
    const int ncols = min(kTileD, a.d_model - d0);
    if (Reducer::split_k(s_red, partials, tile_counters + tile, a.d_model, d0, ncols, part, parts)) {
      for (int ch = tid; ch < ncols; ch += kThreads) a.y[d0 + ch] = from_float<T>(Reducer::at(s_red, 0, ch));
    }
    __syncthreads();  // s_red is reused by the next task
  }
}

// ---------------------------------------------------------------- L3: op
namespace glu_down_gemv {

/**
 * @brief Largest grid this policy can run with on the current device: SMs x min(Policy::kMinBlocks,
 * blocks of this kernel that fit on one SM). Host only; the driver is queried once per device.
 */
template <class Policy, class Act, class T>
Status max_grid_blocks(int* out) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  // Both facts are read from the driver once per device (detail::cached_for_device): the launcher
  // checks every grid against them, and the hot path must not pay a driver query per call.
  static std::atomic<int> fit_cache[detail::kMaxCachedDevices];
  int dev = 0;
  int sms = 0;
  int fit = 0;
  PROX_RETURN_IF_ERROR(detail::current_device(&dev));
  PROX_RETURN_IF_ERROR(detail::device_attribute<cudaDevAttrMultiProcessorCount>(dev, &sms));
  PROX_RETURN_IF_ERROR(detail::cached_for_device(
      fit_cache, dev,
      [](int, int* v) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, glu_down_gemv_kernel<Policy, T, Act>, Policy::kThreads,
                                                             0) == cudaSuccess
                   ? Status::kSuccess
                   : Status::kErrorCudaRuntime;
      },
      &fit));
  if (fit <= 0 || sms <= 0) return Status::kErrorUnsupportedDevice;
  *out = sms * (fit < Policy::kMinBlocks ? fit : Policy::kMinBlocks);
  return Status::kSuccess;
}

template <class Policy>
constexpr int num_tiles(int d_model) noexcept {
  return ceil_div(d_model, Policy::kTileD);
}

/**
 * @brief Load slots a block's GLU part spends on one selected row: its steps
 * (GluSlicedPolicy::steps_per_row) times the pieces a step loads. Host and device.
 */
template <class Policy>
constexpr long glu_row_slots(int d_model) noexcept {
  using G = typename Policy::Glu;
  return static_cast<long>(G::steps_per_row(d_model)) * G::kThreads * G::kPieces;
}

/**
 * @brief The fused Stage-2 policy plan() uses without an explicit choice: the candidate of `List`
 * whose GLU steps cover a row of d_model inputs with the fewest load slots (glu_row_slots), ties to
 * the lower index. Measured on the H100 (docs/benchmarks.md): with 256 threads a 5120-wide row
 * takes 3 steps of which the last is half idle, and 320 threads (2 full steps) made the FFN
 * 0.7-2.5 us faster on Qwen3-14B and 32B; 256 threads stayed faster where they fit (2048, 4096).
 */
template <class List>
int default_policy(int d_model) noexcept {
  int best = 0;
  long best_slots = -1;
  for_each_policy<List>([&](auto p, int i) {
    const long slots = glu_row_slots<decltype(p)>(d_model);
    if (best_slots < 0 || slots < best_slots) {
      best = i;
      best_slots = slots;
    }
  });
  return best;
}

/**
 * @brief Validate without launching (the grid size is checked against the device at launch): the
 * GLU GEMV's rules (glu_gemv::can_implement), W_down^T 16-byte aligned, y element-aligned,
 * grid_blocks >= 0.
 */
template <class T>
Status can_implement(const GluDownGemvArgs<T>& a) noexcept {
  PROX_RETURN_IF_ERROR(glu_gemv::can_implement<T>(a));
  if (a.w_down_t == nullptr || a.y == nullptr) return Status::kErrorNullPointer;
  if (a.grid_blocks < 0) return Status::kErrorInvalidArgument;
  if (!is_aligned(a.w_down_t, 16) || !is_aligned(a.y, sizeof(T))) return Status::kErrorMisalignedPointer;
  return Status::kSuccess;
}

//! Workspace layout for a grid: barrier words, down tile counters (a region of the same size for
//! every policy: detail::tile_counter_bytes), split-K partials. The barrier and counters are at the
//! same offsets for every policy and grid, so one workspace serves them all.
struct WorkspaceLayout {
  std::size_t barrier = 0, counters = 0, partials = 0, total = 0;
};
template <class Policy>
constexpr WorkspaceLayout workspace_layout(int d_model, int grid_blocks) noexcept {
  const int tiles = num_tiles<Policy>(d_model);
  const int parts = grid_blocks / tiles > 1 ? grid_blocks / tiles : 1;
  WorkspaceLayout l;
  l.barrier = 0;
  l.counters = 256;
  l.partials = l.counters + detail::tile_counter_bytes<Policy::kTileD>(d_model);
  l.total = l.partials + (parts > 1 ? sizeof(float) * static_cast<std::size_t>(parts) * d_model : 0);
  return l;
}

/**
 * @brief Workspace bytes for a grid of `grid_blocks` (use the grid you launch with): the grid
 * barrier, the down tiles' counters and split-K partials. Zero it before first use (prox leaves it
 * ready for the next launch).
 */
template <class Policy>
constexpr std::size_t workspace_bytes(int d_model, int grid_blocks) noexcept {
  return workspace_layout<Policy>(d_model, grid_blocks).total;
}

/**
 * @brief Launch the fused Stage 2 on `stream` (a cooperative launch: every block resident).
 * @code
 * prox::GluDownGemvArgs<__half> a{{d_x, K, N, d_wg, d_wu, d_mask, d_s}, d_wdt, d_y};
 * using P = prox::PolicyAt<0, prox::GluDownGemvPolicies>;
 * prox::glu_down_gemv::max_grid_blocks<P, prox::SiLU, __half>(&a.grid_blocks);      // plan time
 * std::size_t ws = prox::glu_down_gemv::workspace_bytes<P>(K, a.grid_blocks);
 * auto st = prox::glu_down_gemv::launch<P, prox::SiLU>(a, d_ws, ws, stream);
 * @endcode
 */
template <class Policy, class Act, class T>
Status launch(const GluDownGemvArgs<T>& a, void* workspace, std::size_t workspace_size, cudaStream_t stream,
              const LaunchOptions& opts = {}) noexcept {
  PROX_RETURN_IF_ERROR(can_implement(a));
  int max_blocks = 0;
  PROX_RETURN_IF_ERROR((max_grid_blocks<Policy, Act, T>(&max_blocks)));
  const int blocks = a.grid_blocks > 0 ? a.grid_blocks : max_blocks;
  if (blocks > max_blocks) return Status::kErrorInvalidArgument;  // could not all be resident
  if (workspace == nullptr) return Status::kErrorNullPointer;
  const WorkspaceLayout l = workspace_layout<Policy>(a.d_model, blocks);
  if (workspace_size < l.total) return Status::kErrorWorkspaceTooSmall;
  if (!is_aligned(workspace, 16)) return Status::kErrorMisalignedPointer;
  char* ws = static_cast<char*>(workspace);
  return detail::launch_kernel_ex(glu_down_gemv_kernel<Policy, T, Act>, dim3(static_cast<unsigned>(blocks)),
                                        dim3(Policy::kThreads), 0, stream, opts,
                                        detail::LaunchExtras{0u, opts.cooperative}, a,
                                        reinterpret_cast<float*>(ws + l.partials),
                                        reinterpret_cast<unsigned*>(ws + l.counters),
                                        reinterpret_cast<unsigned*>(ws + l.barrier));
}

}  // namespace glu_down_gemv

PROX_NAMESPACE_END
