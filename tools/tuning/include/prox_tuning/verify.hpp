// SPDX-License-Identifier: Apache-2.0
//! @file verify.hpp  How the tuner decides that a candidate computes what policy 0 computes: the
//! rounding-error model of the GPU tests (tests/reference/reference.hpp), applied per element.
//!
//! Every result the tuner checks is an fp32 sum of n products (then an activation, a product, or a
//! rounding to fp16/bf16). A policy may sum in any fixed order, so a result is within
//! gamma(n) * sum|products| of the exact value, gamma(n) = (n + 64) 2^-24; the INT4 Stage 1 adds its
//! fp16 step sums; an output stored as T adds half an ulp of T. The tuner computes the exact value and
//! that bound of every element on the host, in float64, from the synthetic inputs, then accepts
//!  - policy 0 when each element is within its bound of the exact value (kExact), and
//!  - another candidate when each element is within twice its bound of policy 0's (kPolicy0: both
//!    are within the bound of the exact value).
//! The bound of an element scales with that element's own inputs, not with the largest output, so a
//! candidate that corrupts a small output is caught (the synthetic weights span kMagnitudeOctaves
//! octaves from row to row for that reason). Host-only C++17.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <prox/core/config.hpp>

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace verify {

//! fp32 unit roundoff, 2^-24.
constexpr double kUnitRoundoff32 = 5.9604644775390625e-08;
//! gamma(n) = (n + kGammaSlack) 2^-24: the slack covers the lane, warp and split-K trees of the
//! kernels (a worst-case-style bound, far below the O(1) error of an indexing bug).
constexpr double kGammaSlack = 64.0;
//! fp16 unit roundoff, 2^-11: the INT4 Stage 1 sums each step of rows in fp16.
constexpr double kUnitRoundoff16 = 4.8828125e-04;
//! Rows one INT4 step sums in fp16 (Int4Weights::kMaxStepRows; the tuner static_asserts they agree).
constexpr int kInt4StepRows = 4;
//! INT4 step subnormals: absolute 2^-25 in units of x 2^-6, i.e. 2^-19, per product ...
constexpr double kInt4SubnormalPerProduct = 1.9073486328125e-06;
//! ... and 9x that for |x| < 2^-8, where x 2^-6 itself is an fp16 subnormal.
constexpr double kInt4SmallX = 0.00390625;
//! Bound on |act'(g)|: SiLU 1.0998, tanh-GELU 1.1289.
constexpr double kActSlope = 1.2;
//! Two results each within E of the exact value differ by at most 2E.
constexpr double kPeerFactor = 2.0;
//! Half an ulp of T relative to the value (fp16 2^-11, bf16 2^-8), and half of T's smallest
//! subnormal step in absolute terms (fp16 2^-25, bf16 2^-134): the rounding of storing an fp32 y.
constexpr double kStoreRelF16 = 4.8828125e-04;
constexpr double kStoreRelBf16 = 3.90625e-03;
constexpr double kStoreAbsF16 = 2.98023223876953125e-08;
constexpr double kStoreAbsBf16 = 4.591774807899561e-41;

//! Rounding-error factor of an fp32 sum of n products in any fixed order.
inline double gamma(std::size_t n) { return (static_cast<double>(n) + kGammaSlack) * kUnitRoundoff32; }

//! Extra error of the INT4 Stage 1's fp16 step sums over kept rows whose |x q| sum to abs_xq.
inline double int4_step_rounding(double abs_xq) { return kInt4StepRows * kUnitRoundoff16 * abs_xq; }

//! The activations of prox/activation.cuh in float64 (the exact values the bounds are about):
//! SiLU(g) = g / (1 + e^-g), and tanh-GELU(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
inline double silu(double g) { return g / (1.0 + std::exp(-g)); }
inline double gelu_tanh(double g) {
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * g * (1.0 + std::tanh(c * (g + 0.044715 * g * g * g)));
}

//! A value with a bound on the error an fp32 implementation may make computing it.
struct Bounded {
  double v = 0.0;
  double err = 0.0;
};

/**
 * @brief s = u * act(g) from bounded g and u, with h = act(g.v) (float64). Propagated input errors,
 * the product's rounding, and the fp32 activation's own error (tanh-GELU loses relative accuracy
 * where 1 + tanh(.) cancels, so that term is absolute in |g|).
 */
inline Bounded glu(Bounded g, Bounded u, double h) {
  Bounded s;
  s.v = u.v * h;
  s.err = std::fabs(h) * u.err + std::fabs(u.v) * kActSlope * g.err + u.err * kActSlope * g.err +
          8.0 * kUnitRoundoff32 * std::fabs(s.v) + 16.0 * kUnitRoundoff32 * std::fabs(u.v) * std::fabs(g.v);
  return s;
}

//! The rounding of storing a result: relative to its magnitude and absolute (fp32 outputs: none).
struct Storage {
  double rel = 0.0;
  double abs = 0.0;
};

//! What a result is checked against.
enum class Against {
  kExact,    //!< the float64 value: within the element's bound (policy 0)
  kPolicy0,  //!< policy 0's result: within twice the bound (every other candidate)
};

//! The tolerance of one element with exact value and bound `b`, stored with `st`.
inline double tolerance(const Bounded& b, Storage st, Against against) {
  const double one = b.err + st.rel * (std::fabs(b.v) + b.err) + st.abs;
  return against == Against::kExact ? one : kPeerFactor * one;
}

/**
 * @brief Check `got` against `want` (the exact values for kExact, policy 0's for kPolicy0) within
 * tolerance(exact[i], st, against) at every i (or only where (*selected)[i] != 0). A NaN fails.
 * @return "" if every element is within, else a message naming the first that is not.
 */
inline std::string check_within(const char* what, const std::vector<double>& got, const std::vector<double>& want,
                                const std::vector<Bounded>& exact, Storage st, Against against,
                                const std::vector<std::uint8_t>* selected = nullptr) {
  if (got.size() != want.size() || got.size() != exact.size()) return std::string(what) + ": size mismatch";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (selected != nullptr && (*selected)[i] == 0) continue;
    const double tol = tolerance(exact[i], st, against);
    if (!(std::fabs(got[i] - want[i]) <= tol)) {
      return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(got[i]) +
             (against == Against::kExact ? ", exact " : ", policy 0 gives ") + std::to_string(want[i]) + " (bound " +
             std::to_string(tol) + ")";
    }
  }
  return std::string();
}

//! Bit j % 32 of word j / 32: channel j of a channel bitmask.
inline bool mask_bit(const std::vector<std::uint32_t>& m, std::size_t j) { return (m[j / 32] >> (j % 32)) & 1u; }

//! The channel bitmask of 0/1 flags, one per channel (mask_bit(m, j) == f[j]).
inline std::vector<std::uint32_t> flags_to_mask(const std::vector<std::uint8_t>& f) {
  std::vector<std::uint32_t> m((f.size() + 31) / 32, 0u);
  for (std::size_t j = 0; j < f.size(); ++j)
    if (f[j]) m[j / 32] |= 1u << (j % 32);
  return m;
}

/**
 * @brief Stage-1 channel bits: `got` may differ from `want` only at channels whose |s~| (`want_s`:
 * the exact s~ for kExact, policy 0's for kPolicy0) is within tolerance(exact[j], {}, against) of
 * tau_s, where either decision is right.
 */
inline std::string check_mask(const std::vector<std::uint32_t>& got, const std::vector<std::uint32_t>& want,
                              const std::vector<double>& want_s, const std::vector<Bounded>& exact, double tau_s,
                              Against against) {
  if (got.size() != want.size() || want_s.size() != exact.size() || got.size() * 32 < exact.size())
    return "mask: size mismatch";
  for (std::size_t j = 0; j < exact.size(); ++j) {
    if (mask_bit(got, j) == mask_bit(want, j)) continue;
    const double tol = tolerance(exact[j], Storage{}, against);
    if (!(std::fabs(std::fabs(want_s[j]) - tau_s) <= tol)) {
      return "channel " + std::to_string(j) + " selected differently " +
             (against == Against::kExact ? std::string("from the exact s~") : std::string("from policy 0")) +
             " away from the threshold (|s~| = " + std::to_string(std::fabs(want_s[j])) +
             ", tau_s = " + std::to_string(tau_s) + ", bound " + std::to_string(tol) + ")";
    }
  }
  return std::string();
}

}  // namespace verify
}  // namespace tuning
PROX_NAMESPACE_END
