// SPDX-License-Identifier: Apache-2.0
//! @file test_fp8.cu  FP8 e4m3 Stage-2 weights on the GPU (fp8_weights.cuh, both scale layouts): every FP8 op,
//! batch 1 and batched, against the float64 reference of the dequantized weights, on odd shapes (d_model and
//! d_ff not multiples of 128), fp16 and bf16 activations, SiLU and GeLU, boundary densities, poisoned outputs
//! (every element written); the FP8 SparseFfn end to end (run and run_batch) on the device's channel sets; and
//! bad input (null or misaligned FP8 pointers, scale shapes that do not match, invalid scale values, a d_model
//! that is not a multiple of 16) answered with a Status before any launch.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include <prox/fp8_policies.cuh>
#include <prox/fp8_weights.cuh>
#include <prox/prox.cuh>

#include "fp8_fixture.hpp"
#include "gpu_fixture.hpp"
#include "op_test.hpp"

using namespace prox_test;
namespace fp8 = prox::fp8;
using Layout = fp8::ScaleLayout;

namespace {

constexpr const char* layout_name(Layout l) { return l == Layout::kBlock128 ? "block128" : "channel"; }

//! The reference of Stage 2 on a channel set, with the FP8 bounds (widen_for_scales).
template <Layout L>
prox_ref::Stage2Result fp8_stage2(const Fp8HostLayer<L>& h, const std::vector<double>& x,
                                  const std::vector<std::uint8_t>& sel, prox_ref::Act act) {
  auto r = prox_ref::stage2(x, h.dwg, h.dwu, h.dwdt, h.K, h.N, sel, act);
  widen_for_scales(r.s);
  widen_for_scales(r.y);
  return r;
}

// ======================================================================== batch 1: GLU, down, fused
template <class T, class A, Layout L>
void fp8_glu_suite(int K, int N, std::uint64_t seed) {
  using Fmt = prox::Fp8Weights<L>;
  using Op = prox::GluGemvOp<T, A, Fmt>;
  const auto h = make_fp8_layer<L>(K, N, seed);
  const Fp8DeviceLayer<L> D(h);
  const auto x = normal_vector<T>(K, seed + 5, 1.0);
  const DeviceBuffer<T> dx(x);
  DeviceBuffer<float> ds(N);
  for (double density : {0.3, 0.0, 1.0}) {
    const auto sel = random_flags(N, density, seed + 9);
    const auto ref = fp8_stage2(h, prox_ref::to_double(x), sel, ref_act<A>());
    DeviceBuffer<std::uint32_t> dmask(flags_to_mask(sel));
    prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
      CAPTURE(K, N, density, pi, decltype(p)::name(), A::kName, prox::DTypeTraits<T>::kName, layout_name(L));
      ds.poison();
      typename Op::Args a;
      a.x = dx.get();
      a.d_model = K;
      a.d_ff = N;
      a.w_gate = D.gate();
      a.w_up = D.up();
      a.channel_mask = dmask.get();
      a.s = ds.get();
      DeviceBuffer<char> no_ws;
      REQUIRE(run_op<Op>(a, pi, no_ws) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const SCompare c = compare_s(ds.download(), sel, ref.s);
      std::printf("[fp8 glu]  %-5s %-9s %-8s K=%-5d N=%-5d %-18s density=%.1f err/bound=%.3f bad=%d\n",
                  prox::DTypeTraits<T>::kName, A::kName, layout_name(L), K, N, decltype(p)::name().c_str(), density,
                  c.worst, c.bad);
      CHECK(c.bad == 0);
      CHECK(c.untouched_bad == 0);
    });
  }
}

template <class T, Layout L>
void fp8_down_suite(int K, int N, std::uint64_t seed) {
  using Fmt = prox::Fp8Weights<L>;
  using Op = prox::DownGemvOp<T, Fmt>;
  const auto h = make_fp8_layer<L>(K, N, seed);
  const Fp8DeviceLayer<L> D(h);
  const auto s = normal_floats(N, seed + 3, 1.0);
  DeviceBuffer<float> dsv(s);
  DeviceBuffer<T> dy(K);
  for (double density : {0.23, 0.0, 1.0}) {
    const auto sel = random_flags(N, density, seed + 4);
    auto ref = prox_ref::down_gemv(s, h.dwdt, K, N, sel, /*extra=*/1);  // + the scale's multiply
    widen_for_scales(ref);
    DeviceBuffer<std::uint32_t> dmask(flags_to_mask(sel));
    prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
      CAPTURE(K, N, density, pi, decltype(p)::name(), prox::DTypeTraits<T>::kName, layout_name(L));
      dy.poison();
      typename Op::Args a;
      a.s = dsv.get();
      a.channel_mask = dmask.get();
      a.w_down_t = D.down_t();
      a.d_model = K;
      a.d_ff = N;
      a.y = dy.get();
      const auto ws = op_workspace<Op>(a);
      REQUIRE(run_op<Op>(a, pi, ws, 2) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      double worst = 0.0;
      const int bad = count_out_of_bound(dy.download(), ref, &worst);
      std::printf("[fp8 down] %-5s %-8s K=%-5d N=%-5d %-22s density=%.2f err/bound=%.3f bad=%d\n",
                  prox::DTypeTraits<T>::kName, layout_name(L), K, N, decltype(p)::name().c_str(), density, worst, bad);
      CHECK(bad == 0);
    });
  }
}

template <class T, class A, Layout L>
void fp8_fused_suite(int K, int N, std::uint64_t seed) {
  using Fmt = prox::Fp8Weights<L>;
  using Op = prox::GluDownGemvOp<T, A, Fmt>;
  const auto h = make_fp8_layer<L>(K, N, seed);
  const Fp8DeviceLayer<L> D(h);
  const auto x = normal_vector<T>(K, seed + 5, 1.0);
  const DeviceBuffer<T> dx(x);
  DeviceBuffer<float> ds(N);
  DeviceBuffer<T> dy(K);
  for (double density : {0.3, 0.0, 1.0}) {
    const auto sel = random_flags(N, density, seed + 9);
    const auto ref = fp8_stage2(h, prox_ref::to_double(x), sel, ref_act<A>());
    DeviceBuffer<std::uint32_t> dmask(flags_to_mask(sel));
    prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
      CAPTURE(K, N, density, pi, decltype(p)::name(), A::kName, prox::DTypeTraits<T>::kName, layout_name(L));
      ds.poison();
      dy.poison();
      typename Op::Args a;
      a.x = dx.get();
      a.d_model = K;
      a.d_ff = N;
      a.w_gate = D.gate();
      a.w_up = D.up();
      a.channel_mask = dmask.get();
      a.s = ds.get();
      a.w_down_t = D.down_t();
      a.y = dy.get();
      const auto ws = op_workspace<Op>(a);
      REQUIRE(run_op<Op>(a, pi, ws, 2) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const SCompare c = compare_s(ds.download(), sel, ref.s);
      double worst = 0.0;
      const int bad = count_out_of_bound(dy.download(), ref.y, &worst);
      std::printf("[fp8 fused] %-5s %-9s %-8s K=%-5d N=%-5d %-30s density=%.1f s bad=%d y err/bound=%.3f bad=%d\n",
                  prox::DTypeTraits<T>::kName, A::kName, layout_name(L), K, N, decltype(p)::name().c_str(), density,
                  c.bad, worst, bad);
      CHECK(c.bad == 0);
      CHECK(c.untouched_bad == 0);
      CHECK(bad == 0);
    });
  }
}

// ======================================================================== batched: GLU, down, fused
//! Every token's own random channel set (density d, seed per token) and their union.
struct TokenSets {
  std::vector<std::vector<std::uint8_t>> sel;
  std::vector<std::uint8_t> uni;
  std::vector<std::uint32_t> masks;  // [tokens][N/32]
};
inline TokenSets token_sets(int tokens, int N, double density, std::uint64_t seed) {
  TokenSets t;
  t.uni.assign(N, 0);
  for (int b = 0; b < tokens; ++b) {
    t.sel.push_back(random_flags(N, density, seed + 31 * b));
    for (int j = 0; j < N; ++j) t.uni[j] |= t.sel.back()[j];
    const auto m = flags_to_mask(t.sel.back());
    t.masks.insert(t.masks.end(), m.begin(), m.end());
  }
  return t;
}

template <class T, class A, Layout L, int B>
void fp8_batched_suite(int K, int N, int tokens, std::uint64_t seed) {
  using Fmt = prox::Fp8Weights<L>;
  using Glu = prox::BatchedGluGemvOp<T, A, B, Fmt>;
  using Down = prox::BatchedDownGemvOp<T, B, Fmt>;
  const auto h = make_fp8_layer<L>(K, N, seed);
  const Fp8DeviceLayer<L> D(h);
  const auto x = normal_vector<T>(static_cast<std::size_t>(tokens) * K, seed + 5, 1.0);
  const DeviceBuffer<T> dx(x);
  DeviceBuffer<float> ds(static_cast<std::size_t>(tokens) * N);
  DeviceBuffer<T> dy(static_cast<std::size_t>(tokens) * K);
  for (double density : {0.3, 0.0, 1.0}) {
    const TokenSets ts = token_sets(tokens, N, density, seed + 9);
    DeviceBuffer<std::uint32_t> dmasks(ts.masks);
    DeviceBuffer<std::uint32_t> dunion(flags_to_mask(ts.uni));
    std::vector<prox_ref::Stage2Result> ref;
    for (int b = 0; b < tokens; ++b) {
      const std::vector<T> xb(x.begin() + static_cast<std::ptrdiff_t>(b) * K, x.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
      ref.push_back(fp8_stage2(h, prox_ref::to_double(xb), ts.sel[b], ref_act<A>()));
    }
    const auto check_s = [&](const std::vector<float>& got) {
      for (int b = 0; b < tokens; ++b) {
        const std::vector<float> sb(got.begin() + static_cast<std::ptrdiff_t>(b) * N,
                                    got.begin() + static_cast<std::ptrdiff_t>(b + 1) * N);
        const SCompare c = compare_s(sb, ts.sel[b], ref[b].s);
        CHECK(c.bad == 0);
        CHECK(c.untouched_bad == 0);
      }
    };
    const auto check_y = [&](const std::vector<T>& got) {
      int bad = 0;
      for (int b = 0; b < tokens; ++b) {
        const std::vector<T> yb(got.begin() + static_cast<std::ptrdiff_t>(b) * K,
                                got.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
        bad += count_out_of_bound(yb, ref[b].y);
      }
      CHECK(bad == 0);
      return bad;
    };
    // GLU
    typename Glu::Args g;
    g.x = dx.get();
    g.tokens = tokens;
    g.d_model = K;
    g.d_ff = N;
    g.w_gate = D.gate();
    g.w_up = D.up();
    g.channel_mask = dmasks.get();
    g.union_mask = dunion.get();
    g.s = ds.get();
    prox::for_each_policy<typename Glu::Policies>([&](auto p, int pi) {
      CAPTURE(K, N, B, tokens, density, pi, decltype(p)::name(), prox::DTypeTraits<T>::kName, layout_name(L));
      ds.poison();
      DeviceBuffer<char> no_ws;
      REQUIRE(run_op<Glu>(g, pi, no_ws) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      check_s(ds.download());
    });
    // Down, on the GLU's s (every token's s, 0 off its set)
    ds.poison();
    {
      DeviceBuffer<char> no_ws;
      REQUIRE(run_op<Glu>(g, 0, no_ws) == prox::Status::kSuccess);
    }
    typename Down::Args d;
    d.s = ds.get();
    d.union_mask = dunion.get();
    d.w_down_t = D.down_t();
    d.tokens = tokens;
    d.d_model = K;
    d.d_ff = N;
    d.y = dy.get();
    prox::for_each_policy<typename Down::Policies>([&](auto p, int pi) {
      CAPTURE(K, N, B, tokens, density, pi, decltype(p)::name(), prox::DTypeTraits<T>::kName, layout_name(L));
      dy.poison();
      const auto ws = op_workspace<Down>(d);
      REQUIRE(run_op<Down>(d, pi, ws, 2) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const int bad = check_y(dy.download());
      std::printf("[fp8 bdown] %-5s %-8s B=%d tokens=%d K=%-5d N=%-5d %-26s density=%.1f bad=%d\n",
                  prox::DTypeTraits<T>::kName, layout_name(L), B, tokens, K, N, decltype(p)::name().c_str(), density,
                  bad);
    });
    // Fused batched Stage 2 (capacities 2 and 4)
    if constexpr (B <= 4) {
      using Fused = prox::BatchedGluDownGemvOp<T, A, B, Fmt>;
      typename Fused::Args f;
      static_cast<typename Glu::Args&>(f) = g;
      f.w_down_t = D.down_t();
      f.y = dy.get();
      prox::for_each_policy<typename Fused::Policies>([&](auto p, int pi) {
        CAPTURE(K, N, B, tokens, density, pi, decltype(p)::name(), prox::DTypeTraits<T>::kName, layout_name(L));
        ds.poison();
        dy.poison();
        const auto ws = op_workspace<Fused>(f);
        REQUIRE(run_op<Fused>(f, pi, ws, 2) == prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        check_s(ds.download());
        check_y(dy.download());
      });
    }
  }
}

}  // namespace

// Odd shapes: d_model a multiple of 16 and not of 128 (partial last scale block), d_ff a multiple of 32 and not
// of 128; and a Qwen3-8B-sized one (tagged [large]).
TEST_CASE("FP8 GLU GEMV: exact s from the dequantized weights, +0 elsewhere", "[fp8][stage2][gpu]") {
  fp8_glu_suite<__half, prox::SiLU, Layout::kPerChannel>(208, 96, 501);
  fp8_glu_suite<__half, prox::SiLU, Layout::kBlock128>(208, 96, 502);
  fp8_glu_suite<__nv_bfloat16, prox::GeluTanh, Layout::kPerChannel>(1040, 2016, 503);
  fp8_glu_suite<__nv_bfloat16, prox::GeluTanh, Layout::kBlock128>(1040, 2016, 504);
  fp8_glu_suite<__half, prox::SiLU, Layout::kBlock128>(16, 32, 505);  // one piece per row
}

TEST_CASE("FP8 GLU GEMV on the Qwen3-8B shape", "[fp8][stage2][gpu][large]") {
  fp8_glu_suite<__nv_bfloat16, prox::GeluTanh, Layout::kBlock128>(4096, 12288, 506);
}

TEST_CASE("FP8 down GEMV: y from the selected rows only, every element written", "[fp8][stage2][gpu]") {
  fp8_down_suite<__half, Layout::kPerChannel>(208, 96, 511);
  fp8_down_suite<__half, Layout::kBlock128>(208, 96, 512);
  fp8_down_suite<__nv_bfloat16, Layout::kPerChannel>(1040, 2016, 513);
  fp8_down_suite<__nv_bfloat16, Layout::kBlock128>(1040, 2016, 514);
  fp8_down_suite<__half, Layout::kBlock128>(16, 17408, 515);  // 34 split-K chunks
}

TEST_CASE("FP8 fused Stage 2: s and y against the reference", "[fp8][stage2][gludown][gpu]") {
  fp8_fused_suite<__half, prox::SiLU, Layout::kPerChannel>(208, 96, 521);
  fp8_fused_suite<__half, prox::SiLU, Layout::kBlock128>(208, 96, 522);
  fp8_fused_suite<__nv_bfloat16, prox::GeluTanh, Layout::kPerChannel>(1040, 2016, 523);
  fp8_fused_suite<__nv_bfloat16, prox::GeluTanh, Layout::kBlock128>(1040, 2016, 524);
}

TEST_CASE("FP8 batched GLU, down and fused Stage 2: every token against its own reference", "[fp8][batched][gpu]") {
  fp8_batched_suite<__half, prox::SiLU, Layout::kPerChannel, 2>(208, 96, 2, 531);
  fp8_batched_suite<__half, prox::SiLU, Layout::kBlock128, 2>(208, 96, 1, 532);
  fp8_batched_suite<__nv_bfloat16, prox::GeluTanh, Layout::kBlock128, 4>(1040, 2016, 3, 533);
  fp8_batched_suite<__nv_bfloat16, prox::GeluTanh, Layout::kPerChannel, 4>(1040, 2016, 4, 534);
  fp8_batched_suite<__half, prox::SiLU, Layout::kBlock128, 8>(208, 2016, 8, 535);
  fp8_batched_suite<__nv_bfloat16, prox::GeluTanh, Layout::kPerChannel, 8>(1040, 96, 5, 536);
}

// ======================================================================== SparseFfn
namespace {
template <class T, class A, Layout L>
void fp8_ffn_case(int K, int N, std::uint64_t seed) {
  using Fmt = prox::Fp8Weights<L>;
  using Ffn = prox::SparseFfn<T, A, prox::Int4Weights, Fmt>;
  constexpr int kMax = prox::kMaxBatchTokens;
  const auto h = make_fp8_layer<L>(K, N, seed);
  const Fp8DeviceLayer<L> D(h);
  typename Ffn::Weights w;
  w.gate = D.gate();
  w.up = D.up();
  w.down_t = D.down_t();
  w.proxy_gate = {D.pg.get(), D.psg.get()};
  w.proxy_up = {D.pu.get(), D.psu.get()};
  const auto x = normal_vector<T>(static_cast<std::size_t>(kMax) * K, seed + 5, 1.0);
  const DeviceBuffer<T> dx(x);
  DeviceBuffer<T> dy(static_cast<std::size_t>(kMax) * K);
  DeviceBuffer<std::uint32_t> dmask(static_cast<std::size_t>(kMax) * (N / 32));
  DeviceBuffer<float> ds(static_cast<std::size_t>(kMax) * N);
  for (bool fuse : {true, false}) {
    for (const float tau_s : {0.0f, 0.05f, kInf}) {
      typename Ffn::Config c{K, N, 0.2f, tau_s};
      c.max_tokens = kMax;
      typename Ffn::PlanOptions po;
      po.fuse_stage2 = fuse;
      Ffn ffn;
      REQUIRE(ffn.plan(c, w, po) == prox::Status::kSuccess);
      DeviceBuffer<char> ws(ffn.workspace_bytes());
      PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
      for (int tokens : {1, 2, 3, 8}) {
        CAPTURE(K, N, fuse, tau_s, tokens, prox::DTypeTraits<T>::kName, A::kName, layout_name(L));
        dy.poison();
        dmask.poison();
        ds.poison();
        typename Ffn::BatchOutputs out;
        out.channel_mask = dmask.get();
        out.s = ds.get();
        REQUIRE(ffn.run_batch(dx.get(), dy.get(), tokens, ws.get(), ws.bytes(), nullptr, out) ==
                prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        const auto masks = dmask.download();
        const auto s = ds.download();
        const auto y = dy.download();
        int bad_y = 0;
        int bad_s = 0;
        for (int b = 0; b < tokens; ++b) {
          const std::vector<std::uint32_t> mb(masks.begin() + static_cast<std::ptrdiff_t>(b) * (N / 32),
                                              masks.begin() + static_cast<std::ptrdiff_t>(b + 1) * (N / 32));
          const auto sel = mask_to_flags(mb, N);
          const std::vector<T> xb(x.begin() + static_cast<std::ptrdiff_t>(b) * K,
                                  x.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
          const auto ref = fp8_stage2(h, prox_ref::to_double(xb), sel, ref_act<A>());
          const std::vector<float> sb(s.begin() + static_cast<std::ptrdiff_t>(b) * N,
                                      s.begin() + static_cast<std::ptrdiff_t>(b + 1) * N);
          const SCompare cs = compare_s(sb, sel, ref.s);
          bad_s += cs.bad + cs.untouched_bad;
          const std::vector<T> yb(y.begin() + static_cast<std::ptrdiff_t>(b) * K,
                                  y.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
          bad_y += count_out_of_bound(yb, ref.y);
          if (tau_s == 0.0f) CHECK(std::count(sel.begin(), sel.end(), 1) == N);  // every channel: the dense FFN
          if (std::isinf(tau_s)) CHECK(std::count(sel.begin(), sel.end(), 1) == 0);
        }
        CHECK(bad_s == 0);
        CHECK(bad_y == 0);
      }
    }
  }
}
}  // namespace

TEST_CASE("FP8 SparseFfn: run and run_batch on the device's channel sets", "[fp8][ffn][gpu]") {
  fp8_ffn_case<__half, prox::SiLU, Layout::kBlock128>(1040, 2016, 541);
  fp8_ffn_case<__nv_bfloat16, prox::GeluTanh, Layout::kPerChannel>(208, 96, 542);
}

// ======================================================================== bad input
TEST_CASE("FP8: bad input gets a Status before any launch", "[fp8][status][gpu]") {
  using Fmt = prox::Fp8BlockWeights;
  using Ffn = prox::SparseFfn<__half, prox::SiLU, prox::Int4Weights, Fmt>;
  const int K = 208, N = 96;
  const auto h = make_fp8_layer<Layout::kBlock128>(K, N, 551);
  const Fp8DeviceLayer<Layout::kBlock128> D(h);
  typename Ffn::Weights w;
  w.gate = D.gate();
  w.up = D.up();
  w.down_t = D.down_t();
  w.proxy_gate = {D.pg.get(), D.psg.get()};
  w.proxy_up = {D.pu.get(), D.psu.get()};
  const typename Ffn::Config c{K, N, 0.1f, 0.1f};
  Ffn ffn;
  REQUIRE(ffn.plan(c, w) == prox::Status::kSuccess);

  auto bad = w;
  bad.gate.w = nullptr;
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorNullPointer);
  bad = w;
  bad.down_t.scales = nullptr;
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorNullPointer);
  bad = w;
  bad.up.w = D.qu.get() + 1;  // FP8 codes must be 16-byte aligned
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorMisalignedPointer);
  bad = w;
  bad.gate.scales = D.sg.get();
  bad.gate.scales = reinterpret_cast<const float*>(reinterpret_cast<const char*>(D.sg.get()) + 2);
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorMisalignedPointer);
  bad = w;
  bad.gate.scale_cols += 1;  // the block-scale shape does not match the matrix
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorInvalidShape);
  bad = w;
  bad.down_t.scale_rows = bad.down_t.scale_cols;  // W_down's untransposed block scales given for W_down^T
  bad.down_t.scale_cols = fp8::scale_blocks(N);
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorInvalidShape);
  bad = w;
  bad.up.scale_rows = N;  // per-channel shape given to a block-scaled format
  bad.up.scale_cols = 1;
  CHECK(ffn.plan(c, bad) == prox::Status::kErrorInvalidShape);
  // d_model a multiple of 8 but not of 16: a row of FP8 codes is not whole 16-byte pieces.
  CHECK(ffn.plan({200, N, 0.1f, 0.1f}, w) == prox::Status::kErrorInvalidShape);

  // Scale values: NaN, 0, negative, infinite are refused by the plan (PlanOptions::check_scales) with
  // kErrorInvalidScale; with the check off the plan does not read them.
  for (const float v : {std::numeric_limits<float>::quiet_NaN(), 0.0f, -1.0f, kInf}) {
    CAPTURE(v);
    std::vector<float> sdt = h.sdt;
    sdt[sdt.size() - 1] = v;  // the last block: a partial one
    DeviceBuffer<float> dsdt(sdt);
    bad = w;
    bad.down_t.scales = dsdt.get();
    CHECK(ffn.plan(c, bad) == prox::Status::kErrorInvalidScale);
    typename Ffn::PlanOptions po;
    po.check_scales = false;
    CHECK(ffn.plan(c, bad, po) == prox::Status::kSuccess);
  }

  // The ops' own validation (no plan, no launch): a misaligned code pointer, a wrong shape of the scales.
  prox::GluGemvArgs<__half, Fmt> g;
  DeviceBuffer<__half> dx(K);
  DeviceBuffer<std::uint32_t> dmask(N / 32);
  DeviceBuffer<float> ds(N);
  g.x = dx.get();
  g.d_model = K;
  g.d_ff = N;
  g.w_gate = D.gate();
  g.w_up = D.up();
  g.channel_mask = dmask.get();
  g.s = ds.get();
  using GluOp = prox::GluGemvOp<__half, prox::SiLU, Fmt>;
  CHECK(GluOp::can_implement(g) == prox::Status::kSuccess);
  auto g2 = g;
  g2.w_gate.w = D.qg.get() + 16 * 13 + 8;  // a row start plus half a piece
  CHECK(GluOp::can_implement(g2) == prox::Status::kErrorMisalignedPointer);
  g2 = g;
  g2.w_up.scale_rows = 0;
  CHECK(GluOp::can_implement(g2) == prox::Status::kErrorInvalidShape);
  prox::DownGemvArgs<__half, prox::Fp8ChannelWeights> d;
  DeviceBuffer<__half> dy(K);
  dy.poison(0x5A);
  d.s = ds.get();
  d.channel_mask = dmask.get();
  d.w_down_t = {D.qdt.get(), D.sdt.get(), K, 1};  // per-channel W_down^T: one scale per column
  d.d_model = K;
  d.d_ff = N;
  d.y = dy.get();
  using DownOp = prox::DownGemvOp<__half, prox::Fp8ChannelWeights>;
  CHECK(DownOp::can_implement(d) == prox::Status::kSuccess);
  d.w_down_t.scale_rows = N;  // per row: the GLU's orientation, not W_down^T's
  CHECK(DownOp::can_implement(d) == prox::Status::kErrorInvalidShape);
  prox::Operator<DownOp> op;
  CHECK(op.initialize(d) == prox::Status::kErrorInvalidShape);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  for (__half v : dy.download()) CHECK(bits16(v) == 0x5A5Au);  // nothing was launched
}
