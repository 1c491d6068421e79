// SPDX-License-Identifier: Apache-2.0
//! @file gpu_fixture.hpp  Synthetic layers for the GPU tests: seeded random weights and tokens on the
//! host (never zeros), their prox layouts (INT4 pack, W_down^T, input-major proxies), device copies,
//! and helpers that compare device outputs with the float64 reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <string>
#include <vector>

#include <prox/activation.cuh>
#include <prox/int4_format.hpp>
#include <prox/layout.cuh>
#include <prox/proxy_gemv.cuh>
#include <prox/sparse_ffn.cuh>

#include <prox_tuning/verify.hpp>

#include "common.hpp"
#include "reference/reference.hpp"

namespace prox_test {

constexpr float kInf = std::numeric_limits<float>::infinity();

//! The reference's activation tag of an activation functor.
template <class A>
constexpr prox_ref::Act ref_act() {
  return std::is_same_v<A, prox::SiLU> ? prox_ref::Act::kSiLU : prox_ref::Act::kGeluTanh;
}

//! Fast seeded normal generator (splitmix64 + Box-Muller): the 8B layers hold 150 M weights.
class FastNormal {
 public:
  explicit FastNormal(std::uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  //! Continue at draw `i` (even) of the stream from the seed, as if the draws before it had been taken:
  //! splitmix64 is counter-based (draws 2p and 2p + 1 come from states s0 + (2p + 1) C and s0 + (2p + 2) C),
  //! so chunks of one vector starting at even indices can be drawn apart and give the serial stream.
  void skip_to(std::uint64_t i) {
    s_ += i * 0x9E3779B97F4A7C15ull;
    have_ = false;
  }
  double operator()() {
    if (have_) {
      have_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(next() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    const double u2 = static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0);
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(6.283185307179586 * u2);
    have_ = true;
    return r * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t s_;
  bool have_ = false;
  double spare_ = 0.0;
};

//! n values sigma * N(0, 1) of the stream of `seed`, drawn on several threads in ranges of whole draw pairs
//! (FastNormal::skip_to): the serial stream's values.
template <class T>
std::vector<T> normal_vector(std::size_t n, std::uint64_t seed, double sigma) {
  std::vector<T> v(n);
  prox_support::parallel_for((n + 1) / 2, std::size_t{1} << 14, [&](std::size_t pb, std::size_t pe) {
    FastNormal g(seed);
    g.skip_to(2 * pb);
    for (std::size_t i = 2 * pb; i < std::min(n, 2 * pe); ++i) v[i] = prox::from_float<T>(static_cast<float>(sigma * g()));
  });
  return v;
}

//! One FFN layer in every layout prox reads, on the host, plus float64 copies for the reference.
template <class T>
struct HostLayer {
  int K = 0;  // d_model
  int N = 0;  // d_ff
  std::vector<T> wg, wu, wdt;        // [N][K]: nn.Linear gate/up, and W_down^T
  std::vector<T> wg_t, wu_t;         // [K][N]: input-major dense proxies (A1)
  std::vector<std::uint32_t> qg, qu;  // INT4 proxies [K][N/8]
  std::vector<float> sg, su;         // [N]
  std::vector<double> dwg, dwu, dwdt, dwg_t, dwu_t;
};

template <class T>
HostLayer<T> make_host_layer(int K, int N, std::uint64_t seed) {
  HostLayer<T> L;
  L.K = K;
  L.N = N;
  const double sigma = 1.0 / std::sqrt(static_cast<double>(K));
  L.wg = normal_vector<T>(static_cast<std::size_t>(N) * K, seed * 4 + 1, sigma);
  L.wu = normal_vector<T>(static_cast<std::size_t>(N) * K, seed * 4 + 2, sigma);
  L.wdt = normal_vector<T>(static_cast<std::size_t>(N) * K, seed * 4 + 3, 1.0 / std::sqrt(static_cast<double>(N)));
  L.wg_t.resize(L.wg.size());
  L.wu_t.resize(L.wu.size());
  PROX_TEST_OK(prox::transpose_host(L.wg.data(), N, K, L.wg_t.data()));
  PROX_TEST_OK(prox::transpose_host(L.wu.data(), N, K, L.wu_t.data()));
  L.qg.resize(prox::int4::packed_words(K, N));
  L.qu.resize(prox::int4::packed_words(K, N));
  L.sg.resize(N);
  L.su.resize(N);
  PROX_TEST_OK(prox::int4::pack_host(L.wg.data(), K, N, L.qg.data(), L.sg.data()));
  PROX_TEST_OK(prox::int4::pack_host(L.wu.data(), K, N, L.qu.data(), L.su.data()));
  L.dwg = prox_ref::to_double(L.wg);
  L.dwu = prox_ref::to_double(L.wu);
  L.dwdt = prox_ref::to_double(L.wdt);
  L.dwg_t = prox_ref::to_double(L.wg_t);
  L.dwu_t = prox_ref::to_double(L.wu_t);
  return L;
}

template <class T>
struct DeviceLayer {
  explicit DeviceLayer(const HostLayer<T>& h)
      : wg(h.wg), wu(h.wu), wdt(h.wdt), wg_t(h.wg_t), wu_t(h.wu_t), qg(h.qg), qu(h.qu), sg(h.sg), su(h.su) {}
  DeviceBuffer<T> wg, wu, wdt, wg_t, wu_t;
  DeviceBuffer<std::uint32_t> qg, qu;
  DeviceBuffer<float> sg, su;
};

//! The proxies of a device layer in a Stage-1 argument struct: INT4 packs with their scales, or the
//! input-major fp16/bf16 copies (A1).
template <class T>
void set_proxy_weights(prox::ProxyGemvArgs<T, prox::Int4Weights>& a, const DeviceLayer<T>& D) {
  a.gate = {D.qg.get(), D.sg.get()};
  a.up = {D.qu.get(), D.su.get()};
}
template <class T>
void set_proxy_weights(prox::ProxyGemvArgs<T, prox::DenseWeights<T>>& a, const DeviceLayer<T>& D) {
  a.gate = {D.wg_t.get(), nullptr};
  a.up = {D.wu_t.get(), nullptr};
}

//! The weights of a device layer for a SparseFfn with INT4 proxies (members by name).
template <class A, class T>
typename prox::SparseFfn<T, A>::Weights ffn_weights(const DeviceLayer<T>& D) {
  typename prox::SparseFfn<T, A>::Weights w;
  w.gate = D.wg.get();
  w.up = D.wu.get();
  w.down_t = D.wdt.get();
  w.proxy_gate = {D.qg.get(), D.sg.get()};
  w.proxy_up = {D.qu.get(), D.su.get()};
  return w;
}

//! |v| quantile as the calibration defines it: sorted magnitudes a, tau = a[floor(s n)] (as float).
inline float quantile_abs(const std::vector<double>& v, double s) {
  std::vector<double> a(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  std::sort(a.begin(), a.end());
  const std::size_t idx = static_cast<std::size_t>(std::floor(s * static_cast<double>(a.size())));
  if (idx >= a.size()) return INFINITY;
  return static_cast<float>(a[idx]);
}

inline std::vector<double> values_of(const std::vector<prox_ref::Bounded>& b) {
  std::vector<double> v(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) v[i] = b[i].v;
  return v;
}

//! Channel bitmasks (bit j % 32 of word j / 32): the tuner's, which the tests link.
using ::prox::tuning::verify::flags_to_mask;
using ::prox::tuning::verify::mask_bit;

inline std::vector<std::uint8_t> mask_to_flags(const std::vector<std::uint32_t>& mask, int n) {
  std::vector<std::uint8_t> f(n);
  for (int j = 0; j < n; ++j) f[j] = mask_bit(mask, j);
  return f;
}

//! Stage-2 s from the device against the reference on a given channel set: selected channels within
//! their rounding bound, unselected ones written as exactly +0.
struct SCompare {
  int bad = 0;            //!< selected channels outside the bound
  int untouched_bad = 0;  //!< unselected channels not +0
  double worst = 0.0;     //!< largest |error| / bound over the selected channels
};
inline SCompare compare_s(const std::vector<float>& s, const std::vector<std::uint8_t>& sel,
                          const std::vector<prox_ref::Bounded>& ref) {
  SCompare c;
  for (std::size_t j = 0; j < s.size(); ++j) {
    if (sel[j]) {
      const double d = std::fabs(static_cast<double>(s[j]) - ref[j].v);
      c.bad += !(d <= ref[j].err);
      c.worst = std::max(c.worst, d / ref[j].err);
    } else {
      c.untouched_bad += bits32(s[j]) != 0u;
    }
  }
  return c;
}

//! Seeded random flags, each set with probability `density` (0 and 1 give none and all).
inline std::vector<std::uint8_t> random_flags(int n, double density, std::uint64_t seed) {
  FastNormal g(seed);
  std::vector<std::uint8_t> f(n);
  for (int j = 0; j < n; ++j) f[j] = (0.5 * (1.0 + std::erf(g() / std::sqrt(2.0)))) < density;
  return f;
}

/**
 * @brief The inputs of a Stage-2 op test: a synthetic layer on host and device, one token, and per
 * density a random channel set with its float64 Stage-2 reference.
 */
template <class T>
struct Stage2Case {
  Stage2Case(int K, int N, std::uint64_t seed)
      : L(make_host_layer<T>(K, N, seed)), D(L), x(normal_vector<T>(K, seed + 5, 1.0)), dx(x), seed_(seed) {}

  //! fn(density, sel, ref, dmask) for each density: sel drawn with that density, ref = the reference
  //! on sel, dmask = sel as a device bitmask.
  template <class Fn>
  void each_density(std::initializer_list<double> densities, prox_ref::Act act, Fn&& fn) const {
    const auto dxv = prox_ref::to_double(x);
    for (double density : densities) {
      const auto sel = random_flags(L.N, density, seed_ + 9);
      const auto ref = prox_ref::stage2(dxv, L.dwg, L.dwu, L.dwdt, L.K, L.N, sel, act);
      DeviceBuffer<std::uint32_t> dmask(flags_to_mask(sel));
      fn(density, sel, ref, dmask);
    }
  }

  HostLayer<T> L;
  DeviceLayer<T> D;
  std::vector<T> x;
  DeviceBuffer<T> dx;

 private:
  std::uint64_t seed_;
};

//! Stage-1 channel set of the device against the reference: exact, except channels whose reference
//! |s~| lies within its rounding bound of tau_s (ambiguous: either decision is right).
struct MaskCompare {
  int selected_gpu = 0;
  int mismatches = 0;          // unambiguous channels decided differently: must be 0
  int ambiguous = 0;           // channels within rounding distance of tau_s
  int ambiguous_flipped = 0;   // ambiguous channels the device decided differently
};
inline MaskCompare compare_mask(const std::vector<std::uint32_t>& mask, const prox_ref::Stage1Result& ref) {
  MaskCompare c;
  const int n = static_cast<int>(ref.sel.size());
  for (int j = 0; j < n; ++j) {
    const bool g = mask_bit(mask, j);
    c.selected_gpu += g;
    if (ref.ambiguous[j]) {
      ++c.ambiguous;
      c.ambiguous_flipped += g != static_cast<bool>(ref.sel[j]);
    } else {
      c.mismatches += g != static_cast<bool>(ref.sel[j]);
    }
  }
  return c;
}

//! Elements of a device output outside their reference bound (+ the rounding of storing to T).
template <class T>
int count_out_of_bound(const std::vector<T>& y, const std::vector<prox_ref::Bounded>& ref, double* worst = nullptr) {
  int bad = 0;
  double w = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double got = static_cast<double>(prox::to_float(y[i]));
    const double tol = ref[i].err + prox_ref::store_rel<T>() * std::fabs(ref[i].v) + 1e-7;
    const double d = std::fabs(got - ref[i].v);
    if (!(d <= tol)) ++bad;  // NaN fails
    w = std::max(w, d / tol);
  }
  if (worst) *worst = w;
  return bad;
}

}  // namespace prox_test
