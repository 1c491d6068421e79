// SPDX-License-Identifier: Apache-2.0
//! @file fp8_fixture.hpp  FP8 e4m3 layers for the GPU tests: seeded random weights quantized on the host
//! (fp8::quantize_host, per-channel or 128 x 128 block scales), W_down^T with its scales
//! (fp8::transpose_down_host), the INT4 proxies packed from the FP8 weights (fp8::pack_int4_host), the
//! float64 dequantized copies the reference reads, and the device copies in a format's Matrix.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <prox/fp8_format.hpp>
#include <prox/fp8_weights.cuh>
#include <prox/int4_format.hpp>

#include "gpu_fixture.hpp"

namespace prox_test {

//! A layer of FP8 weights in scale layout L: W_gate, W_up [N][K] (nn.Linear) and W_down^T [N][K].
template <prox::fp8::ScaleLayout L>
struct Fp8HostLayer {
  using Fmt = prox::Fp8Weights<L>;
  int K = 0;  // d_model
  int N = 0;  // d_ff
  std::vector<std::uint8_t> qg, qu, qdt;  // e4m3 codes
  std::vector<float> sg, su, sdt;         // their scales (W_down^T's: fp8::transpose_down_host)
  std::vector<std::uint32_t> pg, pu;      // INT4 proxies packed from the FP8 weights
  std::vector<float> psg, psu;
  std::vector<double> dwg, dwu, dwdt;     // dequantized, exact: the reference's weights
};

//! n values sigma * N(0, 1) as floats (the weights before quantization).
inline std::vector<float> normal_floats(std::size_t n, std::uint64_t seed, double sigma) {
  FastNormal g(seed);
  std::vector<float> v(n);
  for (auto& e : v) e = static_cast<float>(sigma * g());
  return v;
}

template <prox::fp8::ScaleLayout L>
Fp8HostLayer<L> make_fp8_layer(int K, int N, std::uint64_t seed) {
  namespace fp8 = prox::fp8;
  using O = fp8::Orientation;
  Fp8HostLayer<L> h;
  h.K = K;
  h.N = N;
  const std::size_t kn = static_cast<std::size_t>(K) * N;
  const auto wg = normal_floats(kn, seed * 4 + 1, 1.0 / std::sqrt(static_cast<double>(K)));
  const auto wu = normal_floats(kn, seed * 4 + 2, 1.0 / std::sqrt(static_cast<double>(K)));
  const auto wd = normal_floats(kn, seed * 4 + 3, 1.0 / std::sqrt(static_cast<double>(N)));  // [K][N] nn.Linear
  h.qg.resize(kn);
  h.qu.resize(kn);
  h.qdt.resize(kn);
  h.sg.resize(fp8::scale_count(L, O::kOutIn, N, K));
  h.su.resize(h.sg.size());
  std::vector<std::uint8_t> qd(kn);
  std::vector<float> sd(fp8::scale_count(L, O::kOutIn, K, N));
  h.sdt.resize(fp8::scale_count(L, O::kInOut, N, K));
  PROX_TEST_OK(fp8::quantize_host(wg.data(), N, K, L, h.qg.data(), h.sg.data()));
  PROX_TEST_OK(fp8::quantize_host(wu.data(), N, K, L, h.qu.data(), h.su.data()));
  PROX_TEST_OK(fp8::quantize_host(wd.data(), K, N, L, qd.data(), sd.data()));
  PROX_TEST_OK(fp8::transpose_down_host(qd.data(), sd.data(), K, N, L, h.qdt.data(), h.sdt.data()));
  h.dwg.resize(kn);
  h.dwu.resize(kn);
  h.dwdt.resize(kn);
  PROX_TEST_OK(fp8::dequantize_host(h.qg.data(), h.sg.data(), N, K, L, O::kOutIn, h.dwg.data()));
  PROX_TEST_OK(fp8::dequantize_host(h.qu.data(), h.su.data(), N, K, L, O::kOutIn, h.dwu.data()));
  PROX_TEST_OK(fp8::dequantize_host(h.qdt.data(), h.sdt.data(), N, K, L, O::kInOut, h.dwdt.data()));
  h.pg.resize(prox::int4::packed_words(K, N));
  h.pu.resize(h.pg.size());
  h.psg.resize(N);
  h.psu.resize(N);
  PROX_TEST_OK(fp8::pack_int4_host(h.qg.data(), h.sg.data(), L, K, N, h.pg.data(), h.psg.data()));
  PROX_TEST_OK(fp8::pack_int4_host(h.qu.data(), h.su.data(), L, K, N, h.pu.data(), h.psu.data()));
  return h;
}

//! The device copies of an Fp8HostLayer, and its matrices in the format's Matrix (scale shapes stated).
template <prox::fp8::ScaleLayout L>
struct Fp8DeviceLayer {
  using Fmt = prox::Fp8Weights<L>;
  explicit Fp8DeviceLayer(const Fp8HostLayer<L>& h)
      : K(h.K), N(h.N), qg(h.qg), qu(h.qu), qdt(h.qdt), sg(h.sg), su(h.su), sdt(h.sdt), pg(h.pg), pu(h.pu),
        psg(h.psg), psu(h.psu) {}
  static typename Fmt::Matrix matrix(const std::uint8_t* q, const float* s, int rows, int cols,
                                     prox::WeightOrientation o) {
    const auto shape = prox::fp8::scale_shape(L, Fmt::orientation(o), rows, cols);
    return {q, s, shape.rows, shape.cols};
  }
  typename Fmt::Matrix gate() const { return matrix(qg.get(), sg.get(), N, K, prox::WeightOrientation::kOutIn); }
  typename Fmt::Matrix up() const { return matrix(qu.get(), su.get(), N, K, prox::WeightOrientation::kOutIn); }
  typename Fmt::Matrix down_t() const { return matrix(qdt.get(), sdt.get(), N, K, prox::WeightOrientation::kInOut); }
  int K, N;
  DeviceBuffer<std::uint8_t> qg, qu, qdt;
  DeviceBuffer<float> sg, su, sdt;
  DeviceBuffer<std::uint32_t> pg, pu;
  DeviceBuffer<float> psg, psu;
};

/**
 * @brief The reference's bounds for an FP8 kernel: the kernels add one rounding per scale multiply (per
 * channel: once per sum; 128 x 128 blocks: once per 16-weight piece, or per row of W_down^T), so the fp32
 * bounds of prox_ref (gamma(n) of the sums) are doubled: still far below the error of a wrong scale or a
 * wrong weight (the quantization step of e4m3 is 2^-3 of a value).
 */
inline void widen_for_scales(std::vector<prox_ref::Bounded>& r) {
  for (auto& b : r) b.err *= 2.0;
}

}  // namespace prox_test
