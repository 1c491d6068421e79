// SPDX-License-Identifier: Apache-2.0
//! @file sparse_ffn.cuh  The Prox FFN driver: plan() validates and chooses, run() only launches.
//!
//!   Stage 1  proxy_gemv   threshold x, INT4 gate/up proxies over kept rows, s~ -> channel bitmask
//!   Stage 2  glu_gemv     exact gate/up rows of selected channels, s = u * act(g)
//!            down_gemv    y = sum over selected j of s_j W_down^T[j,:]
//!
//! By default Stage 2 runs as one kernel, glu_down_gemv (both ops fused, a grid-wide barrier between
//! them), so an FFN is 2 kernels; PlanOptions::fuse_stage2 = false runs the two ops separately.
//!
//! run() allocates nothing, never synchronizes, never copies to the host, and can be captured in a
//! CUDA graph; every data-dependent decision (which rows, how many) stays on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "activation.cuh"
#include "core/config.hpp"
#include "core/shape.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "dispatch.hpp"
#include "down_gemv.cuh"
#include "glu_down_gemv.cuh"
#include "glu_gemv.cuh"
#include "proxy_gemv.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

//! Policy indices into each op's candidate list; -1 lets plan() use the default for the shape.
struct PolicyChoice {
  int proxy = -1;
  int glu = -1;
  int down = -1;
  int glu_down = -1;  //!< fused Stage 2 (PlanOptions::fuse_stage2)
};

/**
 * @brief The Stage-1 policy plan() uses without an explicit choice: default_policy() over the grid
 * sizes, preferring a cp.async-pipelined candidate (kStages > 0) when the grid needs more than one
 * wave (measured faster there; docs/benchmarks.md).
 */
template <class List>
int proxy_gemv_default_policy(int sm_count, int d_model, int d_ff) noexcept {
  return default_policy<List>(
      sm_count,
      [&](auto p) {
        return proxy_gemv::num_blocks<decltype(p)>(d_model, d_ff);
      },
      [](auto p) { return decltype(p)::kStages > 0; });
}

template <class ProxyFmt>
struct ProxyPolicyListFor {
  using type = ProxyGemvPolicies;
};
template <class W>
struct ProxyPolicyListFor<DenseWeights<W>> {
  using type = DenseProxyGemvPolicies;
};

/**
 * @brief One sparse FFN layer (batch 1 decoding): y = (u * act(g)) W_down with Prox's two stages.
 * @tparam T        `__half` or `__nv_bfloat16` (activations, exact weights, output)
 * @tparam Act      SiLU (SwiGLU) or GeluTanh (GeGLU)
 * @tparam ProxyFmt Int4Weights (the method) or DenseWeights<T> (A1 ablation)
 *
 * @code
 * prox::SparseFfn<__half> ffn;
 * prox::SparseFfn<__half>::Weights w{d_wg, d_wu, d_wdt, d_qg, d_qu, d_sg, d_su};
 * if (ffn.plan({4096, 12288, tau_x, tau_s}, w) != prox::Status::kSuccess) ...;
 * prox::initialize_workspace(d_ws, ffn.workspace_bytes(), stream);   // once
 * ffn.run(d_x, d_y, d_ws, ffn.workspace_bytes(), stream);            // per token, graph-capturable
 * @endcode
 */
template <class T, class Act = SiLU, class ProxyFmt = Int4Weights>
class SparseFfn {
 public:
  using ProxyPolicies = typename ProxyPolicyListFor<ProxyFmt>::type;
  using GluPolicies = GluGemvPolicies;
  using DownPolicies = DownGemvPolicies;
  using GluDownPolicies = GluDownGemvPolicies;

  //! Layer shape and calibrated thresholds.
  struct Config {
    int d_model = 0;      //!< a multiple of 8
    int d_ff = 0;         //!< a multiple of 32
    float tau_x = 0.0f;   //!< Stage-1 input threshold (>= 0)
    float tau_s = 0.0f;   //!< Stage-1 channel threshold (>= 0)
  };

  //! Device pointers to the layer's weights (owned by the caller, which keeps them alive).
  struct Weights {
    const T* w_gate = nullptr;          //!< [d_ff][d_model] nn.Linear layout
    const T* w_up = nullptr;            //!< [d_ff][d_model]
    const T* w_down_t = nullptr;        //!< [d_ff][d_model] = W_down^T (transpose_host/device of nn.Linear's)
    const void* proxy_gate = nullptr;   //!< ProxyFmt layout (Int4Weights: int4::pack_host/pack_device)
    const void* proxy_up = nullptr;
    const float* proxy_scale_gate = nullptr;  //!< [d_ff] (Int4Weights)
    const float* proxy_scale_up = nullptr;
  };

  struct PlanOptions {
    PolicyChoice choice{};   //!< explicit policies (tuning cache / tests); -1 = default
    bool pdl = true;         //!< launch with programmatic dependent launch (sm_90+): each kernel's
                             //!< launch overlaps the previous kernel's tail; it waits before reading
    //! Stage 1 combines its split-K partials inside thread-block clusters (sm_90+, 2..8 chunks)
    //! instead of through global memory. Off by default: measured on the H100 it is slower on the
    //! Qwen3-8B shape (Stage 1 alone 18.2 against 15.2 us at e = 70 %, policy 0) and ~1 us faster
    //! on 14B with policy 1; results are bit-identical either way (docs/benchmarks.md).
    bool cluster = false;
    bool fuse_stage2 = true; //!< Stage 2 as one kernel (glu_down_gemv) instead of glu_gemv + down_gemv
    //! Stage 1's grid, where smaller than the GPU holds, runs at most ceil(blocks / SMs) per SM
    //! (LaunchOptions::spread). On by default: the 1.7B FFN is 0.4-2.5 us faster on the H100
    //! (docs/benchmarks.md); results are bit-identical either way.
    bool spread = true;
  };

  /**
   * @brief Validate shapes, pointers and thresholds; choose policies; size the workspace.
   * Reads the current device's attributes (once). Not capturable; call it before capture.
   */
  Status plan(const Config& cfg, const Weights& w, const PlanOptions& opts = {}) noexcept;

  //! Bytes of workspace run() needs (valid after plan()). Sized for every candidate policy, so a
  //! later re-plan with another choice never needs a larger buffer.
  std::size_t workspace_bytes() const noexcept { return ws_total_; }
  //! The policies plan() chose.
  PolicyChoice choice() const noexcept { return choice_; }
  //! Grid of the GLU GEMV that plan() chose (benches, tests).
  int glu_blocks() const noexcept { return glu_blocks_; }
  //! Grid of the fused Stage-2 kernel that plan() chose.
  int glu_down_blocks() const noexcept { return glu_down_blocks_; }
  bool fused_stage2() const noexcept { return fused_; }
  const Config& config() const noexcept { return cfg_; }
  bool uses_pdl() const noexcept { return pdl_; }
  bool uses_cluster() const noexcept { return cluster_; }

  /**
   * @brief Run the layer on one token: y = FFN(x). Launches 2 kernels on `stream` (3 without fusion).
   * @param x [d_model] device, 16-byte aligned; @param y [d_model] device, 16-byte aligned (written)
   * @param workspace workspace_bytes() of device memory, zeroed before its first use
   * @param counters optional SparsityCounters (accumulated on the device)
   */
  Status run(const T* x, T* y, void* workspace, std::size_t workspace_size, cudaStream_t stream,
             SparsityCounters* counters = nullptr) const noexcept;

  /**
   * @brief Stage 1 alone in values mode: s_proxy[j] = s~_j for every channel (calibration of tau_s,
   * analysis). The channel mask (with this plan's tau_s) is written into the workspace as usual.
   */
  Status run_proxy_values(const T* x, float* s_proxy, void* workspace, std::size_t workspace_size,
                          cudaStream_t stream) const noexcept;

  //! Offset of the channel bitmask [d_ff/32] inside the workspace (tests, analysis).
  std::size_t mask_offset() const noexcept { return off_mask_; }
  //! Offset of the Stage-2 s buffer [d_ff] float inside the workspace (tests, analysis).
  std::size_t s_offset() const noexcept { return off_s_; }

 private:
  static Status check_static(const Config& cfg, const Weights& w) noexcept {
    if (w.w_gate == nullptr || w.w_up == nullptr || w.w_down_t == nullptr || w.proxy_gate == nullptr ||
        w.proxy_up == nullptr)
      return Status::kErrorNullPointer;
    if (ProxyFmt::kNeedsScales && (w.proxy_scale_gate == nullptr || w.proxy_scale_up == nullptr))
      return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(check_ffn_shape(cfg.d_model, cfg.d_ff));
    if (!valid_threshold(cfg.tau_x) || !valid_threshold(cfg.tau_s)) return Status::kErrorInvalidThreshold;
    if (!is_aligned(w.w_gate, 16) || !is_aligned(w.w_up, 16) || !is_aligned(w.w_down_t, 16) ||
        !is_aligned(w.proxy_gate, 16) || !is_aligned(w.proxy_up, 16) || !is_aligned(w.proxy_scale_gate, 4) ||
        !is_aligned(w.proxy_scale_up, 4))
      return Status::kErrorMisalignedPointer;
    return Status::kSuccess;
  }

  ProxyGemvArgs<T> stage1_args(const T* x, std::uint32_t* mask, float* s_proxy, float tau_s,
                               SparsityCounters* counters) const noexcept {
    ProxyGemvArgs<T> a;
    a.x = x;
    a.d_model = cfg_.d_model;
    a.d_ff = cfg_.d_ff;
    a.tau_x = cfg_.tau_x;
    a.tau_s = tau_s;
    a.w_gate = w_.proxy_gate;
    a.w_up = w_.proxy_up;
    a.scale_gate = w_.proxy_scale_gate;
    a.scale_up = w_.proxy_scale_up;
    a.channel_mask = mask;
    a.s_proxy = s_proxy;
    a.counters = counters;
    return a;
  }

  Status launch_stage1(const T* x, std::uint32_t* mask, float* s_proxy, float tau_s, char* ws,
                       SparsityCounters* counters, cudaStream_t stream) const noexcept;

  void layout_workspace() noexcept;

  Config cfg_{};
  Weights w_{};
  PolicyChoice choice_{};
  bool pdl_ = false;
  bool cluster_ = false;
  bool spread_ = true;
  bool fused_ = true;
  bool planned_ = false;
  int glu_down_blocks_ = 0;      // fused Stage-2 grid of the chosen policy
  int glu_down_max_blocks_ = 0;  // largest fused grid over the policies (workspace sizing)
  int glu_blocks_ = 0;  // GLU grid: SMs x resident blocks of the chosen policy
  std::size_t ws_proxy_ = 0, ws_down_ = 0, ws_glu_down_ = 0;
  std::size_t off_proxy_ = 0, off_mask_ = 0, off_s_ = 0, off_down_ = 0, off_glu_down_ = 0, ws_total_ = 0;
};

// The members that launch or query kernels are defined out of the class, so they are not inline:
// an explicit instantiation declaration (PROX_SPARSE_FFN_EXTERN, prox/instantiate.cuh) then keeps a
// translation unit from instantiating them, and with them every kernel of the layer.

template <class T, class Act, class ProxyFmt>
Status SparseFfn<T, Act, ProxyFmt>::plan(const Config& cfg, const Weights& w,
                                         const PlanOptions& opts) noexcept {
  planned_ = false;
  cfg_ = cfg;
  w_ = w;
  PROX_RETURN_IF_ERROR(check_static(cfg, w));
  DeviceInfo info;
  PROX_RETURN_IF_ERROR(query_device(&info));
  pdl_ = opts.pdl && info.supports_pdl();
  cluster_ = opts.cluster && info.cc_major >= 9;
  spread_ = opts.spread;
  fused_ = opts.fuse_stage2;
  const auto pick = [&](int requested, int size, int dflt, int* out) {
    if (requested >= size) return Status::kErrorInvalidArgument;
    *out = requested >= 0 ? requested : dflt;
    return Status::kSuccess;
  };
  const int K = cfg.d_model;
  const int N = cfg.d_ff;
  PROX_RETURN_IF_ERROR(pick(opts.choice.proxy, ProxyPolicies::kSize,
                            proxy_gemv_default_policy<ProxyPolicies>(info.sm_count, K, N), &choice_.proxy));
  // Stage 1's launch reads driver facts for its spread once per device (LaunchOptions::spread):
  // read them now, so that a first run under graph capture makes no driver query.
  if (spread_) {
    PROX_RETURN_IF_ERROR(dispatch_policy<ProxyPolicies>(choice_.proxy, [&](auto p) {
      std::size_t bytes = 0;
      return proxy_gemv::spread_bytes<decltype(p), ProxyFmt, Act, T>(K, N, &bytes);
    }));
  }
  // The GLU GEMV splits the selected rows evenly by rank, so its grid is sized to fill the GPU in
  // one wave (SMs x resident blocks) and its policy 0 is the default.
  PROX_RETURN_IF_ERROR(pick(opts.choice.glu, GluPolicies::kSize, 0, &choice_.glu));
  PROX_RETURN_IF_ERROR(pick(opts.choice.down, DownPolicies::kSize,
                            default_policy<DownPolicies>(
                                info.sm_count, [&](auto p) { return down_gemv::num_blocks<decltype(p)>(K, N); }),
                            &choice_.down));
  dispatch_policy<GluPolicies>(choice_.glu, [&](auto p) {
    glu_blocks_ = glu_gemv::wave_blocks<decltype(p)>(info.sm_count);
    return Status::kSuccess;
  });
  // The fused Stage 2 needs every block resident: its grid is what fits (SMs x resident blocks).
  PROX_RETURN_IF_ERROR(pick(opts.choice.glu_down, GluDownPolicies::kSize,
                            glu_down_gemv::default_policy<GluDownPolicies>(K), &choice_.glu_down));
  glu_down_blocks_ = 0;
  glu_down_max_blocks_ = 0;
  for_each_policy<GluDownPolicies>([&](auto p, int i) {
    int blocks = 0;
    if (glu_down_gemv::max_grid_blocks<decltype(p), Act, T>(&blocks) != Status::kSuccess) blocks = 0;
    glu_down_max_blocks_ = blocks > glu_down_max_blocks_ ? blocks : glu_down_max_blocks_;
    if (i == choice_.glu_down) glu_down_blocks_ = blocks;
  });
  if (fused_ && glu_down_blocks_ <= 0) return Status::kErrorUnsupportedDevice;

  layout_workspace();
  planned_ = true;
  return Status::kSuccess;
}

template <class T, class Act, class ProxyFmt>
Status SparseFfn<T, Act, ProxyFmt>::run(const T* x, T* y, void* workspace, std::size_t workspace_size,
                                        cudaStream_t stream, SparsityCounters* counters) const noexcept {
  if (!planned_) return Status::kErrorNotPlanned;
  if (x == nullptr || y == nullptr || workspace == nullptr) return Status::kErrorNullPointer;
  if (!is_aligned(x, 16) || !is_aligned(y, 16) || !is_aligned(workspace, 16) || !is_aligned(counters, 8))
    return Status::kErrorMisalignedPointer;
  if (workspace_size < ws_total_) return Status::kErrorWorkspaceTooSmall;
  char* ws = static_cast<char*>(workspace);
  auto* mask = reinterpret_cast<std::uint32_t*>(ws + off_mask_);
  auto* s = reinterpret_cast<float*>(ws + off_s_);
  PROX_RETURN_IF_ERROR(launch_stage1(x, mask, nullptr, cfg_.tau_s, ws + off_proxy_, counters, stream));
  LaunchOptions chained;
  chained.pdl = pdl_;
  GluGemvArgs<T> a2;
  a2.x = x;
  a2.d_model = cfg_.d_model;
  a2.d_ff = cfg_.d_ff;
  a2.w_gate = w_.w_gate;
  a2.w_up = w_.w_up;
  a2.channel_mask = mask;
  a2.s = s;
  if (fused_) {
    GluDownGemvArgs<T> f;
    static_cast<GluGemvArgs<T>&>(f) = a2;
    f.grid_blocks = glu_down_blocks_;
    f.w_down_t = w_.w_down_t;
    f.y = y;
    return dispatch_policy<GluDownPolicies>(choice_.glu_down, [&](auto p) {
      return glu_down_gemv::launch<decltype(p), Act>(f, ws + off_glu_down_, ws_glu_down_, stream, chained);
    });
  }
  a2.grid_blocks = glu_blocks_;
  PROX_RETURN_IF_ERROR(dispatch_policy<GluPolicies>(choice_.glu, [&](auto p) {
    return glu_gemv::launch<decltype(p), Act>(a2, nullptr, 0, stream, chained);
  }));
  DownGemvArgs<T> a3;
  a3.s = s;
  a3.channel_mask = mask;
  a3.w_down_t = w_.w_down_t;
  a3.d_model = cfg_.d_model;
  a3.d_ff = cfg_.d_ff;
  a3.y = y;
  return dispatch_policy<DownPolicies>(choice_.down, [&](auto p) {
    return down_gemv::launch<decltype(p)>(a3, ws + off_down_, ws_down_, stream, chained);
  });
}

template <class T, class Act, class ProxyFmt>
Status SparseFfn<T, Act, ProxyFmt>::run_proxy_values(const T* x, float* s_proxy, void* workspace,
                                                     std::size_t workspace_size,
                                                     cudaStream_t stream) const noexcept {
  if (!planned_) return Status::kErrorNotPlanned;
  if (x == nullptr || s_proxy == nullptr || workspace == nullptr) return Status::kErrorNullPointer;
  if (workspace_size < ws_total_) return Status::kErrorWorkspaceTooSmall;
  char* ws = static_cast<char*>(workspace);
  return launch_stage1(x, reinterpret_cast<std::uint32_t*>(ws + off_mask_), s_proxy, cfg_.tau_s, ws + off_proxy_,
                       nullptr, stream);
}

template <class T, class Act, class ProxyFmt>
Status SparseFfn<T, Act, ProxyFmt>::launch_stage1(const T* x, std::uint32_t* mask, float* s_proxy, float tau_s,
                                                  char* ws, SparsityCounters* counters,
                                                  cudaStream_t stream) const noexcept {
  const ProxyGemvArgs<T> a1 = stage1_args(x, mask, s_proxy, tau_s, counters);
  return dispatch_policy<ProxyPolicies>(choice_.proxy, [&](auto p) {
    LaunchOptions o;
    o.pdl = pdl_;  // waits (griddepcontrol.wait) before reading x or writing anything
    o.cluster = cluster_;
    o.spread = spread_;
    return proxy_gemv::launch<decltype(p), ProxyFmt, Act>(a1, ws, ws_proxy_, stream, o);
  });
}

template <class T, class Act, class ProxyFmt>
void SparseFfn<T, Act, ProxyFmt>::layout_workspace() noexcept {
  const ProxyGemvArgs<T> a1 = stage1_args(nullptr, nullptr, nullptr, 0.0f, nullptr);
  ws_proxy_ = 0;
  for_each_policy<ProxyPolicies>([&](auto p, int) {
    const std::size_t b = proxy_gemv::workspace_bytes<decltype(p)>(a1);
    ws_proxy_ = b > ws_proxy_ ? b : ws_proxy_;
  });
  DownGemvArgs<T> a3;
  a3.d_model = cfg_.d_model;
  a3.d_ff = cfg_.d_ff;
  ws_down_ = 0;
  for_each_policy<DownPolicies>([&](auto p, int) {
    const std::size_t b = down_gemv::workspace_bytes<decltype(p)>(a3);
    ws_down_ = b > ws_down_ ? b : ws_down_;
  });
  // The fused kernel has a region of its own: its grid barrier's generation word is left non-zero,
  // where the down GEMV keeps a tile counter, so a re-plan between fused and unfused Stage 2 on one
  // workspace must not share the region. Within each op's region every policy finds its counters at
  // the same place (detail::tile_counter_bytes), so a re-plan needs no new initialize_workspace.
  ws_glu_down_ = 0;
  for_each_policy<GluDownPolicies>([&](auto p, int) {
    const std::size_t b = glu_down_gemv::workspace_bytes<decltype(p)>(cfg_.d_model, glu_down_max_blocks_);
    ws_glu_down_ = b > ws_glu_down_ ? b : ws_glu_down_;
  });
  constexpr std::size_t kAlign = 256;
  off_proxy_ = 0;
  off_mask_ = round_up(off_proxy_ + ws_proxy_, kAlign);
  off_s_ = round_up(off_mask_ + sizeof(std::uint32_t) * static_cast<std::size_t>(cfg_.d_ff / 32), kAlign);
  off_down_ = round_up(off_s_ + sizeof(float) * static_cast<std::size_t>(cfg_.d_ff), kAlign);
  off_glu_down_ = round_up(off_down_ + ws_down_, kAlign);
  ws_total_ = round_up(off_glu_down_ + ws_glu_down_, kAlign);
}
/**
 * @brief Zero a workspace on `stream` before its first use (split-K tile counters and the fused
 * Stage 2's grid barrier must start at zero; prox kernels leave them ready for the next launch).
 * Asynchronous and capturable. Once zeroed, a workspace serves every launch of an op at one shape
 * with any of its policies, and every plan of a SparseFfn with the same Config (any policies, fused
 * Stage 2 or not). Used by an op or layer of another shape, it needs zeroing again first: that
 * shape's counters may lie where the other wrote split-K partials.
 */
inline Status initialize_workspace(void* workspace, std::size_t bytes, cudaStream_t stream) noexcept {
  if (workspace == nullptr) return Status::kErrorNullPointer;
  return cudaMemsetAsync(workspace, 0, bytes, stream) == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
}

PROX_NAMESPACE_END
