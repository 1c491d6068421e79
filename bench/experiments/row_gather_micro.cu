// Row-gather microbenchmark (issue 23): how fast can a batched-Stage-1-shaped grid stream the union's
// INT4 rows, as a function of the row segment a tile reads (64 B = 128 channels, 128 B = 256 channels) and
// of the steps each warp keeps in flight? Loads only (a XOR fold stands in for the decode and the mma),
// so the figure is the access pattern's ceiling, not the kernel's.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90a -Iinclude bench/experiments/row_gather_micro.cu -o row_gather_micro
// Run:   ./row_gather_micro [d_model d_ff density]   (defaults: Qwen3-8B, union density 0.76)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));           \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

template <int kSeg>
__device__ __forceinline__ uint4 ld_seg(const char* p) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if constexpr (kSeg == 16) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  }
  return v;
}

// Lane (g, t): bytes g * kSeg .. + kSeg of the tile's row segment, rows 4t .. 4t+3 of a 16-row step, of
// gate and up. kDepth steps are loaded before any is folded.
template <int kSeg, int kDepth, int kThreads>
__global__ __launch_bounds__(kThreads, 2) void gather(const char* gate, const char* up, std::size_t row_bytes,
                                                      const int* rows, const int* counts, int max_rows,
                                                      unsigned* out) {
  extern __shared__ int s_rows[];
  constexpr int kWarps = kThreads / 32;
  const int chunk = blockIdx.y;
  const int count = counts[chunk];
  for (int i = threadIdx.x; i < count; i += kThreads) s_rows[i] = rows[chunk * max_rows + i];
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, t = lane & 3;
  const std::size_t col = static_cast<std::size_t>(blockIdx.x) * 8 * kSeg + g * kSeg;
  const int steps = (count + 15) / 16;
  unsigned acc = 0;
  for (int st0 = warp; st0 < steps; st0 += kDepth * kWarps) {
    uint4 v[kDepth][2][4];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int st = st0 + d * kWarps;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = st * 16 + 4 * t + j;
        const bool ok = st < steps && r < count;
        const std::size_t off = static_cast<std::size_t>(s_rows[ok ? r : 0]) * row_bytes + col;
        v[d][0][j] = ok ? ld_seg<kSeg>(gate + off) : make_uint4(0, 0, 0, 0);
        v[d][1][j] = ok ? ld_seg<kSeg>(up + off) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= v[d][m][j].x ^ v[d][m][j].y ^ v[d][m][j].z ^ v[d][m][j].w;
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

struct Case {
  const char* name;
  void (*kernel)(const char*, const char*, std::size_t, const int*, const int*, int, unsigned*);
  int seg;
  int threads;
};

int main(int argc, char** argv) {
  const int d_model = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int d_ff = argc > 2 ? std::atoi(argv[2]) : 12288;
  const double density = argc > 3 ? std::atof(argv[3]) : 0.76;
  const std::size_t row_bytes = d_ff / 2;
  const std::size_t mat = row_bytes * d_model;
  constexpr int kSets = 4;  // 4 x 2 matrices: 200 MB on Qwen3-8B, past the 50 MB L2
  char* buf;
  CK(cudaMalloc(&buf, 2 * mat * kSets));
  CK(cudaMemset(buf, 0x5a, 2 * mat * kSets));
  unsigned* out;
  CK(cudaMalloc(&out, 1 << 16));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // The copy ceiling: cudaMemcpy device to device of one set.
  {
    CK(cudaMemcpy(buf + 2 * mat, buf, 2 * mat, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 10; ++i) CK(cudaMemcpy(buf + 2 * mat * ((i + 1) % kSets), buf + 2 * mat * (i % kSets), 2 * mat, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("copy: %.0f GB/s (read + write)\n", 2.0 * 10 * 2 * mat / (ms * 1e6));
  }
  const Case cases[] = {
      {"seg64  depth2 t256", gather<8, 2, 256>, 8, 256},   {"seg64  depth4 t256", gather<8, 4, 256>, 8, 256},
      {"seg128 depth2 t256", gather<16, 2, 256>, 16, 256}, {"seg128 depth4 t256", gather<16, 4, 256>, 16, 256},
      {"seg64  depth2 t128", gather<8, 2, 128>, 8, 128},   {"seg128 depth1 t256", gather<16, 1, 256>, 16, 256},
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u01(0, 1);
  for (const Case& c : cases) {
    const int tile_bytes = 8 * c.seg;
    const int tiles = static_cast<int>(row_bytes / tile_bytes);
    for (int chunks : {1, 2, 3, 4, 5, 6, 8}) {
      if (static_cast<long>(tiles) * chunks > 2L * sms * (c.threads == 128 ? 2 : 1) * 2) continue;
      const int len = (d_model + chunks - 1) / chunks;
      std::vector<int> rows(static_cast<std::size_t>(chunks) * len), counts(chunks, 0);
      long total = 0;
      for (int ch = 0; ch < chunks; ++ch)
        for (int k = ch * len; k < std::min(d_model, (ch + 1) * len); ++k)
          if (u01(rng) < density) rows[static_cast<std::size_t>(ch) * len + counts[ch]++] = k;
      for (int n : counts) total += n;
      int *d_rows, *d_counts;
      CK(cudaMalloc(&d_rows, rows.size() * sizeof(int)));
      CK(cudaMalloc(&d_counts, chunks * sizeof(int)));
      CK(cudaMemcpy(d_rows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_counts, counts.data(), chunks * sizeof(int), cudaMemcpyHostToDevice));
      const dim3 grid(tiles, chunks);
      const std::size_t smem = len * sizeof(int);
      CK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
      const int iters = 40;
      float best = 1e9f, sum = 0;
      for (int rep = 0; rep < 3; ++rep) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) {
          const char* base = buf + 2 * mat * (i % kSets);
          c.kernel<<<grid, c.threads, smem>>>(base, base + mat, row_bytes, d_rows, d_counts, len, out);
        }
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms / iters);
        sum += ms / iters;
      }
      CK(cudaGetLastError());
      const double bytes = 2.0 * total * row_bytes;
      std::printf("%s  tiles %3d x chunks %d = %4d blocks  %7.2f us  %6.0f GB/s (best of 3)\n", c.name, tiles, chunks,
                  tiles * chunks, best * 1e3, bytes / (best * 1e6));
      CK(cudaFree(d_rows));
      CK(cudaFree(d_counts));
    }
  }
  return 0;
}
