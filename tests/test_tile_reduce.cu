// SPDX-License-Identifier: Apache-2.0
//! @file test_tile_reduce.cu  detail::TileReducer::reduce against the plain butterfly it replaced
//! (warp_sum_strided per value, lanes < kTn store, warps summed in index order): bit-identical for
//! every reducer shape the library instantiates and for more row groups per warp (more halving
//! steps), on inputs whose sums depend on the order of the additions (checked: the same sums with
//! the warps in reverse order differ).
#include "catch.hpp"

#include <cstdint>
#include <vector>

#include <prox/core/math.hpp>
#include <prox/core/warp.cuh>
#include <prox/detail/tile_reduce.cuh>

#include "common.hpp"

using namespace prox_test;

namespace {

//! A float of random sign, mantissa and exponent in [2^-20, 2^20): sums of these lose different
//! bits in different orders.
__device__ float spread_value(std::uint64_t seed, int block, int tid, int i) {
  const std::uint64_t h = prox::detail::mix64(seed ^ (static_cast<std::uint64_t>(block) << 40) ^
                                              (static_cast<std::uint64_t>(tid) << 20) ^ static_cast<std::uint64_t>(i));
  const float mant = 1.0f + static_cast<float>(h & 0xFFFFFFu) / 16777216.0f;
  const int e = static_cast<int>((h >> 24) % 40u) - 20;
  return ((h >> 63) != 0u ? -1.0f : 1.0f) * ldexpf(mant, e);
}

//! Per block: out_new = reduce(); out_ref = the butterfly; out_rev = the butterfly, warps reversed.
template <int kThreads, int kTn, int kCpv, int kMats>
__global__ void tile_reduce_kernel(std::uint64_t seed, float* out_new, float* out_ref, float* out_rev) {
  using R = prox::detail::TileReducer<kThreads, kTn, kCpv, kMats>;
  constexpr int kWarps = kThreads / prox::kWarpSize;
  constexpr int kTile = R::kTile;
  __shared__ typename R::Storage st;
  __shared__ float ref[kWarps][kMats][kTile];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = prox::lane_id();
  const int warp = prox::warp_id();
  const int block = static_cast<int>(blockIdx.x);
  float acc[kMats][kCpv];
  for (int m = 0; m < kMats; ++m)
    for (int c = 0; c < kCpv; ++c) {
      acc[m][c] = spread_value(seed, block, tid, m * kCpv + c);
      float x = acc[m][c];
      if constexpr (kTn < prox::kWarpSize) x = prox::warp_sum_strided<kTn>(x);
      if (lane < kTn) ref[warp][m][(tid % kTn) * kCpv + c] = x;
    }
  __syncthreads();
  float* nb = out_new + static_cast<std::size_t>(block) * kMats * kTile;
  float* rb = out_ref + static_cast<std::size_t>(block) * kMats * kTile;
  float* vb = out_rev + static_cast<std::size_t>(block) * kMats * kTile;
  for (int v = tid; v < kMats * kTile; v += kThreads) {
    float sum = 0.0f;
    float rev = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += ref[w][v / kTile][v % kTile];
    for (int w = kWarps - 1; w >= 0; --w) rev += ref[w][v / kTile][v % kTile];
    rb[v] = sum;
    vb[v] = rev;
  }
  R::reduce(st, acc);
  for (int v = tid; v < kMats * kTile; v += kThreads) nb[v] = R::at(st, v / kTile, v % kTile);
}

template <int kThreads, int kTn, int kCpv, int kMats>
void check_reducer() {
  using R = prox::detail::TileReducer<kThreads, kTn, kCpv, kMats>;
  constexpr int kBlocks = 16;
  const std::size_t n = static_cast<std::size_t>(kBlocks) * kMats * R::kTile;
  DeviceBuffer<float> dn(n), dr(n), dv(n);
  int differs_reversed = 0;
  for (std::uint64_t seed : {1ull, 0x5eedull}) {
    CAPTURE(kThreads, kTn, kCpv, kMats, seed);
    dn.poison();
    dr.poison();
    dv.poison();
    tile_reduce_kernel<kThreads, kTn, kCpv, kMats><<<kBlocks, kThreads>>>(seed, dn.get(), dr.get(), dv.get());
    PROX_TEST_CUDA(cudaGetLastError());
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    const std::vector<float> got = dn.download();
    const std::vector<float> want = dr.download();
    const std::vector<float> rev = dv.download();
    int mismatches = 0;
    int unwritten = 0;
    for (std::size_t i = 0; i < n; ++i) {
      unwritten += bits32(got[i]) == 0xFFFFFFFFu || bits32(want[i]) == 0xFFFFFFFFu;
      mismatches += bits32(got[i]) != bits32(want[i]);
      differs_reversed += bits32(rev[i]) != bits32(want[i]);
    }
    REQUIRE(unwritten == 0);
    REQUIRE(mismatches == 0);
  }
  REQUIRE(differs_reversed > 0);  // the inputs are order-sensitive, so the equality above says something
}

}  // namespace

TEST_CASE("tile reduction: recursive halving is bit-identical to the butterfly", "[reduce][gpu]") {
  check_reducer<256, 16, 16, 2>();  // Stage 1 (256-channel tiles of 16-channel pieces): one halving step
  check_reducer<256, 16, 8, 1>();   // down GEMV, 128-column tiles
  check_reducer<256, 32, 8, 1>();   // down GEMV, 256-column tiles: no warp step (the butterfly path)
  check_reducer<256, 8, 16, 2>();   // two steps
  check_reducer<128, 2, 16, 2>();   // four steps
  check_reducer<256, 1, 32, 1>();   // five steps
}
