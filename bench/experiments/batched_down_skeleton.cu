// SPDX-License-Identifier: Apache-2.0
//! @file batched_down_skeleton.cu  Development harness (not part of the library, not built by CMake): how
//! fast a down GEMV that serves B tokens at once streams the union of their selected rows, for issue 23
//! (batched decode). Each row of W_down^T [d_ff][d_model] in the union is read once; every token b adds
//! s_b[row] * row (s_b = 0 where b did not select the row, as Stage 2 writes it). Blocks: (column tile of
//! 256, part of the union rows); each thread holds 8 columns x B accumulators; the rows stream as in
//! prox's DownRows (two steps of kU 16-byte pieces in flight). The split-K partials are written, not
//! combined: the streaming is what is timed. Reports time, union bytes at the copy bandwidth measured in
//! the same process, and the fraction reached, for B = 1, 2, 4, 8 at one union density, so that the cost
//! of the B accumulators shows apart from the bytes.
//!
//! Build and run (sm_90a; results in docs/history.md):
//!   nvcc -std=c++17 -O3 -arch=sm_90a -Iinclude -o batched_down bench/experiments/batched_down_skeleton.cu
//!   ./batched_down
#include <prox/core/vec.cuh>
#include <cuda_fp16.h>
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

using namespace prox;

constexpr int kThreads = 256;
constexpr int kTn = 32;                   // threads across a 256-column tile (8 columns each)
constexpr int kGroups = kThreads / kTn;   // row groups

template <int B, int kU>
__global__ __launch_bounds__(kThreads, 2) void down_b(const __half* __restrict__ wdt, int K, const int* __restrict__ rows,
                                                       const float* __restrict__ sv, int count, int parts,
                                                       float* __restrict__ partials) {
  const int tile = blockIdx.x, part = blockIdx.y;
  const int lo = static_cast<int>(static_cast<long long>(count) * part / parts);
  const int hi = static_cast<int>(static_cast<long long>(count) * (part + 1) / parts);
  const int n = hi - lo;
  const int slot = threadIdx.x % kTn, group = threadIdx.x / kTn;
  // The block's s values, [row][B] (a row's B values contiguous), staged in shared memory.
  extern __shared__ float s_sv[];
  for (int i = threadIdx.x; i < n * B; i += kThreads) s_sv[i] = sv[static_cast<size_t>(lo) * B + i];
  __syncthreads();
  const int d = tile * 256 + slot * 8;
  const __half* base = wdt + d;
  float acc[B][8];
#pragma unroll
  for (int b = 0; b < B; ++b)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[b][c] = 0.0f;
  const int steps = (n + kGroups * kU - 1) / (kGroups * kU);
  uint4 v0[kU], v1[kU];
  auto load = [&](int it, uint4 (&v)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int r = group + (it * kU + u) * kGroups;
      const bool ok = r < n;
      v[u] = ld_stream_16(base + static_cast<size_t>(rows[lo + (ok ? r : 0)]) * K, ok);
    }
  };
  auto compute = [&](int it, const uint4 (&v)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int r = group + (it * kU + u) * kGroups;
      float w[8];
      unpack8<__half>(v[u], w);
      float sr[B];
      const float* p = s_sv + (r < n ? r : 0) * B;
      if constexpr (B % 4 == 0) {
#pragma unroll
        for (int q = 0; q < B / 4; ++q) {
          const float4 f = reinterpret_cast<const float4*>(p)[q];
          sr[4 * q] = f.x; sr[4 * q + 1] = f.y; sr[4 * q + 2] = f.z; sr[4 * q + 3] = f.w;
        }
      } else {
#pragma unroll
        for (int b = 0; b < B; ++b) sr[b] = p[b];
      }
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float s = r < n ? sr[b] : 0.0f;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[b][c] = fmaf(s, w[c], acc[b][c]);
      }
    }
  };
  load(0, v0);
  load(1, v1);
  int it = 0;
#pragma unroll 1
  for (; it + 1 < steps; it += 2) {
    compute(it, v0);
    load(it + 2, v0);
    compute(it + 1, v1);
    load(it + 3, v1);
  }
  if (it < steps) compute(it, v0);
  // Per-block partial (no cross-group reduction: one store per group keeps the timing on the stream).
#pragma unroll
  for (int b = 0; b < B; ++b)
#pragma unroll
    for (int c = 0; c < 8; ++c)
      partials[((static_cast<size_t>(part) * kGroups + group) * B + b) * K + d + c] = acc[b][c];
}

#define CK(e) do { cudaError_t err_ = (e); if (err_ != cudaSuccess) { std::printf("CUDA %s: %s\n", #e, cudaGetErrorString(err_)); std::exit(1); } } while (0)

template <class F>
float time_graph(cudaStream_t s, int launches, int reps, F&& enqueue) {
  for (int i = 0; i < launches; ++i) enqueue(i);
  CK(cudaStreamSynchronize(s));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) enqueue(i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int r = 0; r < reps + 2; ++r) {
    CK(cudaEventRecord(a, s)); CK(cudaGraphLaunch(ge, s)); CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); if (r >= 2) ts.push_back(ms * 1000.0f / launches);
  }
  std::sort(ts.begin(), ts.end());
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return ts[ts.size() / 2];
}

struct Set { const __half* w; const int* rows; const float* sv; };

template <int B, int kU>
void run(const char* name, int K, int N, int count, int parts, const std::vector<Set>& sets, float* partials,
         cudaStream_t s, double copy_gbps) {
  const dim3 grid(K / 256, parts);
  const size_t smem = sizeof(float) * B * ((count + parts - 1) / parts + 1);
  CK(cudaFuncSetAttribute(down_b<B, kU>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const float us = time_graph(s, 32, 20, [&](int i) {
    const Set& st = sets[i % sets.size()];
    down_b<B, kU><<<grid, kThreads, smem, s>>>(st.w, K, st.rows, st.sv, count, parts, partials);
  });
  CK(cudaGetLastError());
  const double bytes = static_cast<double>(count) * K * 2 + static_cast<double>(count) * (4 + 4.0 * B);
  const double floor_us = bytes / (copy_gbps * 1e3);
  std::printf("%-4s B=%d kU=%d union %5d rows (%.3f): %7.2f us, floor %6.2f us, %5.1f %% of copy\n", name, B, kU,
              count, static_cast<double>(count) / N, us, floor_us, 100.0 * floor_us / us);
}

int main() {
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Copy bandwidth: read + write of a 1 GiB device-to-device copy, the best of 5 (eager, events).
  void *ca, *cb; const size_t cbytes = size_t(1) << 30; CK(cudaMalloc(&ca, cbytes)); CK(cudaMalloc(&cb, cbytes));
  float best_ms = 1e30f;
  {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int r = 0; r < 6; ++r) {
      CK(cudaEventRecord(a, s)); CK(cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice, s));
      CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b); if (r > 0) best_ms = std::min(best_ms, ms);
    }
  }
  const double copy_gbps = 2.0 * cbytes / (best_ms * 1e6);
  CK(cudaFree(ca)); CK(cudaFree(cb));
  std::printf("copy bandwidth %.0f GB/s\n", copy_gbps);
  struct Shape { const char* name; int K, N; } shapes[] = {{"8B", 4096, 12288}, {"14B", 5120, 17408}};
  for (const Shape& sh : shapes) {
    const size_t wbytes = size_t(sh.N) * sh.K * 2;
    const int copies = std::max(2, static_cast<int>((size_t(1) << 30) / wbytes) + 1);  // > 1 GB rotated
    std::vector<__half*> ws(copies);
    for (auto& w : ws) { CK(cudaMalloc(&w, wbytes)); CK(cudaMemset(w, 0x3c, wbytes)); }  // 1.0 in every half
    float* partials; CK(cudaMalloc(&partials, size_t(64) * kGroups * 8 * sh.K * 4));
    for (double dens : {0.233, 0.41, 0.65, 0.87}) {
      const int count = static_cast<int>(dens * sh.N);
      std::mt19937 rng(7);
      std::vector<int> all(sh.N); for (int j = 0; j < sh.N; ++j) all[j] = j;
      std::shuffle(all.begin(), all.end(), rng);
      std::vector<int> rows(all.begin(), all.begin() + count); std::sort(rows.begin(), rows.end());
      int* drows; CK(cudaMalloc(&drows, count * 4)); CK(cudaMemcpy(drows, rows.data(), count * 4, cudaMemcpyHostToDevice));
      // Random s; the kernel reads the first count * B values as [row][B].
      std::vector<float> sv(size_t(8) * count);
      for (auto& v : sv) v = std::uniform_real_distribution<float>(-1, 1)(rng);
      float* dsv; CK(cudaMalloc(&dsv, sv.size() * 4)); CK(cudaMemcpy(dsv, sv.data(), sv.size() * 4, cudaMemcpyHostToDevice));
      std::vector<Set> sets; for (auto* w : ws) sets.push_back({w, drows, dsv});
      const int parts = std::max(1, 2 * 132 / (sh.K / 256));  // ~2 blocks per SM
      run<1, 4>(sh.name, sh.K, sh.N, count, parts, sets, partials, s, copy_gbps);
      run<2, 4>(sh.name, sh.K, sh.N, count, parts, sets, partials, s, copy_gbps);
      run<4, 4>(sh.name, sh.K, sh.N, count, parts, sets, partials, s, copy_gbps);
      run<8, 4>(sh.name, sh.K, sh.N, count, parts, sets, partials, s, copy_gbps);
      run<8, 2>(sh.name, sh.K, sh.N, count, parts, sets, partials, s, copy_gbps);
      CK(cudaFree(drows)); CK(cudaFree(dsv));
    }
    for (auto* w : ws) CK(cudaFree(w));
    CK(cudaFree(partials));
  }
  return 0;
}
