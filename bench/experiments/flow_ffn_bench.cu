// SPDX-License-Identifier: Apache-2.0
//! @file flow_ffn_bench.cu  Development harness (issue 46): the one-kernel FFN (flow_ffn.cuh) against the
//! two-kernel SparseFfn and cuBLAS dense on the same synthetic layers (bench_common.cuh), in one process:
//! correctness first (y against a float64 host reference on the flow kernel's own channel set, the channel sets
//! of both paths, every y element written, run-to-run differences), then CUDA-graph timings over rotated weight
//! copies. Built by CMake as prox_flow_experiment (not part of `all`).
//!   prox_flow_experiment [--shapes=8B,14B] [--targets=0,40,50,60,70] [--iterations=20] [--prefetch_mb=0]
//! target 0 is the fixed cost (thresholds +inf: nothing kept, nothing selected).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#define PROX_FLOW_TRACE 1
#include "bench_common.cuh"
#include "flow/flow_ffn.cuh"

namespace {
using namespace prox_bench;
using T = __nv_bfloat16;
using Act = prox::SiLU;
using Ffn = prox::SparseFfn<T, Act>;
using FlowOp = prox_flow::FlowFfnOp<T, Act>;

struct Flags {
  std::string shapes = "8B,14B";
  std::string targets = "0,40,50,60,70";
  int iterations = 20;
  double prefetch_mb = 0.0;
  int policy = -1;
  double rotate_gb = 4.0;
  bool trace = false;
  bool chain = false;
};

std::string flag_value(int argc, char** argv, const char* name, const std::string& def) {
  const std::string p = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], p.c_str(), p.size()) == 0) return argv[i] + p.size();
  return def;
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

//! Tiled copies of every weight copy's proxies (int4::tile_device).
struct TiledProxies {
  DeviceBuffer arena;
  std::size_t words = 0;
  TiledProxies(const SyntheticLayer<T>& layer, cudaStream_t s) {
    const int K = layer.shape().d_model, N = layer.shape().d_ff;
    words = prox::int4::packed_words(K, N);
    arena = DeviceBuffer(sizeof(std::uint32_t) * words * 2 * layer.copies(), "tiled proxies");
    for (int c = 0; c < layer.copies(); ++c) {
      const LayerCopy<T> l = layer.copy(c);
      PROX_BENCH_PROX(prox_flow::tiled::tile_device(l.proxy_gate.packed, K, N, gate(c), s));
      PROX_BENCH_PROX(prox_flow::tiled::tile_device(l.proxy_up.packed, K, N, up(c), s));
    }
    PROX_BENCH_CUDA(cudaStreamSynchronize(s));
  }
  std::uint32_t* gate(int c) const { return arena.as<std::uint32_t>(sizeof(std::uint32_t) * words * (2 * c)); }
  std::uint32_t* up(int c) const { return arena.as<std::uint32_t>(sizeof(std::uint32_t) * words * (2 * c + 1)); }
};

FlowOp::Args flow_args(const SyntheticLayer<T>& layer, const TiledProxies& tp, int c, int t, float tau_x, float tau_s,
                       T* y) {
  const LayerCopy<T> l = layer.copy(c);
  FlowOp::Args a;
  a.x = layer.token(t);
  a.y = y;
  a.d_model = layer.shape().d_model;
  a.d_ff = layer.shape().d_ff;
  a.tau_x = tau_x;
  a.tau_s = tau_s;
  a.proxy_gate = {tp.gate(c), l.proxy_gate.scales};
  a.proxy_up = {tp.up(c), l.proxy_up.scales};
  a.w_gate = l.w_gate;
  a.w_up = l.w_up;
  a.w_down_t = l.w_down_t;
  return a;
}

//! Issue 46 part 2's question, measured without touching the library: does pulling the next layer's QKV weights
//! into L2 while the FFN runs save more in the QKV GEMV than it costs the FFN? Blocks spin until `delay_ns` after
//! their start, then prefetch their share of [p, p + bytes) (cp.async.bulk.prefetch.L2, 64 KB pieces).
__global__ void prefetch_kernel(const char* p, std::size_t bytes, unsigned long long delay_ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < delay_ns);
  if (threadIdx.x != 0) return;
  const std::size_t share = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~std::size_t(15);
  const std::size_t lo = share * blockIdx.x, hi = lo + share < bytes ? lo + share : bytes;
  for (std::size_t o = lo; o < hi; o += 65536)
    prox_flow::bulk::prefetch_l2(p + o, static_cast<unsigned>(hi - o < 65536 ? hi - o : 65536));
}

//! FFN (two kernels, SparseFfn) then a cuBLAS QKV GEMV [n_qkv][d_model] per launch, over rotated copies; with a
//! prefetch of the launch's QKV weights on a parallel graph branch (mb MB, after delay_us), or none (mb = 0).
void chain_experiment(const FfnShape& shape, int n_qkv, const Flags& f, cudaStream_t s, cublasHandle_t cublas) {
  const int K = shape.d_model, N = shape.d_ff;
  const std::size_t copy_bytes = SyntheticLayer<T>::bytes_per_copy(shape);
  const int copies = rotation_copies(copy_bytes, std::size_t(4e9), memory_budget(std::size_t(40e9)) / 2);
  const int tokens = 8;
  SyntheticLayer<T> layer(shape, copies, tokens, 0x5eed0000ull + K * 131ull + N, s);
  const std::size_t qkv_bytes = sizeof(T) * static_cast<std::size_t>(n_qkv) * K;
  DeviceBuffer qkv(qkv_bytes * copies, "QKV copies"), q_out(sizeof(T) * n_qkv, "qkv out"), y(sizeof(T) * K, "y");
  fill_normal(qkv.as<T>(), qkv_bytes / sizeof(T) * copies, 0x9e11ull, 0.02f, s);
  prox_support::DenseFfn<T, Act> dense(cublas, K, N);
  const int launches = launches_per_graph(copies, tokens, 32);
  std::vector<const T*> toks;
  for (int t = 0; t < tokens; ++t) toks.push_back(layer.token(t));
  prox::StageSparsity split{};
  PROX_BENCH_PROX(prox::allocate_sparsity(0.7, &split));
  const float tau_x = magnitude_threshold(layer.host_abs_tokens(s), split.s1);
  const float tau_s = calibrate_tau_s<T, Act, prox::Int4Weights>(layer.copy(0).ffn_weights<Act>(), shape, tau_x,
                                                                 split.s2, toks, prox::PolicyChoice{}, s);
  std::vector<Ffn> ffns(copies);
  for (int c = 0; c < copies; ++c) PROX_BENCH_PROX(ffns[c].plan({K, N, tau_x, tau_s}, layer.copy(c).ffn_weights<Act>()));
  DeviceBuffer ws(ffns[0].workspace_bytes(), "workspace");
  PROX_BENCH_PROX(prox::initialize_workspace(ws.get(), ws.bytes(), s));
  cudaStream_t s2;
  PROX_BENCH_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(2 * launches);
  for (auto& e : ev) PROX_BENCH_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  const auto qkv_gemv = [&](int i, cudaStream_t st) {
    dense.gemv(qkv.as<const T>(qkv_bytes * (i % copies)), y.as<const T>(), q_out.as<T>(), n_qkv, K, st);
  };
  const auto measure = [&](double mb, double delay_us, bool ffn, bool gemv) {
    GraphReplay g(s, launches, [&](int i, cudaStream_t st) {
      if (mb > 0) {
        PROX_BENCH_CUDA(cudaEventRecord(ev[2 * i], st));
        PROX_BENCH_CUDA(cudaStreamWaitEvent(s2, ev[2 * i], 0));
        const std::size_t b = std::min(qkv_bytes, static_cast<std::size_t>(mb * 1e6)) & ~std::size_t(15);
        prefetch_kernel<<<8, 32, 0, s2>>>(qkv.as<const char>(qkv_bytes * (i % copies)), b,
                                            static_cast<unsigned long long>(delay_us * 1e3));
        PROX_BENCH_CUDA(cudaGetLastError());
        PROX_BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], s2));
      }
      if (ffn) PROX_BENCH_PROX(ffns[i % copies].run(layer.token(i % tokens), y.as<T>(), ws.get(), ws.bytes(), st));
      if (mb > 0) PROX_BENCH_CUDA(cudaStreamWaitEvent(st, ev[2 * i + 1], 0));
      if (gemv) qkv_gemv(i, st);
    });
    return g.measure(3, f.iterations).median_s * 1e6;
  };
  std::printf("\n== chain %s: SparseFfn (e = 70 %%) then QKV GEMV [%d][%d] (%.1f MB), %d copies\n", shape.name, n_qkv, K,
              qkv_bytes / 1e6, copies);
  const double t_ffn = measure(0, 0, true, false), t_gemv = measure(0, 0, false, true), t_both = measure(0, 0, true, true);
  std::printf("FFN alone %.2f us, QKV GEMV alone %.2f us, FFN + GEMV %.2f us\n", t_ffn, t_gemv, t_both);
  for (double mb : {12.5, 25.0, 50.0}) {
    for (double d : {0.0, 10.0, 20.0, 28.0}) {
      const double t = measure(mb, d, true, true);
      std::printf("prefetch %5.1f MB after %4.1f us: FFN + GEMV %.2f us (%+.2f us)\n", mb, d, t, t - t_both);
    }
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaStreamDestroy(s2);
}

//! One traced launch: where each block's time goes (worker thread 0's and the producer's view), one summary line.
void trace_launch(prox::Operator<FlowOp>& flow, const FlowOp::Args& a, DeviceBuffer& ws, cudaStream_t s,
                  const char* label) {
  namespace d = prox_flow::fx;
  const int G = static_cast<int>(flow.launch_config().grid.x);
  constexpr int kEv = d::kFlowTraceEvents;
  DeviceBuffer buf(sizeof(unsigned long long) * 2 * kEv * 2 * G, "trace");
  PROX_BENCH_CUDA(cudaMemsetAsync(buf.get(), 0, buf.bytes(), s));
  unsigned long long* p = buf.as<unsigned long long>();
  PROX_BENCH_CUDA(cudaMemcpyToSymbolAsync(d::g_flow_trace, &p, sizeof(p), 0, cudaMemcpyHostToDevice, s));
  PROX_BENCH_PROX(flow.run(a, ws.get(), ws.bytes(), s));
  unsigned long long* null = nullptr;
  PROX_BENCH_CUDA(cudaMemcpyToSymbolAsync(d::g_flow_trace, &null, sizeof(null), 0, cudaMemcpyHostToDevice, s));
  const std::vector<unsigned long long> h = to_host(buf.as<const unsigned long long>(), 2 * kEv * 2 * G, s);
  const auto ev = [&](int b, int role, int i) { return h.data() + ((static_cast<std::size_t>(b) * 2 + role) * kEv + i) * 2; };
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < G; ++b)
    if (ev(b, 0, 0)[0] != 0) t0 = std::min(t0, ev(b, 0, 0)[0]);
  double x_loaded = 0, x_round0 = 0, x_done_sum = 0, x_loaded_sum = 0, x_round0_sum = 0, work_sum = 0, arr_sum = 0;
  double x_done = 0, last_tile = 0, first_cons = 1e30, last_cons = 0, last_work = 0, last_arr = 0, fin = 0,
         last_fill = 0, fills_done = 0;
  double tile_t = 0, wait_t = 0, cons_t = 0, n_tiles = 0, n_cons = 0, n_ch = 0, n_fill = 0;
  for (int b = 0; b < G; ++b) {
    double mark = 0;
    for (int i = 0; i < kEv && ev(b, 0, i)[0] != 0; ++i) {
      const double t = (ev(b, 0, i)[0] - t0) * 1e-3;
      const int kind = static_cast<int>(ev(b, 0, i)[1] >> 32);
      const unsigned v = static_cast<unsigned>(ev(b, 0, i)[1]);
      switch (kind) {
        case d::kFlowEvXDone: x_done = std::max(x_done, t); x_done_sum += t; break;
        case d::kFlowEvXLoaded: x_loaded = std::max(x_loaded, t); x_loaded_sum += t; break;
        case d::kFlowEvXRound: if (v == 0) { x_round0 = std::max(x_round0, t); x_round0_sum += t; } break;
        case d::kFlowEvTile: mark = t; break;
        case d::kFlowEvTileEnd: tile_t += t - mark; n_tiles += 1; last_tile = std::max(last_tile, t); break;
        case d::kFlowEvWait: mark = t; break;
        case d::kFlowEvConsume: wait_t += t - mark; mark = t; n_cons += 1; n_ch += v; first_cons = std::min(first_cons, t); break;
        case d::kFlowEvConsumeEnd: cons_t += t - mark; last_cons = std::max(last_cons, t); break;
        case d::kFlowEvWorkDone: wait_t += t - mark; last_work = std::max(last_work, t); work_sum += t; break;
        case d::kFlowEvArrived: last_arr = std::max(last_arr, t); arr_sum += t; break;
        case d::kFlowEvFinal: fin = t; break;
        default: break;
      }
    }
    for (int i = 0; i < kEv && ev(b, 1, i)[0] != 0; ++i) {
      const double t = (ev(b, 1, i)[0] - t0) * 1e-3;
      const int kind = static_cast<int>(ev(b, 1, i)[1] >> 32);
      if (kind == d::kFlowEvFill) { n_fill += 1; last_fill = std::max(last_fill, t); }
      if (kind == d::kFlowEvFillDone) fills_done = std::max(fills_done, t);
    }
  }
  std::printf("  trace %s: x loaded %.2f/%.2f, round0 %.2f/%.2f, x done %.2f (mean %.2f), work done mean %.2f, arrived "
              "mean %.2f\n", label, x_loaded_sum / G, x_loaded, x_round0_sum / G, x_round0, x_done, x_done_sum / G,
              work_sum / G, arr_sum / G);
  std::printf("  trace %s: x %.2f, last tile %.2f, consume %.2f..%.2f, work done %.2f, last fill %.2f, fills done %.2f, "
              "arrived %.2f, final %.2f us | per block: tiles %.1f (%.2f us), stages %.1f (%.1f ch), waiting %.2f us, "
              "computing %.2f us, fills %.1f\n",
              label, x_done, last_tile, first_cons < 1e29 ? first_cons : 0.0, last_cons, last_work, last_fill,
              fills_done, last_arr, fin, n_tiles / G, tile_t / G, n_cons / G, n_ch / G, wait_t / G, cons_t / G, n_fill / G);
}

void run_shape(const FfnShape& shape, const Flags& f, const std::vector<int>& targets, cudaStream_t s,
               cublasHandle_t cublas, double copy_gbps) {
  const int K = shape.d_model, N = shape.d_ff;
  const std::size_t copy_bytes = SyntheticLayer<T>::bytes_per_copy(shape);
  const std::size_t budget = memory_budget(std::size_t(40e9));
  const int copies = rotation_copies(copy_bytes * 5 / 4, static_cast<std::size_t>(f.rotate_gb * 1e9), budget - budget / 10);
  const int tokens = 8;
  SyntheticLayer<T> layer(shape, copies, tokens, 0x5eed0000ull + K * 131ull + N, s);
  TiledProxies tp(layer, s);
  prox_support::DenseFfn<T, Act> dense(cublas, K, N);
  const int launches = launches_per_graph(copies, tokens, 32);
  std::printf("\n== %s (d_model %d, d_ff %d): %d copies, %d launches per graph\n", shape.name, K, N, copies, launches);

  // Host copies of copy 0 (float64 reference).
  const LayerCopy<T> l0 = layer.copy(0);
  const std::size_t kn = static_cast<std::size_t>(K) * N;
  const std::vector<T> hg = to_host(l0.w_gate, kn, s), hu = to_host(l0.w_up, kn, s), hd = to_host(l0.w_down_t, kn, s);

  std::vector<const T*> toks;
  for (int t = 0; t < tokens; ++t) toks.push_back(layer.token(t));
  const std::vector<float> absx = layer.host_abs_tokens(s);

  DeviceBuffer y_flow(sizeof(T) * K, "y flow"), y_ffn(sizeof(T) * K, "y ffn"), y_dense(sizeof(T) * K, "y dense");
  DeviceBuffer mask_f(sizeof(std::uint32_t) * N / 32, "mask flow"), mask_2(sizeof(std::uint32_t) * N / 32, "mask 2k");
  DeviceBuffer sp_f(sizeof(float) * N, "s~ flow"), sp_2(sizeof(float) * N, "s~ 2k"), s_f(sizeof(float) * N, "s flow");
  DeviceBuffer prefetch_buf;
  if (f.prefetch_mb > 0) prefetch_buf = DeviceBuffer(static_cast<std::size_t>(f.prefetch_mb * 1e6) & ~std::size_t(255), "prefetch");

  // Dense baseline.
  GraphReplay gd(s, launches, [&](int i, cudaStream_t st) {
    const LayerCopy<T> l = layer.copy(i % copies);
    dense.run(l.w_gate, l.w_up, l.w_down_t, layer.token(i % tokens), y_dense.as<T>(), st);
  });
  const double dense_us = gd.measure(3, f.iterations).median_s * 1e6;
  std::printf("%-6s %9s %9s %9s %8s %8s | %7s %7s %7s | %s\n", "e", "dense us", "2k us", "flow us", "2k x", "flow x",
              "s1", "s2", "flowGBs", "checks");

  for (int e : targets) {
    float tau_x = INFINITY, tau_s = INFINITY;
    prox::StageSparsity split{};
    if (e > 0) {
      PROX_BENCH_PROX(prox::allocate_sparsity(e / 100.0, &split));
      tau_x = magnitude_threshold(absx, split.s1);
      tau_s = calibrate_tau_s<T, Act, prox::Int4Weights>(l0.ffn_weights<Act>(), shape, tau_x, split.s2, toks,
                                                          prox::PolicyChoice{}, s);
    }
    // Plans: the two-kernel FFN per copy, the flow op once (per-call arguments).
    std::vector<Ffn> ffns(copies);
    for (int c = 0; c < copies; ++c) PROX_BENCH_PROX(ffns[c].plan({K, N, tau_x, tau_s}, layer.copy(c).ffn_weights<Act>()));
    DeviceBuffer ws2(ffns[0].workspace_bytes(), "2k workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(ws2.get(), ws2.bytes(), s));
    prox::Operator<FlowOp> flow;
    FlowOp::Args a0 = flow_args(layer, tp, 0, 0, tau_x, tau_s, y_flow.as<T>());
    PROX_BENCH_PROX(flow.initialize(a0, FlowOp::Options{true, true}, f.policy));
    const std::size_t wsf_bytes = prox::Operator<FlowOp>::workspace_bytes(a0);
    DeviceBuffer wsf(wsf_bytes, "flow workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(wsf.get(), wsf.bytes(), s));

    // ---- Checks on token t, copy 0.
    std::string checks;
    int bad_total = 0;
    double worst_rel = 0.0;
    int nondet = 0, mask_diff = 0;
    double kept_sum = 0, sel_sum = 0;
    for (int t = 0; t < tokens; ++t) {
      PROX_BENCH_CUDA(cudaMemsetAsync(y_flow.get(), 0xff, sizeof(T) * K, s));  // poison (NaN bits)
      FlowOp::Args a = flow_args(layer, tp, 0, t, tau_x, tau_s, y_flow.as<T>());
      a.channel_mask = mask_f.as<std::uint32_t>();
      a.s_proxy = sp_f.as<float>();
      a.s = s_f.as<float>();
      PROX_BENCH_PROX(flow.run(a, wsf.get(), wsf.bytes(), s));
      const std::vector<T> y1 = to_host(y_flow.as<const T>(), K, s);
      PROX_BENCH_PROX(flow.run(a, wsf.get(), wsf.bytes(), s));
      const std::vector<T> y1b = to_host(y_flow.as<const T>(), K, s);
      Ffn::Outputs o;
      o.channel_mask = mask_2.as<std::uint32_t>();
      o.s_proxy = sp_2.as<float>();
      PROX_BENCH_PROX(ffns[0].run(layer.token(t), y_ffn.as<T>(), ws2.get(), ws2.bytes(), s, o));
      const std::vector<T> y2 = to_host(y_ffn.as<const T>(), K, s);
      const std::vector<std::uint32_t> mf = to_host(mask_f.as<const std::uint32_t>(), N / 32, s);
      const std::vector<std::uint32_t> m2 = to_host(mask_2.as<const std::uint32_t>(), N / 32, s);
      const std::vector<float> sf = to_host(s_f.as<const float>(), N, s);
      const std::vector<T> hx = to_host(layer.token(t), K, s);
      for (int w = 0; w < N / 32; ++w) mask_diff += __builtin_popcount(mf[w] ^ m2[w]);
      int kept = 0;
      for (int k = 0; k < K; ++k) kept += std::fabs(prox::to_float(hx[k])) >= tau_x;
      kept_sum += kept;
      // float64 reference on the flow kernel's channel set.
      std::vector<double> yr(K, 0.0);
      int sel = 0;
      double s_err = 0.0;
      for (int j = 0; j < N; ++j) {
        const bool on = (mf[j / 32] >> (j % 32)) & 1u;
        if (!on) {
          if (sf[j] != 0.0f) s_err = INFINITY;  // unselected channels must have s = +0
          continue;
        }
        ++sel;
        double g = 0, u = 0;
        for (int k = 0; k < K; ++k) {
          const double xk = prox::to_float(hx[k]);
          g += xk * prox::to_float(hg[static_cast<std::size_t>(j) * K + k]);
          u += xk * prox::to_float(hu[static_cast<std::size_t>(j) * K + k]);
        }
        const double sj = u * silu(g);
        s_err = std::max(s_err, std::fabs(sj - sf[j]) / (std::fabs(sj) + 1e-3));
        for (int d = 0; d < K; ++d) yr[d] += sj * prox::to_float(hd[static_cast<std::size_t>(j) * K + d]);
      }
      sel_sum += sel;
      double num = 0, den = 0, num2 = 0;
      int bad = 0;
      for (int d = 0; d < K; ++d) {
        const double v = prox::to_float(y1[d]);
        if (!std::isfinite(v)) ++bad;
        num += (v - yr[d]) * (v - yr[d]);
        den += yr[d] * yr[d];
        const double v2 = prox::to_float(y2[d]);
        num2 += (v2 - v) * (v2 - v);
        nondet += std::memcmp(&y1[d], &y1b[d], sizeof(T)) != 0;
      }
      bad_total += bad;
      const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      worst_rel = std::max(worst_rel, rel);
      if (t == 0) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "t0: rel %.2e vs f64, vs 2k %.2e, s err %.1e", rel,
                      den > 0 ? std::sqrt(num2 / den) : std::sqrt(num2), s_err);
        checks += buf;
      }
    }
    {
      char buf[200];
      std::snprintf(buf, sizeof buf, "; worst rel %.2e, unwritten/NaN %d, mask diff %d bits, nondet %d elems",
                    worst_rel, bad_total, mask_diff, nondet);
      checks += buf;
    }
    // ---- Timings.
    GraphReplay g2(s, launches, [&](int i, cudaStream_t st) {
      PROX_BENCH_PROX(ffns[i % copies].run(layer.token(i % tokens), y_ffn.as<T>(), ws2.get(), ws2.bytes(), st));
    });
    const double t2 = g2.measure(3, f.iterations).median_s * 1e6;
    GraphReplay gf(s, launches, [&](int i, cudaStream_t st) {
      FlowOp::Args a = flow_args(layer, tp, i % copies, i % tokens, tau_x, tau_s, y_flow.as<T>());
      if (prefetch_buf.bytes() > 0) {
        a.prefetch = prefetch_buf.get();
        a.prefetch_bytes = prefetch_buf.bytes();
      }
      PROX_BENCH_PROX(flow.run(a, wsf.get(), wsf.bytes(), st));
    });
    const double tf = gf.measure(3, f.iterations).median_s * 1e6;
    const double s1 = 1.0 - kept_sum / (tokens * double(K)), s2 = 1.0 - sel_sum / (tokens * double(N));
    const double bytes = (1.0 - s1) * K * (N / 2.0 + 0.0) + (1.0 - s2) * N * 3.0 * K * sizeof(T);
    std::printf("%-6d %9.2f %9.2f %9.2f %8.3f %8.3f | %7.4f %7.4f %7.0f | %s\n", e, dense_us, t2, tf, dense_us / t2,
                dense_us / tf, s1, s2, bytes / (tf * 1e-6) / 1e9, checks.c_str());
    if (f.trace) {
      for (int r = 0; r < 2; ++r) {
        char label[32];
        std::snprintf(label, sizeof label, "e%d #%d", e, r);
        trace_launch(flow, flow_args(layer, tp, r % copies, r % tokens, tau_x, tau_s, y_flow.as<T>()), wsf, s, label);
      }
    }
    std::fflush(stdout);
  }
  std::printf("(copy bandwidth %.0f GB/s; flowGBs = bytes that had to be read / flow time)\n", copy_gbps);
}
}  // namespace

int main(int argc, char** argv) {
  Flags f;
  f.shapes = flag_value(argc, argv, "shapes", f.shapes);
  f.targets = flag_value(argc, argv, "targets", f.targets);
  f.iterations = std::stoi(flag_value(argc, argv, "iterations", std::to_string(f.iterations)));
  f.prefetch_mb = std::stod(flag_value(argc, argv, "prefetch_mb", "0"));
  f.policy = std::stoi(flag_value(argc, argv, "policy", "-1"));
  f.rotate_gb = std::stod(flag_value(argc, argv, "rotate_gb", "4"));
  f.trace = flag_value(argc, argv, "trace", "0") == "1";
  f.chain = flag_value(argc, argv, "chain", "0") == "1";
  try {
    const DeviceFacts dev = query_device_facts();
    std::printf("%s\n", describe(dev).c_str());
    cudaStream_t s;
    PROX_BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate");
    const CopyBandwidth cb = measure_copy_bandwidth(s);
    std::vector<int> targets;
    for (const std::string& t : split_list(f.targets)) targets.push_back(std::stoi(t));
    if (f.chain) {  // issue 46 part 2: Qwen3-8B's fused QKV (32 + 2 x 8 heads of 128)
      chain_experiment(select_shapes("8B", qwen3_shapes())[0], 6144, f, s, h);
      return 0;
    }
    for (const FfnShape& shape : select_shapes(f.shapes, qwen3_shapes())) run_shape(shape, f, targets, s, h, cb.GBps);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
