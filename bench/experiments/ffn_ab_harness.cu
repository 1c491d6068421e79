// SPDX-License-Identifier: Apache-2.0
//! @file ffn_ab_harness.cu  Development harness (not part of the library, not built by CMake) for issue 19:
//! the same FFN -- the same host-drawn weights, tokens and thresholds -- through SparseFfn of an older
//! commit and of this one, so that their times differ by the library alone (prox_bench's synthetic layers
//! differ between those commits). fp16 SiLU, Qwen3 1.7B / 4B / 8B shapes, e = 40 % and 70 % (thresholds
//! from the tokens' |x| and copy 0's s~ quantiles), 8 weight copies, 32 runs per graph, median of 30
//! replays. Argument "small": 1.7B and 4B only; "nocheck": PlanOptions::check_workspace = false.
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
  for (const Shape& sh : shapes) {
    if (small && sh.K > 3000) continue;
    const int K = sh.K, N = sh.N, C = 8, T = 8;
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<__half> hw[3];  // gate, up, down^T: one host draw, the same bytes in every copy
    for (auto& h : hw) { h.resize(size_t(N) * K); for (auto& v : h) v = __float2half(0.02f * nd(rng)); }
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
    for (auto& v : hx) v = __float2half(nd(rng));
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
#ifdef PROX_OLD
        PK(cp[c].ffn.plan({K, N, tau_x, tau_s}, w));
#else
        Ffn::PlanOptions po;
        po.check_workspace = !nocheck;
        PK(cp[c].ffn.plan({K, N, tau_x, tau_s}, w, po));
#endif
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
      std::printf("%s %s e%d: %.3f us (min %.3f)  tau_x %.4f tau_s %.5f\n",
#ifdef PROX_OLD
                  "old",
#else
                  nocheck ? "new-nocheck" : NEW_NAME,
#endif
                  sh.name, ei ? 70 : 40, ts[ts.size() / 2], ts[0], tau_x, tau_s);
      cudaGraphExecDestroy(ge); cudaGraphDestroy(g); CK(cudaFree(ws)); CK(cudaFree(sp));
    }
    for (auto& q : cp) { cudaFree(q.g); cudaFree(q.u); cudaFree(q.dt); cudaFree(q.qg); cudaFree(q.qu); cudaFree(q.sg); cudaFree(q.su); }
    cudaFree(x); cudaFree(y);
  }
  return 0;
}
