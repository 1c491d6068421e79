// SPDX-License-Identifier: Apache-2.0
//! @file test_allocation.cpp  The stage-wise allocation rule reproduces the paper's table.
#include "catch.hpp"

#include <cmath>
#include <limits>

#include <prox/allocation.hpp>
#include <prox/stats.cuh>

namespace {
double pct1(double v) { return std::round(v * 1000.0) / 10.0; }  // percent with one decimal, as the paper prints
}  // namespace

TEST_CASE("allocation reproduces the paper's stage-wise table", "[allocation]") {
  struct Row {
    double e, s1, s2_pct;
  };
  const Row rows[] = {{0.40, 0.00, 62.2}, {0.50, 0.10, 70.0}, {0.60, 0.55, 70.0}, {0.70, 0.70, 76.7}};
  for (const Row& r : rows) {
    prox::StageSparsity s;
    REQUIRE(prox::allocate_sparsity(r.e, &s) == prox::Status::kSuccess);
    CAPTURE(r.e, s.s1, s.s2);
    CHECK(s.s1 == Approx(r.s1).margin(1e-12));
    CHECK(pct1(s.s2) == Approx(r.s2_pct).margin(1e-9));
    // The split realizes the target exactly.
    CHECK(prox::effective_sparsity(s.s1, s.s2) == Approx(r.e).margin(1e-12));
  }
}

TEST_CASE("allocation keeps s2 at the anchor inside the clamp and clamps s1 outside", "[allocation]") {
  for (double e = 0.0; e <= prox::max_effective_sparsity() + 1e-12; e += 0.01) {
    prox::StageSparsity s;
    REQUIRE(prox::allocate_sparsity(std::min(e, prox::max_effective_sparsity()), &s) == prox::Status::kSuccess);
    CHECK(s.s1 >= 0.0);
    CHECK(s.s1 <= 0.7 + 1e-15);
    CHECK(s.s2 >= 0.0);
    CHECK(s.s2 <= 1.0);
    if (s.s1 > 1e-12 && s.s1 < 0.7 - 1e-12) CHECK(s.s2 == Approx(0.7).margin(1e-12));
  }
}

TEST_CASE("allocation rejects invalid targets", "[allocation]") {
  prox::StageSparsity s{0.123, 0.456};
  CHECK(prox::allocate_sparsity(-0.01, &s) == prox::Status::kErrorInvalidTarget);
  CHECK(prox::allocate_sparsity(0.95, &s) == prox::Status::kErrorInvalidTarget);
  CHECK(prox::allocate_sparsity(std::numeric_limits<double>::quiet_NaN(), &s) == prox::Status::kErrorInvalidTarget);
  CHECK(prox::allocate_sparsity(std::numeric_limits<double>::infinity(), &s) == prox::Status::kErrorInvalidTarget);
  CHECK(prox::allocate_sparsity(0.5, nullptr) == prox::Status::kErrorNullPointer);
  prox::AllocationRule bad;
  bad.alpha = 0.0;
  CHECK(prox::allocate_sparsity(0.5, &s, bad) == prox::Status::kErrorInvalidTarget);
  CHECK(s.s1 == 0.123);  // untouched on error
  CHECK(s.s2 == 0.456);
}

TEST_CASE("allocation is usable at compile time", "[allocation]") {
  constexpr auto split = [] {
    prox::StageSparsity s;
    prox::allocate_sparsity(0.6, &s);
    return s;
  }();
  static_assert(split.s1 > 0.549 && split.s1 < 0.551, "e = 60% -> s1 = 55%");
  static_assert(split.s2 > 0.699 && split.s2 < 0.701, "e = 60% -> s2 = 70%");
  SUCCEED();
}

TEST_CASE("effective sparsity from measured stage sparsities", "[allocation][stats]") {
  // The paper's runtime formula e^ = s2^ - 2 alpha (1 - s1^) / 3 with alpha = 1/3.
  CHECK(prox::effective_sparsity(0.1, 0.7) == Approx(0.5));
  CHECK(prox::effective_sparsity(0.0, 0.0) == Approx(-2.0 / 9.0));
  prox::SparsityCounters c;
  c.calls = 4;
  c.kept_inputs = 4 * 100 - 40;        // s1 = 0.1 at d_model = 100
  c.selected_channels = 4 * 320 - 896;  // s2 = 0.7 at d_ff = 320
  prox::SparsityReport r;
  REQUIRE(prox::make_report(c, 100, 320, &r) == prox::Status::kSuccess);
  CHECK(r.calls == 4);
  CHECK(r.s1 == Approx(0.1));
  CHECK(r.s2 == Approx(0.7));
  CHECK(r.effective == Approx(0.5));
  prox::SparsityCounters none;
  REQUIRE(prox::make_report(none, 100, 320, &r) == prox::Status::kSuccess);
  CHECK(r.calls == 0);
  CHECK(prox::make_report(c, 0, 320, &r) == prox::Status::kErrorInvalidShape);
}
