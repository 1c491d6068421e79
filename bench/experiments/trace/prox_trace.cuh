// SPDX-License-Identifier: Apache-2.0
// Development instrumentation (issue 19): per-block globaltimer stamps of Stage 1 (kind 1) and the fused
// Stage 2 (kind 2): entry, after the PDL wait, exit. Injected with nvcc -include (bench/experiments/trace/instrument.py stamps the kernels); not part of the library.
#pragma once
#include <cuda_runtime.h>
struct ProxTraceRec { unsigned kind, block, smid, pad; unsigned long long t0, t1, t2, t3, t4; };
constexpr unsigned kProxTraceCap = 1u << 18;
__device__ ProxTraceRec g_prox_trace[kProxTraceCap];
__device__ unsigned g_prox_trace_n;
__device__ __forceinline__ unsigned long long prox_gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
struct ProxTrace {
  unsigned kind;
  unsigned long long t0, t1, t3 = 0ull, t4 = 0ull;
  __device__ explicit ProxTrace(unsigned k) : kind(k), t0(threadIdx.x == 0 ? prox_gtime() : 0ull), t1(0ull) {}
  __device__ void waited() { if (threadIdx.x == 0) t1 = prox_gtime(); }
  __device__ void mark3() { if (threadIdx.x == 0) t3 = prox_gtime(); }
  __device__ void mark4() { if (threadIdx.x == 0 && t4 == 0ull) t4 = prox_gtime(); }
  __device__ ~ProxTrace() {
    if (threadIdx.x == 0) {
      const unsigned i = atomicAdd(&g_prox_trace_n, 1u);
      if (i < kProxTraceCap) {
        ProxTraceRec& r = g_prox_trace[i];
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        r.kind = kind; r.block = blockIdx.x + blockIdx.y * gridDim.x; r.smid = sm;
        r.t0 = t0; r.t1 = t1; r.t2 = prox_gtime(); r.t3 = t3; r.t4 = t4;
      }
    }
  }
};
