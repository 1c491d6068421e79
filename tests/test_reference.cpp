// SPDX-License-Identifier: Apache-2.0
//! @file test_reference.cpp  Self-consistency of the float64 reference (the golden model).
#include "catch.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include <prox/int4_format.hpp>
#include <prox/layout.cuh>

#include "common.hpp"
#include "reference/reference.hpp"

using prox_ref::Act;

TEST_CASE("reference: activations", "[reference]") {
  CHECK(prox_ref::act(Act::kSiLU, 0.0) == 0.0);
  CHECK(prox_ref::act(Act::kSiLU, 2.0) == Approx(2.0 / (1.0 + std::exp(-2.0))));
  CHECK(prox_ref::act(Act::kGeluTanh, 1.0) == Approx(0.8411919906082768));
  CHECK(prox_ref::act(Act::kGeluTanh, -3.0) == Approx(-0.0036373920817729943));
}

TEST_CASE("reference: Stage 2 with every channel selected is the dense FFN", "[reference]") {
  const int K = 24, N = 40;
  for (Act a : {Act::kSiLU, Act::kGeluTanh}) {
    const auto x = prox_ref::to_double(prox_test::random_vector<__half>(K, 1));
    const auto wg = prox_ref::to_double(prox_test::random_vector<__half>(N * K, 2, 0.2));
    const auto wu = prox_ref::to_double(prox_test::random_vector<__half>(N * K, 3, 0.2));
    const auto wdt = prox_ref::to_double(prox_test::random_vector<__half>(N * K, 4, 0.2));
    const auto dense = prox_ref::dense_ffn(x, wg, wu, wdt, K, N, a);
    const auto st2 = prox_ref::stage2(x, wg, wu, wdt, K, N, std::vector<std::uint8_t>(N, 1), a);
    for (int j = 0; j < N; ++j) CHECK(st2.s[j].v == Approx(dense.s[j]).epsilon(1e-12));
    for (int k = 0; k < K; ++k) {
      CHECK(st2.y[k].v == Approx(dense.y[k]).epsilon(1e-12).margin(1e-12));
      CHECK(st2.y[k].err > 0.0);
    }
    // Nothing selected: y is exactly zero.
    const auto none = prox_ref::stage2(x, wg, wu, wdt, K, N, std::vector<std::uint8_t>(N, 0), a);
    for (int k = 0; k < K; ++k) CHECK(none.y[k].v == 0.0);
  }
}

TEST_CASE("reference: dense-proxy Stage 1 with tau_x = 0 gives the exact s", "[reference]") {
  const int K = 16, N = 32;
  const auto x = prox_ref::to_double(prox_test::random_vector<__half>(K, 5));
  const auto wg = prox_ref::to_double(prox_test::random_vector<__half>(N * K, 6, 0.3));
  const auto wu = prox_ref::to_double(prox_test::random_vector<__half>(N * K, 7, 0.3));
  std::vector<double> wg_t(N * K), wu_t(N * K);
  prox::transpose_host(wg.data(), N, K, wg_t.data());
  prox::transpose_host(wu.data(), N, K, wu_t.data());
  const auto dense = prox_ref::dense_ffn(x, wg, wu, std::vector<double>(N * K, 0.0), K, N, Act::kSiLU);
  const auto st1 = prox_ref::stage1_dense(x, K, N, 0.0f, 0.0f, wg_t, wu_t, Act::kSiLU);
  CHECK(st1.kept.size() == static_cast<std::size_t>(K));
  CHECK(st1.num_selected == N);
  for (int j = 0; j < N; ++j) CHECK(st1.s[j].v == Approx(dense.s[j]).epsilon(1e-12));
}

TEST_CASE("reference: INT4 Stage 1 on a hand-checked example", "[reference]") {
  const int K = 2, N = 32;
  // W[n][k]: channel 0 = (7, -7) -> scale 1, q = (7, -7); channel 1 = (1, 0) -> scale 1/7, q = (7, 0)
  std::vector<__half> w(static_cast<std::size_t>(N) * K, __float2half(0.0f));
  w[0] = __float2half(7.0f);
  w[1] = __float2half(-7.0f);
  w[2] = __float2half(1.0f);
  std::vector<std::uint32_t> q(prox::int4::packed_words(K, N));
  std::vector<float> sc(N);
  REQUIRE(prox::int4::pack_host(w.data(), K, N, q.data(), sc.data()) == prox::Status::kSuccess);
  const std::vector<double> x = {0.5, -0.25};
  // tau_x = 0.3 keeps only k = 0: g~ = u~ = 7 * 0.5 * scale
  const auto r = prox_ref::stage1_int4(x, K, N, 0.3f, 0.0f, q, sc, q, sc, Act::kSiLU);
  REQUIRE(r.kept == std::vector<int>{0});
  const double g0 = 3.5;
  CHECK(r.s[0].v == Approx(g0 * prox_ref::act(Act::kSiLU, g0)));
  const double g1 = 3.5 * (1.0 / 7.0);
  CHECK(r.s[1].v == Approx(g1 * prox_ref::act(Act::kSiLU, g1)).epsilon(1e-7));
  CHECK(r.s[2].v == 0.0);
}

TEST_CASE("reference: threshold semantics for tau = 0, tau = inf, NaN and inf inputs", "[reference][threshold]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> x = {0.0, -0.0, 1.0, -2.0, inf, -inf, nan, 1e-8};
  CHECK(prox_ref::kept_inputs(x, 0.0f) == std::vector<int>{0, 1, 2, 3, 4, 5, 7});
  CHECK(prox_ref::kept_inputs(x, std::numeric_limits<float>::infinity()) == std::vector<int>{4, 5});
  CHECK(prox_ref::kept_inputs(x, 1.0f) == std::vector<int>{2, 3, 4, 5});
}

TEST_CASE("reference: oracle-s keeps the largest |s|, ties to the lower index", "[reference]") {
  const std::vector<double> s = {0.1, -3.0, 2.0, -2.0, 0.5};
  const auto sel = prox_ref::oracle_channels(s, 3);
  CHECK(sel == std::vector<std::uint8_t>{0, 1, 1, 1, 0});
  CHECK(prox_ref::oracle_channels(s, 2) == std::vector<std::uint8_t>{0, 1, 1, 0, 0});
  CHECK(prox_ref::overlap(sel, prox_ref::oracle_channels(s, 2)) == Approx(2.0 / 3.0));
  CHECK(prox_ref::overlap(std::vector<std::uint8_t>(5, 0), sel) == 1.0);
}
