// SPDX-License-Identifier: Apache-2.0
//! @file test_fp8_device.cu  FP8 e4m3 on the GPU: the register conversions of every code pair, on the
//! architecture's path (the cvt instruction on sm_89+) and the sm_80 emulation called explicitly;
//! the encoder against the host and the cvt instruction; device quantization, the W_down transpose,
//! INT4 packing from FP8 and the scale check, each bit-identical to its host twin on random inputs,
//! odd shapes and poisoned outputs; bad input.
#include "catch.hpp"

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <prox/fp8.cuh>

#include "common.hpp"

using prox::Status;
using prox::fp8::Orientation;
using prox::fp8::ScaleLayout;
using prox_test::DeviceBuffer;
using prox_test::random_vector;

namespace {

constexpr ScaleLayout kLayouts[] = {ScaleLayout::kPerChannel, ScaleLayout::kBlock128};

std::uint32_t bits(float f) { return prox::fp8::float_bits(f); }

bool half_is_nan(std::uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0; }

//! Pair p (codes p & 0xFF, p >> 8) through every path, kOuts words each: [0] the architecture's
//! e4m3x2_to_half2, [1] the emulation with garbage in the upper 16 bits (ignored), [2, 3] the bits of
//! e4m3x2_to_float2, [4, 5] e4m3x4_to_half2 and [6, 7] e4m3x4_to_half2_emulated of the word p | p' << 16.
constexpr int kOuts = 8;
__device__ __host__ inline std::uint32_t partner(std::uint32_t p) { return p ^ 0x5A5Au; }
__global__ void pair_kernel(std::uint32_t* out) {
  const std::uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= 65536u) return;
  std::uint32_t* o = out + kOuts * p;
  o[0] = prox::pair_bits(prox::fp8::e4m3x2_to_half2(p));
  o[1] = prox::pair_bits(prox::fp8::e4m3x2_to_half2_emulated(p | 0xA5C30000u));
  const float2 f = prox::fp8::e4m3x2_to_float2(p);
  o[2] = __float_as_uint(f.x);
  o[3] = __float_as_uint(f.y);
  __half2 lo, hi, elo, ehi;
  const std::uint32_t w = p | (partner(p) << 16);
  prox::fp8::e4m3x4_to_half2(w, lo, hi);
  prox::fp8::e4m3x4_to_half2_emulated(w, elo, ehi);
  o[4] = prox::pair_bits(lo);
  o[5] = prox::pair_bits(hi);
  o[6] = prox::pair_bits(elo);
  o[7] = prox::pair_bits(ehi);
}

//! dequant16 of every piece: float and f16x2 outputs.
__global__ void dequant16_kernel(const uint4* pieces, int n, float* f, std::uint32_t* h) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v[16];
  __half2 p[8];
  prox::fp8::dequant16(pieces[i], v);
  prox::fp8::dequant16(pieces[i], p);
  for (int j = 0; j < 16; ++j) f[16 * i + j] = v[j];
  for (int j = 0; j < 8; ++j) h[8 * i + j] = prox::pair_bits(p[j]);
}

//! The library's encoder and cuda_fp8.h's (the cvt.rn.satfinite instruction on sm_89+) on the device.
__global__ void encode_kernel(const float* x, std::size_t n, std::uint8_t* ours, std::uint8_t* nv) {
  const std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  ours[i] = prox::fp8::float_to_e4m3(x[i]);
  nv[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
}

}  // namespace

TEST_CASE("fp8: register conversions of every e4m3 pair, architecture path and sm_80 emulation", "[fp8][gpu]") {
  DeviceBuffer<std::uint32_t> dout(kOuts * 65536);
  dout.poison();
  pair_kernel<<<256, 256>>>(dout.get());
  PROX_TEST_CUDA(cudaGetLastError());
  const auto out = dout.download();
  std::uint16_t ref[256];
  for (int c = 0; c < 256; ++c) ref[c] = prox::fp8::e4m3_to_half_bits(static_cast<std::uint8_t>(c));
  // Finite codes: the same bits on every path. NaN codes: a NaN on the architecture's path (the
  // instruction's NaN), cuda_fp8.h's 0x7FFF on the emulated one.
  const auto same_pair = [&](std::uint32_t got, std::uint32_t pair, bool exact_nan) {
    for (int i = 0; i < 2; ++i) {
      const int code = static_cast<int>((pair >> (8 * i)) & 0xFF);
      const auto h = static_cast<std::uint16_t>(got >> (16 * i));
      const bool ok = !half_is_nan(ref[code]) ? h == ref[code] : (exact_nan ? h == 0x7FFFu : half_is_nan(h));
      if (!ok) return false;
    }
    return true;
  };
  std::size_t bad_hw = 0, bad_emu = 0, bad_f2 = 0, bad_x4 = 0, bad_x4_emu = 0;
  for (std::uint32_t p = 0; p < 65536u; ++p) {
    const std::uint32_t* o = out.data() + kOuts * p;
    bad_hw += !same_pair(o[0], p, false);
    bad_emu += !same_pair(o[1], p, true);
    for (int i = 0; i < 2; ++i) {
      const auto code = static_cast<std::uint8_t>(p >> (8 * i));
      const float want = prox::fp8::e4m3_to_float(code);
      bad_f2 += std::isnan(want) ? !std::isnan(prox::fp8::bits_float(o[2 + i])) : o[2 + i] != bits(want);
    }
    bad_x4 += !same_pair(o[4], p, false) || !same_pair(o[5], partner(p), false);
    bad_x4_emu += !same_pair(o[6], p, true) || !same_pair(o[7], partner(p), true);
  }
  CHECK(bad_hw == 0);
  CHECK(bad_emu == 0);
  CHECK(bad_f2 == 0);
  CHECK(bad_x4 == 0);
  CHECK(bad_x4_emu == 0);
  INFO("architecture path: NaN code 0x7F gives 0x" << std::hex << (out[kOuts * 0x7F7F] & 0xFFFF) << ", 0xFF gives 0x"
                                                   << (out[kOuts * 0xFFFF] & 0xFFFF));
  CHECK(half_is_nan(static_cast<std::uint16_t>(out[kOuts * 0xFFFF])));
  CHECK(out[kOuts * 0xFFFF + 1] == 0x7FFF7FFFu);

  // dequant16: 16 pieces cover every code once, in rotated orders; element j = byte j.
  std::vector<uint4> pieces(64);
  std::vector<std::uint8_t> codes(pieces.size() * 16);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>((i * 37 + i / 256) & 0xFF);
  std::memcpy(pieces.data(), codes.data(), codes.size());
  DeviceBuffer<uint4> dp(pieces);
  DeviceBuffer<float> df(codes.size());
  DeviceBuffer<std::uint32_t> dh(codes.size() / 2);
  df.poison();
  dh.poison();
  dequant16_kernel<<<1, 64>>>(dp.get(), static_cast<int>(pieces.size()), df.get(), dh.get());
  PROX_TEST_CUDA(cudaGetLastError());
  const auto f = df.download();
  const auto h = dh.download();
  std::size_t bad_f = 0, bad_h = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const std::uint16_t hb = static_cast<std::uint16_t>(h[i / 2] >> (16 * (i % 2)));
    if (half_is_nan(ref[codes[i]])) {
      bad_f += !std::isnan(f[i]);
      bad_h += !half_is_nan(hb);
    } else {
      bad_f += bits(f[i]) != bits(prox::fp8::e4m3_to_float(codes[i]));
      bad_h += hb != ref[codes[i]];
    }
  }
  CHECK(bad_f == 0);
  CHECK(bad_h == 0);
}

TEST_CASE("fp8: the encoder gives the same codes on the device, on the host and from cvt.rn.satfinite", "[fp8][gpu]") {
  std::vector<float> x;
  for (std::uint32_t e = 100; e <= 140; ++e)
    for (std::uint32_t hi = 0; hi < 2048; hi += 3)
      for (const std::uint32_t lo : {0x000u, 0x001u, 0x7FFu, 0x800u, 0x801u, 0xFFFu})
        for (const std::uint32_t s : {0u, 0x80000000u})
          x.push_back(prox::fp8::bits_float(s | (e << 23) | (hi << 12) | lo));
  std::mt19937 rng(9);
  for (int i = 0; i < (1 << 20); ++i) {
    const std::uint32_t u = static_cast<std::uint32_t>(rng());
    if ((u & 0x7FFFFFFFu) <= 0x7F800000u) x.push_back(prox::fp8::bits_float(u));  // no NaN
  }
  for (const float v : {0.0f, -0.0f, 448.0f, 464.0f, 1e38f, std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min()})
    x.push_back(v);
  DeviceBuffer<float> dx(x);
  DeviceBuffer<std::uint8_t> dours(x.size()), dnv(x.size());
  dours.poison(0x7F);
  dnv.poison(0x7F);
  encode_kernel<<<static_cast<unsigned>((x.size() + 255) / 256), 256>>>(dx.get(), x.size(), dours.get(), dnv.get());
  PROX_TEST_CUDA(cudaGetLastError());
  const auto ours = dours.download();
  const auto nv = dnv.download();
  std::size_t bad_host = 0, bad_nv = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    bad_host += ours[i] != prox::fp8::float_to_e4m3(x[i]);
    bad_nv += ours[i] != nv[i];
  }
  CHECK(bad_host == 0);
  CHECK(bad_nv == 0);
}

TEMPLATE_TEST_CASE("fp8: device quantization equals host quantization bit for bit", "[fp8][gpu]", float, __half,
                   __nv_bfloat16) {
  const std::pair<int, int> shapes[] = {{4096, 1024}, {200, 72}, {129, 257}, {1, 16}, {300, 4100}, {1, 1}};
  std::uint64_t seed = 70;
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [N, K] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), N, K);
      auto w = random_vector<TestType>(static_cast<std::size_t>(N) * K, ++seed, 0.05);
      for (int r = 0; r < N; r += 5)  // rows (and blocks) of very different scales
        for (int c = 0; c < K; ++c) {
          auto& e = w[static_cast<std::size_t>(r) * K + c];
          e = prox_test::element_from_float<TestType>(prox::fp8::source_float(e) * 200.0f);
        }
      const std::size_t count = prox::fp8::scale_count(layout, Orientation::kOutIn, N, K);
      std::vector<std::uint8_t> qh(w.size());
      std::vector<float> sh(count);
      REQUIRE(prox::fp8::quantize_host(w.data(), N, K, layout, qh.data(), sh.data()) == Status::kSuccess);
      DeviceBuffer<TestType> dw(w);
      DeviceBuffer<std::uint8_t> dq(w.size());
      DeviceBuffer<float> ds(count);
      dq.poison();  // 0xFF: a NaN code, never the code of a finite weight
      ds.poison();
      REQUIRE(prox::fp8::quantize_device(dw.get(), N, K, layout, dq.get(), ds.get(), nullptr) == Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const auto qd = dq.download();
      const auto sd = ds.download();
      std::size_t bad_q = 0, bad_s = 0;
      for (std::size_t i = 0; i < qh.size(); ++i) bad_q += qd[i] != qh[i];
      for (std::size_t i = 0; i < count; ++i) bad_s += bits(sd[i]) != bits(sh[i]);
      CHECK(bad_q == 0);
      CHECK(bad_s == 0);
    }
  }
}

TEST_CASE("fp8: device quantization rejects non-finite weights before writing q, and bad arguments", "[fp8][gpu]") {
  const int N = 300, K = 260;
  for (const ScaleLayout layout : kLayouts) {
    for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      auto w = random_vector<__nv_bfloat16>(static_cast<std::size_t>(N) * K, 4, 0.1);
      w[static_cast<std::size_t>(299) * K + 259] = prox::from_float<__nv_bfloat16>(bad);  // the last, partial block
      DeviceBuffer<__nv_bfloat16> dw(w);
      DeviceBuffer<std::uint8_t> dq(w.size());
      DeviceBuffer<float> ds(prox::fp8::scale_count(layout, Orientation::kOutIn, N, K));
      dq.poison(0xAB);
      CHECK(prox::fp8::quantize_device(dw.get(), N, K, layout, dq.get(), ds.get(), nullptr) ==
            Status::kErrorNonFiniteWeight);
      std::size_t written = 0;
      for (const std::uint8_t v : dq.download()) written += v != 0xAB;
      CHECK(written == 0);
    }
  }
  DeviceBuffer<float> dw(64 * 64);
  DeviceBuffer<std::uint8_t> dq(64 * 64);
  DeviceBuffer<float> ds(64);
  CHECK(prox::fp8::quantize_device<float>(nullptr, 64, 64, ScaleLayout::kPerChannel, dq.get(), ds.get(), nullptr) ==
        Status::kErrorNullPointer);
  CHECK(prox::fp8::quantize_device(dw.get(), 0, 64, ScaleLayout::kPerChannel, dq.get(), ds.get(), nullptr) ==
        Status::kErrorInvalidShape);
  CHECK(prox::fp8::quantize_device(dw.get(), 64, 64, static_cast<ScaleLayout>(3), dq.get(), ds.get(), nullptr) ==
        Status::kErrorInvalidArgument);
  CHECK(prox::fp8::quantize_device(dw.get(), 64, 64, ScaleLayout::kPerChannel, dq.get(),
                                   reinterpret_cast<float*>(reinterpret_cast<char*>(ds.get()) + 2),
                                   nullptr) == Status::kErrorMisalignedPointer);
}

TEST_CASE("fp8: device W_down transpose equals the host one, both layouts", "[fp8][gpu]") {
  const std::pair<int, int> shapes[] = {{200, 96}, {130, 257}, {1024, 3072}, {16, 32}};
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [d_model, d_ff] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), d_model, d_ff);
      const auto w = random_vector<__half>(static_cast<std::size_t>(d_model) * d_ff, 12, 0.03);
      const std::size_t count = prox::fp8::scale_count(layout, Orientation::kOutIn, d_model, d_ff);
      std::vector<std::uint8_t> q(w.size()), qt(w.size());
      std::vector<float> s(count), st(count);
      REQUIRE(prox::fp8::quantize_host(w.data(), d_model, d_ff, layout, q.data(), s.data()) == Status::kSuccess);
      REQUIRE(prox::fp8::transpose_down_host(q.data(), s.data(), d_model, d_ff, layout, qt.data(), st.data()) ==
              Status::kSuccess);
      DeviceBuffer<std::uint8_t> dq(q), dqt(q.size());
      DeviceBuffer<float> ds(s), dst(count);
      dqt.poison();
      dst.poison();
      REQUIRE(prox::fp8::transpose_down_device(dq.get(), ds.get(), d_model, d_ff, layout, dqt.get(), dst.get(),
                                               nullptr) == Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      CHECK(dqt.download() == qt);
      const auto std_ = dst.download();
      std::size_t bad_s = 0;
      for (std::size_t i = 0; i < count; ++i) bad_s += bits(std_[i]) != bits(st[i]);
      CHECK(bad_s == 0);
    }
  }
  DeviceBuffer<std::uint8_t> dq(16 * 32), dqt(16 * 32);
  DeviceBuffer<float> ds(1);
  CHECK(prox::fp8::transpose_down_device(dq.get(), ds.get(), 16, 32, ScaleLayout::kBlock128, dqt.get(), ds.get(),
                                         nullptr) == Status::kErrorInvalidArgument);
}

TEST_CASE("fp8: device INT4 packing from FP8 equals the host one, both layouts", "[fp8][int4][gpu]") {
  const std::pair<int, int> shapes[] = {{200, 96}, {4096, 1024}, {37, 64}, {130, 288}};
  for (const ScaleLayout layout : kLayouts) {
    for (const auto& [d_model, d_ff] : shapes) {
      CAPTURE(prox::fp8::to_string(layout), d_model, d_ff);
      const auto w = random_vector<__nv_bfloat16>(static_cast<std::size_t>(d_ff) * d_model, 44, 0.02);
      const std::size_t count = prox::fp8::scale_count(layout, Orientation::kOutIn, d_ff, d_model);
      std::vector<std::uint8_t> q(w.size());
      std::vector<float> s(count);
      REQUIRE(prox::fp8::quantize_host(w.data(), d_ff, d_model, layout, q.data(), s.data()) == Status::kSuccess);
      std::vector<std::uint32_t> ph(prox::int4::packed_words(d_model, d_ff));
      std::vector<float> psh(d_ff);
      REQUIRE(prox::fp8::pack_int4_host(q.data(), s.data(), layout, d_model, d_ff, ph.data(), psh.data()) ==
              Status::kSuccess);
      DeviceBuffer<std::uint8_t> dq(q);
      DeviceBuffer<float> ds(s), dps(d_ff);
      DeviceBuffer<std::uint32_t> dp(ph.size());
      dp.poison();
      dps.poison();
      REQUIRE(prox::fp8::pack_int4_device(dq.get(), ds.get(), layout, d_model, d_ff, dp.get(), dps.get(), nullptr) ==
              Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      CHECK(dp.download() == ph);
      const auto psd = dps.download();
      std::size_t bad_s = 0;
      for (int n = 0; n < d_ff; ++n) bad_s += bits(psd[n]) != bits(psh[n]);
      CHECK(bad_s == 0);
    }
  }
  // A bad scale: kErrorInvalidScale, nothing written.
  const int d_model = 64, d_ff = 64;
  std::vector<std::uint8_t> q(d_model * d_ff, 0x38);
  std::vector<float> s(d_ff, 0.25f);
  s[40] = 0.0f;
  DeviceBuffer<std::uint8_t> dq(q);
  DeviceBuffer<float> ds(s), dps(d_ff);
  DeviceBuffer<std::uint32_t> dp(prox::int4::packed_words(d_model, d_ff));
  dp.poison(0xAB);
  dps.poison(0xAB);
  CHECK(prox::fp8::pack_int4_device(dq.get(), ds.get(), ScaleLayout::kPerChannel, d_model, d_ff, dp.get(), dps.get(),
                                    nullptr) == Status::kErrorInvalidScale);
  for (const std::uint32_t v : dp.download()) REQUIRE(v == 0xABABABABu);
  for (const float v : dps.download()) REQUIRE(bits(v) == 0xABABABABu);
  CHECK(prox::fp8::pack_int4_device(dq.get(), ds.get(), ScaleLayout::kPerChannel, d_model, 40, dp.get(), dps.get(),
                                    nullptr) == Status::kErrorInvalidShape);
}

TEST_CASE("fp8: device scale check agrees with the host one, first index included", "[fp8][gpu]") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::size_t count = (std::size_t{1} << 20) + 3;
  std::vector<float> s(count);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(1e-3f, 10.0f);
  for (auto& v : s) v = dist(rng);
  s[7] = std::numeric_limits<float>::denorm_min();  // valid
  s[8] = FLT_MAX;                                   // valid
  DeviceBuffer<float> ds(s);
  std::size_t first = 999;
  CHECK(prox::fp8::check_scales_device(ds.get(), count, nullptr, &first) == Status::kSuccess);
  CHECK(first == 999);
  for (const float bad : {nan, 0.0f, -0.0f, -2.0f, inf, -inf}) {
    for (const std::size_t at : {std::size_t{0}, std::size_t{12345}, count - 1}) {
      CAPTURE(bad, at);
      auto t = s;
      t[at] = bad;
      if (at + 777 < count) t[at + 777] = bad;  // a later one too: the first is reported
      std::size_t h = 0, d = 0;
      REQUIRE(prox::fp8::check_scales_host(t.data(), count, &h) == Status::kErrorInvalidScale);
      ds.upload(t);
      CHECK(prox::fp8::check_scales_device(ds.get(), count, nullptr, &d) == Status::kErrorInvalidScale);
      CHECK(d == h);
      CHECK(d == at);
    }
  }
  CHECK(prox::fp8::check_scales_device(nullptr, 4, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::fp8::check_scales_device(ds.get(), 0, nullptr) == Status::kErrorInvalidShape);
  CHECK(prox::fp8::check_scales_device(reinterpret_cast<const float*>(reinterpret_cast<const char*>(ds.get()) + 1), 4,
                                       nullptr) == Status::kErrorMisalignedPointer);
  // It synchronizes, so a capturing stream is refused before any work is enqueued.
  cudaStream_t stream;
  PROX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  PROX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status st = prox::fp8::check_scales_device(ds.get(), count, stream);
  cudaGraph_t graph = nullptr;
  PROX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  if (graph != nullptr) PROX_TEST_CUDA(cudaGraphDestroy(graph));
  PROX_TEST_CUDA(cudaStreamDestroy(stream));
  CHECK(st == Status::kErrorCapturing);
}
