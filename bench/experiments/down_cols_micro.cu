// SPDX-License-Identifier: Apache-2.0
//! @file down_cols_micro.cu  Development harness (not part of the library, not built by CMake) for issue 22:
//! can the down GEMV drop its split-K combine? The library's down GEMV (DownGemvOp, default policy) splits
//! each 256-column tile's selected channels over several blocks and combines their partials through global
//! memory (the last block of a tile sums them): dependent round trips that every FFN pays. Here each block
//! owns kCols whole output columns and streams *every* selected row's kCols-column slice, so no block waits
//! on another and y is written directly. The price: short row slices (32 or 64 bytes) and every block
//! walking the whole selected list. "tiled" variants read W_down^T re-laid as [d_model / kCols][d_ff][kCols]
//! (a block's slices of consecutive rows adjacent), the others the library's row-major W_down^T.
//!
//! Every variant gets the same weights (copies rotated past L2), mask and s; each y is checked against a
//! float64 host reference (|y - ref| <= 4e-3 * max|ref| + 1e-3 * |ref|, every element written: y is
//! poisoned with NaN before the check), then timed as graphs of 32 launches (no PDL), median of 20 replays,
//! two rounds visiting the variants in turn. Channel densities 0 (the fixed cost), 0.233, 0.30, 0.38;
//! Qwen3-8B and 14B shapes, fp16. Results: docs/history.md, round at `da6080d`.
//!
//! Build and run (sm_90a):
//!   nvcc -std=c++17 -O3 -arch=sm_90a -Iinclude -o down_cols_micro bench/experiments/down_cols_micro.cu
//!   ./down_cols_micro            # "quick": one timing round
#include <prox/prox.cuh>

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#define CK(e)                                                                             \
  do {                                                                                    \
    cudaError_t err_ = (e);                                                               \
    if (err_ != cudaSuccess) {                                                            \
      std::printf("%s:%d CUDA %s: %s\n", __FILE__, __LINE__, #e, cudaGetErrorString(err_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
#define PK(e)                                                                 \
  do {                                                                        \
    prox::Status st_ = (e);                                                   \
    if (st_ != prox::Status::kSuccess) {                                      \
      std::printf("%s:%d prox %s: %d\n", __FILE__, __LINE__, #e, int(st_));   \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

using T = __half;
constexpr int kThreads = 256;

//! y[d0 .. d0 + kCols) = sum over every selected channel j (in rank order) of s_j * W_down^T[j, d0 ..].
//! Dynamic shared memory: the selected rows and their s values, in rounds of `round_rows`.
template <int kCols, int kU, int kMinBlocks, bool kTiled = false>
__global__ __launch_bounds__(kThreads, kMinBlocks) void down_cols_kernel(const prox::DownGemvArgs<T> a,
                                                                         int round_rows) {
  using Rows = prox::detail::DownRows<kThreads, kCols, kU, T>;
  using Reducer = prox::detail::TileReducer<kThreads, Rows::kTn, 8, 1>;
  extern __shared__ int s_dyn[];
  int* s_rows = s_dyn;
  float* s_val = reinterpret_cast<float*>(s_dyn + round_rows);
  __shared__ int s_warp[kThreads / 32];
  __shared__ typename Reducer::Storage s_red;
  const int tid = static_cast<int>(threadIdx.x);
  const int d0 = static_cast<int>(blockIdx.x) * kCols;
  const int n_words = a.d_ff / 32;
  int total = 0;
  const int offset = prox::detail::mask_rank_offset<kThreads>(a.channel_mask, n_words, s_warp, &total);
  float acc[1][8];
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[0][c] = 0.0f;
#pragma unroll 1
  for (int sub = 0; sub < total; sub += round_rows) {
    const int count = min(round_rows, total - sub);
    prox::detail::gather_rank_range<kThreads>(a.channel_mask, n_words, offset, sub, sub + count, s_rows);
    __syncthreads();
    // Tiled layout: the block's kCols columns of every row are contiguous, [d_model / kCols][d_ff][kCols].
    const T* base = kTiled ? a.w_down_t + static_cast<std::size_t>(blockIdx.x) * a.d_ff * kCols : a.w_down_t;
    Rows::run(base, kTiled ? kCols : a.d_model, kTiled ? 0 : d0, s_rows, s_val, count, acc[0], [&] {
      // s of every row of the round: loads issued in batches of 8 before their stores.
#pragma unroll 1
      for (int i0 = 0; i0 < count; i0 += 8 * kThreads) {
        float sv[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = i0 + j * kThreads + tid;
          sv[j] = i < count ? __ldcg(a.s + s_rows[i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = i0 + j * kThreads + tid;
          if (i < count) s_val[i] = sv[j];
        }
      }
      __syncthreads();
    });
    __syncthreads();  // s_rows / s_val are reused by the next round
  }
  Reducer::reduce(s_red, acc);
  const int ncols = min(kCols, a.d_model - d0);
  for (int ch = tid; ch < ncols; ch += kThreads) a.y[d0 + ch] = prox::from_float<T>(Reducer::at(s_red, 0, ch));
}

struct Variant {
  std::string name;
  // launches one call on `stream` for weight copy `w`
  std::function<void(const T* w, cudaStream_t)> launch;
};

static std::uint16_t bits_of(T h) {
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("down_cols_micro on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  struct Shape {
    const char* name;
    int K, N;
  } shapes[] = {{"8B", 4096, 12288}, {"14B", 5120, 17408}};
  const double densities[] = {0.0, 0.233, 0.30, 0.38};
  int failures = 0;
  for (const Shape& sh : shapes) {
    const int K = sh.K, N = sh.N;
    const std::size_t elems = static_cast<std::size_t>(N) * K;
    const int copies = std::max(2, static_cast<int>((std::size_t{240} << 20) / (elems * 2)) + 1);
    std::mt19937 rng(77);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<T> hw(elems);
    for (auto& v : hw) v = __float2half(0.02f * nd(rng));
    std::vector<T*> w(copies), w16(copies), w32(copies);
    const auto tiled = [&](int cols) {
      std::vector<T> t(elems);
      for (int tile = 0; tile < K / cols; ++tile)
        for (int j = 0; j < N; ++j)
          for (int c = 0; c < cols; ++c)
            t[(static_cast<std::size_t>(tile) * N + j) * cols + c] = hw[static_cast<std::size_t>(j) * K + tile * cols + c];
      return t;
    };
    const std::vector<T> h16 = tiled(16), h32 = tiled(32);
    for (int c = 0; c < copies; ++c) {
      for (auto [pp, src] : {std::pair<T**, const T*>{&w[c], hw.data()}, {&w16[c], h16.data()}, {&w32[c], h32.data()}}) {
        CK(cudaMalloc(pp, elems * 2));
        CK(cudaMemcpy(*pp, src, elems * 2, cudaMemcpyHostToDevice));
      }
    }
    float* s;
    std::uint32_t* mask;
    T* y;
    CK(cudaMalloc(&s, N * 4));
    CK(cudaMalloc(&mask, N / 8));
    CK(cudaMalloc(&y, K * 2));
    for (double p : densities) {
      std::uniform_real_distribution<double> u01(0.0, 1.0);
      std::vector<std::uint32_t> hm(N / 32, 0u);
      std::vector<float> hs(N, 0.0f);
      std::vector<int> sel;
      for (int j = 0; j < N; ++j)
        if (u01(rng) < p) {
          hm[j / 32] |= 1u << (j % 32);
          hs[j] = nd(rng);
          sel.push_back(j);
        }
      CK(cudaMemcpy(mask, hm.data(), hm.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(s, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
      std::vector<double> ref(K, 0.0);
      for (int j : sel)
        for (int k = 0; k < K; ++k) ref[k] += static_cast<double>(hs[j]) * __half2float(hw[static_cast<std::size_t>(j) * K + k]);
      double refmax = 0.0;
      for (double v : ref) refmax = std::max(refmax, std::fabs(v));

      prox::DownGemvArgs<T> a;
      a.s = s;
      a.channel_mask = mask;
      a.w_down_t = w[0];
      a.d_model = K;
      a.d_ff = N;
      a.y = y;
      prox::Operator<prox::DownGemvOp<T>> op;
      PK(op.initialize(a));
      const std::size_t wsb = op.workspace_bytes(a);
      void* ws;
      CK(cudaMalloc(&ws, wsb));
      PK(prox::initialize_workspace(ws, wsb, stream));
      const int round_rows = std::max(32, std::min(N, ((static_cast<int>(sel.size()) + 31) / 32) * 32));
      const std::size_t smem = static_cast<std::size_t>(round_rows) * 8;
      std::vector<Variant> vs;
      vs.push_back({"library down_gemv (split-K, policy " + std::to_string(op.policy()) + ")",
                    [&](const T* wp, cudaStream_t st) {
                      prox::DownGemvArgs<T> b = a;
                      b.w_down_t = wp;
                      PK(op.run(b, ws, wsb, st));
                    }});
      const auto add_cols = [&](auto kernel, int cols, int min_blocks, const char* what,
                                const std::vector<T*>* layout = nullptr) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        const unsigned blocks = static_cast<unsigned>((K + cols - 1) / cols);
        vs.push_back({std::string(what) + " (" + std::to_string(blocks) + " blocks, " + std::to_string(min_blocks) +
                          "/SM)",
                      [=, &w](const T* wp, cudaStream_t st) {
                        prox::DownGemvArgs<T> b = a;
                        b.w_down_t = wp;
                        if (layout != nullptr)  // the same copy index in the tiled layout
                          for (int c = 0; c < copies; ++c)
                            if (w[c] == wp) b.w_down_t = (*layout)[c];
                        kernel<<<blocks, kThreads, smem, st>>>(b, round_rows);
                      }});
      };
      add_cols(down_cols_kernel<16, 2, 3>, 16, 3, "cols16 u2");
      add_cols(down_cols_kernel<32, 4, 2>, 32, 2, "cols32 u4");
      add_cols(down_cols_kernel<16, 2, 3, true>, 16, 3, "cols16 u2 tiled", &w16);
      add_cols(down_cols_kernel<16, 4, 3, true>, 16, 3, "cols16 u4 tiled", &w16);
      add_cols(down_cols_kernel<32, 4, 2, true>, 32, 2, "cols32 u4 tiled", &w32);
      // correctness: poison, run, check every element
      std::vector<T> hy(K);
      for (auto& v : vs) {
        CK(cudaMemset(y, 0xff, K * 2));  // NaN in fp16
        v.launch(w[1 % copies], stream);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(stream));
        CK(cudaMemcpy(hy.data(), y, K * 2, cudaMemcpyDeviceToHost));
        double worst = 0.0;
        bool nan = false;
        for (int k = 0; k < K; ++k) {
          const double v2 = __half2float(hy[k]);
          if (std::isnan(v2) || bits_of(hy[k]) == 0xffffu) nan = true;
          const double bound = 4e-3 * refmax + 1e-3 * std::fabs(ref[k]) + 1e-30;
          worst = std::max(worst, std::fabs(v2 - ref[k]) / bound);
        }
        const bool ok = !nan && worst <= 1.0;
        failures += ok ? 0 : 1;
        std::printf("  check %-4s p=%.3f %-44s err/bound %.3f%s\n", sh.name, p, v.name.c_str(), worst,
                    ok ? "" : (nan ? "  FAIL (unwritten)" : "  FAIL"));
      }
      // timing: graphs of 32 launches over rotated copies, alternating rounds
      const int L = 32;
      std::vector<cudaGraphExec_t> ge(vs.size());
      for (std::size_t i = 0; i < vs.size(); ++i) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int l = 0; l < L; ++l) vs[i].launch(w[l % copies], stream);
        CK(cudaStreamEndCapture(stream, &g));
        CK(cudaGraphInstantiate(&ge[i], g, 0));
        CK(cudaGraphDestroy(g));
      }
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      std::vector<std::vector<float>> ts(vs.size());
      const int rounds = quick ? 1 : 2;
      for (int r = 0; r < rounds; ++r)
        for (std::size_t i = 0; i < vs.size(); ++i) {
          CK(cudaGraphLaunch(ge[i], stream));  // warm-up
          for (int rep = 0; rep < 20; ++rep) {
            CK(cudaEventRecord(e0, stream));
            CK(cudaGraphLaunch(ge[i], stream));
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            ts[i].push_back(ms * 1000.0f / L);
          }
        }
      const double bytes = static_cast<double>(sel.size()) * K * 2;
      for (std::size_t i = 0; i < vs.size(); ++i) {
        std::sort(ts[i].begin(), ts[i].end());
        const double med = ts[i][ts[i].size() / 2];
        std::printf("TIME %-4s p=%.3f %-44s %8.2f us  %6.0f GB/s of rows\n", sh.name, p, vs[i].name.c_str(), med,
                    bytes / (med * 1e3));
        CK(cudaGraphExecDestroy(ge[i]));
      }
      CK(cudaEventDestroy(e0));
      CK(cudaEventDestroy(e1));
      CK(cudaFree(ws));
    }
    for (auto* v : {&w, &w16, &w32})
      for (auto p : *v) CK(cudaFree(p));
    CK(cudaFree(s));
    CK(cudaFree(mask));
    CK(cudaFree(y));
  }
  std::printf("%d check failures\n", failures);
  return failures == 0 ? 0 : 1;
}
