// SPDX-License-Identifier: Apache-2.0
//! @file test_int4_device.cu  INT4 format on the GPU: device pack == host pack bit for bit, the
//! register dequantizer decodes every nibble, non-finite weights get a Status, device transpose.
#include "catch.hpp"

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <prox/int4.cuh>
#include <prox/layout.cuh>

#include "common.hpp"

using prox_test::DeviceBuffer;
using prox_test::random_vector;

namespace {
__global__ void dequant_test_kernel(const std::uint32_t* words, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float q[8];
  prox::int4::dequant_word(words[i], q);
  for (int c = 0; c < 8; ++c) out[8 * i + c] = q[c];
}
}  // namespace

TEMPLATE_TEST_CASE("int4: device pack equals host pack bit for bit", "[int4][gpu]", __half, __nv_bfloat16) {
  const std::pair<int, int> shapes[] = {{4096, 12288}, {200, 96}, {1, 32}, {37, 64}};
  std::uint64_t seed = 100;
  for (auto [K, N] : shapes) {
    CAPTURE(K, N);
    auto w = random_vector<TestType>(static_cast<std::size_t>(N) * K, ++seed, 0.02);
    // Edge rows: an all-zero channel and a channel holding exactly +-max.
    for (int k = 0; k < K; ++k) w[k] = prox::from_float<TestType>(0.0f);
    if (N > 1)
      for (int k = 0; k < K; ++k)
        w[static_cast<std::size_t>(K) + k] = prox::from_float<TestType>(k % 3 ? 0.75f : -0.75f);
    std::vector<std::uint32_t> qh(prox::int4::packed_words(K, N));
    std::vector<float> sh(N);
    REQUIRE(prox::int4::pack_host(w.data(), K, N, qh.data(), sh.data()) == prox::Status::kSuccess);

    DeviceBuffer<TestType> dw(w);
    DeviceBuffer<std::uint32_t> dq(qh.size());
    DeviceBuffer<float> ds(N);
    dq.poison();
    ds.poison();
    REQUIRE(prox::int4::pack_device(dw.get(), K, N, dq.get(), ds.get(), nullptr) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    const auto qd = dq.download();
    const auto sd = ds.download();
    std::size_t word_mismatch = 0;
    for (std::size_t i = 0; i < qh.size(); ++i) word_mismatch += qd[i] != qh[i];
    std::size_t scale_mismatch = 0;
    for (int n = 0; n < N; ++n) scale_mismatch += prox_test::bits32(sd[n]) != prox_test::bits32(sh[n]);
    CHECK(word_mismatch == 0);
    CHECK(scale_mismatch == 0);
  }
}

TEST_CASE("int4: register dequantizer decodes every nibble value in channel order", "[int4][gpu]") {
  std::mt19937 rng(7);
  std::vector<std::uint32_t> words(4096);
  for (auto& w : words) w = rng();
  words[0] = 0x00000000u;  // all -8
  words[1] = 0xFFFFFFFFu;  // all +7
  words[2] = 0x76543210u;
  DeviceBuffer<std::uint32_t> dwords(words);
  DeviceBuffer<float> dout(words.size() * 8);
  dout.poison();
  dequant_test_kernel<<<16, 256>>>(dwords.get(), static_cast<int>(words.size()), dout.get());
  PROX_TEST_CUDA(cudaGetLastError());
  const auto out = dout.download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < words.size(); ++i)
    for (int c = 0; c < 8; ++c) {
      const int nib = static_cast<int>((words[i] >> (4 * prox::int4::nibble_of_channel(c))) & 0xF);
      bad += out[8 * i + c] != static_cast<float>(nib - 8);
    }
  CHECK(bad == 0);
  CHECK(out[0] == -8.0f);
  CHECK(out[8] == 7.0f);
}

TEST_CASE("int4: device pack rejects non-finite weights before writing", "[int4][gpu]") {
  const int K = 64, N = 64;
  auto w = random_vector<__half>(static_cast<std::size_t>(N) * K, 9);
  w[17 * K + 5] = __float2half(std::numeric_limits<float>::infinity());
  DeviceBuffer<__half> dw(w);
  DeviceBuffer<std::uint32_t> dq(prox::int4::packed_words(K, N));
  DeviceBuffer<float> ds(N);
  dq.poison(0xAB);
  CHECK(prox::int4::pack_device(dw.get(), K, N, dq.get(), ds.get(), nullptr) == prox::Status::kErrorNonFiniteWeight);
  for (std::uint32_t v : dq.download()) REQUIRE(v == 0xABABABABu);
  CHECK(prox::int4::pack_device(dw.get(), K, 40, dq.get(), ds.get(), nullptr) == prox::Status::kErrorInvalidShape);
}

TEST_CASE("layout: device transpose equals host transpose", "[layout][gpu]") {
  const int rows = 77, cols = 130;
  const auto in = random_vector<__nv_bfloat16>(static_cast<std::size_t>(rows) * cols, 12);
  std::vector<__nv_bfloat16> ref(in.size());
  REQUIRE(prox::transpose_host(in.data(), rows, cols, ref.data()) == prox::Status::kSuccess);
  DeviceBuffer<__nv_bfloat16> din(in), dout(in.size());
  dout.poison();
  REQUIRE(prox::transpose_device(din.get(), rows, cols, dout.get(), nullptr) == prox::Status::kSuccess);
  const auto out = dout.download();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < out.size(); ++i) bad += prox_test::bits16(out[i]) != prox_test::bits16(ref[i]);
  CHECK(bad == 0);
}
