// SPDX-License-Identifier: Apache-2.0
//! @file prox_bench.cu  Google Benchmark suite: the full Prox FFN and each of its ops at the Qwen3
//! FFN shapes, fp16 and bf16, targets e = 40..70 %, against cuBLAS dense (GEMV and SwiGLU FFN)
//! measured in the same process, with a copy-bandwidth ceiling measured at startup.
//!
//! Benchmark names: <bench>/<model>/<dtype>[/e<target %>], e.g. prox_ffn/Qwen3-8B/f16/e70
//!   dense_ffn        cuBLAS SwiGLU FFN (3 GEMVs + act-mul kernel)     bytes: 3 d_model d_ff 2
//!   dense_gemv_up    cuBLAS GEMV, W_up   [d_ff][d_model]              bytes: d_model d_ff 2
//!   dense_gemv_down  cuBLAS GEMV, W_down [d_model][d_ff]              bytes: d_model d_ff 2
//!   prox_ffn         prox::SparseFfn<T, SiLU> (Int4 proxies), 2 kernels  bytes: Stage 1 + GLU + down
//!   ffn_paired       prox_ffn and dense_ffn replayed in alternation (dense first in even pairs, Prox first
//!                    in odd ones): t_us and dense_us are the medians of the pairs, speedup_vs_dense their
//!                    ratio, speedup_pair_median / _min / _max over the per-pair ratios. Both see the same
//!                    GPU state, so the ratio does not carry the drift between separate benchmarks
//!   prox_stage2      Stage 2 as the FFN runs it (glu_down_gemv, fused) on Stage 1's precomputed masks
//!   stage2_unfused   glu_gemv + down_gemv (two kernels) on the same masks: what the fusion saves
//!   stage2_empty     Stage 2 as the FFN runs it on an all-zero mask: no weight byte is read, so its
//!                    time is Stage 2's fixed cost (the counterpart of proxy_int4_empty)
//!   threshold        threshold op on x (mask + compacted indices)      bytes: d_model 2
//!   proxy_int4       proxy_gemv<Int4Weights> (Stage 1 alone)           bytes: kept rows d_ff/2 2 + 8 d_ff + x
//!   proxy_int4_empty Stage 1 with tau_x = +inf (no input kept): Stage 1's fixed cost
//!   glu              glu_gemv on Stage 1's masks                        bytes: selected d_model 2 2
//!   down             down_gemv on Stage 1's masks and s                 bytes: selected d_model 2
//!   glu_empty, down_empty  glu / down on an all-zero mask: their fixed costs
//!   ffn_empty        the FFN as prox_ffn plans it (same policies), thresholds +inf: no input kept, no
//!                    channel selected, no weight byte read: the whole FFN's fixed cost
//!   attn_gemv        cuBLAS GEMV of an attention output projection W_o [d_model][d_model]
//!   chain_dense      attn_gemv then dense_ffn, per launch, in one graph
//!   chain_ffn        attn_gemv then prox_ffn, per launch, in one graph (Stage 1 PDL-launched after the
//!                    GEMV, as an engine runs the layer): ffn_us = t_us - gemv_us is the FFN's cost in
//!                    that sequence; speedup_vs_dense against chain_dense, ffn_speedup against
//!                    chain_dense's FFN part (chain_dense_us - gemv_us)
//!   chain_ffn_empty  attn_gemv then ffn_empty: ffn_us is the fixed cost inside the sequence
//!   fp8_ffn, fp8_dense  FP8 e4m3 Stage-2 weights (--prox_fp8): see "FP8 Stage-2 weights" below
//! Every bench reports per-launch time from CUDA-graph replays (UseManualTime) and the counters
//! t_us, bytes_needed, GBps, copy_GBps, frac_copy; sparse benches add s1, s2, e_hat (measured with
//! SparsityCounters on the real masks); the FFN and Stage-2 benches add speedup_vs_dense and dense_us
//! against dense_ffn, and the op benches against the cuBLAS GEMVs the op stands for: glu and proxy_int4
//! against two dense_gemv_up (gate and up), down against dense_gemv_down. docs/benchmarks.md explains.
//!
//! Own flags (before or after Google Benchmark's): --prox_shapes=8B,14B --prox_dtypes=f16,bf16
//! --prox_targets=40,50,60,70 --prox_iterations=N --prox_warmup=N --prox_tokens=N
//! --prox_min_launches=N --prox_rotate_gb=G --prox_max_device_gb=G --prox_policy=P,G,D[,F]
//! --prox_fuse=0|1 --prox_cluster=0|1 --prox_spread=0|1 --prox_check_workspace=0|1 --prox_tuning=FILE
//! --prox_commit=SHA --prox_fp8=channel,block128 --prox_fp8_alpha=A --prox_fp8_policies=0,1,2. Use
//! --benchmark_filter=REGEX for subsets.

#include <benchmark/benchmark.h>

#include <cstdio>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.cuh"
#include "bench_loop.cuh"
#include <prox_support/dense_ffn.cuh>
#include "prox/tuning/choose.cuh"

namespace {

using prox_bench::check_workspace;
using prox_bench::DeviceBuffer;
using prox_bench::FfnShape;
using prox_bench::GraphReplay;
using prox_bench::PairedTiming;
using prox_bench::Timing;

// ---------------------------------------------------------------- options and process-wide state
struct Options {
  std::string shapes = "1.7B,4B,8B,14B,32B";
  std::string dtypes = "f16,bf16";
  std::string targets = "40,50,60,70";
  int iterations = 30;     //!< timed graph replays per benchmark
  int warmup = 3;          //!< untimed replays first
  int tokens = 8;          //!< distinct input tokens cycled through the launches
  int min_launches = 32;   //!< launches per graph (at least; a multiple of tokens)
  //! Weight bytes rotated over (at least). 4 GB gives every bench, even Stage 1 alone at e = 70 %
  //! on the 1.7B shape (3.8 MB a launch, 46 copies), > 3x the H100's 50 MB L2 between reuses.
  double rotate_gb = 4.0;
  double max_device_gb = 40.0;
  prox::PolicyChoice policy{};  //!< -1 = SparseFfn's default for the shape
  bool fuse = true;             //!< PlanOptions::fuse_stage2
  bool cluster = false;         //!< PlanOptions::cluster
  bool spread = true;           //!< PlanOptions::spread
  bool check_workspace = true;  //!< PlanOptions::check_workspace
  //! A prox-tune cache file: the plans take their policies from it (prox::tuning::choose(), read-only,
  //! at the target's densities 1 - s1 and 1 - s2); a miss keeps SparseFfn's default.
  std::string tuning;
  std::string commit;
  //! FP8 Stage-2 benches (fp8_ffn, fp8_dense) of these scale layouts: channel, block128 (empty: none).
  std::string fp8;
  //! The allocation's alpha of the FP8 plans (e is the fraction of the dense FP8 FFN's cost saved).
  double fp8_alpha = prox::fp8::kAllocationAlpha;
  //! FP8 benches once per fused Stage-2 candidate of these indices (names end in /p<i>); empty: the plan's
  //! default policy only.
  std::string fp8_policies;
};
Options g_opt;

struct Globals : prox_bench::BenchGlobals {
  std::unique_ptr<prox::tuning::Cache> tuning;  //!< --prox_tuning
};
Globals g;

//! Median seconds per launch of the dense baselines measured in this process, by bench name
//! (dense_seconds): "dense_ffn/Qwen3-8B/f16" -> s.
std::map<std::string, double> g_dense_s;

// ---------------------------------------------------------------- per-layer context (one alive at a time)
struct ContextBase {
  virtual ~ContextBase() = default;
};

template <class T>
struct SparseSetup {
  using Ffn = prox::SparseFfn<T, prox::SiLU>;
  int e_pct = 0;
  prox::StageSparsity target{};
  float tau_x = 0.0f;
  float tau_s = 0.0f;
  std::vector<Ffn> ffns;  //!< one plan per weight copy (plans hold pointers)
  //! ffns' plans with thresholds +inf (nothing kept, nothing selected): ffn_empty (made on first use).
  std::vector<Ffn> empty_ffns;
  prox::PolicyChoice choice{};
  bool pdl = false;
  bool cluster = false;
  bool fused = false;
  int fused_blocks = 0;
  std::size_t ws_bytes = 0;
  DeviceBuffer ws;  //!< the timed FFN's workspace
  //! Per token, the mask and s of the setup's FFN run (SparseFfn::Outputs): they feed the Stage-2
  //! benches. Each token's slice starts on a 256-byte boundary, as the workspace regions do.
  DeviceBuffer tok_mask, tok_s;
  std::size_t tok_mask_stride = 0, tok_s_stride = 0;
  DeviceBuffer counters;  //!< prox::SparsityCounters
  DeviceBuffer mask_scratch, s_scratch, y_scratch;
  DeviceBuffer empty_mask;  //!< all zero: nothing selected (stage2_empty)
  //! The ops the op benches launch, planned once here with the policies and options of the FFN's plan
  //! (Stage 1, and the Stage 2 it runs, are copies of ffns[0]'s planned operators).
  prox::Operator<typename Ffn::Stage1Op> proxy_op;
  prox::Operator<typename Ffn::GluOp> glu_op;
  prox::Operator<typename Ffn::DownOp> down_op;
  prox::Operator<typename Ffn::FusedStage2Op> glu_down_op;  //!< initialized when the plan fuses Stage 2
  prox::Operator<prox::ThresholdOp<T>> threshold_op;
  //! Op-only workspaces (Operator<Op>::workspace_bytes(), initialize_workspace()d once), and the views
  //! the Stage-2 launches get (prox::Operator::stage2_view()).
  DeviceBuffer proxy_ws, down_ws, glu_down_ws;
  prox::OpWorkspace glu_view, down_view, glu_down_view;
  DeviceBuffer thr_mask, thr_idx, thr_count;
  prox::SparsityReport report{};
  double kept_mean = 0.0;  //!< mean kept inputs per token (measured)
  double sel_mean = 0.0;   //!< mean selected channels per token (measured)
  std::string label;

  std::uint32_t* token_mask(int t) const {
    return tok_mask.as<std::uint32_t>(tok_mask_stride * static_cast<std::size_t>(t));
  }
  float* token_s(int t) const { return tok_s.as<float>(tok_s_stride * static_cast<std::size_t>(t)); }
};

template <class T>
struct Context : ContextBase {
  Context(const FfnShape& s, int copies)
      : shape(s),
        layer(s, copies, g_opt.tokens, /*seed=*/0x5eed0000ull + static_cast<std::uint64_t>(s.d_model) * 131 + s.d_ff,
              g.stream),
        dense(g.cublas, s.d_model, s.d_ff),
        y(sizeof(T) * s.d_model, "y"),
        gemv_out(sizeof(T) * s.d_ff, "gemv output"),
        down_in(sizeof(T) * s.d_ff, "gemv input") {
    launches = prox_bench::launches_per_graph(layer.copies(), layer.tokens(), g_opt.min_launches);
    prox_bench::fill_normal(down_in.as<T>(), static_cast<std::size_t>(s.d_ff), 0xd0ull, 1.0f, g.stream);
    PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
  }
  FfnShape shape;
  prox_bench::SyntheticLayer<T> layer;
  prox_support::DenseFfn<T, prox::SiLU> dense;
  DeviceBuffer y, gemv_out, down_in;
  int launches = 0;
  std::map<int, std::unique_ptr<SparseSetup<T>>> sparse;
  std::unique_ptr<ContextBase> fp8[2];  //!< the FP8 copies of each scale layout (--prox_fp8; fp8_set())

  //! The attention output projection the chained benches run before each FFN: W_o [d_model][d_model]
  //! in copies that rotate past L2 (>= 256 MB), its input and output (made on first use).
  struct Attn {
    int copies = 0;
    DeviceBuffer w, in, out;
  };
  const Attn& attn() {
    if (attn_) return *attn_;
    auto a = std::make_unique<Attn>();
    const std::size_t d = static_cast<std::size_t>(shape.d_model);
    const std::size_t bytes = sizeof(T) * d * d;
    a->copies =
        static_cast<int>(std::min<std::size_t>(64, std::max<std::size_t>(2, (256000000 + bytes - 1) / bytes)));
    a->w = DeviceBuffer(bytes * a->copies, "W_o copies");
    a->in = DeviceBuffer(sizeof(T) * d, "attention output");
    a->out = DeviceBuffer(sizeof(T) * d, "projected attention output");
    prox_bench::fill_normal(a->w.template as<T>(), d * d * a->copies, 0xa770ull, 0.02f, g.stream);
    prox_bench::fill_normal(a->in.template as<T>(), d, 0xa771ull, 1.0f, g.stream);
    PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
    attn_ = std::move(a);
    return *attn_;
  }

 private:
  std::unique_ptr<Attn> attn_;
};

std::string g_ctx_key;
std::unique_ptr<ContextBase> g_ctx;

template <class T>
std::string key_of(const FfnShape& s) {
  return std::string(s.name) + "/" + prox_bench::dtype_name<T>();
}

//! The layer of (shape, T): made on first use; the previous layer is freed first, so the
//! benchmarks (registered shape-major) hold one layer's copies at a time.
template <class T>
Context<T>& context_for(const FfnShape& shape) {
  const std::string key = key_of<T>(shape);
  if (g_ctx && g_ctx_key == key) return static_cast<Context<T>&>(*g_ctx);
  PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
  g_ctx.reset();
  g_ctx_key.clear();
  const std::size_t copy_bytes = prox_bench::SyntheticLayer<T>::bytes_per_copy(shape);
  const std::size_t budget = prox_bench::memory_budget(static_cast<std::size_t>(g_opt.max_device_gb * 1e9));
  // Leave room for everything else a context holds (tokens, workspaces, cuBLAS, graphs): ~5 %.
  const int copies = prox_bench::rotation_copies(copy_bytes, static_cast<std::size_t>(g_opt.rotate_gb * 1e9),
                                                 budget - budget / 20);
  auto ctx = std::make_unique<Context<T>>(shape, copies);
  std::fprintf(stderr, "[prox_bench] %s: %d weight copies x %.1f MB = %.2f GB rotated, %d launches per graph\n",
               key.c_str(), copies, copy_bytes / 1e6, copies * copy_bytes / 1e9, ctx->launches);
  Context<T>& ref = *ctx;
  g_ctx = std::move(ctx);
  g_ctx_key = key;
  return ref;
}

// ---------------------------------------------------------------- the ops' arguments for launch i
// Launch i reads weight copy i mod copies and token i mod tokens (Stage 2: that token's mask and s).

//! The GLU GEMV's arguments.
template <class T>
prox::GluGemvArgs<T> glu_args(const Context<T>& ctx, const SparseSetup<T>& sp, int i, float* s_out,
                              bool empty = false) {
  const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % ctx.layer.copies());
  const int t = i % ctx.layer.tokens();
  prox::GluGemvArgs<T> a;
  a.x = ctx.layer.token(t);
  a.d_model = ctx.shape.d_model;
  a.d_ff = ctx.shape.d_ff;
  a.w_gate = l.w_gate;
  a.w_up = l.w_up;
  a.channel_mask = empty ? sp.empty_mask.template as<const std::uint32_t>() : sp.token_mask(t);
  a.s = s_out;
  return a;
}

//! The down GEMV's arguments; s_in = nullptr reads the token's own s.
template <class T>
prox::DownGemvArgs<T> down_args(const Context<T>& ctx, const SparseSetup<T>& sp, int i, const float* s_in,
                                bool empty = false) {
  const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % ctx.layer.copies());
  const int t = i % ctx.layer.tokens();
  prox::DownGemvArgs<T> a;
  a.s = s_in != nullptr ? s_in : sp.token_s(t);
  a.channel_mask = empty ? sp.empty_mask.template as<const std::uint32_t>() : sp.token_mask(t);
  a.w_down_t = l.w_down_t;
  a.d_model = ctx.shape.d_model;
  a.d_ff = ctx.shape.d_ff;
  a.y = sp.y_scratch.template as<T>();
  return a;
}

//! The fused Stage 2's arguments (s to the scratch, as the GLU GEMV's in stage2_unfused).
template <class T>
prox::GluDownGemvArgs<T> glu_down_args(const Context<T>& ctx, const SparseSetup<T>& sp, int i, bool empty = false) {
  prox::GluDownGemvArgs<T> a;
  static_cast<prox::GluGemvArgs<T>&>(a) = glu_args(ctx, sp, i, sp.s_scratch.template as<float>(), empty);
  a.w_down_t = ctx.layer.copy(i % ctx.layer.copies()).w_down_t;
  a.y = sp.y_scratch.template as<T>();
  return a;
}

//! Stage 1's arguments (mask to the scratch); tau_x = +inf keeps no input (proxy_int4_empty).
template <class T>
prox::ProxyGemvArgs<T> proxy_args(const Context<T>& ctx, const SparseSetup<T>& sp, int i, float tau_x) {
  const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % ctx.layer.copies());
  prox::ProxyGemvArgs<T> a;
  a.x = ctx.layer.token(i % ctx.layer.tokens());
  a.d_model = ctx.shape.d_model;
  a.d_ff = ctx.shape.d_ff;
  a.tau_x = tau_x;
  a.tau_s = sp.tau_s;
  a.gate = l.proxy_gate;
  a.up = l.proxy_up;
  a.channel_mask = sp.mask_scratch.template as<std::uint32_t>();
  return a;
}

//! The threshold op's arguments: x's mask and compacted indices.
template <class T>
prox::ThresholdArgs<T> threshold_args(const Context<T>& ctx, const SparseSetup<T>& sp, int i) {
  prox::ThresholdArgs<T> a;
  a.x = ctx.layer.token(i % ctx.layer.tokens());
  a.n = ctx.shape.d_model;
  a.tau = sp.tau_x;
  a.mask = sp.thr_mask.template as<std::uint32_t>();
  a.indices = sp.thr_idx.template as<int>();
  a.count = sp.thr_count.template as<int>();
  return a;
}

//! Plan the op benches' operators and their workspaces (after the FFN plans and the token masks).
template <class T>
void setup_ops(Context<T>& ctx, SparseSetup<T>& sp, const prox::PolicyChoice& requested) {
  using Ffn = typename SparseSetup<T>::Ffn;
  const cudaStream_t s = g.stream;
  const Ffn& ffn = sp.ffns[0];
  sp.proxy_op = ffn.stage1();
  if (sp.fused) {
    sp.glu_down_op = ffn.fused_stage2_op();
    // The unfused ops (stage2_unfused, glu, down) as a plan without fusion would make them: the
    // requested index or the default for the shape, the FFN's PDL setting, one-wave GLU grid.
    PROX_BENCH_PROX(sp.glu_op.initialize(glu_args(ctx, sp, 0, sp.s_scratch.template as<float>()),
                                         Ffn::template op_options<typename Ffn::GluOp>(ffn.plan_options()),
                                         requested.glu));
    PROX_BENCH_PROX(sp.down_op.initialize(down_args(ctx, sp, 0, nullptr),
                                          Ffn::template op_options<typename Ffn::DownOp>(ffn.plan_options()),
                                          requested.down));
  } else {
    sp.glu_op = ffn.glu_op();
    sp.down_op = ffn.down_op();
  }
  sp.choice.glu = sp.glu_op.policy();
  sp.choice.down = sp.down_op.policy();
  // Policy 0 and the default options, so no PDL (its predecessor in the graph is itself).
  PROX_BENCH_PROX(sp.threshold_op.initialize(threshold_args(ctx, sp, 0), {}, 0));

  using ProxyOp = prox::Operator<typename Ffn::Stage1Op>;
  using DownOp = prox::Operator<typename Ffn::DownOp>;
  using FusedOp = prox::Operator<typename Ffn::FusedStage2Op>;
  sp.proxy_ws = DeviceBuffer(ProxyOp::workspace_bytes(proxy_args(ctx, sp, 0, sp.tau_x)), "proxy workspace");
  sp.down_ws = DeviceBuffer(DownOp::workspace_bytes(down_args(ctx, sp, 0, nullptr)), "down workspace");
  PROX_BENCH_PROX(prox::initialize_workspace(sp.proxy_ws.get(), sp.proxy_ws.bytes(), s));
  PROX_BENCH_PROX(prox::initialize_workspace(sp.down_ws.get(), sp.down_ws.bytes(), s));
  // As in SparseFfn::run: the GLU kernel stamps the header of the workspace its down kernel uses.
  sp.glu_view = prox::OpWorkspace{};
  sp.glu_view.guard.stamp = sp.down_ws.template as<std::uint32_t>();
  sp.down_view = prox::Operator<typename Ffn::DownOp>::stage2_view(sp.down_ws.get(), down_args(ctx, sp, 0, nullptr),
                                                                   /*stamp=*/false);
  if (sp.fused) {
    const prox::GluDownGemvArgs<T> f = glu_down_args(ctx, sp, 0);
    sp.glu_down_ws = DeviceBuffer(FusedOp::workspace_bytes(f), "fused Stage-2 workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(sp.glu_down_ws.get(), sp.glu_down_ws.bytes(), s));
    sp.glu_down_view =
        prox::Operator<typename Ffn::FusedStage2Op>::stage2_view(sp.glu_down_ws.get(), f, /*stamp=*/true);
  }
}

//! Every op once through the checked path (Operator::run validates the arguments and the workspace
//! size; the kernels check the header), then no workspace may be flagged: the views the timed graphs
//! use lie on workspaces known to be initialized.
template <class T>
void setup_check(Context<T>& ctx, SparseSetup<T>& sp) {
  const cudaStream_t s = g.stream;
  PROX_BENCH_PROX(sp.threshold_op.run(threshold_args(ctx, sp, 0), nullptr, 0, s));
  PROX_BENCH_PROX(sp.proxy_op.run(proxy_args(ctx, sp, 0, sp.tau_x), sp.proxy_ws.get(), sp.proxy_ws.bytes(), s));
  PROX_BENCH_PROX(sp.glu_op.run(glu_args(ctx, sp, 0, sp.s_scratch.template as<float>()), nullptr, 0, s));
  PROX_BENCH_PROX(sp.down_op.run(down_args(ctx, sp, 0, sp.s_scratch.template as<const float>()), sp.down_ws.get(),
                                 sp.down_ws.bytes(), s));
  if (sp.fused)
    PROX_BENCH_PROX(sp.glu_down_op.run(glu_down_args(ctx, sp, 0), sp.glu_down_ws.get(), sp.glu_down_ws.bytes(), s));
  check_workspace(sp.ws, "FFN workspace", s);
  check_workspace(sp.proxy_ws, "proxy workspace", s);
  check_workspace(sp.down_ws, "down workspace", s);
  if (sp.fused) check_workspace(sp.glu_down_ws, "fused Stage-2 workspace", s);
  PROX_BENCH_CUDA(cudaStreamSynchronize(s));
}

//! Calibrate, plan and measure the densities of target e (cached per context).
template <class T>
SparseSetup<T>& sparse_setup(Context<T>& ctx, int e_pct) {
  using Ffn = typename SparseSetup<T>::Ffn;
  auto it = ctx.sparse.find(e_pct);
  if (it != ctx.sparse.end()) return *it->second;
  auto sp = std::make_unique<SparseSetup<T>>();
  const FfnShape& sh = ctx.shape;
  const int K = sh.d_model;
  const int N = sh.d_ff;
  const cudaStream_t s = g.stream;
  sp->e_pct = e_pct;
  PROX_BENCH_PROX(prox::allocate_sparsity(e_pct / 100.0, &sp->target));

  // tau_x: exact |x| quantile over the bench tokens; tau_s: exact |s~| quantile of Stage 1's values.
  sp->tau_x = prox_bench::magnitude_threshold(ctx.layer.host_abs_tokens(s), sp->target.s1);
  std::vector<const T*> toks;
  for (int t = 0; t < ctx.layer.tokens(); ++t) toks.push_back(ctx.layer.token(t));
  const auto weights_of = [&](int c) { return ctx.layer.copy(c).template ffn_weights<prox::SiLU>(); };
  // Plan copy 0 first to learn the policies, then calibrate on exactly those kernels.
  typename Ffn::PlanOptions po;
  po.choice = g_opt.policy;
  po.fuse_stage2 = g_opt.fuse;
  po.cluster = g_opt.cluster;
  po.spread = g_opt.spread;
  po.check_workspace = g_opt.check_workspace;
  {
    Ffn probe;
    if (g.tuning) {  // the tuned choice at this target's densities, then any --prox_policy index on top
      typename Ffn::PlanOptions to = po;  // choose() fills the fields of po's Stage-2 form
      PROX_BENCH_PROX(prox::tuning::choose<Ffn>(*g.tuning, {K, N, sp->tau_x, 0.0f}, 1.0 - sp->target.s1,
                                                1.0 - sp->target.s2, &to, s));
      const prox::PolicyChoice tuned = to.choice;
      for (auto [field, t] : {std::pair{&po.choice.proxy, tuned.proxy}, std::pair{&po.choice.glu, tuned.glu},
                              std::pair{&po.choice.down, tuned.down}, std::pair{&po.choice.glu_down, tuned.glu_down}})
        if (*field < 0) *field = t;
    }
    PROX_BENCH_PROX(probe.plan({K, N, sp->tau_x, 0.0f}, weights_of(0), po));
    sp->choice = probe.choice();
  }
  sp->tau_s = prox_bench::calibrate_tau_s<T, prox::SiLU, prox::Int4Weights>(weights_of(0), sh, sp->tau_x,
                                                                            sp->target.s2, toks, sp->choice, s);
  sp->ffns.resize(static_cast<std::size_t>(ctx.layer.copies()));
  for (int c = 0; c < ctx.layer.copies(); ++c) {
    typename Ffn::PlanOptions pc = po;
    pc.choice = sp->choice;
    PROX_BENCH_PROX(sp->ffns[c].plan({K, N, sp->tau_x, sp->tau_s}, weights_of(c), pc));
  }
  const Ffn& ffn0 = sp->ffns[0];
  sp->pdl = ffn0.stage1().launch_config().pdl;
  sp->cluster = ffn0.plan_options().cluster && g.dev.cc_major >= 9;  // asked for and possible on the device
  sp->fused = ffn0.fused_stage2();
  sp->fused_blocks = sp->fused ? static_cast<int>(ffn0.fused_stage2_op().launch_config().grid.x) : 0;
  sp->ws_bytes = ffn0.workspace_bytes();

  const int ntok = ctx.layer.tokens();
  sp->ws = DeviceBuffer(sp->ws_bytes, "FFN workspace");
  sp->tok_mask_stride = prox_bench::align_up(sizeof(std::uint32_t) * (N / 32));
  sp->tok_s_stride = prox_bench::align_up(sizeof(float) * N);
  sp->tok_mask = DeviceBuffer(sp->tok_mask_stride * ntok, "per-token masks");
  sp->tok_s = DeviceBuffer(sp->tok_s_stride * ntok, "per-token s");
  sp->counters = DeviceBuffer(sizeof(prox::SparsityCounters), "sparsity counters");
  sp->mask_scratch = DeviceBuffer(sizeof(std::uint32_t) * (N / 32), "mask scratch");
  sp->s_scratch = DeviceBuffer(sizeof(float) * N, "s scratch");
  sp->y_scratch = DeviceBuffer(sizeof(T) * K, "y scratch");
  sp->empty_mask = DeviceBuffer(sizeof(std::uint32_t) * (N / 32), "all-zero mask");
  PROX_BENCH_CUDA(cudaMemsetAsync(sp->empty_mask.get(), 0, sp->empty_mask.bytes(), s));
  PROX_BENCH_PROX(prox::initialize_workspace(sp->ws.get(), sp->ws.bytes(), s));
  sp->thr_mask = DeviceBuffer(sizeof(std::uint32_t) * ((K + 31) / 32), "threshold mask");
  sp->thr_idx = DeviceBuffer(sizeof(int) * K, "threshold indices");
  sp->thr_count = DeviceBuffer(sizeof(int), "threshold count");

  // Real masks: one FFN run per token with SparsityCounters on; each token's mask and s are kept
  // (Outputs) for the Stage-2 benches.
  auto* counters = sp->counters.template as<prox::SparsityCounters>();
  PROX_BENCH_PROX(prox::reset_counters(counters, s));
  for (int t = 0; t < ntok; ++t) {
    typename Ffn::Outputs out;
    out.counters = counters;
    out.channel_mask = sp->token_mask(t);
    out.s = sp->token_s(t);
    PROX_BENCH_PROX(
        sp->ffns[0].run(ctx.layer.token(t), sp->y_scratch.template as<T>(), sp->ws.get(), sp->ws_bytes, s, out));
  }
  PROX_BENCH_PROX(prox::read_report(counters, K, N, s, &sp->report));
  if (sp->report.calls != static_cast<unsigned long long>(ntok))
    throw std::runtime_error("SparsityCounters counted " + std::to_string(sp->report.calls) + " calls, expected " +
                             std::to_string(ntok));
  sp->kept_mean = (1.0 - sp->report.s1) * K;
  sp->sel_mean = (1.0 - sp->report.s2) * N;
  setup_ops(ctx, *sp, po.choice);
  setup_check(ctx, *sp);
  {
    std::string names;
    prox::for_each_policy<prox::ProxyGemvPolicies>([&](auto p, int i) {
      if (i == sp->choice.proxy) names += decltype(p)::name();
    });
    if (sp->fused) {
      prox::for_each_policy<prox::GluDownGemvPolicies>([&](auto p, int i) {
        if (i == sp->choice.glu_down) names += " " + decltype(p)::name() + " x" + std::to_string(sp->fused_blocks);
      });
    } else {
      prox::for_each_policy<prox::GluGemvPolicies>([&](auto p, int i) {
        if (i == sp->choice.glu) names += " " + decltype(p)::name();
      });
      prox::for_each_policy<prox::DownGemvPolicies>([&](auto p, int i) {
        if (i == sp->choice.down) names += " " + decltype(p)::name();
      });
    }
    sp->label = names + (sp->pdl ? " pdl" : "") + (sp->cluster ? " cluster" : "");
  }
  std::fprintf(stderr,
               "[prox_bench] %s e=%d%%: target (s1, s2) = (%.3f, %.3f), tau_x = %.6g, tau_s = %.6g, "
               "measured (s1, s2, e^) = (%.4f, %.4f, %.4f); %s\n",
               key_of<T>(sh).c_str(), e_pct, sp->target.s1, sp->target.s2, sp->tau_x, sp->tau_s, sp->report.s1,
               sp->report.s2, sp->report.effective, sp->label.c_str());
  SparseSetup<T>& ref = *sp;
  ctx.sparse[e_pct] = std::move(sp);
  return ref;
}

// ---------------------------------------------------------------- the counters
template <class T>
void set_counters(benchmark::State& st, const std::string& name, const Context<T>& ctx, const Timing& t, double bytes,
                  bool rotates = true) {
  const double gbps = bytes / t.median_s / 1e9;
  st.counters["t_us"] = t.median_s * 1e6;
  st.counters["t_min_us"] = t.min_s * 1e6;
  st.counters["bytes_needed"] = bytes;
  st.counters["GBps"] = gbps;
  st.counters["copy_GBps"] = g.copy.GBps;
  st.counters["frac_copy"] = gbps / g.copy.GBps;
  st.counters["d_model"] = ctx.shape.d_model;
  st.counters["d_ff"] = ctx.shape.d_ff;
  st.counters["launches"] = t.launches;
  st.counters["copies"] = rotates ? ctx.layer.copies() : 1;
  // Weight bytes this bench touches across the rotation before a copy comes back: should be >> L2.
  const double distinct = bytes * std::min(ctx.layer.copies(), t.launches);
  st.counters["rotated_MB"] = rotates ? distinct / 1e6 : 0.0;
  if (rotates && distinct < 2.0 * static_cast<double>(g.dev.l2_bytes)) {
    std::fprintf(stderr, "[prox_bench] warning: %s touches only %.1f MB across its rotation (L2 %.0f MB)\n",
                 name.c_str(), distinct / 1e6, g.dev.l2_bytes / 1e6);
  }
}

template <class T>
void set_sparse_counters(benchmark::State& st, const SparseSetup<T>& sp) {
  st.counters["e_target"] = sp.e_pct / 100.0;
  st.counters["s1_target"] = sp.target.s1;
  st.counters["s2_target"] = sp.target.s2;
  st.counters["s1"] = sp.report.s1;
  st.counters["s2"] = sp.report.s2;
  st.counters["e_hat"] = sp.report.effective;
  st.counters["policy_proxy"] = sp.choice.proxy;
  st.counters["policy_glu"] = sp.choice.glu;
  st.counters["policy_down"] = sp.choice.down;
  st.counters["policy_glu_down"] = sp.fused ? sp.choice.glu_down : -1;
  st.SetLabel(sp.label);
}

void report_error(benchmark::State& st, const std::string& name, const std::exception& e) {
  std::fprintf(stderr, "[prox_bench] %s: %s\n", name.c_str(), e.what());
  // A sticky device error would fail every later bench too: say so once, clearly.
  const cudaError_t sticky = cudaDeviceSynchronize();
  if (sticky != cudaSuccess)
    std::fprintf(stderr, "[prox_bench] device error state: %s (later benchmarks will fail too)\n",
                 cudaGetErrorString(sticky));
  st.SkipWithError(e.what());
}

// ---------------------------------------------------------------- dense baselines
template <class T>
void enqueue_dense_ffn(Context<T>& ctx, int i, cudaStream_t s) {
  const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % ctx.layer.copies());
  // W_down^T of the synthetic layer is read as an nn.Linear W_down [d_model][d_ff]: random data,
  // the same bytes and the same access pattern a real W_down gives cuBLAS.
  ctx.dense.run(l.w_gate, l.w_up, l.w_down_t, ctx.layer.token(i % ctx.layer.tokens()), ctx.y.template as<T>(), s);
}

//! The attention output projection of launch i (copy i mod its copies), cuBLAS, as the chained benches
//! run it before the FFN. The FFN does not read its output: the dependency is the stream's order (and
//! Stage 1's PDL wait), the timing the same as when it does.
template <class T>
void enqueue_attn_gemv(Context<T>& ctx, int i, cudaStream_t s) {
  const auto& a = ctx.attn();
  const int d = ctx.shape.d_model;
  const std::size_t copy_bytes = sizeof(T) * static_cast<std::size_t>(d) * d;
  ctx.dense.gemv(a.w.template as<const T>(copy_bytes * static_cast<std::size_t>(i % a.copies)),
                 a.in.template as<const T>(), a.out.template as<T>(), d, d, s);
}

//! The dense baselines, as their benches name them.
enum class DenseKind { kFfn, kGemvUp, kGemvDown, kAttn, kChain };
constexpr const char* dense_name(DenseKind k) {
  switch (k) {
    case DenseKind::kFfn: return "dense_ffn";
    case DenseKind::kGemvUp: return "dense_gemv_up";
    case DenseKind::kGemvDown: return "dense_gemv_down";
    case DenseKind::kAttn: return "attn_gemv";
    case DenseKind::kChain: return "chain_dense";
  }
  return "?";
}

//! Bytes a dense baseline reads: its weights.
template <class T>
double dense_bytes(const FfnShape& sh, DenseKind k) {
  const double gemv = static_cast<double>(sh.d_model) * sh.d_ff * sizeof(T);
  const double attn = static_cast<double>(sh.d_model) * sh.d_model * sizeof(T);
  switch (k) {
    case DenseKind::kFfn: return prox_bench::dense_ffn_bytes(sh.d_model, sh.d_ff, sizeof(T));
    case DenseKind::kGemvUp:
    case DenseKind::kGemvDown: return gemv;
    case DenseKind::kAttn: return attn;
    case DenseKind::kChain: return attn + prox_bench::dense_ffn_bytes(sh.d_model, sh.d_ff, sizeof(T));
  }
  return 0.0;
}

//! Enqueue launch i of a dense baseline (weight copy i mod copies, token i mod tokens).
template <class T>
void enqueue_dense(Context<T>& ctx, DenseKind k, int i, cudaStream_t s) {
  if (k == DenseKind::kAttn || k == DenseKind::kChain) enqueue_attn_gemv(ctx, i, s);
  if (k == DenseKind::kFfn || k == DenseKind::kChain) enqueue_dense_ffn(ctx, i, s);
  if (k != DenseKind::kGemvUp && k != DenseKind::kGemvDown) return;
  const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % ctx.layer.copies());
  if (k == DenseKind::kGemvUp) {
    ctx.dense.gemv(l.w_up, ctx.layer.token(i % ctx.layer.tokens()), ctx.gemv_out.template as<T>(), ctx.shape.d_ff,
                   ctx.shape.d_model, s);
  } else {
    ctx.dense.gemv(l.w_down_t, ctx.down_in.template as<const T>(), ctx.y.template as<T>(), ctx.shape.d_model,
                   ctx.shape.d_ff, s);
  }
}

//! Median seconds of a dense baseline of this shape and dtype in this process: the time its bench
//! measured (`measured`, recorded), else measured here once (a filtered run that skipped the bench).
template <class T>
double dense_seconds(Context<T>& ctx, DenseKind k, const Timing* measured = nullptr) {
  const std::string key = std::string(dense_name(k)) + "/" + key_of<T>(ctx.shape);
  if (measured != nullptr) g_dense_s[key] = measured->median_s;
  auto it = g_dense_s.find(key);
  if (it != g_dense_s.end()) return it->second;
  GraphReplay graph(g.stream, ctx.launches, [&](int i, cudaStream_t s) { enqueue_dense(ctx, k, i, s); });
  const Timing t = graph.measure(g_opt.warmup, g_opt.iterations);
  g_dense_s[key] = t.median_s;
  return t.median_s;
}

//! A dense baseline's bench: its graph timed, and its time kept for the Prox benches' ratios.
template <class T>
void bench_dense(benchmark::State& st, const std::string& name, FfnShape shape, DenseKind k) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    GraphReplay graph(g.stream, ctx.launches, [&](int i, cudaStream_t s) { enqueue_dense(ctx, k, i, s); });
    const Timing t = prox_bench::run_loop(st, graph, g_opt.warmup);
    dense_seconds(ctx, k, &t);
    set_counters(st, name, ctx, t, dense_bytes<T>(shape, k));
    if (k == DenseKind::kFfn) st.counters["speedup_vs_dense"] = 1.0;
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}

// ---------------------------------------------------------------- prox benches
enum class Op {
  kFfn,
  kFfnPaired,
  kStage2,
  kStage2Unfused,
  kStage2Empty,
  kThreshold,
  kProxy,
  kProxyEmpty,
  kFfnEmpty,
  kChainFfn,
  kChainFfnEmpty,
  kGlu,
  kGluEmpty,
  kDown,
  kDownEmpty
};

//! The unfused GLU GEMV as SparseFfn launches it (its planned policy, one-wave grid and PDL).
template <class T>
void enqueue_glu(const Context<T>& ctx, const SparseSetup<T>& sp, int i, float* s_out, cudaStream_t s,
                 bool empty = false) {
  PROX_BENCH_PROX(sp.glu_op.launch(glu_args(ctx, sp, i, s_out, empty), sp.glu_view, s));
}

//! The unfused down GEMV as SparseFfn launches it.
template <class T>
void enqueue_down(const Context<T>& ctx, const SparseSetup<T>& sp, int i, const float* s_in, cudaStream_t s,
                  bool empty = false) {
  PROX_BENCH_PROX(sp.down_op.launch(down_args(ctx, sp, i, s_in, empty), sp.down_view, s));
}

//! The fused Stage 2 as SparseFfn launches it (the FFN's planned operator: policy, grid, PDL).
template <class T>
void enqueue_glu_down(const Context<T>& ctx, const SparseSetup<T>& sp, int i, cudaStream_t s, bool empty = false) {
  PROX_BENCH_PROX(sp.glu_down_op.launch(glu_down_args(ctx, sp, i, empty), sp.glu_down_view, s));
}

//! ffn_empty's plans: sp.ffns' plans (their options and policies) with thresholds +inf (made on first use).
template <class T>
const std::vector<typename SparseSetup<T>::Ffn>& empty_ffns(Context<T>& ctx, SparseSetup<T>& sp) {
  if (!sp.empty_ffns.empty()) return sp.empty_ffns;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<typename SparseSetup<T>::Ffn> ffns(sp.ffns.size());
  for (std::size_t c = 0; c < ffns.size(); ++c) {
    const auto& f = sp.ffns[c];
    PROX_BENCH_PROX(ffns[c].plan({ctx.shape.d_model, ctx.shape.d_ff, inf, inf}, f.weights(), f.plan_options()));
  }
  sp.empty_ffns = std::move(ffns);
  return sp.empty_ffns;
}

template <class T>
void bench_prox(benchmark::State& st, const std::string& name, FfnShape shape, int e_pct, Op op) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    SparseSetup<T>& sp = sparse_setup(ctx, e_pct);
    const int K = shape.d_model;
    const int N = shape.d_ff;
    const double stage1 = prox_bench::stage1_int4_bytes(sp.kept_mean, K, N, sizeof(T));
    const double glu = prox_bench::glu_bytes(sp.sel_mean, K, sizeof(T));
    const double down = prox_bench::down_bytes(sp.sel_mean, K, sizeof(T));
    double bytes = 0.0;
    bool rotates = true;
    GraphReplay::Enqueue enqueue;
    switch (op) {
      case Op::kFfn:
      case Op::kFfnPaired:
        bytes = stage1 + glu + down;
        enqueue = [&](int i, cudaStream_t s) {
          PROX_BENCH_PROX(sp.ffns[i % ctx.layer.copies()].run(ctx.layer.token(i % ctx.layer.tokens()),
                                                              ctx.y.template as<T>(), sp.ws.get(), sp.ws_bytes, s));
        };
        break;
      case Op::kFfnEmpty:
      case Op::kChainFfn:
      case Op::kChainFfnEmpty: {
        // The FFN (or its empty plans: no input kept, no channel selected, no weight byte read), alone or
        // after the attention projection (chain_*: its weights' bytes counted, the FFN PDL-launched after it).
        const bool chain = op != Op::kFfnEmpty;
        const auto& ffns = op == Op::kChainFfn ? sp.ffns : empty_ffns(ctx, sp);
        bytes = (op == Op::kChainFfn ? stage1 + glu + down : static_cast<double>(K) * sizeof(T)) +
                (chain ? dense_bytes<T>(shape, DenseKind::kAttn) : 0.0);
        rotates = chain;
        if (chain) ctx.attn();  // allocated before capture
        enqueue = [&, chain](int i, cudaStream_t s) {
          if (chain) enqueue_attn_gemv(ctx, i, s);
          PROX_BENCH_PROX(ffns[i % ctx.layer.copies()].run(ctx.layer.token(i % ctx.layer.tokens()),
                                                           ctx.y.template as<T>(), sp.ws.get(), sp.ws_bytes, s));
        };
        break;
      }
      case Op::kStage2:
        if (sp.fused) {
          bytes = glu + down;
          enqueue = [&](int i, cudaStream_t s) { enqueue_glu_down(ctx, sp, i, s); };
          break;
        }
        [[fallthrough]];
      case Op::kStage2Unfused:
        bytes = glu + down;
        enqueue = [&](int i, cudaStream_t s) {
          enqueue_glu(ctx, sp, i, sp.s_scratch.template as<float>(), s);
          enqueue_down(ctx, sp, i, sp.s_scratch.template as<const float>(), s);
        };
        break;
      case Op::kStage2Empty:
        // Nothing selected, so no weight byte is read: what Stage 2 costs whatever the density (read
        // the mask, rank, write s = 0, the grid barrier, the down split-K combine, write y), as the
        // FFN runs it (fused or not). Bytes: the mask.
        bytes = static_cast<double>(N) / 8.0;
        enqueue = [&](int i, cudaStream_t s) {
          if (sp.fused) {
            enqueue_glu_down(ctx, sp, i, s, /*empty=*/true);
          } else {
            enqueue_glu(ctx, sp, i, sp.s_scratch.template as<float>(), s, /*empty=*/true);
            enqueue_down(ctx, sp, i, sp.s_scratch.template as<const float>(), s, /*empty=*/true);
          }
        };
        break;
      case Op::kThreshold:
        bytes = static_cast<double>(K) * sizeof(T);
        rotates = false;  // reads only x, which stays in L2 in a real decoder too
        enqueue = [&](int i, cudaStream_t s) {
          PROX_BENCH_PROX(sp.threshold_op.run(threshold_args(ctx, sp, i), nullptr, 0, s));
        };
        break;
      case Op::kProxy:
      case Op::kProxyEmpty:
        // kProxyEmpty: tau_x = +inf keeps no input, so no weight byte is read: the kernel's fixed
        // cost (x threshold, block reduction, split-K combine, epilogue), for docs/benchmarks.md.
        bytes = op == Op::kProxy ? stage1 : static_cast<double>(K) * sizeof(T);
        enqueue = [&, op](int i, cudaStream_t s) {
          // Launched as SparseFfn launches Stage 1: its planned operator (policy, PDL, clusters where
          // the plan uses them, spread), on an op-only workspace.
          const float tau_x = op == Op::kProxy ? sp.tau_x : std::numeric_limits<float>::infinity();
          PROX_BENCH_PROX(sp.proxy_op.run(proxy_args(ctx, sp, i, tau_x), sp.proxy_ws.get(), sp.proxy_ws.bytes(), s));
        };
        break;
      case Op::kGlu:
      case Op::kGluEmpty:
        // kGluEmpty, kDownEmpty: an all-zero mask, no weight byte read: the op's fixed cost. Bytes: the mask.
        bytes = op == Op::kGlu ? glu : static_cast<double>(N) / 8.0;
        enqueue = [&, op](int i, cudaStream_t s) {
          enqueue_glu(ctx, sp, i, sp.s_scratch.template as<float>(), s, op == Op::kGluEmpty);
        };
        break;
      case Op::kDown:
      case Op::kDownEmpty:
        bytes = op == Op::kDown ? down : static_cast<double>(N) / 8.0;
        enqueue = [&, op](int i, cudaStream_t s) { enqueue_down(ctx, sp, i, nullptr, s, op == Op::kDownEmpty); };
        break;
    }
    GraphReplay graph(g.stream, ctx.launches, enqueue);
    Timing t;
    if (op == Op::kFfnPaired) {
      GraphReplay dense(g.stream, ctx.launches, [&](int i, cudaStream_t s) { enqueue_dense_ffn(ctx, i, s); });
      const PairedTiming pt = prox_bench::run_paired_loop(st, graph, dense, g_opt.warmup);
      t = pt.prox;
      st.counters["dense_us"] = pt.dense.median_s * 1e6;
      st.counters["speedup_vs_dense"] = pt.dense.median_s / pt.prox.median_s;
      st.counters["speedup_pair_median"] = pt.ratio.median_s;
      st.counters["speedup_pair_min"] = pt.ratio.min_s;
      st.counters["speedup_pair_max"] = pt.ratio.max_s;
    } else {
      t = prox_bench::run_loop(st, graph, g_opt.warmup);
    }
    if (op == Op::kFfn || op == Op::kFfnPaired) {
      // Read the densities back after timing, from the timed plans and workspace: they must be the
      // ones the setup measured (Stage 1 is deterministic), else bytes_needed would be wrong.
      auto* cnt = sp.counters.template as<prox::SparsityCounters>();
      PROX_BENCH_PROX(prox::reset_counters(cnt, g.stream));
      for (int tok = 0; tok < ctx.layer.tokens(); ++tok) {
        PROX_BENCH_PROX(sp.ffns[tok % ctx.layer.copies()].run(ctx.layer.token(tok), ctx.y.template as<T>(), sp.ws.get(),
                                                              sp.ws_bytes, g.stream, cnt));
      }
      prox::SparsityReport rep{};
      PROX_BENCH_PROX(prox::read_report(cnt, K, N, g.stream, &rep));
      check_workspace(sp.ws, "FFN workspace", g.stream);
      if (rep.s1 != sp.report.s1 || rep.s2 != sp.report.s2) {
        std::fprintf(stderr,
                     "[prox_bench] warning: %s: densities after timing (%.5f, %.5f) differ from setup (%.5f, %.5f)\n",
                     name.c_str(), rep.s1, rep.s2, sp.report.s1, sp.report.s2);
      }
    }
    set_counters(st, name, ctx, t, bytes, rotates);
    set_sparse_counters(st, sp);
    // The dense work the bench stands for (ffn_paired: its own counters, above).
    double dense_s = 0.0;
    if (op == Op::kFfn || op == Op::kStage2 || op == Op::kStage2Unfused) dense_s = dense_seconds(ctx, DenseKind::kFfn);
    if (op == Op::kGlu || op == Op::kProxy) dense_s = 2.0 * dense_seconds(ctx, DenseKind::kGemvUp);
    if (op == Op::kDown) dense_s = dense_seconds(ctx, DenseKind::kGemvDown);
    if (dense_s > 0.0) {
      st.counters["speedup_vs_dense"] = dense_s / t.median_s;
      st.counters["dense_us"] = dense_s * 1e6;
    }
    if (op == Op::kChainFfn || op == Op::kChainFfnEmpty) {
      // The FFN's share of the chain: the chain less the projection alone (both measured in this process).
      const double gemv_s = dense_seconds(ctx, DenseKind::kAttn);
      const double chain_dense_s = dense_seconds(ctx, DenseKind::kChain);
      st.counters["gemv_us"] = gemv_s * 1e6;
      st.counters["ffn_us"] = (t.median_s - gemv_s) * 1e6;
      st.counters["chain_dense_us"] = chain_dense_s * 1e6;
      if (op == Op::kChainFfn) {
        st.counters["speedup_vs_dense"] = chain_dense_s / t.median_s;
        st.counters["ffn_speedup"] = (chain_dense_s - gemv_s) / (t.median_s - gemv_s);
      }
    }
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}

// ---------------------------------------------------------------- FP8 Stage-2 weights (--prox_fp8)
// The layer's weights quantized to FP8 e4m3 on the device (fp8::quantize_device; W_down^T and its scales by
// fp8::transpose_down_device; the INT4 proxies packed from the FP8 weights, fp8::pack_int4_device), one FP8
// copy per weight copy of the context. The benches:
//   fp8_ffn    prox::SparseFfn<T, SiLU, Int4Weights, Fp8Weights<L>> at target e, replayed in alternation with
//              fp8_dense (the timed iteration is the FFN's): t_us, and against the baselines of issue 40
//              that C++ measures: (b) fp8_dense_us, speedup_vs_fp8_dense; (c) fp8_floor_us, the dense FP8
//              bytes (W_gate, W_up, W_down and their scales) at the copy bandwidth of this run,
//              speedup_vs_fp8_floor; (d) bf16_dense_us, speedup_vs_bf16_dense, the cuBLAS bf16 FFN of the
//              shape measured in this process (when --prox_dtypes has bf16; registered before)
//   fp8_dense  (b) alone: prox's fused FP8 Stage 2 with every channel selected (no Stage 1), a dense FP8
//              FFN: GBps and frac_copy on the dense FP8 bytes

//! The FP8 copies of a context's layer in scale layout L (prox_bench::Fp8Copies), the dense FP8 FFN (b) and the
//! plans of each target.
template <class T, prox::fp8::ScaleLayout L>
struct Fp8Set : ContextBase {
  using Fmt = prox::Fp8Weights<L>;
  using Ffn = prox::SparseFfn<T, prox::SiLU, prox::Int4Weights, Fmt>;
  using DenseOp = prox::GluDownGemvOp<T, prox::SiLU, Fmt>;
  //! The dense FP8 FFN (b) with fused Stage-2 candidate `policy` (-1: the plan's default).
  struct Dense {
    prox::Operator<DenseOp> op;
    DeviceBuffer ws;
    prox::OpWorkspace view{};
  };
  struct Plans {
    prox::StageSparsity target{};
    float tau_x = 0.0f, tau_s = 0.0f;
    std::vector<Ffn> ffns;
    DeviceBuffer ws;
    std::size_t ws_bytes = 0;
    prox::SparsityReport report{};
    double kept_mean = 0.0, sel_mean = 0.0;
    DeviceBuffer masks;  //!< [tokens][N / 32]: each bench token's channel set (fp8_stage2 replays them)
  };

  explicit Fp8Set(Context<T>& ctx)
      : K(ctx.shape.d_model), N(ctx.shape.d_ff), copies(ctx.layer.copies()), fp8(ctx.layer, g.stream),
        dense_bytes(fp8.dense_bytes()) {
    const cudaStream_t s = g.stream;
    all_mask = DeviceBuffer(sizeof(std::uint32_t) * (N / 32), "all-ones mask");
    PROX_BENCH_CUDA(cudaMemsetAsync(all_mask.get(), 0xff, all_mask.bytes(), s));
    s_scratch = DeviceBuffer(sizeof(float) * N, "FP8 s");
    PROX_BENCH_CUDA(cudaStreamSynchronize(s));
  }
  //! The dense FP8 FFN (b) of fused Stage-2 candidate `policy` (made on first use): the fused Stage 2 on the
  //! all-ones mask, with the plan's options.
  Dense& dense(Context<T>& ctx, int policy) {
    auto it = dense_by_policy.find(policy);
    if (it != dense_by_policy.end()) return *it->second;
    auto d = std::make_unique<Dense>();
    const typename DenseOp::Args a0 = dense_args(ctx, 0);
    PROX_BENCH_PROX(d->op.initialize(a0, Ffn::template op_options<DenseOp>(typename Ffn::PlanOptions{}), policy));
    d->ws = DeviceBuffer(std::max<std::size_t>(prox::Operator<DenseOp>::workspace_bytes(a0), 16), "FP8 dense ws");
    PROX_BENCH_PROX(prox::initialize_workspace(d->ws.get(), d->ws.bytes(), g.stream));
    d->view = prox::Operator<DenseOp>::stage2_view(d->ws.get(), a0, /*stamp=*/true);
    Dense& ref = *d;
    dense_by_policy[policy] = std::move(d);
    return ref;
  }
  typename Ffn::Weights weights(int c) const { return fp8.template ffn_weights<prox::SiLU>(c); }
  //! The dense FP8 FFN's arguments for launch i (copy i mod copies, token i mod tokens); with `masks` (a
  //! Plans' per-token channel sets) the fused Stage 2 on token i's channel set instead of every channel.
  typename DenseOp::Args dense_args(Context<T>& ctx, int i, const DeviceBuffer* masks = nullptr) const {
    const typename Ffn::Weights w = weights(i % copies);
    typename DenseOp::Args a;
    a.x = ctx.layer.token(i % ctx.layer.tokens());
    a.d_model = K;
    a.d_ff = N;
    a.w_gate = w.gate;
    a.w_up = w.up;
    a.channel_mask = masks == nullptr ? all_mask.template as<const std::uint32_t>()
                                      : masks->template as<const std::uint32_t>() +
                                            static_cast<std::size_t>(i % ctx.layer.tokens()) * (N / 32);
    a.s = s_scratch.template as<float>();
    a.w_down_t = w.down_t;
    a.y = ctx.y.template as<T>();
    return a;
  }

  //! The plans of target e (made on first use): tau_x and tau_s calibrated as prox_ffn's (exact quantiles of
  //! the bench tokens' |x| and of Stage 1's |s~| on the FP8 layer's own proxies), one plan per copy, and the
  //! realized (s1, s2) and each token's channel set measured once. e_pct < 0: thresholds +inf (nothing kept,
  //! nothing selected: the FFN's fixed cost, fp8_ffn_empty).
  Plans& plans(Context<T>& ctx, int e_pct, int policy) {
    const std::pair<int, int> key{e_pct, policy};
    auto it = by_target.find(key);
    if (it != by_target.end()) return *it->second;
    auto p = std::make_unique<Plans>();
    const cudaStream_t s = g.stream;
    if (e_pct < 0) {
      p->tau_x = p->tau_s = std::numeric_limits<float>::infinity();
    } else {
      prox::AllocationRule rule;
      rule.alpha = g_opt.fp8_alpha;
      PROX_BENCH_PROX(prox::allocate_sparsity(e_pct / 100.0, &p->target, rule));
      p->tau_x = prox_bench::magnitude_threshold(ctx.layer.host_abs_tokens(s), p->target.s1);
      std::vector<const T*> toks;
      for (int t = 0; t < ctx.layer.tokens(); ++t) toks.push_back(ctx.layer.token(t));
      p->tau_s = prox_bench::calibrate_tau_s<T, prox::SiLU, prox::Int4Weights, Fmt>(
          weights(0), ctx.shape, p->tau_x, p->target.s2, toks, prox::PolicyChoice{}, s);
    }
    p->ffns.resize(static_cast<std::size_t>(copies));
    typename Ffn::PlanOptions po;
    po.choice.glu_down = policy;
    for (int c = 0; c < copies; ++c) PROX_BENCH_PROX(p->ffns[c].plan({K, N, p->tau_x, p->tau_s}, weights(c), po));
    p->ws_bytes = p->ffns[0].workspace_bytes();
    p->ws = DeviceBuffer(p->ws_bytes, "FP8 FFN workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(p->ws.get(), p->ws.bytes(), s));
    DeviceBuffer counters(sizeof(prox::SparsityCounters), "FP8 counters");
    auto* cnt = counters.template as<prox::SparsityCounters>();
    PROX_BENCH_PROX(prox::reset_counters(cnt, s));
    p->masks = DeviceBuffer(sizeof(std::uint32_t) * static_cast<std::size_t>(ctx.layer.tokens()) * (N / 32),
                            "FP8 channel sets");
    for (int t = 0; t < ctx.layer.tokens(); ++t) {
      typename Ffn::Outputs o;
      o.counters = cnt;
      o.channel_mask = p->masks.template as<std::uint32_t>() + static_cast<std::size_t>(t) * (N / 32);
      PROX_BENCH_PROX(p->ffns[0].run(ctx.layer.token(t), ctx.y.template as<T>(), p->ws.get(), p->ws_bytes, s, o));
    }
    PROX_BENCH_PROX(prox::read_report(cnt, K, N, s, &p->report, g_opt.fp8_alpha));
    p->kept_mean = (1.0 - p->report.s1) * K;
    p->sel_mean = (1.0 - p->report.s2) * N;
    std::fprintf(stderr, "[prox_bench] fp8 %s %s e=%d%%: tau_x = %.6g, tau_s = %.6g, measured (s1, s2, e^) = "
                 "(%.4f, %.4f, %.4f)\n", key_of<T>(ctx.shape).c_str(), prox::fp8::to_string(L), e_pct, p->tau_x,
                 p->tau_s, p->report.s1, p->report.s2, p->report.effective);
    Plans& ref = *p;
    by_target[key] = std::move(p);
    return ref;
  }

  int K, N, copies;
  prox_bench::Fp8Copies<T, L> fp8;
  double dense_bytes = 0.0;  //!< the dense FP8 FFN's weight bytes: codes and scales
  DeviceBuffer all_mask, s_scratch;
  std::map<int, std::unique_ptr<Dense>> dense_by_policy;
  std::map<std::pair<int, int>, std::unique_ptr<Plans>> by_target;
};

//! The context's FP8 set of layout L (made on first use, freed with the context).
template <class T, prox::fp8::ScaleLayout L>
Fp8Set<T, L>& fp8_set(Context<T>& ctx) {
  auto& slot = ctx.fp8[static_cast<int>(L)];
  if (!slot) slot = std::make_unique<Fp8Set<T, L>>(ctx);
  return static_cast<Fp8Set<T, L>&>(*slot);
}

//! What an FP8 bench times: the dense FP8 FFN (b), the FFN at target e, the FFN with thresholds +inf (its fixed
//! cost), or the fused Stage 2 alone on the channel sets the FFN selects at target e.
enum class Fp8Bench { kDense, kFfn, kEmpty, kStage2 };

//! One FP8 bench of layout L (`kind`; e_pct for kFfn and kStage2), with fused Stage-2 candidate `policy` (-1:
//! the plan's default).
template <class T, prox::fp8::ScaleLayout L>
void bench_fp8(benchmark::State& st, const std::string& name, FfnShape shape, Fp8Bench kind, int e_pct, int policy) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    Fp8Set<T, L>& set = fp8_set<T, L>(ctx);
    const int K = shape.d_model;
    const double io = 2.0 * sizeof(T) * K;  // x and y
    auto& dn = set.dense(ctx, policy);
    GraphReplay dense(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
      PROX_BENCH_PROX(dn.op.launch(set.dense_args(ctx, i), dn.view, s));
    });
    st.counters["policy_glu_down"] = dn.op.policy();
    st.counters["alpha"] = g_opt.fp8_alpha;
    const double floor_s = set.dense_bytes / (g.copy.GBps * 1e9);
    if (kind == Fp8Bench::kDense) {
      const Timing t = prox_bench::run_loop(st, dense, g_opt.warmup);
      set_counters(st, name, ctx, t, set.dense_bytes + io);
      st.counters["fp8_floor_us"] = floor_s * 1e6;
      st.counters["frac_fp8_floor"] = floor_s / t.median_s;
      return;
    }
    auto& p = set.plans(ctx, kind == Fp8Bench::kEmpty ? -1 : e_pct, policy);
    const auto ffn_launch = [&](int i, cudaStream_t s) {
      PROX_BENCH_PROX(p.ffns[i % set.copies].run(ctx.layer.token(i % ctx.layer.tokens()), ctx.y.template as<T>(),
                                                 p.ws.get(), p.ws_bytes, s));
    };
    const auto plan_counters = [&] {
      st.counters["s1"] = p.report.s1;
      st.counters["s2"] = p.report.s2;
      st.SetLabel(prox::fp8::to_string(L));
    };
    if (kind == Fp8Bench::kEmpty) {  // no byte of weights read: the two kernels' fixed cost
      GraphReplay empty(g.stream, ctx.launches, ffn_launch);
      const Timing t = prox_bench::run_loop(st, empty, g_opt.warmup);
      set_counters(st, name, ctx, t, io);
      plan_counters();
      return;
    }
    if (kind == Fp8Bench::kStage2) {  // the fused Stage 2 alone, each token on the channel set its FFN selected
      GraphReplay stage2(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
        PROX_BENCH_PROX(dn.op.launch(set.dense_args(ctx, i, &p.masks), dn.view, s));
      });
      const Timing t = prox_bench::run_loop(st, stage2, g_opt.warmup);
      set_counters(st, name, ctx, t, 3.0 * p.sel_mean * K + set.fp8.scale_bytes() + io);
      st.counters["e_target"] = e_pct / 100.0;
      plan_counters();
      return;
    }
    GraphReplay prox_g(g.stream, ctx.launches, ffn_launch);
    const PairedTiming pt = prox_bench::run_paired_loop(st, prox_g, dense, g_opt.warmup);
    // Bytes: Stage 1 (INT4 proxies of the kept rows), the selected rows of the three FP8 matrices (1 byte a
    // weight) and their scales (counted whole: at most 2 % of them), x and y.
    const double bytes = prox_bench::stage1_int4_bytes(p.kept_mean, K, shape.d_ff, sizeof(T)) +
                         3.0 * p.sel_mean * K + set.fp8.scale_bytes() + io;
    set_counters(st, name, ctx, pt.prox, bytes);
    st.counters["e_target"] = e_pct / 100.0;
    plan_counters();
    st.counters["e_hat"] = p.report.effective;
    st.counters["fp8_dense_us"] = pt.dense.median_s * 1e6;                  // (b)
    st.counters["speedup_vs_fp8_dense"] = pt.ratio.median_s;
    st.counters["fp8_floor_us"] = floor_s * 1e6;                              // (c)
    st.counters["speedup_vs_fp8_floor"] = floor_s / pt.prox.median_s;
    const auto bf16 = g_dense_s.find(std::string("dense_ffn/") + shape.name + "/bf16");  // (d)
    if (bf16 != g_dense_s.end()) {
      st.counters["bf16_dense_us"] = bf16->second * 1e6;
      st.counters["speedup_vs_bf16_dense"] = bf16->second / pt.prox.median_s;
    }
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}

// ---------------------------------------------------------------- registration
benchmark::internal::Benchmark* configure(benchmark::internal::Benchmark* b) {
  return b->UseManualTime()->Iterations(g_opt.iterations)->Unit(benchmark::kMicrosecond);
}

template <class T>
void register_shape(const FfnShape& shape, const std::vector<int>& targets) {
  const std::string base = key_of<T>(shape);
  const auto reg = [](const std::string& name, std::function<void(benchmark::State&, const std::string&)> fn) {
    configure(benchmark::RegisterBenchmark(name.c_str(), [name, fn](benchmark::State& st) { fn(st, name); }));
  };
  for (DenseKind k : {DenseKind::kFfn, DenseKind::kGemvUp, DenseKind::kGemvDown, DenseKind::kAttn, DenseKind::kChain})
    reg(std::string(dense_name(k)) + "/" + base,
        [shape, k](benchmark::State& st, const std::string& n) { bench_dense<T>(st, n, shape, k); });
  const std::pair<const char*, Op> ops[] = {
      {"prox_ffn", Op::kFfn},         {"ffn_paired", Op::kFfnPaired},     {"prox_stage2", Op::kStage2},
      {"stage2_unfused", Op::kStage2Unfused}, {"stage2_empty", Op::kStage2Empty}, {"threshold", Op::kThreshold},
      {"proxy_int4", Op::kProxy},     {"proxy_int4_empty", Op::kProxyEmpty}, {"glu", Op::kGlu},
      {"glu_empty", Op::kGluEmpty},   {"down", Op::kDown},                {"down_empty", Op::kDownEmpty},
      {"ffn_empty", Op::kFfnEmpty},   {"chain_ffn", Op::kChainFfn},       {"chain_ffn_empty", Op::kChainFfnEmpty}};
  for (int e : targets) {
    for (const auto& [opname, op] : ops) {
      const Op o = op;
      reg(std::string(opname) + "/" + base + "/e" + std::to_string(e),
          [shape, e, o](benchmark::State& st, const std::string& n) { bench_prox<T>(st, n, shape, e, o); });
    }
  }
  // FP8 (--prox_fp8): fp8_dense/<model>/<dtype>/<layout>, fp8_ffn/<model>/<dtype>/<layout>/e<t>.
  using L = prox::fp8::ScaleLayout;
  for (const std::string& l : prox_bench::split_list(prox_bench::lower(g_opt.fp8))) {
    const auto add = [&](auto layout) {
      constexpr L kL = decltype(layout)::value;
      const std::string lb = base + "/" + l;
      std::vector<int> policies{-1};  // the plan's default
      if (!g_opt.fp8_policies.empty()) {
        policies.clear();
        for (const std::string& p : prox_bench::split_list(g_opt.fp8_policies)) {
          const int i = std::stoi(p);
          if (i < 0 || i >= prox::GluDownGemvOp<T, prox::SiLU, prox::Fp8Weights<kL>>::Policies::kSize)
            throw std::invalid_argument("--prox_fp8_policies: no fused Stage-2 candidate " + p);
          policies.push_back(i);
        }
      }
      for (int pol : policies) {
        const std::string ps = pol < 0 ? "" : "/p" + std::to_string(pol);
        reg("fp8_dense/" + lb + ps, [shape, pol](benchmark::State& st, const std::string& n) {
          bench_fp8<T, kL>(st, n, shape, Fp8Bench::kDense, 0, pol);
        });
        reg("fp8_ffn_empty/" + lb + ps, [shape, pol](benchmark::State& st, const std::string& n) {
          bench_fp8<T, kL>(st, n, shape, Fp8Bench::kEmpty, 0, pol);
        });
        for (int e : targets) {
          reg("fp8_ffn/" + lb + "/e" + std::to_string(e) + ps, [shape, e, pol](benchmark::State& st, const std::string& n) {
            bench_fp8<T, kL>(st, n, shape, Fp8Bench::kFfn, e, pol);
          });
          reg("fp8_stage2/" + lb + "/e" + std::to_string(e) + ps,
              [shape, e, pol](benchmark::State& st, const std::string& n) {
                bench_fp8<T, kL>(st, n, shape, Fp8Bench::kStage2, e, pol);
              });
        }
      }
    };
    if (l == "channel") {
      add(std::integral_constant<L, L::kPerChannel>{});
    } else if (l == "block128") {
      add(std::integral_constant<L, L::kBlock128>{});
    } else {
      throw std::invalid_argument("--prox_fp8: unknown scale layout '" + l + "' (channel, block128)");
    }
  }
}

void register_all() {
  const std::vector<FfnShape> shapes = prox_bench::select_shapes(g_opt.shapes, prox_bench::qwen3_shapes());
  std::vector<int> targets;
  for (const std::string& t : prox_bench::split_list(g_opt.targets)) {
    const int e = std::stoi(t);
    prox::StageSparsity tmp;
    if (e < 0 || e > 93 || prox::allocate_sparsity(e / 100.0, &tmp) != prox::Status::kSuccess)
      throw std::invalid_argument("--prox_targets: " + t + " % is not a valid target");
    targets.push_back(e);
  }
  const std::vector<std::string> dtypes = prox_bench::split_list(prox_bench::lower(g_opt.dtypes));
  for (const std::string& d : dtypes)
    if (d != "f16" && d != "bf16") throw std::invalid_argument("--prox_dtypes: unknown dtype '" + d + "' (f16, bf16)");
  const auto want = [&](const char* d) { return std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end(); };
  for (const FfnShape& s : shapes) {
    if (want("f16")) register_shape<__half>(s, targets);
    if (want("bf16")) register_shape<__nv_bfloat16>(s, targets);
  }
}

// ---------------------------------------------------------------- flags
//! The suite's own flags, bound to g_opt (whose values are the defaults the help shows).
void add_flags(CLI::App* app) {
  namespace cli = prox_support::cli;
  cli::setup(*app, cli::Syntax::kEquals);
  const auto count = [](int lo) { return cli::value_check(cli::number_in(lo, 1e9, true)); };
  const auto positive = cli::value_check(cli::positive_number());
  const auto zero_one = cli::value_check(cli::one_of({"0", "1"}));
  prox_bench::add_layer_flags(*app, &g_opt.shapes, &g_opt.dtypes, &g_opt.targets);
  app->add_option("--prox_iterations", g_opt.iterations, "timed graph replays per benchmark")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(1));
  app->add_option("--prox_warmup", g_opt.warmup, "untimed replays first")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(0));
  app->add_option("--prox_tokens", g_opt.tokens, "distinct tokens cycled")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(1));
  app->add_option("--prox_min_launches", g_opt.min_launches, "launches per graph, at least")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(1));
  app->add_option("--prox_rotate_gb", g_opt.rotate_gb, "weight bytes rotated over, at least")
      ->type_name("G")
      ->capture_default_str()
      ->check(positive);
  app->add_option("--prox_max_device_gb", g_opt.max_device_gb, "device memory cap")
      ->type_name("G")
      ->capture_default_str()
      ->check(positive);
  app->add_option_function<std::string>(
         "--prox_policy",
         [](const std::string& v) {
           const std::vector<std::string> p = prox_bench::split_list(v);
           g_opt.policy.proxy = std::stoi(p[0]);
           g_opt.policy.glu = std::stoi(p[1]);
           g_opt.policy.down = std::stoi(p[2]);
           if (p.size() == 4) g_opt.policy.glu_down = std::stoi(p[3]);
         },
         "policy indices (proxy,glu,down[,fused]), -1 = default")
      ->type_name("P,G,D[,F]")
      ->check(cli::list_check(cli::number_in(-1, 1e6, true)))
      ->check(cli::value_check([](const std::string& v) -> std::string {
        const std::size_t n = prox_bench::split_list(v).size();
        return n == 3 || n == 4 ? std::string() : std::string("not three or four indices: proxy,glu,down[,fused]");
      }));
  app->add_option("--prox_fuse", g_opt.fuse, "Stage 2 as one fused kernel")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(zero_one);
  app->add_option("--prox_cluster", g_opt.cluster, "Stage-1 split-K through clusters")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(zero_one);
  app->add_option("--prox_spread", g_opt.spread, "spread a small Stage-1 grid over the SMs")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(zero_one);
  app->add_option("--prox_check_workspace", g_opt.check_workspace, "Stage 1 checks the workspace header")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(zero_one);
  app->add_option("--prox_tuning", g_opt.tuning,
                  "plan with the policies of this prox-tune cache (read-only; a miss or a file of another GPU/build "
                  "keeps the defaults)")
      ->type_name("FILE");
  app->add_option("--prox_commit", g_opt.commit, "commit to record (else $PROX_COMMIT, else the one built from)")
      ->type_name("SHA");
  app->add_option("--prox_fp8", g_opt.fp8,
                  "FP8 e4m3 Stage-2 benches (fp8_ffn, fp8_dense) of these scale layouts: channel,block128 (default: "
                  "none)")
      ->type_name("LIST");
  app->add_option("--prox_fp8_alpha", g_opt.fp8_alpha,
                  "the allocation's alpha of the FP8 plans (default prox::fp8::kAllocationAlpha, measured by "
                  "prox_alpha --fp8=1)")
      ->capture_default_str()
      ->check(CLI::Range(1e-3, 10.0));
  app->add_option("--prox_fp8_policies", g_opt.fp8_policies,
                  "FP8 benches once per fused Stage-2 candidate of these indices, names ending in /p<i> (default: "
                  "the plan's default policy)")
      ->type_name("LIST");
  app->footer(
      "plus Google Benchmark's flags, e.g. --benchmark_filter=REGEX --benchmark_out=FILE\n"
      "--benchmark_out_format=json --benchmark_list_tests");
}

constexpr const char* kDescription = "prox_bench: Google Benchmark suite of prox (see docs/benchmarks.md)";

void usage() {
  CLI::App app{kDescription, "prox_bench"};
  add_flags(&app);
  std::fputs(app.help().c_str(), stdout);
}

//! The --prox_* flags out of argv, the rest left for Google Benchmark (prox_bench::parse_own_flags).
void parse_flags(int* argc, char** argv) {
  CLI::App app{kDescription, "prox_bench"};
  add_flags(&app);
  prox_bench::parse_own_flags(app, argc, argv);
}

//! prox_bench's own run context: the tuning cache (--prox_tuning), the architectures, the options.
void add_context() {
  if (!g_opt.tuning.empty()) {
    prox::tuning::CacheOptions co;
    co.path = g_opt.tuning;
    co.mode = prox::tuning::Mode::kReadOnly;
    const prox::Status st = prox::tuning::open_cache(&g.tuning, co);
    if (g.tuning == nullptr) throw std::runtime_error("--prox_tuning: " + std::string(prox::to_string(st)));
    std::fprintf(stderr, "[prox_bench] tuning cache %s: %zu entries\n", g_opt.tuning.c_str(), g.tuning->size());
    benchmark::AddCustomContext("prox_tuning", g_opt.tuning);
  }
  benchmark::AddCustomContext("prox_cuda_archs", PROX_BENCH_CUDA_ARCHS);
  char opts[160];
  std::snprintf(opts, sizeof(opts), "iterations=%d warmup=%d tokens=%d min_launches=%d rotate_gb=%.2f fuse=%d cluster=%d",
                g_opt.iterations, g_opt.warmup, g_opt.tokens, g_opt.min_launches, g_opt.rotate_gb, int(g_opt.fuse),
                int(g_opt.cluster));
  benchmark::AddCustomContext("prox_options", opts);
}

}  // namespace

int main(int argc, char** argv) {
  const prox_bench::BenchMain m{"prox_bench", usage, parse_flags, register_all, add_context, [] { g_ctx.reset(); }};
  return prox_bench::bench_main(argc, argv, g, m, g_opt.commit);
}
