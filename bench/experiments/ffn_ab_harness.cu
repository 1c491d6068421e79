// SPDX-License-Identifier: Apache-2.0
//! @file ffn_ab_harness.cu  Development harness (not part of the library, not built by CMake) for issue 19:
//! the same FFN -- the same host-drawn weights, tokens and thresholds -- through SparseFfn of an older
//! commit and of this one, so that their times differ by the library alone (prox_bench's synthetic layers
//! differ between those commits). fp16 SiLU, Qwen3 1.7B / 4B / 8B shapes, e = 40 % and 70 % (thresholds
//! from the tokens' |x| and copy 0's s~ quantiles), 8 weight copies, 32 runs per graph, median of 30
//! replays. Argument (substrings, combined): "small": 1.7B and 4B only; "nocheck":
//! PlanOptions::check_workspace = false; "g0" / "g1": the fused Stage 2's policy forced to 0 / 1;
//! "pads": the placement sweep -- each shape is measured five times, with a pad of 0, 1, 3, 8 and 21 MiB
//! allocated before its weight copies, so that the copies land on other addresses (and physical pages)
//! with the same data: how much the time moves with placement alone, in one build.
//! With -DPROX_TRACE -include bench/experiments/trace/prox_trace.cuh, built against a tree that
//! bench/experiments/trace/instrument.py stamped, one replay is traced per cell: Stage 1's and Stage 2's
//! time, the hand-offs between them, and Stage 2's GLU, barrier and down phases (%globaltimer per block).
//!
//! Build against f7ef040's headers and this tree's, then run them in turns on one GPU:
//!   git archive f7ef040 include | tar -x -C /tmp/f7
//!   nvcc -std=c++17 -O3 -arch=sm_90a -I/tmp/f7/include -DPROX_OLD -o ffn_old bench/experiments/ffn_ab_harness.cu
//!   nvcc -std=c++17 -O3 -arch=sm_90a -Iinclude -o ffn_new bench/experiments/ffn_ab_harness.cu
#include <prox/prox.cuh>
#include <cuda_fp16.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>
#define CK(e) do { cudaError_t err_ = (e); if (err_ != cudaSuccess) { std::printf("CUDA %s: %s\n", #e, cudaGetErrorString(err_)); std::exit(1); } } while (0)
#define PK(e) do { prox::Status st_ = (e); if (st_ != prox::Status::kSuccess) { std::printf("prox %s: %d\n", #e, int(st_)); std::exit(1); } } while (0)
using Ffn = prox::SparseFfn<__half, prox::SiLU>;
#ifndef NEW_NAME
#define NEW_NAME "new"
#endif

struct Copy { __half *g, *u, *dt; std::uint32_t *qg, *qu; float *sg, *su; Ffn ffn; };

int main(int argc, char** argv) {
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  struct Shape { const char* name; int K, N; } shapes[] = {{"1.7B", 2048, 6144}, {"4B", 2560, 9728}, {"8B", 4096, 12288}};
  const double s1s[] = {0.0, 0.7}, s2s[] = {0.622, 0.767};  // e = 40 % and 70 %
  const bool small = argc > 1 && std::string(argv[1]).find("small") != std::string::npos;
  const bool nocheck = argc > 1 && std::string(argv[1]).find("nocheck") != std::string::npos;
  int force_glud = -1;
  if (argc > 1 && std::string(argv[1]).find("g0") != std::string::npos) force_glud = 0;
  if (argc > 1 && std::string(argv[1]).find("g1") != std::string::npos) force_glud = 1;
  const bool pads = argc > 1 && std::string(argv[1]).find("pads") != std::string::npos;
  std::vector<int> pad_mib = {0};
  if (pads) pad_mib = {0, 1, 3, 8, 21};
  for (const Shape& sh : shapes) {
    if (small && sh.K > 3000) continue;
    const int K = sh.K, N = sh.N, C = 8, T = 8;
    std::mt19937 rng0(1234);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<__half> hw[3];  // gate, up, down^T: one host draw, the same bytes in every copy
    for (auto& h : hw) { h.resize(size_t(N) * K); for (auto& v : h) v = __float2half(0.02f * nd(rng0)); }
    const std::mt19937 rng_after_weights = rng0;
    const std::normal_distribution<float> nd_after_weights = nd;
   for (const int pad : pad_mib) {
    std::mt19937 rng = rng_after_weights;  // the same tokens at every pad
    std::normal_distribution<float> ndt = nd_after_weights;
    void* pad_buf = nullptr;
    if (pad > 0) CK(cudaMalloc(&pad_buf, size_t(pad) << 20));
    std::vector<Copy> cp(C);
    for (int c = 0; c < C; ++c) {
      Copy& q = cp[c];
      __half** mats[3] = {&q.g, &q.u, &q.dt};
      for (int m = 0; m < 3; ++m) {
        CK(cudaMalloc(mats[m], hw[m].size() * 2));
        CK(cudaMemcpy(*mats[m], hw[m].data(), hw[m].size() * 2, cudaMemcpyHostToDevice));
      }
      CK(cudaMalloc(&q.qg, size_t(K) * N / 2)); CK(cudaMalloc(&q.qu, size_t(K) * N / 2));
      CK(cudaMalloc(&q.sg, N * 4)); CK(cudaMalloc(&q.su, N * 4));
      PK(prox::int4::pack_device(q.g, K, N, q.qg, q.sg, s));
      PK(prox::int4::pack_device(q.u, K, N, q.qu, q.su, s));
    }
    std::vector<__half> hx(size_t(T) * K);
    for (auto& v : hx) v = __float2half(ndt(rng));
    __half *x, *y; CK(cudaMalloc(&x, hx.size() * 2)); CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&y, K * 2));
    std::vector<float> ax(hx.size()); for (size_t i = 0; i < hx.size(); ++i) ax[i] = std::fabs(__half2float(hx[i]));
    std::sort(ax.begin(), ax.end());
    for (int ei = 0; ei < 2; ++ei) {
      const float tau_x = s1s[ei] == 0.0 ? 0.0f : ax[size_t(s1s[ei] * ax.size())];
      // tau_s: the s2 quantile of |s~| over the tokens, from copy 0's proxy values.
      Ffn probe;
#ifdef PROX_OLD
      Ffn::Weights w0{cp[0].g, cp[0].u, cp[0].dt, cp[0].qg, cp[0].qu, cp[0].sg, cp[0].su};
#else
      Ffn::Weights w0; w0.gate = cp[0].g; w0.up = cp[0].u; w0.down_t = cp[0].dt;
      w0.proxy_gate = {cp[0].qg, cp[0].sg}; w0.proxy_up = {cp[0].qu, cp[0].su};
#endif
      PK(probe.plan({K, N, tau_x, 0.0f}, w0));
      const size_t wsb = probe.workspace_bytes();
      void* ws; CK(cudaMalloc(&ws, wsb));
#ifdef PROX_OLD
      CK(cudaMemset(ws, 0, wsb));
#else
      PK(prox::initialize_workspace(ws, wsb, s));
#endif
      float* sp; CK(cudaMalloc(&sp, size_t(N) * 4));
      std::vector<float> as; std::vector<float> hs(N);
      for (int t = 0; t < T; ++t) {
        PK(probe.run_proxy_values(x + size_t(t) * K, sp, ws, wsb, s));
        CK(cudaMemcpyAsync(hs.data(), sp, N * 4, cudaMemcpyDeviceToHost, s)); CK(cudaStreamSynchronize(s));
        for (float v : hs) as.push_back(std::fabs(v));
      }
      std::sort(as.begin(), as.end());
      const float tau_s = as[size_t(s2s[ei] * as.size())];
      for (int c = 0; c < C; ++c) {
#ifdef PROX_OLD
        Ffn::Weights w{cp[c].g, cp[c].u, cp[c].dt, cp[c].qg, cp[c].qu, cp[c].sg, cp[c].su};
#else
        Ffn::Weights w; w.gate = cp[c].g; w.up = cp[c].u; w.down_t = cp[c].dt;
        w.proxy_gate = {cp[c].qg, cp[c].sg}; w.proxy_up = {cp[c].qu, cp[c].su};
#endif
        Ffn::PlanOptions po;
        po.choice.glu_down = force_glud;
#ifndef PROX_OLD
        po.check_workspace = !nocheck;
#endif
        PK(cp[c].ffn.plan({K, N, tau_x, tau_s}, w, po));
      }
      const int L = 32;
      auto enqueue = [&](int i) { PK(cp[i % C].ffn.run(x + size_t(i % T) * K, y, ws, wsb, s)); };
      for (int i = 0; i < L; ++i) enqueue(i);
      CK(cudaStreamSynchronize(s));
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < L; ++i) enqueue(i);
      CK(cudaStreamEndCapture(s, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      std::vector<float> ts;
      for (int r = 0; r < 33; ++r) {
        CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 3) ts.push_back(ms * 1000.0f / L);
      }
      std::sort(ts.begin(), ts.end());
      std::printf("g%d pad%d %s %s e%d: %.3f us (min %.3f)  tau_x %.4f tau_s %.5f\n", force_glud, pad,
#ifdef PROX_OLD
                  "old",
#else
                  nocheck ? "new-nocheck" : NEW_NAME,
#endif
                  sh.name, ei ? 70 : 40, ts[ts.size() / 2], ts[0], tau_x, tau_s);
#ifdef PROX_TRACE
      {  // one traced replay: per launch, Stage 1 and Stage 2 windows from per-block globaltimer stamps
        const unsigned zero = 0;
        CK(cudaMemcpyToSymbol(g_prox_trace_n, &zero, sizeof(zero)));
        CK(cudaGraphLaunch(ge, s)); CK(cudaStreamSynchronize(s));
        unsigned n = 0; CK(cudaMemcpyFromSymbol(&n, g_prox_trace_n, sizeof(n)));
        n = std::min(n, kProxTraceCap);
        std::vector<ProxTraceRec> rec(n);
        CK(cudaMemcpyFromSymbol(rec.data(), g_prox_trace, sizeof(ProxTraceRec) * n));
        std::vector<ProxTraceRec> k1, k2;
        for (auto& r : rec) (r.kind == 1 ? k1 : k2).push_back(r);
        auto by_t1 = [](const ProxTraceRec& a, const ProxTraceRec& b) { return a.t1 < b.t1; };
        std::sort(k1.begin(), k1.end(), by_t1); std::sort(k2.begin(), k2.end(), by_t1);
        const size_t g1 = k1.size() / L, g2 = k2.size() / L;
        struct W { double wait_min, wait_max, end_max, entry_min; };
        auto window = [](const std::vector<ProxTraceRec>& v, size_t a, size_t b) {
          W w{1e30, 0, 0, 1e30};
          for (size_t i = a; i < b; ++i) { w.wait_min = std::min(w.wait_min, (double)v[i].t1); w.wait_max = std::max(w.wait_max, (double)v[i].t1);
                                           w.end_max = std::max(w.end_max, (double)v[i].t2); w.entry_min = std::min(w.entry_min, (double)v[i].t0); }
          return w;
        };
        // Stage 2's phases: GLU (from its wait to the barrier arrive), the barrier (arrive -> released), down.
        {
          double glu = 0, barr = 0, down = 0, glu_max = 0, rel_min = 0; int c2 = 0;
          for (int i = 1; i + 1 < L; ++i) {
            double w_min = 1e30, a_max = 0, r_min = 1e30, e_max = 0;
            for (size_t j = i * g2; j < (i + 1) * g2; ++j) {
              const auto& r = k2[j];
              w_min = std::min(w_min, (double)r.t1); a_max = std::max(a_max, (double)r.t3);
              if (r.t4) r_min = std::min(r_min, (double)r.t4); e_max = std::max(e_max, (double)r.t2);
            }
            glu += a_max - w_min; barr += r_min - a_max; down += e_max - r_min; ++c2;
          }
          std::printf("   S2 phases: GLU to last arrive %.3f us, last arrive -> first release %.3f, first release -> end %.3f\n",
                      glu / c2 / 1e3, barr / c2 / 1e3, down / c2 / 1e3);
          (void)glu_max; (void)rel_min;
        }
        double s1_run = 0, s2_run = 0, h12 = 0, h21 = 0, s1_spread = 0, s2_spread = 0; int cnt = 0;
        for (int i = 1; i + 1 < L; ++i) {
          const W a = window(k1, i * g1, (i + 1) * g1), b = window(k2, i * g2, (i + 1) * g2), c = window(k1, (i + 1) * g1, (i + 2) * g1);
          s1_run += a.end_max - a.wait_min; s2_run += b.end_max - b.wait_min;
          h12 += b.wait_min - a.end_max; h21 += c.wait_min - b.end_max;
          s1_spread += a.wait_max - a.wait_min; s2_spread += b.wait_max - b.wait_min; ++cnt;
        }
        std::printf("   trace %zu+%zu blocks/launch: S1 %.3f us (waits spread %.3f), S1 end->S2 go %.3f, S2 %.3f us (spread %.3f), S2 end->next S1 go %.3f; sum %.3f\n",
                    g1, g2, s1_run / cnt / 1e3, s1_spread / cnt / 1e3, h12 / cnt / 1e3, s2_run / cnt / 1e3, s2_spread / cnt / 1e3, h21 / cnt / 1e3,
                    (s1_run + s2_run + h12 + h21) / cnt / 1e3);
      }
#endif
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g); CK(cudaFree(ws)); CK(cudaFree(sp));
    }
    for (auto& q : cp) { cudaFree(q.g); cudaFree(q.u); cudaFree(q.dt); cudaFree(q.qg); cudaFree(q.qu); cudaFree(q.sg); cudaFree(q.su); }
    cudaFree(x); cudaFree(y);
    if (pad_buf != nullptr) cudaFree(pad_buf);
   }
  }
  return 0;
}
