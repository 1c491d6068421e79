// SPDX-License-Identifier: Apache-2.0
//! @file minimal_ffn.cu  The smallest complete use of prox: one SwiGLU FFN layer with random weights
//! made on the device, one token, fixed thresholds; prints a few outputs and the realized sparsity.
//! prox_example_ffn (ffn_example.cu) adds threshold calibration, a dense baseline and timing.
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <prox/prox.cuh>

//! p[i] uniform in [-a, a) from a hash of (seed, i): random enough for a demo, no RNG state.
template <class T>
__global__ void fill(T* p, int n, unsigned seed, float a) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned h = (static_cast<unsigned>(i) ^ (seed * 0x9e3779b9u)) * 0x85ebca6bu;
    h = (h ^ (h >> 13)) * 0xc2b2ae35u;
    p[i] = prox::from_float<T>(a * (static_cast<float>(h ^ (h >> 16)) * (1.0f / 2147483648.0f) - 1.0f));
  }
}

//! Device memory for n elements (an example exits on failure; prox itself never allocates).
template <class U>
U* device_alloc(std::size_t n) {
  void* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(U)) != cudaSuccess) {
    std::puts("cudaMalloc failed");
    std::exit(1);
  }
  return static_cast<U*>(p);
}

int main() {
  using T = __half;
  using Ffn = prox::SparseFfn<T, prox::SiLU>;  // SwiGLU with INT4 proxies
  constexpr int K = 2048, N = 8192;            // d_model, d_ff
  prox::DeviceInfo dev;
  if (const prox::Status st = prox::query_device(&dev); st != prox::Status::kSuccess) {
    std::printf("prox minimal example: %s\n", prox::to_string(st));  // "no CUDA device" without a GPU
    return 1;
  }
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 1;
  // nn.Linear weights W_gate, W_up [d_ff][d_model], W_down [d_model][d_ff] (std 1/sqrt(fan-in)); a token x.
  T *wg = device_alloc<T>(K * N), *wu = device_alloc<T>(K * N), *wd = device_alloc<T>(K * N);
  T *wdt = device_alloc<T>(K * N), *x = device_alloc<T>(K), *y = device_alloc<T>(K);
  fill<<<512, 256, 0, s>>>(wg, K * N, 1, std::sqrt(3.0f / K));
  fill<<<512, 256, 0, s>>>(wu, K * N, 2, std::sqrt(3.0f / K));
  fill<<<512, 256, 0, s>>>(wd, K * N, 3, std::sqrt(3.0f / N));
  fill<<<8, 256, 0, s>>>(x, K, 4, 1.0f);
  // The layouts prox reads: INT4 proxies (packed words, scales) of W_gate and W_up; W_down^T [d_ff][d_model].
  const std::size_t words = prox::int4::packed_words(K, N);
  std::uint32_t *qg = device_alloc<std::uint32_t>(words), *qu = device_alloc<std::uint32_t>(words);
  float *sg = device_alloc<float>(N), *su = device_alloc<float>(N);
  PROX_CHECK(prox::int4::pack_device(wg, K, N, qg, sg, s));
  PROX_CHECK(prox::int4::pack_device(wu, K, N, qu, su, s));
  PROX_CHECK(prox::transpose_device(wd, K, N, wdt, s));

  Ffn::Weights w;  // by name: gate and up, or a matrix and its proxy, cannot be swapped by position
  w.gate = wg;  w.up = wu;  w.down_t = wdt;
  w.proxy_gate = {qg, sg};  w.proxy_up = {qu, su};
  Ffn ffn;
  PROX_CHECK(ffn.plan({K, N, /*tau_x=*/0.3f, /*tau_s=*/0.05f}, w));  // fixed thresholds, not calibrated
  const std::size_t bytes = Ffn::workspace_bytes(K, N);
  void* ws = device_alloc<char>(bytes);
  auto* counters = device_alloc<prox::SparsityCounters>(1);
  PROX_CHECK(prox::initialize_workspace(ws, bytes, s));  // once, before the first run
  PROX_CHECK(prox::reset_counters(counters, s));
  PROX_CHECK(ffn.run(x, y, ws, bytes, s, counters));  // y = FFN(x): Stage 1 + fused Stage 2

  T hy[4];
  if (cudaMemcpyAsync(hy, y, sizeof(hy), cudaMemcpyDeviceToHost, s) != cudaSuccess) return 1;
  prox::SparsityReport rep;
  PROX_CHECK(prox::read_report(counters, K, N, s, &rep));  // synchronizes s
  prox::Status ws_status;
  PROX_CHECK(prox::read_workspace_status(ws, s, &ws_status));
  PROX_CHECK(ws_status);  // kErrorDirtyWorkspace if a kernel had found the workspace not initialized
  std::printf("y[0..3] = %.4f %.4f %.4f %.4f\n", __half2float(hy[0]), __half2float(hy[1]), __half2float(hy[2]),
              __half2float(hy[3]));
  std::printf("realized sparsity: inputs s1 %.1f %%, channels s2 %.1f %%, effective e %.1f %%\n", 100 * rep.s1,
              100 * rep.s2, 100 * rep.effective);
  return 0;
}
