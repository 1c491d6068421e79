// SPDX-License-Identifier: Apache-2.0
//! @file allocation.hpp  The paper's stage-wise sparsity allocation: target effective sparsity e ->
//! (s1, s2), and the effective sparsity realized by measured (s1, s2). Host and device, constexpr.
#pragma once

#include "core/config.hpp"
#include "core/status.hpp"

PROX_NAMESPACE_BEGIN

//! Constants of the allocation rule (paper, "Sparsity Allocation between Two Stages").
struct AllocationRule {
  double alpha = 1.0 / 3.0;  //!< cost of one INT4 proxy projection relative to a dense one
  double s_ref = 0.7;        //!< Stage-2 anchor sparsity
  double s1_min = 0.0;       //!< lower clamp of the Stage-1 (input) sparsity
  double s1_max = 0.7;       //!< upper clamp of the Stage-1 (input) sparsity
};

//! A (Stage-1 input sparsity, Stage-2 channel sparsity) pair, both fractions in [0, 1].
struct StageSparsity {
  double s1 = 0.0;
  double s2 = 0.0;
};

/**
 * @brief Effective FFN sparsity of a (s1, s2) pair under the paper's cost model:
 *        e = s2 - 2 alpha (1 - s1) / 3   (dense cost 3, proxy cost 2 alpha (1 - s1), exact 3 (1 - s2)).
 * Use it with measured sparsities (s^1, s^2) to report the realized e^.
 */
PROX_HOST_DEVICE constexpr double effective_sparsity(double s1, double s2, double alpha = 1.0 / 3.0) noexcept {
  return s2 - 2.0 * alpha * (1.0 - s1) / 3.0;
}

//! Largest target the rule can realize (s1 = s1_max, s2 = 1).
PROX_HOST_DEVICE constexpr double max_effective_sparsity(const AllocationRule& r = {}) noexcept {
  return 1.0 - 2.0 * r.alpha * (1.0 - r.s1_max) / 3.0;
}

/**
 * @brief Split a target effective sparsity e between the two stages (paper, Sec. 4.2):
 * start from s2 = s_ref, solve for s1; if s1 leaves [s1_min, s1_max], clamp it and re-solve s2.
 *
 * Valid targets are 0 <= e <= max_effective_sparsity(rule) (0.9333 with the defaults). NaN,
 * negative or larger targets, and a malformed rule, return kErrorInvalidTarget and leave *out alone.
 *
 * @code
 * prox::StageSparsity s;
 * prox::allocate_sparsity(0.5, &s);   // s.s1 == 0.10, s.s2 == 0.70
 * @endcode
 */
PROX_HOST_DEVICE constexpr Status allocate_sparsity(double e, StageSparsity* out,
                                                    const AllocationRule& r = {}) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  // NaN fails every comparison below, so it is rejected by the first test.
  if (!(r.alpha > 0.0) || !(r.s1_min >= 0.0) || !(r.s1_max >= r.s1_min) || !(r.s1_max < 1.0) || !(r.s_ref >= 0.0) ||
      !(r.s_ref <= 1.0)) {
    return Status::kErrorInvalidTarget;
  }
  if (!(e >= 0.0) || !(e <= max_effective_sparsity(r))) return Status::kErrorInvalidTarget;
  const double k = 2.0 * r.alpha / 3.0;
  // e = s2 - k (1 - s1)  =>  s1 = 1 - (s_ref - e) / k  at s2 = s_ref.
  double s1 = 1.0 - (r.s_ref - e) / k;
  double s2 = r.s_ref;
  if (s1 < r.s1_min || s1 > r.s1_max) {
    s1 = s1 < r.s1_min ? r.s1_min : r.s1_max;
    s2 = e + k * (1.0 - s1);
  }
  if (s2 > 1.0) s2 = 1.0;  // only reachable through rounding at e == max_effective_sparsity
  out->s1 = s1;
  out->s2 = s2;
  return Status::kSuccess;
}

PROX_NAMESPACE_END
