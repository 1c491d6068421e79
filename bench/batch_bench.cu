// SPDX-License-Identifier: Apache-2.0
//! @file batch_bench.cu  Google Benchmark suite of batched decode (SparseFfn::run_batch): B = 1, 2, 4, 8
//! tokens per call at e = 40..70 % on the Qwen3 FFN shapes, against cuBLAS dense at the same B in the
//! same process, for two mask models.
//!
//! Benchmark names: batch_ffn/<model>/<dtype>/e<target %>/b<B>/<masks>, masks = indep (every token
//! drawn independently: the worst case for the union) or corr (x_b = 0.8 shared + 0.6 own, both N(0, 1):
//! tokens of one sequence or prompt share much of their activations). Each iteration replays the Prox
//! graph and the dense graph (cuBLAS GEMMs of n = B, fp32 compute) in alternation (bench_loop.cuh's
//! run_paired_loop, as prox_bench's ffn_paired). Counters:
//!   t_us, dense_us, speedup_vs_dense   medians of Prox and dense per call, and their ratio
//!   in_token, ch_token                 mean density of one token's input set and channel set
//!   in_union, ch_union                 density of the union over the batch: the rows each stage streams
//!   union_bytes, GBps, frac_copy       bytes the union needs (Stage 1 INT4 rows + scales + x, GLU and
//!                                      down rows) over t_us, and that against the copy bandwidth
//!   floor_speedup                      dense bytes / union bytes: the speed-up if both streamed their
//!                                      bytes at the same bandwidth
//!   frac_floor                         speedup_vs_dense / floor_speedup: how much of it Prox reaches
//!
//! batch_ffn_empty/<model>/<dtype>/b<B>: the same plans (Config::max_tokens = 8, the same PlanOptions) with
//! thresholds +inf, so no input is kept, no channel is selected and no weight byte is read: the batched
//! FFN's fixed cost at B tokens (batch 1: prox_bench's ffn_empty). Counter t_us (median per call).
//!
//! Own flags: --prox_shapes=8B,14B --prox_dtypes=f16,bf16 --prox_targets=40,50,60,70
//! --prox_batches=1,2,4,8 --prox_masks=indep,corr --prox_iterations=N --prox_warmup=N
//! --prox_min_launches=N --prox_rotate_gb=G --prox_max_device_gb=G --prox_fuse_batch=0|1 --prox_commit=SHA
//! --prox_fp8=channel,block128 (batch_fp8: see "FP8 Stage-2 weights" below).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "bench_loop.cuh"
#include <prox_support/dense_ffn.cuh>

namespace {

using prox_bench::DeviceBuffer;
using prox_bench::FfnShape;
using prox_bench::GraphReplay;
using prox_bench::Timing;

constexpr int kMaxB = prox::kMaxBatchTokens;
constexpr int kBatches = 8;  //!< distinct batches (of kMaxB tokens each) cycled through the launches

struct Options {
  std::string shapes = "1.7B,4B,8B,14B,32B";
  std::string dtypes = "f16,bf16";
  std::string targets = "40,50,60,70";
  std::string batches = "1,2,4,8";
  std::string masks = "indep,corr";
  int iterations = 20;
  int warmup = 3;
  int min_launches = 32;
  double rotate_gb = 4.0;
  double max_device_gb = 40.0;
  bool fuse_batch = false;  //!< PlanOptions::fuse_batch_stage2
  std::string commit;
  std::string fp8;  //!< batch_fp8 benches of these FP8 scale layouts: channel, block128 (empty: none)
  double fp8_alpha = prox::fp8::kAllocationAlpha;  //!< the allocation's alpha of the FP8 plans
};
Options g_opt;

prox_bench::BenchGlobals g;

enum class Masks { kIndependent, kCorrelated };
const char* masks_name(Masks m) { return m == Masks::kIndependent ? "indep" : "corr"; }

struct ContextBase {
  virtual ~ContextBase() = default;
};

template <class T>
struct Sparse {
  using Ffn = prox::SparseFfn<T, prox::SiLU>;
  prox::StageSparsity target{};
  float tau_x = 0.0f;
  float tau_s = 0.0f;
  std::vector<Ffn> ffns;  //!< one plan per weight copy, max_tokens = 8
  DeviceBuffer ws;
};

template <class T>
struct Context : ContextBase {
  Context(const FfnShape& s, int copies)
      : shape(s),
        layer(s, copies, 1, 0xba7c0000ull + static_cast<std::uint64_t>(s.d_model) * 131 + s.d_ff, g.stream),
        dense(g.cublas, s.d_model, s.d_ff, kMaxB),
        y(sizeof(T) * kMaxB * s.d_model, "y"),
        counters(sizeof(prox::SparsityCounters) * (kMaxB + 1), "counters") {
    const int K = s.d_model;
    const std::size_t per = static_cast<std::size_t>(kBatches) * kMaxB * K;
    // Tokens made on the host (seeded), the correlated ones from the same own parts as the independent.
    std::mt19937_64 gen(0x70c5ull + static_cast<std::uint64_t>(K));
    std::normal_distribution<double> normal(0.0, 1.0);
    const auto rng = [&] { return normal(gen); };
    std::vector<T> ind(per), cor(per);
    for (int b = 0; b < kBatches; ++b) {
      std::vector<float> shared(K);
      for (float& v : shared) v = static_cast<float>(rng());
      for (int t = 0; t < kMaxB; ++t) {
        for (int k = 0; k < K; ++k) {
          const float own = static_cast<float>(rng());
          const std::size_t i = (static_cast<std::size_t>(b) * kMaxB + t) * K + k;
          ind[i] = prox::from_float<T>(own);
          cor[i] = prox::from_float<T>(0.8f * shared[k] + 0.6f * own);
        }
      }
    }
    x_ind = DeviceBuffer(sizeof(T) * per, "independent tokens");
    x_cor = DeviceBuffer(sizeof(T) * per, "correlated tokens");
    PROX_BENCH_CUDA(cudaMemcpy(x_ind.get(), ind.data(), sizeof(T) * per, cudaMemcpyHostToDevice));
    PROX_BENCH_CUDA(cudaMemcpy(x_cor.get(), cor.data(), sizeof(T) * per, cudaMemcpyHostToDevice));
    for (const T& v : ind) abs_ind.push_back(std::fabs(prox::to_float(v)));
    launches = prox_bench::launches_per_graph(layer.copies(), kBatches, g_opt.min_launches);
  }
  //! Batch i's tokens [kMaxB][d_model] (the first B of them are used).
  const T* batch(Masks m, int i) const {
    const DeviceBuffer& x = m == Masks::kIndependent ? x_ind : x_cor;
    return x.as<const T>(sizeof(T) * static_cast<std::size_t>(i % kBatches) * kMaxB * shape.d_model);
  }
  FfnShape shape;
  prox_bench::SyntheticLayer<T> layer;
  prox_support::DenseFfn<T, prox::SiLU> dense;
  DeviceBuffer y, counters, x_ind, x_cor;
  std::vector<float> abs_ind;
  int launches = 0;
  std::map<int, std::unique_ptr<Sparse<T>>> sparse;
  std::unique_ptr<Sparse<T>> empty;  //!< batch_ffn_empty's plans: thresholds +inf (made on first use)
  std::unique_ptr<ContextBase> fp8[2];  //!< the FP8 copies of each scale layout (--prox_fp8; fp8_for())
};

std::string g_ctx_key;
std::unique_ptr<ContextBase> g_ctx;

template <class T>
Context<T>& context_for(const FfnShape& shape) {
  const std::string key = std::string(shape.name) + "/" + prox_bench::dtype_name<T>();
  if (g_ctx && g_ctx_key == key) return static_cast<Context<T>&>(*g_ctx);
  PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
  g_ctx.reset();
  const std::size_t copy_bytes = prox_bench::SyntheticLayer<T>::bytes_per_copy(shape);
  const std::size_t budget = prox_bench::memory_budget(static_cast<std::size_t>(g_opt.max_device_gb * 1e9));
  const int copies = prox_bench::rotation_copies(copy_bytes, static_cast<std::size_t>(g_opt.rotate_gb * 1e9),
                                                 budget - budget / 20);
  auto ctx = std::make_unique<Context<T>>(shape, copies);
  std::fprintf(stderr, "[batch_bench] %s: %d weight copies x %.1f MB, %d launches per graph\n", key.c_str(), copies,
               copy_bytes / 1e6, ctx->launches);
  Context<T>& ref = *ctx;
  g_ctx = std::move(ctx);
  g_ctx_key = key;
  return ref;
}

//! One plan per weight copy at sp's thresholds (max_tokens = 8), and their workspace.
template <class T>
void plan_sparse(Context<T>& ctx, Sparse<T>& sp) {
  using Ffn = typename Sparse<T>::Ffn;
  sp.ffns.resize(static_cast<std::size_t>(ctx.layer.copies()));
  for (int c = 0; c < ctx.layer.copies(); ++c) {
    typename Ffn::Config cfg{ctx.shape.d_model, ctx.shape.d_ff, sp.tau_x, sp.tau_s};
    cfg.max_tokens = kMaxB;
    typename Ffn::PlanOptions po;
    po.fuse_batch_stage2 = g_opt.fuse_batch;
    PROX_BENCH_PROX(sp.ffns[c].plan(cfg, ctx.layer.copy(c).template ffn_weights<prox::SiLU>(), po));
  }
  sp.ws = DeviceBuffer(sp.ffns[0].workspace_bytes(), "workspace");
  PROX_BENCH_PROX(prox::initialize_workspace(sp.ws.get(), sp.ws.bytes(), g.stream));
}

//! Thresholds of target e calibrated on the independent tokens (thresholds are per layer: the same
//! for every batch size and mask model), and one plan per weight copy.
template <class T>
Sparse<T>& sparse_for(Context<T>& ctx, int e_pct) {
  auto it = ctx.sparse.find(e_pct);
  if (it != ctx.sparse.end()) return *it->second;
  auto sp = std::make_unique<Sparse<T>>();
  const int K = ctx.shape.d_model;
  PROX_BENCH_PROX(prox::allocate_sparsity(e_pct / 100.0, &sp->target));
  sp->tau_x = prox_bench::magnitude_threshold(ctx.abs_ind, sp->target.s1);
  std::vector<const T*> toks;
  for (int b = 0; b < kBatches; ++b)
    for (int t = 0; t < kMaxB; ++t) toks.push_back(ctx.batch(Masks::kIndependent, b) + static_cast<std::size_t>(t) * K);
  const auto weights_of = [&](int c) { return ctx.layer.copy(c).template ffn_weights<prox::SiLU>(); };
  sp->tau_s = prox_bench::calibrate_tau_s<T, prox::SiLU, prox::Int4Weights>(weights_of(0), ctx.shape, sp->tau_x,
                                                                            sp->target.s2, toks, {}, g.stream);
  plan_sparse(ctx, *sp);
  Sparse<T>& ref = *sp;
  ctx.sparse[e_pct] = std::move(sp);
  return ref;
}

//! batch_ffn_empty's plans: as sparse_for's, with thresholds +inf (no input kept, no channel selected).
template <class T>
Sparse<T>& empty_for(Context<T>& ctx) {
  if (ctx.empty) return *ctx.empty;
  auto sp = std::make_unique<Sparse<T>>();
  sp->tau_x = sp->tau_s = std::numeric_limits<float>::infinity();
  plan_sparse(ctx, *sp);
  ctx.empty = std::move(sp);
  return *ctx.empty;
}

void report_error(benchmark::State& st, const std::string& name, const std::exception& e) {
  std::fprintf(stderr, "[batch_bench] %s: %s\n", name.c_str(), e.what());
  st.SkipWithError(e.what());
}

//! The counters of one untimed run_batch of B tokens per distinct batch of masks m (Config::max_tokens + 1 entries:
//! each token's, then the batch union's at [B]; one token is its own union at [0]), read back to the host.
template <class T, class Ffn>
std::vector<prox::SparsityCounters> batch_counters(Context<T>& ctx, const Ffn& ffn, const DeviceBuffer& ws, int B,
                                                   Masks m) {
  auto* cnt = ctx.counters.template as<prox::SparsityCounters>();
  PROX_BENCH_CUDA(cudaMemsetAsync(cnt, 0, ctx.counters.bytes(), g.stream));
  for (int b = 0; b < kBatches; ++b) {
    typename Ffn::BatchOutputs out;
    out.counters = cnt;
    PROX_BENCH_PROX(ffn.run_batch(ctx.batch(m, b), ctx.y.template as<T>(), B, ws.get(), ws.bytes(), g.stream, out));
  }
  std::vector<prox::SparsityCounters> h(kMaxB + 1);
  PROX_BENCH_CUDA(cudaMemcpyAsync(h.data(), cnt, ctx.counters.bytes(), cudaMemcpyDeviceToHost, g.stream));
  PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
  return h;
}

template <class T>
void bench_batch(benchmark::State& st, const std::string& name, const FfnShape& shape, int e_pct, int B, Masks m) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    Sparse<T>& sp = sparse_for(ctx, e_pct);
    const int K = shape.d_model;
    const int N = shape.d_ff;
    T* y = ctx.y.template as<T>();
    // Densities: one untimed call per distinct batch with the counters on.
    const std::vector<prox::SparsityCounters> h = batch_counters(ctx, sp.ffns[0], sp.ws, B, m);
    prox_bench::check_workspace(sp.ws, "workspace", g.stream);
    double kept = 0.0, sel = 0.0;
    for (int t = 0; t < B; ++t) {
      kept += static_cast<double>(h[t].kept_inputs);
      sel += static_cast<double>(h[t].selected_channels);
    }
    const double calls = kBatches;
    const double in_token = kept / (calls * B * K);
    const double ch_token = sel / (calls * B * N);
    // A single token is its own union (run_batch with one token writes counters[0] only).
    const prox::SparsityCounters& u = B > 1 ? h[B] : h[0];
    const double in_union = static_cast<double>(u.kept_inputs) / (calls * K);
    const double ch_union = static_cast<double>(u.selected_channels) / (calls * N);
    // Stage 1's union rows, scales and the B tokens' x; the union's GLU and down rows.
    const double union_bytes = prox_bench::stage1_int4_bytes(in_union * K, K, N, sizeof(T)) +
                               static_cast<double>(B - 1) * K * sizeof(T) +
                               prox_bench::glu_bytes(ch_union * N, K, sizeof(T)) +
                               prox_bench::down_bytes(ch_union * N, K, sizeof(T));
    const double dense_bytes = prox_bench::dense_ffn_bytes(K, N, sizeof(T));

    const int copies = ctx.layer.copies();
    GraphReplay prox_g(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
      PROX_BENCH_PROX(sp.ffns[i % copies].run_batch(ctx.batch(m, i), y, B, sp.ws.get(), sp.ws.bytes(), s));
    });
    GraphReplay dense_g(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
      const prox_bench::LayerCopy<T> l = ctx.layer.copy(i % copies);
      // W_down^T read as an nn.Linear W_down [d_model][d_ff], as prox_bench's dense_ffn: the same bytes
      // and GEMM shape.
      ctx.dense.run(l.w_gate, l.w_up, l.w_down_t, ctx.batch(m, i), y, s, B);
    });
    const prox_bench::PairedTiming pt = prox_bench::run_paired_loop(st, prox_g, dense_g, g_opt.warmup);
    const Timing& tprox = pt.prox;
    const Timing& tdense = pt.dense;
    prox_bench::check_workspace(sp.ws, "workspace", g.stream);
    const double speedup = tdense.median_s / tprox.median_s;
    const double gbps = union_bytes / tprox.median_s / 1e9;
    st.counters["t_us"] = tprox.median_s * 1e6;
    st.counters["dense_us"] = tdense.median_s * 1e6;
    st.counters["speedup_vs_dense"] = speedup;
    st.counters["tokens"] = B;
    st.counters["e_target"] = e_pct / 100.0;
    st.counters["in_token"] = in_token;
    st.counters["ch_token"] = ch_token;
    st.counters["in_union"] = in_union;
    st.counters["ch_union"] = ch_union;
    st.counters["union_bytes"] = union_bytes;
    st.counters["GBps"] = gbps;
    st.counters["copy_GBps"] = g.copy.GBps;
    st.counters["frac_copy"] = gbps / g.copy.GBps;
    st.counters["floor_speedup"] = dense_bytes / union_bytes;
    st.counters["frac_floor"] = speedup / (dense_bytes / union_bytes);
    st.counters["d_model"] = K;
    st.counters["d_ff"] = N;
    st.counters["copies"] = copies;
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}

//! The batched FFN's fixed cost: empty_for's plans at B tokens, nothing kept, no weight byte read.
template <class T>
void bench_batch_empty(benchmark::State& st, const std::string& name, const FfnShape& shape, int B) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    Sparse<T>& sp = empty_for(ctx);
    T* y = ctx.y.template as<T>();
    const int copies = ctx.layer.copies();
    GraphReplay prox_g(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
      PROX_BENCH_PROX(sp.ffns[i % copies].run_batch(ctx.batch(Masks::kIndependent, i), y, B, sp.ws.get(),
                                                    sp.ws.bytes(), s));
    });
    const Timing t = prox_bench::run_loop(st, prox_g, g_opt.warmup);
    prox_bench::check_workspace(sp.ws, "workspace", g.stream);
    st.counters["t_us"] = t.median_s * 1e6;
    st.counters["tokens"] = B;
    st.counters["d_model"] = shape.d_model;
    st.counters["d_ff"] = shape.d_ff;
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}


// ---------------------------------------------------------------- FP8 Stage-2 weights (--prox_fp8)
// batch_fp8/<model>/<dtype>/<layout>/e<t>/b<B>/<masks>: prox::SparseFfn<T, SiLU, Int4Weights, Fp8Weights<L>>
// (the layer's weights quantized to FP8, prox_bench::Fp8Copies) run_batch at B tokens, replayed in alternation
// with the dense FP8 FFN at B tokens on prox's own kernels (b): the batched FP8 GLU and down GEMVs with every
// channel selected for every token (no Stage 1). Counters: t_us, fp8_dense_us, speedup_vs_fp8_dense (b);
// fp8_floor_us, the dense FP8 bytes at this run's copy bandwidth, speedup_vs_fp8_floor (c); bf16 cuBLAS at B
// tokens (d) is batch_ffn's dense_us of the bf16 layer; in_union, ch_union.

template <class T, prox::fp8::ScaleLayout L>
struct Fp8Batch : ContextBase {
  using Fmt = prox::Fp8Weights<L>;
  using Ffn = prox::SparseFfn<T, prox::SiLU, prox::Int4Weights, Fmt>;
  struct Plans {
    float tau_x = 0.0f, tau_s = 0.0f;
    std::vector<Ffn> ffns;
    DeviceBuffer ws;
  };
  //! The dense FP8 FFN of capacity C: the batched GLU and down GEMVs on all-ones masks.
  template <int C>
  struct Dense {
    using Glu = prox::BatchedGluGemvOp<T, prox::SiLU, C, Fmt>;
    using Down = prox::BatchedDownGemvOp<T, C, Fmt>;
    prox::Operator<Glu> glu;
    prox::Operator<Down> down;
    DeviceBuffer ws;
  };
  explicit Fp8Batch(Context<T>& ctx) : N(ctx.shape.d_ff), fp8(ctx.layer, g.stream) {
    ones = DeviceBuffer(sizeof(std::uint32_t) * (kMaxB + 1) * (N / 32), "all-ones masks");
    PROX_BENCH_CUDA(cudaMemsetAsync(ones.get(), 0xff, ones.bytes(), g.stream));
    s = DeviceBuffer(sizeof(float) * kMaxB * N, "FP8 s");
    PROX_BENCH_CUDA(cudaStreamSynchronize(g.stream));
  }
  typename Ffn::Weights weights(int c) const { return fp8.template ffn_weights<prox::SiLU>(c); }

  Plans& plans(Context<T>& ctx, int e_pct) {
    auto it = by_target.find(e_pct);
    if (it != by_target.end()) return *it->second;
    auto p = std::make_unique<Plans>();
    prox::StageSparsity target{};
    prox::AllocationRule rule;
    rule.alpha = g_opt.fp8_alpha;
    PROX_BENCH_PROX(prox::allocate_sparsity(e_pct / 100.0, &target, rule));
    const int K = ctx.shape.d_model;
    p->tau_x = prox_bench::magnitude_threshold(ctx.abs_ind, target.s1);
    std::vector<const T*> toks;
    for (int b = 0; b < kBatches; ++b)
      for (int t = 0; t < kMaxB; ++t) toks.push_back(ctx.batch(Masks::kIndependent, b) + static_cast<std::size_t>(t) * K);
    p->tau_s = prox_bench::calibrate_tau_s<T, prox::SiLU, prox::Int4Weights, Fmt>(weights(0), ctx.shape, p->tau_x,
                                                                                  target.s2, toks, {}, g.stream);
    p->ffns.resize(static_cast<std::size_t>(fp8.copies()));
    for (int c = 0; c < fp8.copies(); ++c) {
      typename Ffn::Config cfg{K, N, p->tau_x, p->tau_s};
      cfg.max_tokens = kMaxB;
      PROX_BENCH_PROX(p->ffns[c].plan(cfg, weights(c)));
    }
    p->ws = DeviceBuffer(p->ffns[0].workspace_bytes(), "FP8 workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(p->ws.get(), p->ws.bytes(), g.stream));
    Plans& ref = *p;
    by_target[e_pct] = std::move(p);
    return ref;
  }

  //! The dense FP8 FFN of B tokens for launch i (copy i mod copies), on capacity C's ops (planned on first use).
  template <int C>
  void enqueue_dense(Context<T>& ctx, std::unique_ptr<Dense<C>>& d, int i, int B, Masks m, cudaStream_t st) {
    const typename Ffn::Weights w = weights(i % fp8.copies());
    typename Dense<C>::Glu::Args ga;
    ga.x = ctx.batch(m, i);
    ga.tokens = B;
    ga.d_model = ctx.shape.d_model;
    ga.d_ff = N;
    ga.w_gate = w.gate;
    ga.w_up = w.up;
    ga.channel_mask = ones.template as<const std::uint32_t>();
    ga.union_mask = ones.template as<const std::uint32_t>();
    ga.s = s.template as<float>();
    typename Dense<C>::Down::Args da;
    da.s = s.template as<const float>();
    da.union_mask = ones.template as<const std::uint32_t>();
    da.w_down_t = w.down_t;
    da.tokens = B;
    da.d_model = ctx.shape.d_model;
    da.d_ff = N;
    da.y = ctx.y.template as<T>();
    if (!d) {
      d = std::make_unique<Dense<C>>();
      PROX_BENCH_PROX(d->glu.initialize(ga));
      PROX_BENCH_PROX(d->down.initialize(da));
      d->ws = DeviceBuffer(std::max<std::size_t>(prox::Operator<typename Dense<C>::Down>::workspace_bytes(da), 16),
                           "FP8 dense workspace");
      PROX_BENCH_PROX(prox::initialize_workspace(d->ws.get(), d->ws.bytes(), st));
    }
    PROX_BENCH_PROX(d->glu.run(ga, nullptr, 0, st));
    PROX_BENCH_PROX(d->down.run(da, d->ws.get(), d->ws.bytes(), st));
  }
  void enqueue_dense(Context<T>& ctx, int i, int B, Masks m, cudaStream_t st) {
    if (B <= 2) {
      enqueue_dense<2>(ctx, dense2, i, B, m, st);
    } else if (B <= 4) {
      enqueue_dense<4>(ctx, dense4, i, B, m, st);
    } else {
      enqueue_dense<8>(ctx, dense8, i, B, m, st);
    }
  }

  int N;
  prox_bench::Fp8Copies<T, L> fp8;
  DeviceBuffer ones, s;
  std::map<int, std::unique_ptr<Plans>> by_target;
  std::unique_ptr<Dense<2>> dense2;
  std::unique_ptr<Dense<4>> dense4;
  std::unique_ptr<Dense<8>> dense8;
};

template <class T, prox::fp8::ScaleLayout L>
void bench_fp8_batch(benchmark::State& st, const std::string& name, const FfnShape& shape, int e_pct, int B,
                     Masks m) {
  try {
    Context<T>& ctx = context_for<T>(shape);
    auto& slot = ctx.fp8[static_cast<int>(L)];
    if (!slot) slot = std::make_unique<Fp8Batch<T, L>>(ctx);
    auto& set = static_cast<Fp8Batch<T, L>&>(*slot);
    auto& p = set.plans(ctx, e_pct);
    const int K = shape.d_model;
    const int N = shape.d_ff;
    T* y = ctx.y.template as<T>();
    const std::vector<prox::SparsityCounters> h = batch_counters(ctx, p.ffns[0], p.ws, B, m);
    const prox::SparsityCounters& u = B > 1 ? h[B] : h[0];
    const double in_union = static_cast<double>(u.kept_inputs) / (kBatches * static_cast<double>(K));
    const double ch_union = static_cast<double>(u.selected_channels) / (kBatches * static_cast<double>(N));
    const int copies = set.fp8.copies();
    GraphReplay prox_g(g.stream, ctx.launches, [&](int i, cudaStream_t s) {
      PROX_BENCH_PROX(p.ffns[i % copies].run_batch(ctx.batch(m, i), y, B, p.ws.get(), p.ws.bytes(), s));
    });
    GraphReplay dense_g(g.stream, ctx.launches, [&](int i, cudaStream_t s) { set.enqueue_dense(ctx, i, B, m, s); });
    const prox_bench::PairedTiming pt = prox_bench::run_paired_loop(st, prox_g, dense_g, g_opt.warmup);
    const double floor_s = set.fp8.dense_bytes() / (g.copy.GBps * 1e9);
    st.counters["t_us"] = pt.prox.median_s * 1e6;
    st.counters["fp8_dense_us"] = pt.dense.median_s * 1e6;
    st.counters["speedup_vs_fp8_dense"] = pt.ratio.median_s;
    st.counters["fp8_floor_us"] = floor_s * 1e6;
    st.counters["speedup_vs_fp8_floor"] = floor_s / pt.prox.median_s;
    st.counters["copy_GBps"] = g.copy.GBps;
    st.counters["tokens"] = B;
    st.counters["e_target"] = e_pct / 100.0;
    st.counters["in_union"] = in_union;
    st.counters["ch_union"] = ch_union;
    st.counters["d_model"] = K;
    st.counters["d_ff"] = N;
    st.counters["copies"] = copies;
    st.SetLabel(prox::fp8::to_string(L));
  } catch (const std::exception& e) {
    report_error(st, name, e);
  }
}

template <class T>
void register_shape(const FfnShape& shape, const std::vector<int>& targets, const std::vector<int>& batches,
                    const std::vector<Masks>& masks) {
  const std::string base = std::string(shape.name) + "/" + prox_bench::dtype_name<T>();
  for (int B : batches) {
    const std::string name = "batch_ffn_empty/" + base + "/b" + std::to_string(B);
    benchmark::RegisterBenchmark(name.c_str(), [name, shape, B](benchmark::State& st) {
      bench_batch_empty<T>(st, name, shape, B);
    })
        ->UseManualTime()
        ->Iterations(g_opt.iterations)
        ->Unit(benchmark::kMicrosecond);
  }
  for (int e : targets) {
    for (Masks m : masks) {
      for (int B : batches) {
        const std::string name =
            "batch_ffn/" + base + "/e" + std::to_string(e) + "/b" + std::to_string(B) + "/" + masks_name(m);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [name, shape, e, B, m](benchmark::State& st) {
                                       bench_batch<T>(st, name, shape, e, B, m);
                                     })
            ->UseManualTime()
            ->Iterations(g_opt.iterations)
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  using L = prox::fp8::ScaleLayout;
  for (const std::string& l : prox_bench::split_list(prox_bench::lower(g_opt.fp8))) {
    if (l != "channel" && l != "block128")
      throw std::invalid_argument("--prox_fp8: unknown scale layout '" + l + "' (channel, block128)");
    const bool block = l == "block128";
    for (int e : targets) {
      for (Masks m : masks) {
        for (int B : batches) {
          const std::string name = "batch_fp8/" + base + "/" + l + "/e" + std::to_string(e) + "/b" + std::to_string(B) +
                                   "/" + masks_name(m);
          benchmark::RegisterBenchmark(name.c_str(),
                                       [name, shape, e, B, m, block](benchmark::State& st) {
                                         if (block) {
                                           bench_fp8_batch<T, L::kBlock128>(st, name, shape, e, B, m);
                                         } else {
                                           bench_fp8_batch<T, L::kPerChannel>(st, name, shape, e, B, m);
                                         }
                                       })
              ->UseManualTime()
              ->Iterations(g_opt.iterations)
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
}

void register_all() {
  const std::vector<FfnShape> shapes = prox_bench::select_shapes(g_opt.shapes, prox_bench::qwen3_shapes());
  std::vector<int> targets, batches;
  for (const std::string& t : prox_bench::split_list(g_opt.targets)) targets.push_back(std::stoi(t));
  for (const std::string& b : prox_bench::split_list(g_opt.batches)) batches.push_back(std::stoi(b));
  std::vector<Masks> masks;
  for (const std::string& m : prox_bench::split_list(prox_bench::lower(g_opt.masks)))
    masks.push_back(m == "indep" ? Masks::kIndependent : Masks::kCorrelated);
  const std::vector<std::string> dtypes = prox_bench::split_list(prox_bench::lower(g_opt.dtypes));
  const auto want = [&](const char* d) { return std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end(); };
  for (const FfnShape& s : shapes) {
    if (want("f16")) register_shape<__half>(s, targets, batches, masks);
    if (want("bf16")) register_shape<__nv_bfloat16>(s, targets, batches, masks);
  }
}

void add_flags(CLI::App* app) {
  namespace cli = prox_support::cli;
  cli::setup(*app, cli::Syntax::kEquals);
  const auto count = [](int lo) { return cli::value_check(cli::number_in(lo, 1e9, true)); };
  const auto positive = cli::value_check(cli::positive_number());
  prox_bench::add_layer_flags(*app, &g_opt.shapes, &g_opt.dtypes, &g_opt.targets);
  app->add_option("--prox_batches", g_opt.batches, "tokens per call, 1..8")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(cli::number_in(1, kMaxB, true)));
  app->add_option("--prox_masks", g_opt.masks, "indep (independent tokens), corr (correlated tokens)")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check([](const std::string& v) { return cli::one_of({"indep", "corr"})(prox_bench::lower(v)); }));
  app->add_option("--prox_iterations", g_opt.iterations, "timed replay pairs per benchmark")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(1));
  app->add_option("--prox_warmup", g_opt.warmup, "untimed replays first")->type_name("N")->capture_default_str()->check(count(0));
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
  app->add_option("--prox_fuse_batch", g_opt.fuse_batch,
                  "B = 2..4: Stage 2 as the fused batched kernel (PlanOptions::fuse_batch_stage2)")
      ->type_name("0|1")
      ->capture_default_str();
  app->add_option("--prox_fp8", g_opt.fp8,
                  "FP8 e4m3 Stage-2 benches (batch_fp8) of these scale layouts: channel,block128 (default: none)")
      ->type_name("LIST");
  app->add_option("--prox_fp8_alpha", g_opt.fp8_alpha,
                  "the allocation's alpha of the FP8 plans (default prox::fp8::kAllocationAlpha)")
      ->capture_default_str()
      ->check(CLI::Range(1e-3, 10.0));
  app->add_option("--prox_commit", g_opt.commit, "commit to record (else $PROX_COMMIT, else the one built from)")
      ->type_name("SHA");
  app->footer("plus Google Benchmark's flags, e.g. --benchmark_filter=REGEX --benchmark_out=FILE --benchmark_list_tests");
}

constexpr const char* kDescription = "prox_batch_bench: batched decode against cuBLAS dense (docs/benchmarks.md)";


void parse_flags(int* argc, char** argv) {
  CLI::App app{kDescription, "prox_batch_bench"};
  add_flags(&app);
  prox_bench::parse_own_flags(app, argc, argv);
}

//! --help: the flags of this binary (Google Benchmark's are listed by --benchmark_*).
void usage() {
  CLI::App app{kDescription, "prox_batch_bench"};
  add_flags(&app);
  std::fputs(app.help().c_str(), stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const prox_bench::BenchMain m{"prox_batch_bench", usage, parse_flags, register_all, nullptr, [] { g_ctx.reset(); }};
  return prox_bench::bench_main(argc, argv, g, m, g_opt.commit);
}
