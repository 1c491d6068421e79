// SPDX-License-Identifier: Apache-2.0
//! @file glu_gemv.cuh  Op 3, Stage 2: the masked GLU GEMV. For every channel j selected in the
//! bitmask, compute g_j = <x, W_gate[j,:]> and u_j = <x, W_up[j,:]> exactly from the original
//! fp16/bf16 weights (fp32 accumulation) and write s_j = u_j * act(g_j). Unselected rows are never read.
//!
//! Grid: one block per range of kChannels channels; the block compacts its selected channels from
//! the mask in shared memory. Two schemes, chosen by the policy type: GluSlicedPolicy (the block
//! shares each batch of rows: even work split, default) and GluGemvPolicy (one warp per row). Rows
//! are read in 16-byte pieces (nn.Linear layout: row j contiguous over d_model).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief Arguments of the masked GLU GEMV. All pointers are device pointers.
 * @tparam T `__half` or `__nv_bfloat16` (activations and weights).
 */
template <class T>
struct GluGemvArgs {
  const T* x = nullptr;       //!< [d_model], 16-byte aligned
  int d_model = 0;            //!< a multiple of 8, 8..2^20
  int d_ff = 0;               //!< a multiple of 32, 32..2^20
  const T* w_gate = nullptr;  //!< [d_ff][d_model] row-major (nn.Linear), 16-byte aligned
  const T* w_up = nullptr;    //!< [d_ff][d_model] row-major, 16-byte aligned
  const std::uint32_t* channel_mask = nullptr;  //!< [d_ff/32] selected channels (Stage 1's output)
  float* s = nullptr;         //!< out [d_ff]: s_j for selected j, +0 for unselected j (every entry written)
};

/**
 * @brief GLU policy, warp-per-channel scheme: each warp takes whole selected rows, one at a time.
 * @tparam Threads   threads per block
 * @tparam Channels  channel range per block (a multiple of 32)
 * @tparam Unroll    16-byte pieces of each row in flight per lane
 */
template <int Threads, int Channels, int Unroll>
struct GluGemvPolicy {
  static constexpr bool kSliced = false;
  static constexpr int kThreads = Threads;
  static constexpr int kChannels = Channels;
  static constexpr int kUnroll = Unroll;
  static_assert(Channels % 32 == 0 && Threads % 32 == 0, "policy shape");
  static std::string name() {
    return "glu_t" + std::to_string(Threads) + "_c" + std::to_string(Channels) + "_u" + std::to_string(Unroll);
  }
};

/**
 * @brief GLU policy, block-sliced scheme: the whole block works on a batch of kBatch selected rows at
 * once, each thread on its own 16-byte pieces of every row of the batch, so the work of a block is
 * split evenly whatever the number of selected channels (no warp idles while another finishes a row).
 * @tparam Threads   threads per block
 * @tparam Channels  channel range per block (a multiple of 32)
 * @tparam Batch     selected rows processed together (2 * Batch a power of two <= 32)
 * @tparam Pieces    16-byte pieces per row and thread in flight
 */
template <int Threads, int Channels, int Batch, int Pieces>
struct GluSlicedPolicy {
  static constexpr bool kSliced = true;
  static constexpr int kThreads = Threads;
  static constexpr int kChannels = Channels;
  static constexpr int kBatch = Batch;
  static constexpr int kPieces = Pieces;
  static_assert(Channels % 32 == 0 && Threads % 32 == 0, "policy shape");
  static_assert(is_pow2(2 * Batch) && 2 * Batch <= 32, "2 * Batch must be a power of two <= 32");
  static std::string name() {
    return "glus_t" + std::to_string(Threads) + "_c" + std::to_string(Channels) + "_b" + std::to_string(Batch) +
           "_p" + std::to_string(Pieces);
  }
};

using GluGemvPolicies = PolicyList<GluSlicedPolicy<128, 32, 4, 1>, GluSlicedPolicy<256, 64, 4, 1>,
                                   GluSlicedPolicy<128, 32, 2, 2>, GluGemvPolicy<128, 32, 4>>;

// ---------------------------------------------------------------- L1: row dot products
/**
 * @brief Warp-cooperative dot products of x with two rows (gate, up) of length k (a multiple of 8).
 * Lane l handles elements [8 l + 256 i, +8). Result is in every lane; order of additions fixed.
 */
template <int kUnroll, class T>
PROX_DEVICE PROX_FORCEINLINE float2 warp_dot2(const T* __restrict__ x, const T* __restrict__ r0,
                                              const T* __restrict__ r1, int k) {
  constexpr int kStep = kWarpSize * 8;
  const int lane = lane_id();
  float a0 = 0.0f;
  float a1 = 0.0f;
#pragma unroll 1
  for (int e0 = lane * 8; e0 < k; e0 += kStep * kUnroll) {
    uint4 v0[kUnroll];
    uint4 v1[kUnroll];
    uint4 vx[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = e0 + u * kStep;
      const bool ok = e < k;
      v0[u] = ld_stream_16(r0 + e, ok);
      v1[u] = ld_stream_16(r1 + e, ok);
      vx[u] = ld_cached_16(x + e, ok);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float fx[8];
      float f0[8];
      float f1[8];
      unpack8<T>(vx[u], fx);
      unpack8<T>(v0[u], f0);
      unpack8<T>(v1[u], f1);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        a0 = fmaf(fx[c], f0[c], a0);
        a1 = fmaf(fx[c], f1[c], a1);
      }
    }
  }
  return make_float2(warp_sum(a0), warp_sum(a1));
}

// ---------------------------------------------------------------- L2: kernel
template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, 1) void glu_gemv_kernel(const GluGemvArgs<T> a) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kChannels = Policy::kChannels;
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ int s_ch[kChannels];
  __shared__ int s_warp[kWarps];

  const int tid = static_cast<int>(threadIdx.x);
  const int c0 = static_cast<int>(blockIdx.x) * kChannels;
  pdl_wait();  // the mask comes from Stage 1
  pdl_launch_dependents();

  int count = 0;
#pragma unroll 1
  for (int base = 0; base < kChannels; base += kThreads) {
    const int t = base + tid;
    const int j = c0 + t;
    bool sel = false;
    if (t < kChannels && j < a.d_ff) sel = (a.channel_mask[j / kWarpSize] >> (j % kWarpSize)) & 1u;
    int total = 0;
    const int pos = block_compact_position<kThreads>(sel, s_warp, &total);
    if (sel) s_ch[count + pos] = j;
    // Unselected channels get s = 0, so s is fully defined and the down GEMV may read any entry.
    if (!sel && t < kChannels && j < a.d_ff) a.s[j] = 0.0f;
    count += total;
  }
  __syncthreads();

  const Act act{};
  const std::size_t ld = static_cast<std::size_t>(a.d_model);
#pragma unroll 1
  for (int i = warp_id(); i < count; i += kWarps) {
    const int j = s_ch[i];
    const float2 gu = warp_dot2<Policy::kUnroll>(a.x, a.w_gate + j * ld, a.w_up + j * ld, a.d_model);
    if (lane_id() == 0) a.s[j] = gu.y * act(gu.x);
  }
}

template <class Policy, class T, class Act>
PROX_KERNEL __launch_bounds__(Policy::kThreads, 1) void glu_gemv_sliced_kernel(const GluGemvArgs<T> a) {
  constexpr int kThreads = Policy::kThreads;
  constexpr int kChannels = Policy::kChannels;
  constexpr int kWarps = kThreads / kWarpSize;
  constexpr int kB = Policy::kBatch;
  constexpr int kP = Policy::kPieces;
  constexpr int kV = 2 * kB;  // values reduced per batch: g and u of kB rows
  __shared__ int s_ch[kChannels];
  __shared__ int s_warp[kWarps];
  __shared__ float s_red[kWarps][2][kChannels];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int c0 = static_cast<int>(blockIdx.x) * kChannels;
  pdl_wait();  // the mask comes from Stage 1
  pdl_launch_dependents();

  int count = 0;
#pragma unroll 1
  for (int base = 0; base < kChannels; base += kThreads) {
    const int t = base + tid;
    const int j = c0 + t;
    bool sel = false;
    if (t < kChannels && j < a.d_ff) sel = (a.channel_mask[j / kWarpSize] >> (j % kWarpSize)) & 1u;
    int total = 0;
    const int pos = block_compact_position<kThreads>(sel, s_warp, &total);
    if (sel) s_ch[count + pos] = j;
    // Unselected channels get s = 0, so s is fully defined and the down GEMV may read any entry.
    if (!sel && t < kChannels && j < a.d_ff) a.s[j] = 0.0f;
    count += total;
  }
  __syncthreads();

  // Work is a flat sequence of steps; step st covers rows [b0, b0 + kB) of the batch st / kSteps
  // and pieces q0 + p kThreads of each row. Loads of step st + 1 are issued before the arithmetic
  // of step st (register double buffering), so memory is busy while the block reduces a batch.
  const int pieces = a.d_model / 8;  // 16-byte pieces per row
  const int steps_per_batch = (pieces + kThreads * kP - 1) / (kThreads * kP);
  const int total_steps = ((count + kB - 1) / kB) * steps_per_batch;
  const std::size_t ld = static_cast<std::size_t>(a.d_model);

  struct Step {
    uint4 vx[kP];
    uint4 vg[kB][kP];
    uint4 vu[kB][kP];
  };
  // Branch-free: a step past the end loads nothing (all predicates false), so ptxas keeps every
  // load of step st + 1 ahead of the arithmetic of step st instead of sinking it behind a branch.
  const auto load_step = [&](int st, Step& d) {
    const bool live = st < total_steps;
    const int b0 = (st / steps_per_batch) * kB;
    const int q0 = tid + (st % steps_per_batch) * kThreads * kP;
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      const bool have = live && b0 + c < count;
      const std::size_t row = static_cast<std::size_t>(s_ch[have ? b0 + c : b0]) * ld;
#pragma unroll
      for (int p = 0; p < kP; ++p) {
        const int q = q0 + p * kThreads;
        const bool ok = have && q < pieces;
        d.vg[c][p] = ld_stream_16(a.w_gate + row + 8 * q, ok);
        d.vu[c][p] = ld_stream_16(a.w_up + row + 8 * q, ok);
      }
    }
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const int q = q0 + p * kThreads;
      d.vx[p] = ld_cached_16(a.x + 8 * q, live && q < pieces);
    }
  };
  float v[kV];
#pragma unroll
  for (int i = 0; i < kV; ++i) v[i] = 0.0f;
  const auto compute_step = [&](int st, const Step& d) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      float fx[8];
      unpack8<T>(d.vx[p], fx);
#pragma unroll
      for (int c = 0; c < kB; ++c) {
        float fg[8];
        float fu[8];
        unpack8<T>(d.vg[c][p], fg);
        unpack8<T>(d.vu[c][p], fu);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          v[c] = fmaf(fx[e], fg[e], v[c]);
          v[kB + c] = fmaf(fx[e], fu[e], v[kB + c]);
        }
      }
    }
    if (st % steps_per_batch == steps_per_batch - 1) {
      // Batch done: one reduction for all 2 kB values (2 kB - 1 + log2(32 / 2 kB) shuffles).
      const int b0 = (st / steps_per_batch) * kB;
      const float r = warp_sum_many<kV>(v);
      constexpr int kLanesPerValue = kWarpSize / kV;
      if (lane % kLanesPerValue == 0) {
        const int idx = lane / kLanesPerValue;
        const int c = idx % kB;
        if (b0 + c < count) s_red[warp][idx / kB][b0 + c] = r;
      }
#pragma unroll
      for (int i = 0; i < kV; ++i) v[i] = 0.0f;
    }
  };
  Step buf0;
  Step buf1;
  load_step(0, buf0);
#pragma unroll 1
  for (int st = 0; st < total_steps; st += 2) {
    load_step(st + 1, buf1);
    compute_step(st, buf0);
    load_step(st + 2, buf0);
    if (st + 1 < total_steps) compute_step(st + 1, buf1);
  }
  __syncthreads();
  const Act act{};
  for (int i = tid; i < count; i += kThreads) {
    float g = 0.0f;
    float u = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      g += s_red[w][0][i];
      u += s_red[w][1][i];
    }
    a.s[s_ch[i]] = u * act(g);
  }
}

// ---------------------------------------------------------------- L3: op
namespace glu_gemv {

/**
 * @brief Validate without launching. Shape rule: d_model a multiple of 8 in [8, 2^20]; d_ff a
 * multiple of 32 in [32, 2^20]; x, w_gate, w_up 16-byte aligned; mask and s 4-byte aligned.
 */
template <class T>
Status can_implement(const GluGemvArgs<T>& a) noexcept {
  if (a.x == nullptr || a.w_gate == nullptr || a.w_up == nullptr || a.channel_mask == nullptr || a.s == nullptr)
    return Status::kErrorNullPointer;
  if (a.d_model < 8 || a.d_model > (1 << 20) || a.d_model % 8 != 0 || a.d_ff < 32 || a.d_ff > (1 << 20) ||
      a.d_ff % 32 != 0)
    return Status::kErrorInvalidShape;
  if (!is_aligned(a.x, 16) || !is_aligned(a.w_gate, 16) || !is_aligned(a.w_up, 16) || !is_aligned(a.channel_mask, 4) ||
      !is_aligned(a.s, 4))
    return Status::kErrorMisalignedPointer;
  return Status::kSuccess;
}

template <class T>
constexpr std::size_t workspace_bytes(const GluGemvArgs<T>&) noexcept {
  return 0;
}

/**
 * @brief Launch the masked GLU GEMV on `stream`.
 * @code
 * prox::GluGemvArgs<__half> a{d_x, K, N, d_wg, d_wu, d_mask, d_s};
 * auto st = prox::glu_gemv::launch<prox::PolicyAt<0, prox::GluGemvPolicies>, prox::SiLU>(a, nullptr, 0, stream);
 * @endcode
 */
template <class Policy, class Act, class T>
Status launch(const GluGemvArgs<T>& a, void* /*workspace*/, std::size_t /*workspace_size*/, cudaStream_t stream,
              const LaunchOptions& opts = {}) noexcept {
  PROX_RETURN_IF_ERROR(can_implement(a));
  const dim3 grid(static_cast<unsigned>(ceil_div(a.d_ff, Policy::kChannels)));
  if constexpr (Policy::kSliced) {
    return detail::launch_kernel(glu_gemv_sliced_kernel<Policy, T, Act>, grid, dim3(Policy::kThreads), 0, stream,
                                 opts, a);
  } else {
    return detail::launch_kernel(glu_gemv_kernel<Policy, T, Act>, grid, dim3(Policy::kThreads), 0, stream, opts, a);
  }
}

}  // namespace glu_gemv

PROX_NAMESPACE_END
