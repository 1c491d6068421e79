// SPDX-License-Identifier: Apache-2.0
//! @file test_fixture.cu  The test fixtures' threaded parts give the serial bits: the GPU tests' seeded
//! weights (normal_vector, drawn in chunks) and the float64 reference (its loops split over threads), so
//! what a GPU test compares with does not depend on how many cores the machine that runs it has.
#include "catch.hpp"

#include <cstring>
#include <vector>

#include "gpu_fixture.hpp"

namespace {

template <class V>
bool same_bits(const V& a, const V& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
}
bool same_bits(const std::vector<prox_ref::Bounded>& a, const std::vector<prox_ref::Bounded>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i].v, &b[i].v, sizeof(double)) != 0 || std::memcmp(&a[i].err, &b[i].err, sizeof(double)) != 0)
      return false;
  return true;
}

//! prox_support::parallel_for's thread count for one scope.
struct Threads {
  explicit Threads(unsigned n) { prox_support::parallel_threads() = n; }
  ~Threads() { prox_support::parallel_threads() = 0; }
};

}  // namespace

TEMPLATE_TEST_CASE("test fixtures: normal_vector drawn in chunks is the serial stream", "[reference]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  for (unsigned threads : {1u, 3u, 16u}) {
    const Threads t(threads);
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{65537}, std::size_t{300007}}) {
      for (std::uint64_t seed : {1ull, 977ull}) {
        CAPTURE(threads, n, seed);
        prox_test::FastNormal g(seed);
        std::vector<T> serial(n);
        for (auto& e : serial) e = prox::from_float<T>(static_cast<float>(0.5 * g()));
        const std::vector<T> drawn = prox_test::normal_vector<T>(n, seed, 0.5);
        CHECK(same_bits(drawn, serial));
      }
    }
  }
}

TEMPLATE_TEST_CASE("test fixtures: to_double is the per-element conversion for every bit pattern", "[reference]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  std::vector<T> all(65536 * 3);  // three times over, so that the conversion runs in several chunks
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::uint16_t b = static_cast<std::uint16_t>(i);
    std::memcpy(static_cast<void*>(&all[i]), &b, sizeof(b));
  }
  const Threads t(4);
  const std::vector<double> d = prox_ref::to_double(all);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const double want = static_cast<double>(prox::to_float(all[i]));
    differ += std::memcmp(&d[i], &want, sizeof(double)) != 0;  // NaNs too: bitwise
  }
  CHECK(differ == 0);
}

TEST_CASE("test fixtures: the float64 reference gives the same bits on 1 and on 4 threads", "[reference]") {
  const int K = 1024, N = 2048;
  const auto L = prox_test::make_host_layer<__half>(K, N, 3);
  const auto x = prox_ref::to_double(prox_test::normal_vector<__half>(K, 11, 1.0));
  for (const float tau_x : {0.0f, 0.7f, prox_test::kInf}) {
    CAPTURE(tau_x);
    prox_ref::Stage1Result i1, i4, d1, d4;
    prox_ref::Stage2Result s1, s4;
    prox_ref::DenseResult f1, f4;
    for (unsigned threads : {1u, 4u}) {
      const Threads t(threads);
      auto& i = threads == 1 ? i1 : i4;
      auto& d = threads == 1 ? d1 : d4;
      auto& s = threads == 1 ? s1 : s4;
      auto& f = threads == 1 ? f1 : f4;
      i = prox_ref::stage1_int4(x, K, N, tau_x, 0.25f, L.qg, L.sg, L.qu, L.su, prox_ref::Act::kSiLU);
      d = prox_ref::stage1_dense(x, K, N, tau_x, 0.25f, L.dwg_t, L.dwu_t, prox_ref::Act::kGeluTanh);
      s = prox_ref::stage2(x, L.dwg, L.dwu, L.dwdt, K, N, i.sel, prox_ref::Act::kSiLU);
      f = prox_ref::dense_ffn(x, L.dwg, L.dwu, L.dwdt, K, N, prox_ref::Act::kGeluTanh);
    }
    CHECK(same_bits(i1.s, i4.s));
    CHECK(i1.sel == i4.sel);
    CHECK(i1.ambiguous == i4.ambiguous);
    CHECK(same_bits(d1.s, d4.s));
    CHECK(same_bits(s1.s, s4.s));
    CHECK(same_bits(s1.y, s4.y));
    CHECK(same_bits(f1.s, f4.s));
    CHECK(same_bits(f1.y, f4.y));
    // Not a vacuous comparison: something was selected and y is not zero (but for tau_x = inf, where
    // no input is kept, s~ = 0 and every channel passes |0| >= tau_s only if tau_s = 0).
    if (tau_x == 0.0f) {
      CHECK(i1.num_selected > 0);
      CHECK(s1.y[0].v != 0.0);
    }
  }
}
