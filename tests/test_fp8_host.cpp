// SPDX-License-Identifier: Apache-2.0
//! @file test_fp8_host.cpp  The FP8 e4m3 format on the host: every code against an independent decode,
//! the encoder against rounding by hand and cuda_fp8.h, quantization error bounds, block layouts at
//! sizes not multiples of 128, the W_down transpose, INT4 proxies from FP8, and the validation errors.
#include "catch.hpp"

#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <prox/fp8.cuh>  // transpose_down_host; the rest is fp8_format.hpp
#include <prox/int4_format.hpp>

#include "common.hpp"

using prox::Status;
using prox::fp8::Orientation;
using prox::fp8::ScaleLayout;
using prox_test::random_vector;

namespace {

constexpr ScaleLayout kLayouts[] = {ScaleLayout::kPerChannel, ScaleLayout::kBlock128};

//! The e4m3fn definition, in double: (8 + m) 2^(e - 10) for e >= 1, m 2^-9 for e = 0; S.1111.111 is NaN.
double e4m3_reference(std::uint8_t v) {
  const int e = (v >> 3) & 0xF;
  const int m = v & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
  return (v & 0x80) ? -mag : mag;
}

float half_bits_to_float(std::uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return __half2float(__half(r));
}

//! The e4m3 code nearest to x by search over all finite codes, ties to the even code (mantissa bit 0
//! clear), |x| >= 448 saturated: independent of float_to_e4m3.
std::uint8_t nearest_code(double x) {
  if (x >= 448.0) return 0x7E;
  if (x <= -448.0) return 0xFE;
  std::uint8_t best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    if (((c & 0x80) != 0) != std::signbit(x)) continue;  // same sign: -0.0 for tiny negatives
    const double d = std::fabs(e4m3_reference(static_cast<std::uint8_t>(c)) - x);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = static_cast<std::uint8_t>(c);
      best_d = d;
    }
  }
  return best;
}

std::uint32_t bits(float f) { return prox::fp8::float_bits(f); }

}  // namespace

TEST_CASE("fp8 e4m3: every code decodes to its value (all 256, independent decode)", "[fp8]") {
  int nan_codes = 0;
  for (int c = 0; c < 256; ++c) {
    const auto v = static_cast<std::uint8_t>(c);
    CAPTURE(c);
    const double ref = e4m3_reference(v);
    const float f = prox::fp8::e4m3_to_float(v);
    const std::uint16_t h = prox::fp8::e4m3_to_half_bits(v);
    // cuda_fp8.h's own conversion (its host path): the same fp16 bits, NaN included (0x7FFF).
    CHECK(h == __nv_cvt_fp8_to_halfraw(v, __NV_E4M3).x);
    if (std::isnan(ref)) {
      ++nan_codes;
      CHECK(std::isnan(f));
      CHECK(h == 0x7FFF);
      continue;
    }
    CHECK(static_cast<double>(f) == ref);
    CHECK(std::signbit(f) == ((c & 0x80) != 0));  // -0 keeps its sign
    CHECK(static_cast<double>(half_bits_to_float(h)) == ref);
    CHECK(std::signbit(half_bits_to_float(h)) == ((c & 0x80) != 0));
  }
  CHECK(nan_codes == 2);
  CHECK(prox::fp8::e4m3_to_float(0x7E) == 448.0f);
  CHECK(prox::fp8::e4m3_to_float(0xFE) == -448.0f);
  CHECK(prox::fp8::e4m3_to_float(0x38) == 1.0f);
  CHECK(prox::fp8::e4m3_to_float(0x01) == std::ldexp(1.0f, -9));
  CHECK(prox::fp8::e4m3_to_float(0x08) == std::ldexp(1.0f, -6));
  CHECK(prox::fp8::e4m3_to_half_bits(0x01) == 0x1800);  // 2^-9: an fp16 normal
}

TEST_CASE("fp8 float_to_e4m3: nearest even, saturating, as cuda_fp8.h", "[fp8]") {
  using prox::fp8::float_to_e4m3;
  // Every finite code round-trips.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    CAPTURE(c);
    CHECK(float_to_e4m3(prox::fp8::e4m3_to_float(static_cast<std::uint8_t>(c))) == c);
  }
  // Midpoints between neighbours go to the even code; one float ulp either side goes to the nearer.
  for (int c = 0; c < 0x7E; ++c) {
    for (const int sign : {0x00, 0x80}) {
      const auto lo = static_cast<std::uint8_t>(sign | c), hi = static_cast<std::uint8_t>(sign | (c + 1));
      const float a = prox::fp8::e4m3_to_float(lo), b = prox::fp8::e4m3_to_float(hi);
      const float mid = 0.5f * (a + b);  // exact: both have 4 significant bits
      CAPTURE(c, sign, mid);
      REQUIRE(static_cast<double>(mid) == 0.5 * (static_cast<double>(a) + static_cast<double>(b)));
      CHECK(float_to_e4m3(mid) == ((c & 1) == 0 ? lo : hi));
      CHECK(float_to_e4m3(std::nextafter(mid, b)) == hi);
      CHECK(float_to_e4m3(std::nextafter(mid, a)) == lo);
    }
  }
  // Saturation (inf too), NaN, the bottom of the range.
  const float inf = std::numeric_limits<float>::infinity();
  for (const float big : {448.0f, 463.99f, 464.0f, 464.01f, 1e30f, FLT_MAX, inf}) {
    CHECK(float_to_e4m3(big) == 0x7E);
    CHECK(float_to_e4m3(-big) == 0xFE);
  }
  CHECK(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(float_to_e4m3(std::ldexp(1.0f, -10)) == 0x00);  // half of the smallest subnormal: tie to 0
  CHECK(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)) == 0x01);
  CHECK(float_to_e4m3(3.0f * std::ldexp(1.0f, -10)) == 0x02);  // 1.5 x 2^-9: tie to 2
  CHECK(float_to_e4m3(-std::ldexp(1.0f, -12)) == 0x80);
  CHECK(float_to_e4m3(std::numeric_limits<float>::denorm_min()) == 0x00);
  CHECK(float_to_e4m3(15.0f * std::ldexp(1.0f, -10)) == 0x08);  // 7.5 x 2^-9 -> 8 x 2^-9 = 2^-6, a normal

  // Against cuda_fp8.h (host path: float -> double -> e4m3, RN, satfinite): every float whose 11 high
  // mantissa bits are anything and whose 12 low bits sit at the rounding-relevant values, over the
  // exponents that do not simply saturate or vanish, both signs; and 2^20 random bit patterns.
  std::size_t checked = 0, mismatched = 0;
  const auto compare = [&](std::uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return;  // NaN: cuda_fp8.h and float_to_e4m3 both give 0x7F, checked above
    const float x = prox::fp8::bits_float(u);
    ++checked;
    mismatched += float_to_e4m3(x) != __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  };
  for (std::uint32_t e = 100; e <= 140; ++e)
    for (std::uint32_t hi = 0; hi < 2048; ++hi)
      for (const std::uint32_t lo : {0x000u, 0x001u, 0x7FFu, 0x800u, 0x801u, 0xFFEu, 0xFFFu})
        for (const std::uint32_t s : {0u, 0x80000000u}) compare(s | (e << 23) | (hi << 12) | lo);
  std::mt19937 rng(5);
  for (int i = 0; i < (1 << 20); ++i) compare(static_cast<std::uint32_t>(rng()));
  CHECK(checked > 2'000'000);
  CHECK(mismatched == 0);
}

TEST_CASE("fp8 layouts: scale shapes and indices, sizes not multiples of 128", "[fp8]") {
  using prox::fp8::scale_count;
  using prox::fp8::scale_index;
  using prox::fp8::scale_shape;
  CHECK(prox::fp8::scale_blocks(1) == 1);
  CHECK(prox::fp8::scale_blocks(128) == 1);
  CHECK(prox::fp8::scale_blocks(129) == 2);
  CHECK(scale_count(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257) == 6);
  CHECK(scale_count(ScaleLayout::kBlock128, Orientation::kInOut, 129, 257) == 6);
  CHECK(scale_count(ScaleLayout::kBlock128, Orientation::kOutIn, 12288, 4096) == 96 * 32);
  CHECK(scale_count(ScaleLayout::kPerChannel, Orientation::kOutIn, 129, 257) == 129);
  CHECK(scale_count(ScaleLayout::kPerChannel, Orientation::kInOut, 129, 257) == 257);
  CHECK(scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257).rows == 2);
  CHECK(scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257).cols == 3);
  CHECK(scale_shape(ScaleLayout::kPerChannel, Orientation::kOutIn, 129, 257).cols == 1);
  CHECK(scale_index(ScaleLayout::kBlock128, Orientation::kOutIn, 257, 127, 255) == 1);
  CHECK(scale_index(ScaleLayout::kBlock128, Orientation::kOutIn, 257, 128, 256) == 5);
  CHECK(scale_index(ScaleLayout::kBlock128, Orientation::kInOut, 257, 128, 0) == 3);
  CHECK(scale_index(ScaleLayout::kPerChannel, Orientation::kOutIn, 257, 100, 200) == 100);
  CHECK(scale_index(ScaleLayout::kPerChannel, Orientation::kInOut, 257, 100, 200) == 200);

  // Scale arrays as a checkpoint holds them: transformers' [ceil(N/128)][ceil(K/128)], compressed-tensors' [N][1].
  using prox::fp8::check_scale_shape;
  CHECK(check_scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257, 2, 3) == Status::kSuccess);
  CHECK(check_scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257, 3, 2) == Status::kErrorInvalidShape);
  CHECK(check_scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257, 1, 2) == Status::kErrorInvalidShape);
  CHECK(check_scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, 129, 257, 129, 1) == Status::kErrorInvalidShape);
  CHECK(check_scale_shape(ScaleLayout::kPerChannel, Orientation::kOutIn, 129, 257, 129, 1) == Status::kSuccess);
  CHECK(check_scale_shape(ScaleLayout::kPerChannel, Orientation::kOutIn, 129, 257, 257, 1) ==
        Status::kErrorInvalidShape);
  CHECK(check_scale_shape(ScaleLayout::kPerChannel, Orientation::kInOut, 129, 257, 257, 1) == Status::kSuccess);
  CHECK(check_scale_shape(ScaleLayout::kPerChannel, Orientation::kOutIn, 129, 257, 2, 3) == Status::kErrorInvalidShape);
  CHECK(check_scale_shape(static_cast<ScaleLayout>(5), Orientation::kOutIn, 129, 257, 2, 3) ==
        Status::kErrorInvalidArgument);
  CHECK(check_scale_shape(ScaleLayout::kPerChannel, Orientation::kOutIn, 0, 257, 0, 1) == Status::kErrorInvalidShape);

  // Each block of a 129 x 257 matrix (partial blocks: 1 row, 1 column) gets its own amax / 448.
  const int N = 129, K = 257;
  auto w = random_vector<float>(static_cast<std::size_t>(N) * K, 3, 0.001);
  for (int br = 0; br < 2; ++br)
    for (int bc = 0; bc < 3; ++bc) {
      const int r = std::min(128 * br + 17 * bc, N - 1), c = std::min(128 * bc + 5 * br, K - 1);
      w[static_cast<std::size_t>(r) * K + c] = static_cast<float>((br * 3 + bc + 1) * ((r + c) % 2 ? 1 : -1));
    }
  std::vector<std::uint8_t> q(w.size());
  std::vector<float> s(6, -1.0f);
  REQUIRE(prox::fp8::quantize_host(w.data(), N, K, ScaleLayout::kBlock128, q.data(), s.data()) == Status::kSuccess);
  for (int b = 0; b < 6; ++b) CHECK(s[b] == static_cast<float>(b + 1) / 448.0f);
  CHECK((q[static_cast<std::size_t>(N - 1) * K + (K - 1)] & 0x7F) == 0x7E);  // the 1 x 1 block: its own max
}

TEMPLATE_TEST_CASE("fp8 quantize_host: scales, nearest codes, error bound, both layouts", "[fp8]", float, __half,
                   __nv_bfloat16) {
  const std::pair<int, int> shapes[] = {{200, 72}, {129, 257}, {1, 16}, {130, 1}, {256, 384}};
  std::uint64_t seed = 40;
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [N, K] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), N, K);
      auto w = random_vector<TestType>(static_cast<std::size_t>(N) * K, ++seed, 0.05);
      // Wide dynamic range: every 7th row 300x larger, so rows and blocks have very different scales.
      for (int r = 0; r < N; r += 7)
        for (int c = 0; c < K; ++c) {
          auto& e = w[static_cast<std::size_t>(r) * K + c];
          e = prox_test::element_from_float<TestType>(prox::fp8::source_float(e) * 300.0f);
        }
      const std::size_t count = prox::fp8::scale_count(layout, Orientation::kOutIn, N, K);
      std::vector<std::uint8_t> q(w.size(), 0xFF);
      std::vector<float> s(count, -1.0f);
      REQUIRE(prox::fp8::quantize_host(w.data(), N, K, layout, q.data(), s.data()) == Status::kSuccess);
      // Scales from amax, by the test's own loops.
      std::vector<float> amax(count, 0.0f);
      for (int r = 0; r < N; ++r)
        for (int c = 0; c < K; ++c) {
          const std::size_t j = layout == ScaleLayout::kPerChannel
                                    ? static_cast<std::size_t>(r)
                                    : static_cast<std::size_t>(r / 128) * static_cast<std::size_t>((K + 127) / 128) +
                                          static_cast<std::size_t>(c / 128);
          amax[j] = std::max(amax[j], std::fabs(prox::fp8::source_float(w[static_cast<std::size_t>(r) * K + c])));
        }
      std::size_t bad_scale = 0;
      for (std::size_t j = 0; j < count; ++j) bad_scale += bits(s[j]) != bits(std::max(amax[j] / 448.0f, FLT_MIN));
      CHECK(bad_scale == 0);
      std::size_t bad_code = 0, over_bound = 0, amax_not_448 = 0;
      for (int r = 0; r < N; ++r)
        for (int c = 0; c < K; ++c) {
          const std::size_t i = static_cast<std::size_t>(r) * K + c;
          const float v = prox::fp8::source_float(w[i]);
          const float sc = s[prox::fp8::scale_index(layout, Orientation::kOutIn, K, r, c)];
          // The code is the e4m3 value nearest the float quotient (search over all codes).
          bad_code += q[i] != nearest_code(static_cast<double>(v / sc));
          // Error: half an e4m3 step, relative 2^-4 for normals, 2^-10 scale in the subnormal range,
          // plus the float quotient's own rounding.
          const double deq = e4m3_reference(q[i]) * static_cast<double>(sc);
          const double bound = std::ldexp(std::fabs(static_cast<double>(v)), -4) * (1 + 1e-6) +
                               std::ldexp(static_cast<double>(sc), -10) * (1 + 1e-6);
          over_bound += std::fabs(deq - static_cast<double>(v)) > bound;
          if (std::fabs(v) == amax[prox::fp8::scale_index(layout, Orientation::kOutIn, K, r, c)])
            amax_not_448 += (q[i] & 0x7F) != 0x7E;
        }
      CHECK(bad_code == 0);
      CHECK(over_bound == 0);
      CHECK(amax_not_448 == 0);  // the largest |w| of each channel or block is +-448 after scaling
      // float and double dequantization: float is the double rounded once.
      std::vector<double> d64(w.size());
      std::vector<float> d32(w.size());
      REQUIRE(prox::fp8::dequantize_host(q.data(), s.data(), N, K, layout, Orientation::kOutIn, d64.data()) ==
              Status::kSuccess);
      REQUIRE(prox::fp8::dequantize_host(q.data(), s.data(), N, K, layout, Orientation::kOutIn, d32.data()) ==
              Status::kSuccess);
      std::size_t bad_round = 0;
      for (std::size_t i = 0; i < w.size(); ++i) bad_round += bits(d32[i]) != bits(static_cast<float>(d64[i]));
      CHECK(bad_round == 0);
    }
  }
}

TEST_CASE("fp8 quantize_host: an all-zero row or block gets the floor scale and zero codes", "[fp8]") {
  const int N = 130, K = 260;
  auto w = random_vector<__nv_bfloat16>(static_cast<std::size_t>(N) * K, 8, 0.1);
  for (int r = 128; r < N; ++r)  // the last block row (2 rows) and channel 129: all zero
    for (int c = 0; c < K; ++c) w[static_cast<std::size_t>(r) * K + c] = prox::from_float<__nv_bfloat16>(0.0f);
  for (const ScaleLayout layout : kLayouts) {
    std::vector<std::uint8_t> q(w.size());
    std::vector<float> s(prox::fp8::scale_count(layout, Orientation::kOutIn, N, K));
    REQUIRE(prox::fp8::quantize_host(w.data(), N, K, layout, q.data(), s.data()) == Status::kSuccess);
    CHECK(prox::fp8::check_scales_host(s.data(), s.size()) == Status::kSuccess);
    CHECK(s[prox::fp8::scale_index(layout, Orientation::kOutIn, K, 129, 0)] == prox::fp8::kMinScale);
    for (int c = 0; c < K; ++c) CHECK(q[static_cast<std::size_t>(129) * K + c] == 0x00);
  }
}

TEST_CASE("fp8 transpose_down_host: codes transposed, per-channel scales kept, block scales transposed", "[fp8]") {
  const std::pair<int, int> shapes[] = {{200, 96}, {130, 257}, {16, 32}};
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [d_model, d_ff] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), d_model, d_ff);
      const auto w =
          random_vector<__half>(static_cast<std::size_t>(d_model) * d_ff, 21, 0.03);  // W_down [d_model][d_ff]
      const std::size_t count = prox::fp8::scale_count(layout, Orientation::kOutIn, d_model, d_ff);
      std::vector<std::uint8_t> q(w.size()), qt(w.size(), 0xFF);
      std::vector<float> s(count), st(count, -1.0f);
      REQUIRE(prox::fp8::quantize_host(w.data(), d_model, d_ff, layout, q.data(), s.data()) == Status::kSuccess);
      REQUIRE(prox::fp8::transpose_down_host(q.data(), s.data(), d_model, d_ff, layout, qt.data(), st.data()) ==
              Status::kSuccess);
      std::size_t bad = 0;
      for (int d = 0; d < d_model; ++d)
        for (int f = 0; f < d_ff; ++f)
          bad += qt[static_cast<std::size_t>(f) * d_model + d] != q[static_cast<std::size_t>(d) * d_ff + f];
      CHECK(bad == 0);
      const int bm = prox::fp8::scale_blocks(d_model), bf = prox::fp8::scale_blocks(d_ff);
      if (layout == ScaleLayout::kPerChannel) {
        CHECK(st == s);
      } else {
        for (int i = 0; i < bm; ++i)
          for (int j = 0; j < bf; ++j)
            CHECK(st[static_cast<std::size_t>(j) * bm + i] == s[static_cast<std::size_t>(i) * bf + j]);
      }
      // The dequantized W_down^T (kInOut) is the transpose of the dequantized W_down, exactly.
      std::vector<double> a(w.size()), b(w.size());
      REQUIRE(prox::fp8::dequantize_host(q.data(), s.data(), d_model, d_ff, layout, Orientation::kOutIn, a.data()) ==
              Status::kSuccess);
      REQUIRE(prox::fp8::dequantize_host(qt.data(), st.data(), d_ff, d_model, layout, Orientation::kInOut, b.data()) ==
              Status::kSuccess);
      std::size_t bad_deq = 0;
      for (int d = 0; d < d_model; ++d)
        for (int f = 0; f < d_ff; ++f)
          bad_deq += b[static_cast<std::size_t>(f) * d_model + d] != a[static_cast<std::size_t>(d) * d_ff + f];
      CHECK(bad_deq == 0);
    }
  }
  // Per-channel scales may stay in place; codes and block scales may not.
  std::vector<std::uint8_t> q(16 * 32, 0x38), qt(q.size());
  std::vector<float> s(16, 1.0f), sb(1, 1.0f), sbt(1);
  CHECK(prox::fp8::transpose_down_host(q.data(), s.data(), 16, 32, ScaleLayout::kPerChannel, qt.data(), s.data()) ==
        Status::kSuccess);
  CHECK(prox::fp8::transpose_down_host(q.data(), sb.data(), 16, 32, ScaleLayout::kBlock128, qt.data(), sb.data()) ==
        Status::kErrorInvalidArgument);
  CHECK(prox::fp8::transpose_down_host(q.data(), s.data(), 16, 32, ScaleLayout::kPerChannel, q.data(), s.data()) ==
        Status::kErrorInvalidArgument);
  CHECK(prox::fp8::transpose_down_host(q.data(), sb.data(), 0, 32, ScaleLayout::kBlock128, qt.data(), sbt.data()) ==
        Status::kErrorInvalidShape);
  CHECK(prox::fp8::transpose_down_host(nullptr, sb.data(), 16, 32, ScaleLayout::kBlock128, qt.data(), sbt.data()) ==
        Status::kErrorNullPointer);
}

TEST_CASE("fp8 pack_int4_host: the int4 packer over the dequantized weights", "[fp8][int4]") {
  const std::pair<int, int> shapes[] = {{200, 96}, {37, 64}, {256, 384}};
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [d_model, d_ff] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), d_model, d_ff);
      const auto w = random_vector<__nv_bfloat16>(static_cast<std::size_t>(d_ff) * d_model, 33, 0.02);  // W_gate
      std::vector<std::uint8_t> q(w.size());
      std::vector<float> s(prox::fp8::scale_count(layout, Orientation::kOutIn, d_ff, d_model));
      REQUIRE(prox::fp8::quantize_host(w.data(), d_ff, d_model, layout, q.data(), s.data()) == Status::kSuccess);
      std::vector<std::uint32_t> packed(prox::int4::packed_words(d_model, d_ff), 0u);
      std::vector<float> ps(d_ff, -1.0f);
      REQUIRE(prox::fp8::pack_int4_host(q.data(), s.data(), layout, d_model, d_ff, packed.data(), ps.data()) ==
              Status::kSuccess);
      // (a) The int4 packer's loops over the fp32 dequantized weights, held in an array.
      std::vector<float> deq(w.size());
      REQUIRE(prox::fp8::dequantize_host(q.data(), s.data(), d_ff, d_model, layout, Orientation::kOutIn, deq.data()) ==
              Status::kSuccess);
      std::vector<std::uint32_t> ref(packed.size());
      std::vector<float> ref_s(d_ff);
      const auto get = [&](int n, int k) { return deq[static_cast<std::size_t>(n) * d_model + k]; };
      REQUIRE(prox::int4::detail::pack_host_from(get, d_model, d_ff, ref.data(), ref_s.data()) == Status::kSuccess);
      CHECK(packed == ref);
      std::size_t bad_s = 0;
      for (int n = 0; n < d_ff; ++n) bad_s += bits(ps[n]) != bits(ref_s[n]);
      CHECK(bad_s == 0);
      // (b) The int4 rule by hand: scale = max |deq| / 7, q = rint(deq / scale), nibble order as documented.
      std::size_t bad_q = 0;
      for (int n = 0; n < d_ff; ++n) {
        float amax = 0.0f;
        for (int k = 0; k < d_model; ++k) amax = std::max(amax, std::fabs(get(n, k)));
        CHECK(ps[n] == amax / 7.0f);
        for (int k = 0; k < d_model; ++k)
          bad_q += prox::int4::unpack_host(packed.data(), d_ff, k, n) !=
                   static_cast<int>(std::clamp(std::nearbyint(get(n, k) / ps[n]), -7.0f, 7.0f));
      }
      CHECK(bad_q == 0);
    }
  }
}

TEST_CASE("fp8 pack_int4_host equals int4::pack_host where the dequantized weights are fp16 values", "[fp8][int4]") {
  // Per-channel scales 2^-j and any finite codes: every q * scale is an fp16 value, so the public fp16
  // packer sees exactly the weights pack_int4_host dequantizes.
  const int d_model = 72, d_ff = 64;
  std::mt19937 rng(17);
  std::vector<std::uint8_t> q(static_cast<std::size_t>(d_ff) * d_model);
  for (auto& c : q) {
    c = static_cast<std::uint8_t>(rng());
    if ((c & 0x7F) == 0x7F) c = 0x7E;
  }
  std::vector<float> s(d_ff);
  for (int n = 0; n < d_ff; ++n) s[n] = std::ldexp(1.0f, -static_cast<int>(n % 9));
  std::vector<__half> w16(q.size());
  for (int n = 0; n < d_ff; ++n)
    for (int k = 0; k < d_model; ++k) {
      const std::size_t i = static_cast<std::size_t>(n) * d_model + k;
      const double v = e4m3_reference(q[i]) * static_cast<double>(s[n]);
      w16[i] = __float2half_rn(static_cast<float>(v));
      REQUIRE(static_cast<double>(__half2float(w16[i])) == v);
    }
  std::vector<std::uint32_t> a(prox::int4::packed_words(d_model, d_ff)), b(a.size());
  std::vector<float> as(d_ff), bs(d_ff);
  REQUIRE(prox::fp8::pack_int4_host(q.data(), s.data(), ScaleLayout::kPerChannel, d_model, d_ff, a.data(), as.data()) ==
          Status::kSuccess);
  REQUIRE(prox::int4::pack_host(w16.data(), d_model, d_ff, b.data(), bs.data()) == Status::kSuccess);
  CHECK(a == b);
  CHECK(as == bs);
}

TEST_CASE("fp8 validation: scales, matrices, shapes and bad weights get a Status", "[fp8]") {
  using prox::fp8::check_scales_host;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const float bad :
       {nan, -nan, 0.0f, -0.0f, -1.0f, -FLT_MIN, inf, -inf, -std::numeric_limits<float>::denorm_min()}) {
    CAPTURE(bad);
    std::vector<float> s(300, 0.5f);
    s[123] = bad;
    s[250] = bad;
    std::size_t first = 999;
    CHECK(check_scales_host(s.data(), s.size(), &first) == Status::kErrorInvalidScale);
    CHECK(first == 123);
    CHECK(check_scales_host(s.data(), 123) == Status::kSuccess);
  }
  for (const float good : {std::numeric_limits<float>::denorm_min(), FLT_MIN, 1e-30f, 1.0f, 1e30f, FLT_MAX}) {
    const float one[1] = {good};
    std::size_t first = 999;
    CHECK(check_scales_host(one, 1, &first) == Status::kSuccess);
    CHECK(first == 999);
  }
  CHECK(check_scales_host(nullptr, 4) == Status::kErrorNullPointer);
  const float x[1] = {1.0f};
  CHECK(check_scales_host(x, 0) == Status::kErrorInvalidShape);

  // check_matrix: the pointer and shape rules a Stage-2 kernel needs.
  alignas(16) static std::uint8_t qbuf[64 * 48];
  alignas(16) static float sbuf[64];
  using prox::fp8::check_matrix;
  CHECK(check_matrix(qbuf, sbuf, 64, 48) == Status::kSuccess);
  CHECK(check_matrix(qbuf + 16, sbuf + 1, 4, 48) == Status::kSuccess);
  CHECK(check_matrix(qbuf + 1, sbuf, 4, 48) == Status::kErrorMisalignedPointer);
  CHECK(check_matrix(qbuf + 8, sbuf, 4, 48) == Status::kErrorMisalignedPointer);
  CHECK(check_matrix(qbuf, reinterpret_cast<const float*>(reinterpret_cast<const char*>(sbuf) + 2), 4, 48) ==
        Status::kErrorMisalignedPointer);
  CHECK(check_matrix(qbuf, sbuf, 4, 40) == Status::kErrorInvalidShape);  // 40-byte rows: not 16-byte pieces
  CHECK(check_matrix(qbuf, sbuf, 0, 48) == Status::kErrorInvalidShape);
  CHECK(check_matrix(nullptr, sbuf, 4, 48) == Status::kErrorNullPointer);
  CHECK(check_matrix(qbuf, nullptr, 4, 48) == Status::kErrorNullPointer);
  CHECK(prox::fp8::check_ffn_shape(4096, 12288) == Status::kSuccess);
  CHECK(prox::fp8::check_ffn_shape(5120, 25600) == Status::kSuccess);
  CHECK(prox::fp8::check_ffn_shape(4104, 12288) == Status::kErrorInvalidShape);  // a multiple of 8, not 16
  CHECK(prox::check_ffn_shape(4104, 12288) == Status::kSuccess);                 // fine for fp16/bf16
  CHECK(prox::fp8::check_ffn_shape(4096, 100) == Status::kErrorInvalidShape);
  CHECK(prox::fp8::check_ffn_shape(0, 128) == Status::kErrorInvalidShape);

  // quantize_host: non-finite weights, null pointers, shapes, layouts.
  const int N = 8, K = 40;
  std::vector<std::uint8_t> q(N * K);
  std::vector<float> s(N);
  for (const float bad : {nan, inf, -inf}) {
    std::vector<float> w(N * K, 0.25f);
    w[5 * K + 39] = bad;
    CHECK(prox::fp8::quantize_host(w.data(), N, K, ScaleLayout::kPerChannel, q.data(), s.data()) ==
          Status::kErrorNonFiniteWeight);
    std::vector<__half> h(N * K, __float2half(0.25f));
    h[3] = __float2half(bad);
    CHECK(prox::fp8::quantize_host(h.data(), N, K, ScaleLayout::kBlock128, q.data(), s.data()) ==
          Status::kErrorNonFiniteWeight);
  }
  std::vector<float> w(N * K, 0.25f);
  CHECK(prox::fp8::quantize_host<float>(nullptr, N, K, ScaleLayout::kPerChannel, q.data(), s.data()) ==
        Status::kErrorNullPointer);
  CHECK(prox::fp8::quantize_host(w.data(), N, K, ScaleLayout::kPerChannel, nullptr, s.data()) ==
        Status::kErrorNullPointer);
  CHECK(prox::fp8::quantize_host(w.data(), 0, K, ScaleLayout::kPerChannel, q.data(), s.data()) ==
        Status::kErrorInvalidShape);
  CHECK(prox::fp8::quantize_host(w.data(), N, (1 << 20) + 1, ScaleLayout::kPerChannel, q.data(), s.data()) ==
        Status::kErrorInvalidShape);
  CHECK(prox::fp8::quantize_host(w.data(), N, K, static_cast<ScaleLayout>(2), q.data(), s.data()) ==
        Status::kErrorInvalidArgument);

  // pack_int4_host: bad scales, NaN codes, shapes.
  const int d_model = 16, d_ff = 32;
  std::vector<std::uint8_t> q8(d_ff * d_model, 0x38);
  std::vector<float> s8(d_ff, 0.5f);
  std::vector<std::uint32_t> packed(prox::int4::packed_words(d_model, d_ff));
  std::vector<float> ps(d_ff);
  REQUIRE(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, d_ff, packed.data(),
                                    ps.data()) == Status::kSuccess);
  s8[31] = -0.5f;
  CHECK(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, d_ff, packed.data(),
                                  ps.data()) == Status::kErrorInvalidScale);
  s8[31] = 0.5f;
  q8[100] = 0xFF;  // a NaN code
  CHECK(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, d_ff, packed.data(),
                                  ps.data()) == Status::kErrorNonFiniteWeight);
  q8[100] = 0x38;
  s8[0] = FLT_MAX;  // 1.0 x FLT_MAX is finite; 448 x FLT_MAX is not
  q8[0] = 0x7E;
  CHECK(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, d_ff, packed.data(),
                                  ps.data()) == Status::kErrorNonFiniteWeight);
  CHECK(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, 48, packed.data(),
                                  ps.data()) == Status::kErrorInvalidShape);
  CHECK(prox::fp8::pack_int4_host(q8.data(), s8.data(), ScaleLayout::kPerChannel, d_model, d_ff, nullptr, ps.data()) ==
        Status::kErrorNullPointer);
}
