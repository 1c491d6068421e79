// SPDX-License-Identifier: Apache-2.0
//! @file reference.cuh  The float64 expectations the tuner checks policy 0 against, with the
//! rounding bound of every element (prox_tuning/verify.hpp's model, as tests/reference): the GLU
//! output s of selected channels and the down output y. Computed on the host from the synthetic
//! inputs and rotation set 0, split over threads (parallel_for).
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <prox/activation.cuh>

#include "harness.hpp"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

using verify::Bounded;

//! act(g) in float64, for each activation the library is compiled for.
template <class Act>
double act_f64(double g);
template <>
inline double act_f64<SiLU>(double g) {
  return verify::silu(g);
}
template <>
inline double act_f64<GeluTanh>(double g) {
  return verify::gelu_tanh(g);
}

//! The rounding of storing an fp32 result as T (verify.hpp).
template <class T>
verify::Storage storage_of() {
  return std::is_same<T, __half>::value ? verify::Storage{verify::kStoreRelF16, verify::kStoreAbsF16}
                                        : verify::Storage{verify::kStoreRelBf16, verify::kStoreAbsBf16};
}

//! Rows a thread takes at least in the references (below this, threads cost more than they save).
constexpr std::size_t kRowsPerThread = 64;

/**
 * @brief s_j = u_j act(g_j) of the selected channels (+0 elsewhere), g and u exact fp32 dot products
 * of x [K] with rows j of gate and up [N][K] (all K inputs: gamma(K)).
 */
template <class T, class Act>
std::vector<Bounded> glu_expected(const std::vector<T>& x, const T* gate, const T* up, int K, int N,
                                  const std::vector<std::uint8_t>& selected) {
  std::vector<double> xd(x.size());
  for (std::size_t k = 0; k < x.size(); ++k) xd[k] = host_to_double(x[k]);
  std::vector<Bounded> s(static_cast<std::size_t>(N));
  parallel_for(static_cast<std::size_t>(N), kRowsPerThread, [&](std::size_t b, std::size_t e) {
    for (std::size_t j = b; j < e; ++j) {
      if (!selected[j]) continue;
      const T* wg = gate + j * static_cast<std::size_t>(K);
      const T* wu = up + j * static_cast<std::size_t>(K);
      double g = 0.0, u = 0.0, ag = 0.0, au = 0.0;
      for (int k = 0; k < K; ++k) {
        const double pg = xd[static_cast<std::size_t>(k)] * host_to_double(wg[k]);
        const double pu = xd[static_cast<std::size_t>(k)] * host_to_double(wu[k]);
        g += pg;
        u += pu;
        ag += std::fabs(pg);
        au += std::fabs(pu);
      }
      const double gk = verify::gamma(static_cast<std::size_t>(K));
      s[j] = verify::glu(Bounded{g, gk * ag}, Bounded{u, gk * au}, act_f64<Act>(g));
    }
  });
  return s;
}

/**
 * @brief y_d = sum over selected j of s_j W_down^T[j][d], W_down^T [N][K]: the error of the s_j it
 * is given, propagated, plus gamma(selected) of the sum of |s_j w_jd|.
 */
template <class T>
std::vector<Bounded> down_expected(const std::vector<Bounded>& s, const T* down_t, int K, int N,
                                   const std::vector<std::uint8_t>& selected) {
  std::size_t nsel = 0;
  for (int j = 0; j < N; ++j) nsel += selected[static_cast<std::size_t>(j)] != 0;
  std::vector<Bounded> y(static_cast<std::size_t>(K));
  parallel_for(static_cast<std::size_t>(K), kRowsPerThread, [&](std::size_t b, std::size_t e) {
    std::vector<double> abs_sum(e - b, 0.0);
    for (int j = 0; j < N; ++j) {
      if (!selected[static_cast<std::size_t>(j)]) continue;
      const Bounded sj = s[static_cast<std::size_t>(j)];
      const T* row = down_t + static_cast<std::size_t>(j) * static_cast<std::size_t>(K);
      for (std::size_t d = b; d < e; ++d) {
        const double w = host_to_double(row[d]);
        y[d].v += sj.v * w;
        y[d].err += sj.err * std::fabs(w);
        abs_sum[d - b] += std::fabs(sj.v * w);
      }
    }
    for (std::size_t d = b; d < e; ++d) y[d].err += verify::gamma(nsel) * abs_sum[d - b];
  });
  return y;
}

/**
 * @brief Stage 1's s~ of every channel over the kept rows (tests/reference's stage1_int4 and
 * stage1_dense): g~_j = sum over kept k of x_k q(0, k, j), u~_j likewise with q(1, k, j), then for
 * INT4 (`int4`) the fp16 step sums and the per-channel scales scale(0 | 1, j); s~ = u~ act(g~).
 */
template <class T, class Act, class Q, class Scale>
std::vector<Bounded> stage1_expected(const std::vector<T>& x, const std::vector<int>& kept, int N, bool int4, Q&& q,
                                     Scale&& scale) {
  std::vector<Bounded> s(static_cast<std::size_t>(N));
  const double gk = verify::gamma(kept.size());
  double sub = 0.0;  // INT4 fp16 subnormals: the same for every channel
  for (int k : kept)
    sub += (std::fabs(host_to_double(x[static_cast<std::size_t>(k)])) < verify::kInt4SmallX ? 9.0 : 1.0) *
           verify::kInt4SubnormalPerProduct;
  // A range of 32-channel words per thread: every kept row's slice of it, gate and up together.
  parallel_for(static_cast<std::size_t>(N / 32), 1, [&](std::size_t b, std::size_t e) {
    const std::size_t j0 = 32 * b, n = 32 * (e - b);
    std::vector<double> g(n, 0.0), u(n, 0.0), ag(n, 0.0), au(n, 0.0);
    for (int k : kept) {
      const double xk = host_to_double(x[static_cast<std::size_t>(k)]);
      for (std::size_t i = 0; i < n; ++i) {
        const double pg = xk * q(0, k, j0 + i), pu = xk * q(1, k, j0 + i);
        g[i] += pg;
        u[i] += pu;
        ag[i] += std::fabs(pg);
        au[i] += std::fabs(pu);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      Bounded bg{g[i], gk * ag[i]}, bu{u[i], gk * au[i]};
      if (int4) {  // the fp16 step sums, then the per-channel scale (one more rounding)
        const double sg = scale(0, j0 + i), su = scale(1, j0 + i);
        bg = Bounded{
            g[i] * sg,
            (bg.err + verify::int4_step_rounding(ag[i]) + sub + verify::kUnitRoundoff32 * std::fabs(g[i])) * sg};
        bu = Bounded{
            u[i] * su,
            (bu.err + verify::int4_step_rounding(au[i]) + sub + verify::kUnitRoundoff32 * std::fabs(u[i])) * su};
      }
      s[j0 + i] = verify::glu(bg, bu, act_f64<Act>(bg.v));
    }
  });
  return s;
}

//! "" if every unselected channel of s is exactly +0 (GluGemvArgs::s: every entry is written).
inline std::string check_unselected_zero(const std::vector<float>& s, const std::vector<std::uint8_t>& selected) {
  for (std::size_t j = 0; j < s.size(); ++j) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &s[j], sizeof(bits));
    if (!selected[j] && bits != 0u)
      return "s[" + std::to_string(j) + "] of an unselected channel is " + std::to_string(s[j]) + ", not +0";
  }
  return std::string();
}

//! The values of bounded results.
inline std::vector<double> values(const std::vector<Bounded>& b) {
  std::vector<double> v(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) v[i] = b[i].v;
  return v;
}

//! What a candidate's output `i` is checked against (verify.hpp): for policy 0 (`policy0` == nullptr)
//! the float64 values of `exact`, for every other candidate policy 0's output `i`, fetched as U.
struct Expected {
  std::vector<double> want;
  verify::Against against;
};
template <class U>
Expected expected(const Fetched* policy0, std::size_t i, const std::vector<Bounded>& exact) {
  if (policy0 == nullptr) return {values(exact), verify::Against::kExact};
  return {policy0->as_double<U>(i), verify::Against::kPolicy0};
}

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
