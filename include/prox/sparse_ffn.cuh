// SPDX-License-Identifier: Apache-2.0
//! @file sparse_ffn.cuh  The Prox FFN driver: plan() validates and chooses once, run() only launches.
//!
//!   Stage 1  ProxyGemvOp     threshold x, INT4 gate/up proxies over kept rows, s~ -> channel bitmask
//!   Stage 2  GluDownGemvOp   exact gate/up rows of selected channels, s = u * act(g), then
//!                            y = sum over selected j of s_j W_down^T[j,:] (one kernel, a grid barrier)
//!         or GluGemvOp + DownGemvOp (PlanOptions::fuse_stage2 = false: the same as two kernels)
//!
//! Each stage is a prox::Operator planned once; run() fills in the token's pointers and launches. It
//! allocates nothing, never synchronizes, never copies to the host, and can be captured in a CUDA
//! graph; every data-dependent decision (which rows, how many) stays on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "activation.cuh"
#include "batched_down.cuh"
#include "batched_glu.cuh"
#include "batched_glu_down.cuh"
#include "batched_proxy.cuh"
#include "core/config.hpp"
#include "core/device.hpp"
#include "core/math.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/workspace.cuh"
#include "down_gemv.cuh"
#include "glu_down_gemv.cuh"
#include "glu_gemv.cuh"
#include "operator.cuh"
#include "proxy_gemv.cuh"
#include "stage2_weights.cuh"
#include "stats.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

//! Policy indices into each op's candidate list; -1 lets plan() use the default for the shape.
struct PolicyChoice {
  int proxy = -1;
  int glu = -1;       //!< unfused Stage 2 only
  int down = -1;      //!< unfused Stage 2 only
  int glu_down = -1;  //!< fused Stage 2 (PlanOptions::fuse_stage2)
};

namespace detail {
//! Whether an op's Options has Stage 1's knobs (cluster, spread) / the fused Stage 2's (cooperative).
template <class O, class = void>
struct HasStage1Knobs : std::false_type {};
template <class O>
struct HasStage1Knobs<O, std::void_t<decltype(std::declval<O&>().cluster), decltype(std::declval<O&>().spread)>>
    : std::true_type {};
template <class O, class = void>
struct HasCooperative : std::false_type {};
template <class O>
struct HasCooperative<O, std::void_t<decltype(std::declval<O&>().cooperative)>> : std::true_type {};
}  // namespace detail

/**
 * @brief One sparse FFN layer (batch-1 decoding): y = (u * act(g)) W_down with Prox's two stages.
 * @tparam T        `__half` or `__nv_bfloat16` (activations, exact weights, output)
 * @tparam Act      SiLU (SwiGLU) or GeluTanh (GeGLU)
 * @tparam ProxyFmt Int4Weights (the method) or DenseWeights<T> (A1 ablation)
 * @tparam WFmt     the Stage-2 (exact) weight format, stage2_weights.cuh: NativeWeights<T> (fp16/bf16 weights)
 *
 * @code
 * using Ffn = prox::SparseFfn<__half, prox::SiLU>;
 * Ffn::Weights w;                            // named members: no positional mix-up
 * w.gate = d_wg;  w.up = d_wu;  w.down_t = d_wdt;
 * w.proxy_gate = {d_qg, d_sg};  w.proxy_up = {d_qu, d_su};
 * Ffn ffn;
 * if (ffn.plan({4096, 12288, tau_x, tau_s}, w) != prox::Status::kSuccess) { ... }
 * std::size_t bytes = Ffn::workspace_bytes(4096, 12288);       // fp16 and bf16 alike, any device
 * prox::initialize_workspace(d_ws, bytes, stream);              // once
 * ffn.run(d_x, d_y, d_ws, bytes, stream);                       // per token, graph-capturable
 * @endcode
 */
template <class T, class Act = SiLU, class ProxyFmt = Int4Weights, class WFmt = NativeWeights<T>>
class SparseFfn {
 public:
  using Stage1Op = ProxyGemvOp<T, Act, ProxyFmt>;
  using FusedStage2Op = GluDownGemvOp<T, Act, WFmt>;
  using GluOp = GluGemvOp<T, Act, WFmt>;
  using DownOp = DownGemvOp<T, WFmt>;
  using ProxyPolicies = typename Stage1Op::Policies;
  using GluPolicies = typename GluOp::Policies;
  using DownPolicies = typename DownOp::Policies;
  using GluDownPolicies = typename FusedStage2Op::Policies;
  //! One proxy matrix in ProxyFmt's layout (Int4Weights: {packed, scales}).
  using ProxyMatrix = typename ProxyFmt::Matrix;
  //! One exact matrix in WFmt's layout (NativeWeights<T>: a `const T*`, which it converts from).
  using Matrix = typename WFmt::Matrix;

  //! Layer shape and calibrated thresholds.
  struct Config {
    int d_model = 0;     //!< a multiple of 8
    int d_ff = 0;        //!< a multiple of 32
    float tau_x = 0.0f;  //!< Stage-1 input threshold (>= 0)
    float tau_s = 0.0f;  //!< Stage-1 channel threshold (>= 0)
    //! Optional device float[2] {tau_x, tau_s} that every run reads instead of tau_x / tau_s: change a
    //! layer's sparsity (cudaMemcpyAsync into it) without re-planning or re-capturing. The device
    //! values are not validated: NaN keeps nothing, a negative value keeps everything.
    const float* thresholds = nullptr;
    //! Most tokens run_batch() takes, 1..kMaxBatchTokens (8): plan() then also plans the batched ops
    //! (batched.cuh; INT4 proxies only) and workspace_bytes() holds every token's mask and s. 1 (the
    //! default): batch-1 decoding only.
    int max_tokens = 1;
  };

  /**
   * @brief Device pointers to the layer's weights (owned by the caller, which keeps them alive).
   * Not an aggregate: members are assigned by name, so gate and up, or an exact matrix and a proxy,
   * cannot be swapped by position.
   */
  struct Weights {
    Weights() noexcept {}
    Matrix gate{};              //!< W_gate [d_ff][d_model], nn.Linear layout
    Matrix up{};                //!< W_up [d_ff][d_model]
    Matrix down_t{};            //!< W_down^T [d_ff][d_model] (transpose_host/device of nn.Linear's W_down)
    ProxyMatrix proxy_gate{};   //!< proxy of W_gate (Int4Weights: int4::pack_host / pack_device)
    ProxyMatrix proxy_up{};     //!< proxy of W_up
  };

  struct PlanOptions {
    PolicyChoice choice{};  //!< explicit policies (tuning cache / tests); -1 = the default for the shape
    //! Launch with programmatic dependent launch (sm_90+): each kernel's launch overlaps the previous
    //! kernel's tail; it waits before reading its inputs.
    bool pdl = true;
    //! Stage 1 combines its split-K partials inside thread-block clusters (sm_90+, 2..8 chunks)
    //! instead of through global memory. Off by default: measured on the H100 it is slower on the
    //! Qwen3-8B shape (Stage 1 18.2 against 15.2 us at e = 70 %) and ~1 us faster on 14B with policy 1;
    //! results are bit-identical either way.
    bool cluster = false;
    bool fuse_stage2 = true;  //!< Stage 2 as one kernel (GluDownGemvOp) instead of GluGemvOp + DownGemvOp
    //! run_batch() at 2..4 tokens: Stage 2 as one kernel (BatchedGluDownGemvOp) instead of the batched GLU
    //! and down GEMVs. Off by default: measured on the H100 it is up to 8 % slower at B = 4 on the Qwen3
    //! shapes and 2.5 % faster on 14B at B = 2 (batched_glu_down.cuh). Results are deterministic either
    //! way, not bit-identical between the two (the down GEMV's split-K partials are ranges of the union,
    //! not chunks of d_ff).
    bool fuse_batch_stage2 = false;
    //! Stage 1's grid, where smaller than the GPU holds, runs at most ceil(blocks / SMs) per SM. On by
    //! default: the 1.7B FFN is 0.4-2.5 us faster on the H100; results are bit-identical either way.
    bool spread = true;
    //! Launch the fused Stage 2s (batch 1 and batched) cooperatively (GluDownGemvOp::Options::cooperative);
    //! turn off only where a platform rejects cooperative launches.
    bool cooperative = true;
    //! Stage 1 reads the workspace header (core/workspace.cuh): a workspace never initialized, holding
    //! garbage or last used at another shape then gives the exact dense y and is flagged, never a hang.
    //! Off skips that read (about 0.1 us of Stage 1, 1 % of the FFN on the small Qwen3 shapes, H100:
    //! docs/benchmarks.md). Turn it off only where every workspace is initialized once and serves one
    //! shape: without the check a dirty workspace can give wrong results or hang the fused Stage 2.
    bool check_workspace = true;
    //! A scaled Stage-2 format (FP8): plan() checks every scale of W_gate, W_up and W_down^T on the device
    //! (finite and > 0, else kErrorInvalidScale): one small kernel per matrix on cudaStreamPerThread, which
    //! plan() synchronizes (plan time only; never while capturing). Off: the caller has checked them
    //! (fp8::check_scales_device at load). Nothing to check for fp16/bf16 weights.
    bool check_scales = true;
  };

  /**
   * @brief The launch options plan() gives an op for `p`: PDL for every op; clusters and the spread for
   * a Stage-1 op (ProxyGemvOp, any format); the cooperative launch for a fused Stage 2. The tuner times
   * its candidates with these (prox_tuning), and benches plan standalone ops with them.
   */
  template <class Op>
  static typename Op::Options op_options(const PlanOptions& p) noexcept {
    typename Op::Options o;
    o.pdl = p.pdl;
    if constexpr (detail::HasStage1Knobs<typename Op::Options>::value) {
      o.cluster = p.cluster;
      o.spread = p.spread;
    }
    if constexpr (detail::HasCooperative<typename Op::Options>::value) o.cooperative = p.cooperative;
    return o;
  }

  //! Optional outputs of run(): device pointers; null = not wanted.
  struct Outputs {
    SparsityCounters* counters = nullptr;   //!< accumulated runtime sparsity statistics (8-byte aligned)
    std::uint32_t* channel_mask = nullptr;  //!< [d_ff/32] the selected channels (bit j%32 of word j/32)
    float* s_proxy = nullptr;               //!< [d_ff] s~ of every channel (Stage 1's proxy values)
    float* s = nullptr;                     //!< [d_ff] s_j = u_j act(g_j) for selected j, +0 for the others
  };

  /**
   * @brief Bytes of workspace a layer of this shape needs: the same for fp16 and bf16, SiLU and GeLU,
   * every policy, fused Stage 2 or not, on any device. Layout: SparseFfn::Layout (header and sync
   * words as core/workspace.cuh describes them, then the mask, s and the shared scratch).
   */
  static std::size_t workspace_bytes(int d_model, int d_ff) noexcept { return Layout(d_model, d_ff, 1).total; }
  //! Bytes of workspace for up to `max_tokens` tokens per call (Config::max_tokens); 1 gives the above.
  static std::size_t workspace_bytes(int d_model, int d_ff, int max_tokens) noexcept {
    return Layout(d_model, d_ff, max_tokens).total;
  }
  static std::size_t workspace_bytes(const Config& c) noexcept {
    return workspace_bytes(c.d_model, c.d_ff, c.max_tokens);
  }
  //! workspace_bytes() of the planned shape (0 when not planned).
  std::size_t workspace_bytes() const noexcept { return planned_ ? layout_.total : 0; }

  /**
   * @brief Validate shapes, pointers and thresholds; choose the policies; fix every launch. Reads the
   * current device once. Not capturable; call it before capture. On failure the object is left
   * unplanned (run() returns kErrorNotPlanned) and config() / workspace_bytes() reset.
   */
  Status plan(const Config& cfg, const Weights& w, const PlanOptions& opts = {}) noexcept;

  /**
   * @brief Run the layer on one token: y = FFN(x). Launches 2 kernels on `stream` (3 without fusion).
   * @param x [d_model] device, 16-byte aligned; may alias y (x is read before y is written)
   * @param y [d_model] device, 16-byte aligned (every element written)
   * @param workspace workspace_bytes() of device memory, 16-byte aligned, initialized once
   *        (initialize_workspace); shared by every layer of the shape that runs on this stream
   * @param out optional outputs (mask, s~, s, counters)
   */
  Status run(const T* x, T* y, void* workspace, std::size_t workspace_size, cudaStream_t stream,
             const Outputs& out = {}) const noexcept;
  //! run() with only the counters output.
  Status run(const T* x, T* y, void* workspace, std::size_t workspace_size, cudaStream_t stream,
             SparsityCounters* counters) const noexcept {
    Outputs o;
    o.counters = counters;
    return run(x, y, workspace, workspace_size, stream, o);
  }

  //! Optional outputs of run_batch(): device pointers, token-major; null = not wanted.
  struct BatchOutputs {
    //! Accumulated statistics: counters[b] for token b and counters[tokens] for the union (the inputs
    //! any token kept, the channels any token selected), so tokens + 1 entries. With tokens = 1 (the
    //! batch-1 kernels) only counters[0] is written: one token is its own union.
    SparsityCounters* counters = nullptr;
    std::uint32_t* channel_mask = nullptr;  //!< [tokens][d_ff/32] each token's selected channels
    float* s_proxy = nullptr;               //!< [tokens][d_ff] each token's s~
    float* s = nullptr;                     //!< [tokens][d_ff] each token's s (+0 off its channel set)
  };

  /**
   * @brief Run the layer on `tokens` tokens at once (1..Config::max_tokens): y[b] = FFN(x[b]), each
   * token with its own input set, channel set and exact Stage 2, as run() would give it; every weight
   * row is read once when any token needs it (Stage 1 streams the union of the kept inputs, Stage 2 the
   * union of the channel sets). tokens = 1 runs run()'s kernels. For 2..8 tokens launches 3 kernels (batched
   * Stage 1, GLU, down; 2 for 2..4 tokens with PlanOptions::fuse_batch_stage2: the fused batched Stage 2).
   * Allocates nothing, never synchronizes; capturable. Deterministic, not bit-identical to run() (batched.cuh
   * says why).
   * @param x [tokens][d_model] device, 16-byte aligned; may alias y (x is read before y is written)
   * @param y [tokens][d_model] device, 16-byte aligned (every element written)
   * @param workspace workspace_bytes(config()) bytes, initialized once (shared with run())
   */
  Status run_batch(const T* x, T* y, int tokens, void* workspace, std::size_t workspace_size, cudaStream_t stream,
                   const BatchOutputs& out = {}) const noexcept;

  /**
   * @brief Stage 1 alone in values mode: s_proxy[j] = s~_j for every channel (calibration of tau_s,
   * analysis); the channel mask (with this plan's tau_s) goes to the workspace as usual.
   */
  Status run_proxy_values(const T* x, float* s_proxy, void* workspace, std::size_t workspace_size,
                          cudaStream_t stream) const noexcept;

  bool planned() const noexcept { return planned_; }
  const Config& config() const noexcept { return cfg_; }
  const Weights& weights() const noexcept { return w_; }
  //! The options of the plan, with `choice` holding the policies plan() fixed: plan(config(), weights(),
  //! plan_options()) re-makes the same plan (calib::calibrate_layer re-plans so).
  const PlanOptions& plan_options() const noexcept { return opts_; }
  PolicyChoice choice() const noexcept { return opts_.choice; }
  bool fused_stage2() const noexcept { return opts_.fuse_stage2; }
  //! The planned stages (their policies and launch configurations: benches, tests). Their args() hold
  //! stand-ins for the per-token pointers (x, mask, s, y point into W_gate): launch them only with
  //! arguments of your own (Operator::run(args, ...)), never with run(workspace, ...).
  const Operator<Stage1Op>& stage1() const noexcept { return stage1_; }
  const Operator<FusedStage2Op>& fused_stage2_op() const noexcept { return fused_; }
  const Operator<GluOp>& glu_op() const noexcept { return glu_; }
  const Operator<DownOp>& down_op() const noexcept { return down_; }

  //! Nothing planned: the fused batched Stage 2 of capacity 8 (which does not exist).
  struct NoStage {};
  //! Whether token capacity B has a fused Stage 2 (2 and 4: batched_glu_down.cuh).
  template <int B>
  static constexpr bool kFusedBatch = B <= 4;
  //! The planned batched ops of token capacity B (2, 4, 8): planned when Config::max_tokens needs them.
  //! Stage 2 is `fused` where PlanOptions::fuse_batch_stage2 and kFusedBatch<B>, else `glu` and `down`; only
  //! the one that runs is planned.
  template <int B>
  struct BatchStages {
    Operator<BatchedProxyGemvOp<T, Act, B>> proxy{};
    Operator<BatchedGluGemvOp<T, Act, B, WFmt>> glu{};
    Operator<BatchedDownGemvOp<T, B, WFmt>> down{};
    std::conditional_t<kFusedBatch<B>, Operator<BatchedGluDownGemvOp<T, Act, B, WFmt>>, NoStage> fused{};
  };
  //! Whether run_batch() runs the fused Stage 2 at token capacity B.
  template <int B>
  bool fused_batch() const noexcept {
    return kFusedBatch<B> && opts_.fuse_batch_stage2;
  }
  //! Whether this layer's proxy format has the batched path (INT4 only).
  static constexpr bool kBatched = std::is_same_v<ProxyFmt, Int4Weights>;

 private:
  //! Workspace layout of a shape: header, Stage-1 sync words, Stage-2 sync words (fused barrier, then
  //! the down counters that the fused and the unfused Stage 2 share), mask, s, and one scratch region
  //! for the split-K partials of every kernel (each writes its partials only after its PDL wait, when
  //! the previous kernel, the last reader, has completed).
  //! With max_tokens > 1 the mask region holds max_tokens masks and their union, s max_tokens vectors,
  //! and the scratch the batched ops' partials too; the sync regions are the same (the batched ops use
  //! their batch-1 counterparts' counter regions), so the layout tag is the same.
  struct Layout {
    std::size_t stage1_sync = 0, stage2_sync = 0, mask = 0, union_mask = 0, s = 0, scratch = 0, total = 0;
    int stage2_sync_words = 0;
    Layout() = default;
    Layout(int d_model, int d_ff, int max_tokens) noexcept {
      typename Stage1Op::Args a1;
      a1.d_model = d_model;
      a1.d_ff = d_ff;
      typename FusedStage2Op::Args a2;
      a2.d_model = d_model;
      a2.d_ff = d_ff;
      typename DownOp::Args a3;
      a3.d_model = d_model;
      a3.d_ff = d_ff;
      const WorkspaceNeeds n1 = Stage1Op::workspace_needs(a1);
      const WorkspaceNeeds n2 = FusedStage2Op::workspace_needs(a2);
      const WorkspaceNeeds n3 = DownOp::workspace_needs(a3);
      constexpr std::size_t kA = detail::kWorkspaceAlign;
      stage1_sync = detail::kHeaderBytes;
      stage2_sync = stage1_sync + round_up(n1.sync, kA);
      // The fused Stage 2's sync words are its barrier, then down counters laid out as DownOp's.
      stage2_sync_words = static_cast<int>(n2.sync / sizeof(std::uint32_t));
      const int tokens = max_tokens > 1 ? max_tokens : 1;
      const std::size_t words = static_cast<std::size_t>(d_ff / 32);
      mask = stage2_sync + round_up(n2.sync, kA);
      union_mask = mask + sizeof(std::uint32_t) * words * tokens;
      s = mask + round_up(sizeof(std::uint32_t) * words * (tokens > 1 ? tokens + 1 : 1), kA);
      scratch = s + round_up(sizeof(float) * static_cast<std::size_t>(d_ff) * tokens, kA);
      std::size_t sc = n1.scratch > n2.scratch ? n1.scratch : n2.scratch;
      sc = n3.scratch > sc ? n3.scratch : sc;
      if (tokens > 1) {
        const std::size_t b = batched_scratch(d_model, d_ff, batch_capacity(tokens));
        sc = b > sc ? b : sc;
      }
      total = scratch + round_up(sc, kA);
      // n3.sync is n2.sync less the barrier: the unfused down counters sit after the fused barrier.
    }
  };

  /**
   * @brief What plan() puts where run() later puts a call's own pointers (x, the masks, s, y): W_gate's
   * address, 16-byte aligned and non-null (a null W_gate is reported as such), never dereferenced.
   */
  struct Standins {
    const T* x;
    std::uint32_t* mask;
    float* s;
    T* y;
    explicit Standins(const Weights& w) noexcept {
      void* p = const_cast<void*>(static_cast<const void*>(WFmt::data(w.gate)));
      x = static_cast<const T*>(p);
      mask = static_cast<std::uint32_t*>(p);
      s = static_cast<float*>(p);
      y = static_cast<T*>(p);
    }
  };
  //! The planned arguments of a Stage 1 (batch 1 or batched): shape, thresholds, proxies, stand-ins.
  template <class A>
  static A stage1_args(const Config& cfg, const Weights& w, const Standins& p) noexcept {
    A a1;
    a1.x = p.x;
    a1.d_model = cfg.d_model;
    a1.d_ff = cfg.d_ff;
    a1.tau_x = cfg.tau_x;
    a1.tau_s = cfg.tau_s;
    a1.thresholds = cfg.thresholds;
    a1.gate = w.proxy_gate;
    a1.up = w.proxy_up;
    a1.channel_mask = p.mask;
    return a1;
  }
  //! The planned arguments of a GLU GEMV (batch 1 or batched): shape, W_gate, W_up, stand-ins.
  template <class A>
  static A glu_args(const Config& cfg, const Weights& w, const Standins& p) noexcept {
    A g;
    g.x = p.x;
    g.d_model = cfg.d_model;
    g.d_ff = cfg.d_ff;
    g.w_gate = w.gate;
    g.w_up = w.up;
    g.channel_mask = p.mask;
    g.s = p.s;
    return g;
  }
  //! The planned arguments of a down GEMV (batch 1 or batched; the caller sets its mask): shape, W_down^T,
  //! stand-ins.
  template <class A>
  static A down_args(const Config& cfg, const Weights& w, const Standins& p) noexcept {
    A d;
    d.s = p.s;
    d.w_down_t = w.down_t;
    d.d_model = cfg.d_model;
    d.d_ff = cfg.d_ff;
    d.y = p.y;
    return d;
  }

  Status plan_impl(const Config& cfg, const Weights& w, const PlanOptions& opts) noexcept;
  template <int B>
  Status plan_batch(BatchStages<B>& st, const Config& cfg, const Weights& w, const PlanOptions& opts,
                    const DeviceInfo& dev) noexcept;
  template <int B>
  Status launch_batch(const BatchStages<B>& st, const T* x, T* y, int tokens, char* ws, cudaStream_t stream,
                      const BatchOutputs& out) const noexcept;

  //! Scratch of the batched ops of capacity B and below (the partials grow with B).
  static std::size_t batched_scratch(int d_model, int d_ff, int capacity) noexcept {
    std::size_t sc = 0;
    const auto add = [&](auto op) {
      using Op = decltype(op);
      typename Op::Args a;
      a.d_model = d_model;
      a.d_ff = d_ff;
      const std::size_t n = Op::workspace_needs(a).scratch;
      sc = n > sc ? n : sc;
    };
    add(BatchedProxyGemvOp<T, Act, 2>{});
    add(BatchedDownGemvOp<T, 2, WFmt>{});
    add(BatchedGluDownGemvOp<T, Act, 2, WFmt>{});
    if (capacity >= 4) {
      add(BatchedProxyGemvOp<T, Act, 4>{});
      add(BatchedDownGemvOp<T, 4, WFmt>{});
      add(BatchedGluDownGemvOp<T, Act, 4, WFmt>{});
    }
    if (capacity >= 8) {
      add(BatchedProxyGemvOp<T, Act, 8>{});
      add(BatchedDownGemvOp<T, 8, WFmt>{});
    }
    return sc;
  }

  //! Stage 1's view of the workspace: its counters and the shared scratch; a header found not ready
  //! makes it reset Stage 2's sync words too.
  OpWorkspace stage1_view(char* ws) const noexcept {
    OpWorkspace v;
    v.sync = reinterpret_cast<std::uint32_t*>(ws + layout_.stage1_sync);
    v.scratch = ws + layout_.scratch;
    if (opts_.check_workspace) v.guard.check = reinterpret_cast<std::uint32_t*>(ws);
    v.guard.tag = tag_;
    v.guard.reset = reinterpret_cast<std::uint32_t*>(ws + layout_.stage2_sync);
    v.guard.reset_words = layout_.stage2_sync_words;
    return v;
  }
  Status check_run(const T* x, const void* out, const void* workspace, std::size_t workspace_size) const noexcept {
    if (!planned_) return Status::kErrorNotPlanned;
    if (x == nullptr || out == nullptr) return Status::kErrorNullPointer;
    PROX_RETURN_IF_ERROR(detail::check_workspace(workspace, workspace_size, layout_.total));
    return is_aligned(x, 16) ? Status::kSuccess : Status::kErrorMisalignedPointer;
  }

  Config cfg_{};
  Weights w_{};
  PlanOptions opts_{};
  Layout layout_{};
  std::uint32_t tag_ = 0;
  bool planned_ = false;
  Operator<Stage1Op> stage1_{};
  Operator<FusedStage2Op> fused_{};
  Operator<GluOp> glu_{};
  Operator<DownOp> down_{};
  BatchStages<2> batch2_{};
  BatchStages<4> batch4_{};
  BatchStages<8> batch8_{};
};

// The members that launch or plan kernels are defined out of the class, so they are not inline: an
// explicit instantiation declaration (PROX_SPARSE_FFN_EXTERN, prox/instantiate.cuh) then keeps a
// translation unit from instantiating them, and with them every kernel of the layer.

template <class T, class Act, class ProxyFmt, class WFmt>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::plan(const Config& cfg, const Weights& w, const PlanOptions& opts) noexcept {
  const Status st = plan_impl(cfg, w, opts);
  if (st != Status::kSuccess) *this = SparseFfn{};  // unplanned: run() cannot use a stale plan
  return st;
}

template <class T, class Act, class ProxyFmt, class WFmt>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::plan_impl(const Config& cfg, const Weights& w, const PlanOptions& opts) noexcept {
  const PolicyChoice& c = opts.choice;
  if (cfg.max_tokens < 1 || cfg.max_tokens > kMaxBatchTokens || (cfg.max_tokens > 1 && !kBatched))
    return Status::kErrorInvalidArgument;
  if (c.proxy >= ProxyPolicies::kSize || c.glu >= GluPolicies::kSize || c.down >= DownPolicies::kSize ||
      c.glu_down >= GluDownPolicies::kSize)
    return Status::kErrorInvalidArgument;
  // Every op is planned with a stand-in for the per-token pointers (x, mask, s, y), which run() fills
  // in; can_implement() sees the real weights and shape. Only the Stage 2 that will run is planned.
  const Standins p(w);
  const auto a1 = stage1_args<typename Stage1Op::Args>(cfg, w, p);
  const auto g = glu_args<typename GluOp::Args>(cfg, w, p);
  typename FusedStage2Op::Args f;
  static_cast<typename GluOp::Args&>(f) = g;
  f.w_down_t = w.down_t;
  f.y = p.y;
  auto d = down_args<typename DownOp::Args>(cfg, w, p);
  d.channel_mask = p.mask;
  // The ops' own rules, every one before the device is asked anything.
  PROX_RETURN_IF_ERROR(Stage1Op::can_implement(a1));
  if (opts.fuse_stage2) {
    PROX_RETURN_IF_ERROR(FusedStage2Op::can_implement(f));
  } else {
    PROX_RETURN_IF_ERROR(GluOp::can_implement(g));
    PROX_RETURN_IF_ERROR(DownOp::can_implement(d));
  }
  DeviceInfo dev;
  PROX_RETURN_IF_ERROR(query_device(&dev));  // once, for every stage
  if (opts.check_scales) {  // the weights' values the plan can see (a scaled format's scales)
    const cudaStream_t s = cudaStreamPerThread;
    PROX_RETURN_IF_ERROR(WFmt::check_values(w.gate, cfg.d_ff, cfg.d_model, WeightOrientation::kOutIn, s));
    PROX_RETURN_IF_ERROR(WFmt::check_values(w.up, cfg.d_ff, cfg.d_model, WeightOrientation::kOutIn, s));
    PROX_RETURN_IF_ERROR(WFmt::check_values(w.down_t, cfg.d_ff, cfg.d_model, WeightOrientation::kInOut, s));
  }

  // With PDL every kernel waits (griddepcontrol.wait) before reading its inputs or writing anything.
  PROX_RETURN_IF_ERROR(stage1_.initialize(a1, op_options<Stage1Op>(opts), c.proxy, dev));
  opts_ = opts;
  opts_.choice = PolicyChoice{};
  opts_.choice.proxy = stage1_.policy();
  if (opts.fuse_stage2) {
    PROX_RETURN_IF_ERROR(fused_.initialize(f, op_options<FusedStage2Op>(opts), c.glu_down, dev));
    opts_.choice.glu_down = fused_.policy();
  } else {
    PROX_RETURN_IF_ERROR(glu_.initialize(g, op_options<GluOp>(opts), c.glu, dev));
    PROX_RETURN_IF_ERROR(down_.initialize(d, op_options<DownOp>(opts), c.down, dev));
    opts_.choice.glu = glu_.policy();
    opts_.choice.down = down_.policy();
  }
  if constexpr (kBatched) {
    if (cfg.max_tokens > 1) PROX_RETURN_IF_ERROR(plan_batch(batch2_, cfg, w, opts, dev));
    if (cfg.max_tokens > 2) PROX_RETURN_IF_ERROR(plan_batch(batch4_, cfg, w, opts, dev));
    if (cfg.max_tokens > 4) PROX_RETURN_IF_ERROR(plan_batch(batch8_, cfg, w, opts, dev));
  }
  cfg_ = cfg;
  w_ = w;
  layout_ = Layout(cfg.d_model, cfg.d_ff, cfg.max_tokens);
  tag_ = detail::layout_tag(cfg.d_model, cfg.d_ff);
  planned_ = true;
  return Status::kSuccess;
}

template <class T, class Act, class ProxyFmt, class WFmt>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::run(const T* x, T* y, void* workspace, std::size_t workspace_size,
                                        cudaStream_t stream, const Outputs& out) const noexcept {
  PROX_RETURN_IF_ERROR(check_run(x, y, workspace, workspace_size));
  if (!is_aligned(y, 16) || !is_aligned(out.counters, 8) || !is_aligned(out.channel_mask, 4) ||
      !is_aligned(out.s_proxy, 4) || !is_aligned(out.s, 4))
    return Status::kErrorMisalignedPointer;
  char* ws = static_cast<char*>(workspace);
  std::uint32_t* mask =
      out.channel_mask != nullptr ? out.channel_mask : reinterpret_cast<std::uint32_t*>(ws + layout_.mask);
  float* s = out.s != nullptr ? out.s : reinterpret_cast<float*>(ws + layout_.s);
  // The planned arguments, with this token's pointers in place of plan()'s stand-ins.
  typename Stage1Op::Args a1 = stage1_.args();
  a1.x = x;
  a1.channel_mask = mask;
  a1.s_proxy = out.s_proxy;
  a1.counters = out.counters;
  PROX_RETURN_IF_ERROR(stage1_.launch(a1, stage1_view(ws), stream));

  // Stage 2 runs after Stage 1 has completed (its PDL wait), so it marks the workspace ready.
  WorkspaceGuard stamp;
  stamp.stamp = reinterpret_cast<std::uint32_t*>(ws);
  stamp.tag = tag_;
  auto* stage2_sync = reinterpret_cast<std::uint32_t*>(ws + layout_.stage2_sync);
  if (opts_.fuse_stage2) {
    typename FusedStage2Op::Args f = fused_.args();
    f.x = x;
    f.channel_mask = mask;
    f.s = s;
    f.y = y;
    OpWorkspace v;
    v.sync = stage2_sync;
    v.scratch = ws + layout_.scratch;
    v.guard = stamp;
    return fused_.launch(f, v, stream);
  }
  typename GluOp::Args g = glu_.args();
  g.x = x;
  g.channel_mask = mask;
  g.s = s;
  OpWorkspace vg;
  vg.guard = stamp;
  PROX_RETURN_IF_ERROR(glu_.launch(g, vg, stream));
  typename DownOp::Args d = down_.args();
  d.s = s;
  d.channel_mask = mask;
  d.y = y;
  OpWorkspace vd;
  vd.sync = stage2_sync + detail::kBarrierWords;  // the down counters the fused Stage 2 also uses
  vd.scratch = ws + layout_.scratch;
  return down_.launch(d, vd, stream);
}

template <class T, class Act, class ProxyFmt, class WFmt>
template <int B>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::plan_batch(BatchStages<B>& st, const Config& cfg, const Weights& w,
                                               const PlanOptions& opts, const DeviceInfo& dev) noexcept {
  // Stand-ins for the per-call pointers, as plan_impl's.
  const Standins p(w);
  auto a1 = stage1_args<typename BatchedProxyGemvOp<T, Act, B>::Args>(cfg, w, p);
  a1.tokens = B;
  a1.union_mask = p.mask;
  auto g = glu_args<typename BatchedGluGemvOp<T, Act, B, WFmt>::Args>(cfg, w, p);
  g.tokens = B;
  g.union_mask = p.mask;
  auto d = down_args<typename BatchedDownGemvOp<T, B, WFmt>::Args>(cfg, w, p);
  d.union_mask = p.mask;
  d.tokens = B;
  PROX_RETURN_IF_ERROR(st.proxy.initialize(a1, op_options<BatchedProxyGemvOp<T, Act, B>>(opts), -1, dev));
  if constexpr (kFusedBatch<B>) {
    if (opts.fuse_batch_stage2) {
      using FusedOp = BatchedGluDownGemvOp<T, Act, B, WFmt>;
      typename FusedOp::Args f;
      static_cast<typename BatchedGluGemvOp<T, Act, B, WFmt>::Args&>(f) = g;
      f.w_down_t = w.down_t;
      f.y = d.y;
      return st.fused.initialize(f, op_options<FusedOp>(opts), -1, dev);
    }
  }
  PROX_RETURN_IF_ERROR(st.glu.initialize(g, op_options<BatchedGluGemvOp<T, Act, B, WFmt>>(opts), -1, dev));
  return st.down.initialize(d, op_options<BatchedDownGemvOp<T, B, WFmt>>(opts), -1, dev);
}

template <class T, class Act, class ProxyFmt, class WFmt>
template <int B>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::launch_batch(const BatchStages<B>& st, const T* x, T* y, int tokens, char* ws,
                                                 cudaStream_t stream, const BatchOutputs& out) const noexcept {
  std::uint32_t* mask =
      out.channel_mask != nullptr ? out.channel_mask : reinterpret_cast<std::uint32_t*>(ws + layout_.mask);
  auto* union_mask = reinterpret_cast<std::uint32_t*>(ws + layout_.union_mask);
  float* s = out.s != nullptr ? out.s : reinterpret_cast<float*>(ws + layout_.s);
  typename BatchedProxyGemvOp<T, Act, B>::Args a1 = st.proxy.args();
  a1.x = x;
  a1.tokens = tokens;
  a1.channel_mask = mask;
  a1.union_mask = union_mask;
  a1.s_proxy = out.s_proxy;
  a1.counters = out.counters;
  PROX_RETURN_IF_ERROR(st.proxy.launch(a1, stage1_view(ws), stream));
  WorkspaceGuard stamp;  // Stage 1 has completed (Stage 2's PDL wait): mark the workspace ready
  stamp.stamp = reinterpret_cast<std::uint32_t*>(ws);
  stamp.tag = tag_;
  auto* stage2_sync = reinterpret_cast<std::uint32_t*>(ws + layout_.stage2_sync);
  // The GLU's per-call arguments, for the batched GLU GEMV and the fused batched Stage 2 alike.
  const auto bind_glu = [&](BatchedGluGemvArgs<T, WFmt>& g) {
    g.x = x;
    g.tokens = tokens;
    g.channel_mask = mask;
    g.union_mask = union_mask;
    g.s = s;
  };
  if constexpr (kFusedBatch<B>) {
    if (fused_batch<B>()) {
      typename BatchedGluDownGemvOp<T, Act, B, WFmt>::Args f = st.fused.args();
      bind_glu(f);
      f.y = y;
      OpWorkspace v;
      v.sync = stage2_sync;  // the barrier, then the down counters (as the batch-1 fused Stage 2)
      v.scratch = ws + layout_.scratch;
      v.guard = stamp;
      return st.fused.launch(f, v, stream);
    }
  }
  typename BatchedGluGemvOp<T, Act, B, WFmt>::Args g = st.glu.args();
  bind_glu(g);
  OpWorkspace vg;
  vg.guard = stamp;
  PROX_RETURN_IF_ERROR(st.glu.launch(g, vg, stream));
  typename BatchedDownGemvOp<T, B, WFmt>::Args d = st.down.args();
  d.s = s;
  d.union_mask = union_mask;
  d.tokens = tokens;
  d.y = y;
  OpWorkspace vd;
  vd.sync = stage2_sync + detail::kBarrierWords;
  vd.scratch = ws + layout_.scratch;
  return st.down.launch(d, vd, stream);
}

template <class T, class Act, class ProxyFmt, class WFmt>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::run_batch(const T* x, T* y, int tokens, void* workspace,
                                              std::size_t workspace_size, cudaStream_t stream,
                                              const BatchOutputs& out) const noexcept {
  PROX_RETURN_IF_ERROR(check_run(x, y, workspace, workspace_size));
  if (tokens < 1 || tokens > cfg_.max_tokens) return Status::kErrorInvalidArgument;
  if (!is_aligned(y, 16) || !is_aligned(out.counters, 8) || !is_aligned(out.channel_mask, 4) ||
      !is_aligned(out.s_proxy, 4) || !is_aligned(out.s, 4))
    return Status::kErrorMisalignedPointer;
  if (tokens == 1) {
    Outputs o;
    o.counters = out.counters;
    o.channel_mask = out.channel_mask;
    o.s_proxy = out.s_proxy;
    o.s = out.s;
    return run(x, y, workspace, workspace_size, stream, o);
  }
  if constexpr (kBatched) {
    char* ws = static_cast<char*>(workspace);
    if (tokens <= 2) return launch_batch(batch2_, x, y, tokens, ws, stream, out);
    if (tokens <= 4) return launch_batch(batch4_, x, y, tokens, ws, stream, out);
    return launch_batch(batch8_, x, y, tokens, ws, stream, out);
  } else {
    return Status::kErrorInvalidArgument;  // unreachable: plan() refuses max_tokens > 1 without INT4
  }
}

template <class T, class Act, class ProxyFmt, class WFmt>
Status SparseFfn<T, Act, ProxyFmt, WFmt>::run_proxy_values(const T* x, float* s_proxy, void* workspace,
                                                     std::size_t workspace_size,
                                                     cudaStream_t stream) const noexcept {
  PROX_RETURN_IF_ERROR(check_run(x, s_proxy, workspace, workspace_size));
  if (!is_aligned(s_proxy, 4)) return Status::kErrorMisalignedPointer;
  char* ws = static_cast<char*>(workspace);
  typename Stage1Op::Args a1 = stage1_.args();
  a1.x = x;
  a1.channel_mask = reinterpret_cast<std::uint32_t*>(ws + layout_.mask);
  a1.s_proxy = s_proxy;
  return stage1_.launch(a1, stage1_view(ws), stream);
}

PROX_NAMESPACE_END
