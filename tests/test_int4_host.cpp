// SPDX-License-Identifier: Apache-2.0
//! @file test_int4_host.cpp  The INT4 proxy format on the host: layout, rounding, edge cases.
#include "catch.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <prox/int4_format.hpp>
#include <prox/layout.cuh>

#include "common.hpp"

using prox_test::random_vector;

TEMPLATE_TEST_CASE("int4 pack_host: round trip within half a step, layout as documented", "[int4]", __half,
                   __nv_bfloat16) {
  const int K = 40, N = 64;
  const auto w = random_vector<TestType>(static_cast<std::size_t>(N) * K, 11, 0.05);
  std::vector<std::uint32_t> q(prox::int4::packed_words(K, N), 0u);
  std::vector<float> sc(N, -1.0f);
  REQUIRE(prox::int4::pack_host(w.data(), K, N, q.data(), sc.data()) == prox::Status::kSuccess);
  for (int n = 0; n < N; ++n) {
    float amax = 0.0f;
    for (int k = 0; k < K; ++k)
      amax = std::max(amax, std::fabs(prox::to_float(w[static_cast<std::size_t>(n) * K + k])));
    REQUIRE(sc[n] == amax / 7.0f);
    for (int k = 0; k < K; ++k) {
      const float v = prox::to_float(w[static_cast<std::size_t>(n) * K + k]);
      const int qv = prox::int4::unpack_host(q.data(), N, k, n);
      CHECK(qv >= -7);
      CHECK(qv <= 7);
      CHECK(std::fabs(qv * sc[n] - v) <= 0.5f * sc[n] * (1.0f + 1e-6f));
      CHECK(static_cast<float>(qv) == std::nearbyint(v / sc[n]));
    }
  }
  // Nibble order: channel 8w+c sits in nibble (c>>1) + 4 (c&1).
  for (int c = 0; c < 8; ++c) CHECK(prox::int4::nibble_of_channel(c) == std::vector<int>{0, 4, 1, 5, 2, 6, 3, 7}[c]);
  const std::uint32_t word = q[3 * (N / 8) + 2];  // row k = 3, channels 16..23
  for (int c = 0; c < 8; ++c) {
    const int expect = prox::int4::unpack_host(q.data(), N, 3, 16 + c) + 8;
    CHECK(static_cast<int>((word >> (4 * prox::int4::nibble_of_channel(c))) & 0xF) == expect);
  }
}

TEST_CASE("int4 pack_host: edge cases", "[int4]") {
  const int K = 8, N = 32;
  std::vector<__half> w(static_cast<std::size_t>(N) * K);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = __float2half(0.001f * static_cast<float>(i % 13) - 0.006f);
  // channel 0: all zero -> scale 0, every nibble 8 (q = 0)
  for (int k = 0; k < K; ++k) w[k] = __float2half(0.0f);
  // channel 1: values at +max and -max -> +7 and -7 exactly
  for (int k = 0; k < K; ++k) w[static_cast<std::size_t>(K) + k] = __float2half(k % 2 ? 2.0f : -2.0f);
  // channel 2: a tie at exactly half a step rounds to even: amax = 7 -> scale 1; 2.5 -> 2, 3.5 -> 4
  for (int k = 0; k < K; ++k)
    w[2 * static_cast<std::size_t>(K) + k] = __float2half(k == 0 ? 7.0f : (k == 1 ? 2.5f : 3.5f));
  std::vector<std::uint32_t> q(prox::int4::packed_words(K, N));
  std::vector<float> sc(N);
  REQUIRE(prox::int4::pack_host(w.data(), K, N, q.data(), sc.data()) == prox::Status::kSuccess);
  CHECK(sc[0] == 0.0f);
  CHECK(sc[1] == 2.0f / 7.0f);
  CHECK(sc[2] == 1.0f);
  for (int k = 0; k < K; ++k) {
    CHECK(prox::int4::unpack_host(q.data(), N, k, 0) == 0);
    CHECK(prox::int4::unpack_host(q.data(), N, k, 1) == (k % 2 ? 7 : -7));
  }
  CHECK(prox::int4::unpack_host(q.data(), N, 1, 2) == 2);
  CHECK(prox::int4::unpack_host(q.data(), N, 2, 2) == 4);
  // Every stored nibble is in [1, 15]: -8 (nibble 0) never occurs.
  for (std::uint32_t word : q)
    for (int p = 0; p < 8; ++p) CHECK(((word >> (4 * p)) & 0xF) != 0u);
  // The clamp holds for values beyond the scale (a scale given by hand).
  CHECK(prox::int4::quantize_nibble(100.0f, 1.0f) == 15u);
  CHECK(prox::int4::quantize_nibble(-100.0f, 1.0f) == 1u);
  CHECK(prox::int4::quantize_nibble(3.0f, 0.0f) == 8u);
}

TEST_CASE("int4 pack_host: non-finite weights and bad shapes get a Status", "[int4]") {
  const int K = 8, N = 32;
  std::vector<std::uint32_t> q(prox::int4::packed_words(K, N));
  std::vector<float> sc(N);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<__nv_bfloat16> w(static_cast<std::size_t>(N) * K, __float2bfloat16(0.5f));
    w[5 * K + 3] = __float2bfloat16(bad);
    CHECK(prox::int4::pack_host(w.data(), K, N, q.data(), sc.data()) == prox::Status::kErrorNonFiniteWeight);
  }
  std::vector<__half> w(static_cast<std::size_t>(N) * K, __float2half(0.5f));
  CHECK(prox::int4::pack_host(w.data(), K, 48, q.data(), sc.data()) == prox::Status::kErrorInvalidShape);
  CHECK(prox::int4::pack_host(w.data(), 0, N, q.data(), sc.data()) == prox::Status::kErrorInvalidShape);
  CHECK(prox::int4::pack_host<__half>(nullptr, K, N, q.data(), sc.data()) == prox::Status::kErrorNullPointer);
}

TEST_CASE("transpose_host makes W_down^T from nn.Linear's layout", "[layout]") {
  const int rows = 3, cols = 5;  // nn.Linear down: [d_model = 3][d_ff = 5]
  std::vector<int> in(rows * cols);
  for (int i = 0; i < rows * cols; ++i) in[i] = i * 7 + 1;
  std::vector<int> out(rows * cols, -1);
  REQUIRE(prox::transpose_host(in.data(), rows, cols, out.data()) == prox::Status::kSuccess);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) CHECK(out[c * rows + r] == in[r * cols + c]);
  CHECK(prox::transpose_host(in.data(), 0, cols, out.data()) == prox::Status::kErrorInvalidShape);
}
