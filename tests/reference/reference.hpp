// SPDX-License-Identifier: Apache-2.0
//! @file reference.hpp  The float64 host reference of prox: the golden model every test compares with.
//! Dense SwiGLU/GeGLU FFN, Prox Stage 1 (INT4 or fp16 proxy over thresholded x -> s~, channel set),
//! Stage 2 on a given channel set, and the oracle-s channel set. Every value comes with an error
//! bound for an fp32-accumulating implementation, so tests can tell rounding from bugs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include <prox/int4_format.hpp>
#include <prox/core/types.cuh>
#include <prox_tuning/verify.hpp>

// By its path, as tests/common.hpp includes device_buffer.hpp (standard library only).
#include "../../tools/common/include/prox_support/parallel.hpp"

// Hidden visibility, as prox's own namespace: the results below hold verify::Bounded, a prox type, and
// GCC warns of a default-visibility struct with a field of hidden type (-Wattributes; prox/version.hpp).
namespace prox_ref PROX_NAMESPACE_VISIBILITY {

//! The rounding-error model and the float64 activations are the tuner's (prox_tuning/verify.hpp),
//! which checks its candidates by the same rules: one definition of each term.
namespace verify = ::prox::tuning::verify;

enum class Act { kSiLU, kGeluTanh };

inline double act(Act a, double g) { return a == Act::kSiLU ? verify::silu(g) : verify::gelu_tanh(g); }

/**
 * @brief Rounding-error factor of an fp32 sum of n products computed in any fixed order
 * (a worst-case-style bound, loose enough for the kernels' lane/warp/split-K trees, far below the
 * O(1) error of any indexing bug): gamma(n) = (n + 64) * 2^-24.
 */
using verify::gamma;

/**
 * @brief Extra error of the INT4 Stage 1's fp16 step sums (prox::Int4Weights::fma_step: at most
 * verify::kInt4StepRows rows per step, x scaled by 2^-6 before the products, 2^6 after), in two
 * parts. Rounding: each fused multiply-add of a step rounds once, relative 2^-11 of at most the
 * step's sum of |x q|, so a channel whose kept rows sum |x q| to abs_xq is off by at most
 * int4_step_rounding(abs_xq). Subnormals (the same for every channel of a token): absolute 2^-25 in
 * units of x 2^-6, i.e. 2^-19, per product, and for |x| < 2^-8 (x 2^-6 subnormal) also per x, times
 * |q| <= 8.
 */
using verify::int4_step_rounding;
inline double int4_step_subnormal(const std::vector<double>& x, const std::vector<int>& kept) {
  double e = 0.0;
  for (int k : kept) e += (std::fabs(x[k]) < verify::kInt4SmallX ? 9.0 : 1.0) * verify::kInt4SubnormalPerProduct;
  return e;
}

//! Relative rounding of storing to T (half an ulp).
template <class T>
constexpr double store_rel() {
  return std::is_same_v<T, __half> ? verify::kStoreRelF16 : verify::kStoreRelBf16;
}

//! The references' loops split over threads (prox_support/parallel.hpp): each output of a range is
//! summed in the serial order, so the bits do not depend on the thread count.
using ::prox_support::parallel_for;

//! float64 copies of fp16/bf16 (or float) values. 2-byte types go through a table of all 65,536 bit
//! patterns, filled once by the same conversion, so the values are the per-element conversion's.
template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  if constexpr (sizeof(T) == 2 && std::is_trivially_copyable_v<T>) {
    static const std::vector<double> table = [] {
      std::vector<double> t(65536);
      for (std::uint32_t b = 0; b < 65536; ++b) {
        const std::uint16_t bits = static_cast<std::uint16_t>(b);
        T x;
        std::memcpy(static_cast<void*>(&x), &bits, sizeof(bits));  // raw bits into T
        t[b] = static_cast<double>(prox::to_float(x));
      }
      return t;
    }();
    parallel_for(v.size(), std::size_t{1} << 15, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, &v[i], sizeof(bits));
        out[i] = table[bits];
      }
    });
  } else {
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(prox::to_float(v[i]));
  }
  return out;
}

//! A value with a bound on the error an fp32 implementation may make computing it.
using verify::Bounded;

//! s = u * act(g) from bounded g and u (verify::glu: propagated input errors, the product's
//! rounding, and the fp32 activation's own error).
inline Bounded glu(Act a, Bounded g, Bounded u) { return verify::glu(g, u, act(a, g.v)); }

// ---------------------------------------------------------------- dense FFN
/**
 * @brief Dense GLU FFN y = (u * act(g)) W_down in float64.
 * @param x [K]; wg, wu [N][K] (nn.Linear); wdt [N][K] (W_down^T). Returns s [N] and y [K].
 */
struct DenseResult {
  std::vector<double> s;  // exact intermediate state
  std::vector<double> y;
};
inline DenseResult dense_ffn(const std::vector<double>& x, const std::vector<double>& wg, const std::vector<double>& wu,
                             const std::vector<double>& wdt, int K, int N, Act a) {
  DenseResult r;
  r.s.assign(N, 0.0);
  r.y.assign(K, 0.0);
  // Channels, then outputs, split over threads; each value is summed in the same order as serially.
  parallel_for(static_cast<std::size_t>(N), 64, [&](std::size_t jb, std::size_t je) {
    for (std::size_t j = jb; j < je; ++j) {
      double g = 0.0;
      double u = 0.0;
      for (int k = 0; k < K; ++k) {
        g += x[k] * wg[j * K + k];
        u += x[k] * wu[j * K + k];
      }
      r.s[j] = u * act(a, g);
    }
  });
  parallel_for(static_cast<std::size_t>(K), 256, [&](std::size_t kb, std::size_t ke) {
    for (int j = 0; j < N; ++j)
      for (std::size_t k = kb; k < ke; ++k) r.y[k] += r.s[j] * wdt[static_cast<std::size_t>(j) * K + k];
  });
  return r;
}

// ---------------------------------------------------------------- Stage 1
struct Stage1Result {
  std::vector<int> kept;          // kept input coordinates, ascending
  std::vector<Bounded> s;         // s~ per channel with its fp32 error bound
  std::vector<std::uint8_t> sel;  // |s~| >= tau_s (reference decision)
  std::vector<std::uint8_t> ambiguous;  // | |s~| - tau_s | <= bound: either decision is correct
  int num_selected = 0;
  int num_ambiguous = 0;
};

//! The input mask: |float(x_k)| >= tau_x evaluated in float, exactly as the kernels do.
inline std::vector<int> kept_inputs(const std::vector<double>& x, float tau_x) {
  std::vector<int> kept;
  for (std::size_t k = 0; k < x.size(); ++k)
    if (std::fabs(static_cast<float>(x[k])) >= tau_x) kept.push_back(static_cast<int>(k));
  return kept;
}

inline void finish_stage1(Stage1Result& r, float tau_s) {
  const std::size_t N = r.s.size();
  r.sel.assign(N, 0);
  r.ambiguous.assign(N, 0);
  for (std::size_t j = 0; j < N; ++j) {
    const double m = std::fabs(r.s[j].v);
    r.sel[j] = m >= static_cast<double>(tau_s);
    // Strict: a value exactly computable (bound 0, e.g. no input kept) is never ambiguous.
    r.ambiguous[j] = std::fabs(m - static_cast<double>(tau_s)) < r.s[j].err;
    r.num_selected += r.sel[j];
    r.num_ambiguous += r.ambiguous[j];
  }
}

/**
 * @brief Stage 1 with INT4 proxies: g~_j = scale_g[j] sum_{k kept} x_k q_g[k][j] (q from the packed
 * words), likewise u~, s~ = u~ act(g~), channel set |s~| >= tau_s.
 */
inline Stage1Result stage1_int4(const std::vector<double>& x, int K, int N, float tau_x, float tau_s,
                                const std::vector<std::uint32_t>& qg, const std::vector<float>& sg,
                                const std::vector<std::uint32_t>& qu, const std::vector<float>& su, Act a) {
  (void)K;
  Stage1Result r;
  r.kept = kept_inputs(x, tau_x);
  r.s.resize(N);
  const double sub = int4_step_subnormal(x, r.kept);
  // Row by row (the packed rows are read in memory order), each channel's sums still adding the kept
  // rows in ascending order: the same values as a loop over channels, a fraction of the cache misses.
  // Channel ranges split over threads.
  std::vector<double> g(N, 0.0), u(N, 0.0), ag(N, 0.0), au(N, 0.0);
  parallel_for(static_cast<std::size_t>(N), 256, [&](std::size_t jb, std::size_t je) {
    for (int k : r.kept) {
      const double xk = x[k];
      for (int j = static_cast<int>(jb); j < static_cast<int>(je); ++j) {
        const double qgk = prox::int4::unpack_host(qg.data(), N, k, j);
        const double quk = prox::int4::unpack_host(qu.data(), N, k, j);
        g[j] += xk * qgk;
        u[j] += xk * quk;
        ag[j] += std::fabs(xk * qgk);
        au[j] += std::fabs(xk * quk);
      }
    }
  });
  for (int j = 0; j < N; ++j) {
    const double scg = sg[j], scu = su[j];
    const double eg =
        gamma(r.kept.size()) * ag[j] + int4_step_rounding(ag[j]) + sub + verify::kUnitRoundoff32 * std::fabs(g[j]);
    const double eu =
        gamma(r.kept.size()) * au[j] + int4_step_rounding(au[j]) + sub + verify::kUnitRoundoff32 * std::fabs(u[j]);
    const Bounded bg{g[j] * scg, eg * scg};
    const Bounded bu{u[j] * scu, eu * scu};
    r.s[j] = glu(a, bg, bu);
  }
  finish_stage1(r, tau_s);
  return r;
}

/**
 * @brief Stage 1 with fp16/bf16 proxies (A1): wg_t, wu_t input-major [K][N].
 */
inline Stage1Result stage1_dense(const std::vector<double>& x, int K, int N, float tau_x, float tau_s,
                                 const std::vector<double>& wg_t, const std::vector<double>& wu_t, Act a) {
  Stage1Result r;
  r.kept = kept_inputs(x, tau_x);
  r.s.resize(N);
  // Row by row, as stage1_int4: each channel adds the kept rows in ascending order.
  std::vector<double> g(N, 0.0), u(N, 0.0), ag(N, 0.0), au(N, 0.0);
  parallel_for(static_cast<std::size_t>(N), 256, [&](std::size_t jb, std::size_t je) {
    for (int k : r.kept) {
      const double xk = x[k];
      const double* rg = wg_t.data() + static_cast<std::size_t>(k) * N;
      const double* ru = wu_t.data() + static_cast<std::size_t>(k) * N;
      for (std::size_t j = jb; j < je; ++j) {
        g[j] += xk * rg[j];
        u[j] += xk * ru[j];
        ag[j] += std::fabs(xk * rg[j]);
        au[j] += std::fabs(xk * ru[j]);
      }
    }
  });
  for (int j = 0; j < N; ++j)
    r.s[j] = glu(a, Bounded{g[j], gamma(r.kept.size()) * ag[j]}, Bounded{u[j], gamma(r.kept.size()) * au[j]});
  finish_stage1(r, tau_s);
  (void)K;
  return r;
}

// ---------------------------------------------------------------- Stage 2
/**
 * @brief Stage 2 on a given channel set: exact s_j for selected j (others 0), and
 * y = sum_{j selected} s_j W_down^T[j,:], each with its fp32 error bound (output rounding to T
 * is added by the caller with store_rel<T>()).
 */
struct Stage2Result {
  std::vector<Bounded> s;  // [N], zero for unselected channels
  std::vector<Bounded> y;  // [K]
};
inline Stage2Result stage2(const std::vector<double>& x, const std::vector<double>& wg, const std::vector<double>& wu,
                           const std::vector<double>& wdt, int K, int N, const std::vector<std::uint8_t>& sel,
                           Act a) {
  Stage2Result r;
  r.s.assign(N, Bounded{});
  r.y.assign(K, Bounded{});
  std::size_t nsel = 0;
  for (int j = 0; j < N; ++j) nsel += sel[j] != 0;
  // Selected channels, then outputs, split over threads; each value is summed in the serial order.
  parallel_for(static_cast<std::size_t>(N), 64, [&](std::size_t jb, std::size_t je) {
    for (std::size_t j = jb; j < je; ++j) {
      if (!sel[j]) continue;
      double g = 0.0, u = 0.0, ag = 0.0, au = 0.0;
      for (int k = 0; k < K; ++k) {
        const double pg = x[k] * wg[j * K + k];
        const double pu = x[k] * wu[j * K + k];
        g += pg;
        u += pu;
        ag += std::fabs(pg);
        au += std::fabs(pu);
      }
      r.s[j] = glu(a, Bounded{g, gamma(K) * ag}, Bounded{u, gamma(K) * au});
    }
  });
  std::vector<double> abs_sum(K, 0.0);
  parallel_for(static_cast<std::size_t>(K), 256, [&](std::size_t kb, std::size_t ke) {
    for (int j = 0; j < N; ++j) {
      if (!sel[j]) continue;
      for (std::size_t k = kb; k < ke; ++k) {
        const double w = wdt[static_cast<std::size_t>(j) * K + k];
        r.y[k].v += r.s[j].v * w;
        r.y[k].err += r.s[j].err * std::fabs(w);
        abs_sum[k] += std::fabs(r.s[j].v * w);
      }
    }
  });
  for (int k = 0; k < K; ++k) r.y[k].err += gamma(nsel) * abs_sum[k];
  return r;
}

/**
 * @brief The down GEMV alone on given s: y = sum over selected j of s_j W_down^T[j,:] in float64, each y_k
 * bounded by an fp32 sum of its products (gamma(nsel + extra) |s_j w|): `extra` counts a format's own
 * roundings (1 for FP8's scale multiply after the sum). wdt [N][K] (W_down^T).
 */
inline std::vector<Bounded> down_gemv(const std::vector<float>& s, const std::vector<double>& wdt, int K, int N,
                                      const std::vector<std::uint8_t>& sel, int extra = 0) {
  std::vector<Bounded> y(K);
  std::vector<double> abs_sum(K, 0.0);
  std::size_t nsel = 0;
  for (int j = 0; j < N; ++j) {
    if (!sel[j]) continue;
    ++nsel;
    for (int k = 0; k < K; ++k) {
      const double p = static_cast<double>(s[j]) * wdt[static_cast<std::size_t>(j) * K + k];
      y[k].v += p;
      abs_sum[k] += std::fabs(p);
    }
  }
  for (int k = 0; k < K; ++k) y[k].err = gamma(nsel + static_cast<std::size_t>(extra)) * abs_sum[k];
  return y;
}

// ---------------------------------------------------------------- oracle-s
/**
 * @brief The oracle-s channel set: the `keep` channels with the largest |s| (exact s), ties to the
 * lower index. Returns a 0/1 flag per channel.
 */
inline std::vector<std::uint8_t> oracle_channels(const std::vector<double>& s, int keep) {
  std::vector<int> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return std::fabs(s[a]) > std::fabs(s[b]); });
  std::vector<std::uint8_t> sel(s.size(), 0);
  for (int i = 0; i < keep && i < static_cast<int>(s.size()); ++i) sel[order[i]] = 1;
  return sel;
}

//! Fraction of set `a` that is also in set `b` (|a & b| / |a|; 1 for an empty a).
inline double overlap(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::size_t na = 0, both = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    na += a[i];
    both += a[i] && b[i];
  }
  return na == 0 ? 1.0 : static_cast<double>(both) / static_cast<double>(na);
}

}  // namespace prox_ref
