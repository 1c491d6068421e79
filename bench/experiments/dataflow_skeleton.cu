// SPDX-License-Identifier: Apache-2.0
//! @file dataflow_skeleton.cu  Development harness (not part of the library, not built by CMake): the
//! fixed cost of a one-kernel FFN with one thread-block cluster per channel tile, nothing kept and
//! nothing selected (no weight byte read), for issue 22's question whether such a structure can bring
//! the FFN's fixed cost to <= 4 us. Compare with prox_bench's ffn_empty (two kernels) on the same GPU.
//!
//! Per block (tile t = blockIdx.x, rank r = blockIdx.y of a (1, C, 1) cluster):
//!   x chunk r: threshold + compaction (as Stage 1) -> its kept rows (none here) -> block reduction ->
//!   cluster combine through distributed shared memory -> epilogue on its channel slice (select) ->
//!   GLU and down rows of its selected channels (none here) -> a y partial of K floats, reduced over the
//!   cluster through distributed shared memory into ypart[t] -> grid barrier -> y = sum of ypart over
//!   tiles in tile order.
//! kMode 0: all of it; 1: stop after ypart[t]; 2: after the compaction; 4: after the block reduction;
//! 5: after the cluster combine; 3: after the epilogue.
//! kEarly: PDL trigger right after the wait (else at the end). y is checked to be all zero.
//!
//! Build and run (sm_90a; results in docs/history.md, "Round at 3b9d28a"):
//!   nvcc -std=c++17 -O3 -arch=sm_90a -Iinclude -o dataflow_skeleton bench/experiments/dataflow_skeleton.cu
//!   ./dataflow_skeleton
#include <prox/core/warp.cuh>
#include <prox/detail/tile_reduce.cuh>
#include <cuda_fp16.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cmath>

using namespace prox;
using namespace prox::detail;

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned GridBarrier_generation(const unsigned* bar) {
  unsigned g;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
  return g;
}
using Red = TileReducer<kThreads, 32, 8, 2>;  // 256-channel tile, gate + up

template <int C, int K, int kMode, bool kEarly>
__global__ __launch_bounds__(kThreads, 2) void skel(const __half* __restrict__ x, int N, float tau_x, float tau_s,
                                                      float* __restrict__ ypart, __half* __restrict__ y,
                                                      unsigned* bar, unsigned* sink) {
  constexpr int kChunk = K / C;
  constexpr int kPer = (kChunk + kThreads - 1) / kThreads;
  constexpr int kYPer = K / kThreads;
  __shared__ int s_rows[kChunk];
  __shared__ float s_x[kChunk];
  __shared__ int s_warp[kPer * kThreads / 32];
  __shared__ typename Red::Storage s_red;
  __shared__ float s_y[K];
  __shared__ int s_sel[256];
  __shared__ int s_nsel;
  const int tid = threadIdx.x;
  const int t = blockIdx.x, r = blockIdx.y;
  pdl_wait();
  if constexpr (kEarly) pdl_launch_dependents();
  const unsigned gen = tid == 0 ? GridBarrier_generation(bar) : 0u;
  // 1. x chunk
  float xv[kPer];
  bool keep[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int kk = i * kThreads + tid;
    const bool in = kk < kChunk;
    xv[i] = in ? __half2float(x[r * kChunk + kk]) : 0.0f;
    keep[i] = in && fabsf(xv[i]) >= tau_x;
  }
  const int count = block_compact_append<kThreads, kPer>(keep, r * kChunk, xv, s_rows, s_x, s_warp);
  if (tid == 0) s_nsel = 0;
  __syncthreads();
  if constexpr (kMode == 2) {
    if (count > 100000) sink[0] = count;
    if (!kEarly) pdl_launch_dependents();
    return;
  }
  float acc[2][8];
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[0][c] = acc[1][c] = 0.0f;
  for (int i = tid / 32; i < count; i += kThreads / 32) acc[0][0] += s_x[i];  // (the rows: none kept here)
  Red::reduce(s_red, acc);
  if constexpr (kMode == 4) {
    if (Red::at(s_red, 0, tid) > 1e30f) sink[0] = tid;
    if (!kEarly) pdl_launch_dependents();
    return;
  }
  int lo, hi;
  Red::cluster_slice(r, C, 256, lo, hi);
  Red::cluster_combine(s_red, lo, hi, C);
  if constexpr (kMode == 5) {
    if (Red::at(s_red, 0, lo + (tid % 32)) > 1e30f) sink[0] = tid;
    Red::cluster_done();
    if (!kEarly) pdl_launch_dependents();
    return;
  }
  // 2. epilogue on [lo, hi): s~ = u~ silu(g~), select
  for (int ch = lo + tid; ch < hi; ch += kThreads) {
    const float g = Red::at(s_red, 0, ch), u = Red::at(s_red, 1, ch);
    const float s = u * (g / (1.0f + __expf(-g)));
    const bool sel = fabsf(s) >= tau_s;
    const unsigned w = __ballot_sync(0xffffffffu, sel);
    if (sel) s_sel[atomicAdd(&s_nsel, 1)] = t * 256 + ch;  // order irrelevant here (none)
    (void)w;
  }
  Red::cluster_done();
  __syncthreads();
  if constexpr (kMode == 3) {
    if (s_nsel > 100000) sink[0] = s_nsel;
    if (!kEarly) pdl_launch_dependents();
    return;
  }
  // 3. GLU + down rows of the selected channels (none here): y partial in registers
  float yacc[kYPer];
#pragma unroll
  for (int i = 0; i < kYPer; ++i) yacc[i] = 0.0f;
  for (int j = 0; j < s_nsel; ++j) yacc[0] += static_cast<float>(s_sel[j]);
  // 4. y partial over the cluster (DSMEM), rank order -> ypart[t]
#pragma unroll
  for (int i = 0; i < kYPer; ++i) s_y[i * kThreads + tid] = yacc[i];
  cluster_arrive();
  cluster_wait();
  constexpr int kSlice = K / C;
  for (int k = r * kSlice + tid; k < (r + 1) * kSlice; k += kThreads) {
    float part[C];
#pragma unroll
    for (int q = 0; q < C; ++q) part[q] = ld_shared_cluster(&s_y[k], q);
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < C; ++q) sum += part[q];
    ypart[static_cast<size_t>(t) * K + k] = sum;
  }
  cluster_arrive();
  cluster_wait();
  if constexpr (kMode == 1) {
    if (!kEarly) pdl_launch_dependents();
    return;
  }
  // 5. grid barrier, then y = sum over tiles in tile order
  __syncthreads();
  const unsigned blocks = gridDim.x * gridDim.y;
  if (tid == 0) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(bar) : "memory");
    if (prev == blocks - 1u) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1u) : "memory");
    }
    unsigned g;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(bar + 1) : "memory");
      if (g != gen) break;
      __nanosleep(20);
    }
  }
  __syncthreads();
  if (!kEarly) pdl_launch_dependents();
  const int tiles = gridDim.x;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  for (int k = b * kThreads + tid; k < K; k += blocks * kThreads) {
    float sum = 0.0f;
#pragma unroll 16
    for (int tt = 0; tt < tiles; ++tt) sum += __ldcg(ypart + static_cast<size_t>(tt) * K + k);
    y[k] = __float2half(sum);
  }
  (void)N; (void)sink;
}

#define CK(e) do { cudaError_t err_ = (e); if (err_ != cudaSuccess) { std::printf("CUDA %s at %d: %s\n", #e, __LINE__, cudaGetErrorString(err_)); return -1; } } while (0)

template <int C, int K, int kMode, bool kEarly>
float run(int N, cudaStream_t s, const __half* x, float* ypart, __half* y, unsigned* bar, unsigned* sink, int launches, int reps) {
  const int T = N / 256;
  auto kern = skel<C, K, kMode, kEarly>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(T, C);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = 1; at[0].val.clusterDim.y = C; at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = 2;
  int clusters = 0;
  cudaLaunchConfig_t q = cfg; q.numAttrs = 1;
  CK(cudaOccupancyMaxActiveClusters(&clusters, kern, &q));
  cudaFuncAttributes fa{}; CK(cudaFuncGetAttributes(&fa, kern));
  std::printf("  early=%d C=%d K=%d mode=%d: tiles %d, blocks %d, max active clusters %d, regs %d, smem %zu\n", int(kEarly), C, K, kMode, T, T * C, clusters, fa.numRegs, fa.sharedSizeBytes);
  if (clusters < T) { std::printf("  (not co-resident: skipped)\n"); return -1; }
  const float tau_x = INFINITY, tau_s = INFINITY;
  for (int i = 0; i < 3; ++i) CK(cudaLaunchKernelEx(&cfg, kern, x, N, tau_x, tau_s, ypart, y, bar, sink));
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) CK(cudaLaunchKernelEx(&cfg, kern, x, N, tau_x, tau_s, ypart, y, bar, sink));
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int r = 0; r < reps + 3; ++r) {
    CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 3) ts.push_back(ms * 1000.0f / launches);
  }
  std::sort(ts.begin(), ts.end());
  // y must be all zero (nothing selected)
  std::vector<__half> hy(K); CK(cudaMemcpy(hy.data(), y, K * 2, cudaMemcpyDeviceToHost));
  int bad = 0; for (auto v : hy) bad += __half2float(v) != 0.0f;
  std::printf("  -> %.3f us per FFN (median of %d), min %.3f; y nonzero: %d\n", ts[ts.size() / 2], reps, ts[0], bad);
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return ts[ts.size() / 2];
}

int main() {
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  __half* x; float* ypart; __half* y; unsigned* bar; unsigned* sink;
  const int Kmax = 5120, Nmax = 25600;
  CK(cudaMalloc(&x, Kmax * 2)); CK(cudaMalloc(&ypart, (size_t)(Nmax / 256) * Kmax * 4)); CK(cudaMalloc(&y, Kmax * 2));
  CK(cudaMalloc(&bar, 256)); CK(cudaMemset(bar, 0, 256)); CK(cudaMalloc(&sink, 256));
  std::vector<__half> hx(Kmax); for (int k = 0; k < Kmax; ++k) hx[k] = __float2half(std::sin(k * 0.37f) * 2.0f + 0.01f);
  CK(cudaMemcpy(x, hx.data(), Kmax * 2, cudaMemcpyHostToDevice));
  // The table of docs/history.md: every step, C = 2, 4, 8, and without the grid barrier and final sum.
  std::printf("8B (4096, 12288)\n");
  run<8, 4096, 0, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 0, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<2, 4096, 0, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 1, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<2, 4096, 1, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  std::printf("14B (5120, 17408)\n");
  run<8, 5120, 0, false>(17408, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 5120, 0, false>(17408, s, x, ypart, y, bar, sink, 32, 20);  // not co-resident on the H100
  run<2, 5120, 0, false>(17408, s, x, ypart, y, bar, sink, 32, 20);
  run<2, 5120, 1, true>(17408, s, x, ypart, y, bar, sink, 32, 20);
  std::printf("1.7B (2048, 6144)\n");
  run<8, 2048, 0, false>(6144, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 2048, 0, true>(6144, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 2048, 1, true>(6144, s, x, ypart, y, bar, sink, 32, 20);
  // The per-step breakdown (8B, C = 4): cumulative early exits, PDL trigger at the start and at the end.
  std::printf("8B, C = 4, step by step\n");
  run<4, 4096, 2, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 4, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 5, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 3, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 1, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 0, true>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 2, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 4, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  run<4, 4096, 5, false>(12288, s, x, ypart, y, bar, sink, 32, 20);
  return 0;
}
