// SPDX-License-Identifier: Apache-2.0
//! @file glu_gemv.cuh  Op 3, Stage 2: the masked GLU GEMV. For every channel j selected in the
//! bitmask, compute g_j = <x, W_gate[j,:]> and u_j = <x, W_up[j,:]> exactly from the original
//! fp16/bf16 weights (fp32 accumulation) and write s_j = u_j * act(g_j). Unselected rows are never read.
//!
//! Grid: one block per range of kChannels channels; the block compacts its selected channels from
//! the mask in shared memory and gives one warp per channel. Each lane streams 16-byte pieces of
//! both rows (nn.Linear layout: row j contiguous over d_model), kUnroll pieces of each in flight.
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
  float* s = nullptr;         //!< out [d_ff]: s_j for selected j; entries of unselected channels are not written
};

/**
 * @brief Tile policy of the GLU GEMV.
 * @tparam Threads   threads per block (one warp per selected channel at a time)
 * @tparam Channels  channel range per block (a multiple of 32)
 * @tparam Unroll    16-byte pieces of each row in flight per lane
 */
template <int Threads, int Channels, int Unroll>
struct GluGemvPolicy {
  static constexpr int kThreads = Threads;
  static constexpr int kChannels = Channels;
  static constexpr int kUnroll = Unroll;
  static_assert(Channels % 32 == 0 && Threads % 32 == 0, "policy shape");
  static std::string name() {
    return "glu_t" + std::to_string(Threads) + "_c" + std::to_string(Channels) + "_u" + std::to_string(Unroll);
  }
};

using GluGemvPolicies =
    PolicyList<GluGemvPolicy<256, 64, 4>, GluGemvPolicy<128, 32, 4>, GluGemvPolicy<256, 128, 2>>;

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
      if (e < k) {
        v0[u] = ld_stream_16(r0 + e);
        v1[u] = ld_stream_16(r1 + e);
        vx[u] = ld_cached_16(x + e);
      } else {
        v0[u] = v1[u] = vx[u] = make_uint4(0u, 0u, 0u, 0u);
      }
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
PROX_KERNEL __launch_bounds__(Policy::kThreads) void glu_gemv_kernel(const GluGemvArgs<T> a) {
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
  return detail::launch_kernel(glu_gemv_kernel<Policy, T, Act>, grid, dim3(Policy::kThreads), 0, stream, opts, a);
}

}  // namespace glu_gemv

PROX_NAMESPACE_END
