// SPDX-License-Identifier: Apache-2.0
//! @file test_ops.cu  The four ops on the GPU against the float64 reference: threshold, Stage-1 proxy
//! GEMV (INT4 and fp16/bf16 proxies), masked GLU GEMV, sparse down GEMV. Every compiled policy,
//! both dtypes, both activations, boundary densities, odd shapes, poisoned outputs.
#include "catch.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include <prox/prox.cuh>

#include "gpu_fixture.hpp"
#include "op_test.hpp"

using namespace prox_test;
using prox_ref::Act;


// ======================================================================== threshold
TEMPLATE_TEST_CASE("threshold op: mask, compaction and sparse copy are exact", "[threshold][gpu]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  for (int n : {1, 31, 33, 1000, 4096, 5003}) {
    auto x = normal_vector<T>(n, 1000 + n, 1.0);
    // Specials: NaN is never kept, +-inf always (tau finite), zeros kept only at tau = 0.
    if (n > 10) {
      x[3] = prox::from_float<T>(std::numeric_limits<float>::quiet_NaN());
      x[5] = prox::from_float<T>(kInf);
      x[7] = prox::from_float<T>(-kInf);
      x[9] = prox::from_float<T>(0.0f);
    }
    DeviceBuffer<T> dx(x);
    const int words = (n + 31) / 32;
    DeviceBuffer<std::uint32_t> dmask(words);
    DeviceBuffer<int> didx(n), dcount(1);
    DeviceBuffer<T> dsparse(n);
    for (float tau : {0.0f, 0.5f, 1.2f, kInf}) {
      std::vector<std::uint32_t> want_mask(words, 0u);
      std::vector<int> want_idx;
      for (int i = 0; i < n; ++i) {
        if (prox::keep_magnitude(prox::to_float(x[i]), tau)) {
          want_mask[i / 32] |= 1u << (i % 32);
          want_idx.push_back(i);
        }
      }
      prox::for_each_policy<prox::ThresholdPolicies>([&](auto p, int pi) {
        CAPTURE(n, tau, pi);
        dmask.poison();
        didx.poison();
        dcount.poison();
        dsparse.poison();
        prox::ThresholdArgs<T> a;
        a.x = dx.get();
        a.n = n;
        a.tau = tau;
        a.mask = dmask.get();
        a.indices = didx.get();
        a.count = dcount.get();
        a.x_sparse = dsparse.get();
        DeviceBuffer<char> no_ws;
        REQUIRE(run_op<prox::ThresholdOp<T>>(a, pi, no_ws) == prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        CHECK(dmask.download() == want_mask);
        const auto cnt = dcount.download();
        REQUIRE(cnt[0] == static_cast<int>(want_idx.size()));
        const auto idx = didx.download();
        CHECK(std::vector<int>(idx.begin(), idx.begin() + cnt[0]) == want_idx);
        const auto xs = dsparse.download();
        int bad = 0;
        for (int i = 0; i < n; ++i) {
          const bool kept = (want_mask[i / 32] >> (i % 32)) & 1u;
          bad += bits16(xs[i]) != (kept ? bits16(x[i]) : std::uint16_t{0});
        }
        CHECK(bad == 0);
      });
    }
  }
}

// ======================================================================== Stage 1
namespace {

template <class T, class Fmt, class A, class List>
void proxy_case(const HostLayer<T>& L, const DeviceLayer<T>& D, const std::vector<T>& x, float tau_x, float tau_s,
                const char* label) {
  constexpr bool kInt4 = std::is_same_v<Fmt, prox::Int4Weights>;
  const int K = L.K, N = L.N;
  const auto dxv = prox_ref::to_double(x);
  const auto ref = kInt4 ? prox_ref::stage1_int4(dxv, K, N, tau_x, tau_s, L.qg, L.sg, L.qu, L.su, ref_act<A>())
                         : prox_ref::stage1_dense(dxv, K, N, tau_x, tau_s, L.dwg_t, L.dwu_t, ref_act<A>());
  DeviceBuffer<T> dx(x);
  DeviceBuffer<std::uint32_t> dmask(N / 32);
  DeviceBuffer<float> ds(N);
  DeviceBuffer<prox::SparsityCounters> dcnt(1);
  prox::for_each_policy<List>([&](auto p, int pi) {
    using P = decltype(p);
    CAPTURE(label, K, N, tau_x, tau_s, pi, P::name(), Fmt::kName, A::kName, prox::DTypeTraits<T>::kName);
    prox::ProxyGemvArgs<T, Fmt> a;
    a.x = dx.get();
    a.d_model = K;
    a.d_ff = N;
    a.tau_x = tau_x;
    a.tau_s = tau_s;
    set_proxy_weights(a, D);
    a.channel_mask = dmask.get();
    a.s_proxy = ds.get();
    a.counters = dcnt.get();
    const auto ws = op_workspace<prox::ProxyGemvOp<T, A, Fmt>>(a);
    PROX_TEST_CUDA(cudaMemset(dcnt.get(), 0, sizeof(prox::SparsityCounters)));
    dmask.poison();
    ds.poison();
    // Two launches: the second reuses the workspace the first left behind (counters reset).
    REQUIRE(run_op<prox::ProxyGemvOp<T, A, Fmt>>(a, pi, ws, 2) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    const auto mask = dmask.download();
    const auto s = ds.download();
    const MaskCompare c = compare_mask(mask, ref);
    int s_bad = 0;
    double worst = 0.0;
    for (int j = 0; j < N; ++j) {
      const double d = std::fabs(static_cast<double>(s[j]) - ref.s[j].v);
      if (!(d <= ref.s[j].err)) ++s_bad;
      worst = std::max(worst, d / (ref.s[j].err + 1e-300));
    }
    std::printf(
        "[stage1] %-6s %-5s %-4s %-9s K=%-5d N=%-5d %-26s kept=%-5zu sel_ref=%-5d sel_gpu=%-5d ambiguous=%d flipped=%d "
        "mismatch=%d s_err/bound=%.3f\n",
        label, prox::DTypeTraits<T>::kName, Fmt::kName, A::kName, K, N, P::name().c_str(), ref.kept.size(),
        ref.num_selected, c.selected_gpu, c.ambiguous, c.ambiguous_flipped, c.mismatches, worst);
    CHECK(c.mismatches == 0);
    CHECK(s_bad == 0);
    // The band is a worst-case rounding bound, so it must stay a modest share of N. INT4 policies may
    // sum each step in fp16: that bound (4 x 2^-11 of sum |x q|, prox_ref::int4_step_rounding) is ~20x
    // the fp32 one, and at s2 = 70 % up to a fifth of the channels lie in it. Every channel is still
    // checked against its bound (s_bad), which an indexing or decode error would exceed by far.
    CHECK(c.ambiguous <= (kInt4 ? std::max(4, N / 4) : std::max(4, N / 20)));
    const auto cnt = dcnt.download()[0];
    CHECK(cnt.calls == 2u);
    CHECK(cnt.kept_inputs == 2u * ref.kept.size());
    CHECK(cnt.selected_channels == 2u * static_cast<unsigned long long>(c.selected_gpu));
  });
}

template <class T, class Fmt, class A, class List>
void proxy_suite(int K, int N, std::uint64_t seed, bool boundary) {
  const auto L = make_host_layer<T>(K, N, seed);
  const DeviceLayer<T> D(L);
  const auto x = normal_vector<T>(K, seed + 77, 1.0);
  const auto dxv = prox_ref::to_double(x);
  const float tau_x = quantile_abs(dxv, 0.55);
  // tau_s at 70 % channel sparsity of this token's own s~.
  const auto probe = std::is_same_v<Fmt, prox::Int4Weights>
                         ? prox_ref::stage1_int4(dxv, K, N, tau_x, 0.0f, L.qg, L.sg, L.qu, L.su, ref_act<A>())
                         : prox_ref::stage1_dense(dxv, K, N, tau_x, 0.0f, L.dwg_t, L.dwu_t, ref_act<A>());
  const float tau_s = quantile_abs(values_of(probe.s), 0.70);
  proxy_case<T, Fmt, A, List>(L, D, x, tau_x, tau_s, "mid");
  if (boundary) {
    proxy_case<T, Fmt, A, List>(L, D, x, 0.0f, 0.0f, "all");       // every input, every channel
    proxy_case<T, Fmt, A, List>(L, D, x, kInf, 0.0f, "noinput");   // no input kept: s~ = 0, |0| >= 0 keeps all
    proxy_case<T, Fmt, A, List>(L, D, x, tau_x, kInf, "none");     // no channel selected
  }
}

}  // namespace

TEMPLATE_TEST_CASE("proxy GEMV (INT4): channel set and s~ match the reference", "[stage1][gpu]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  proxy_suite<T, prox::Int4Weights, prox::SiLU, prox::ProxyGemvPolicies>(200, 96, 1, true);
  proxy_suite<T, prox::Int4Weights, prox::GeluTanh, prox::ProxyGemvPolicies>(136, 224, 2, true);
  proxy_suite<T, prox::Int4Weights, prox::SiLU, prox::ProxyGemvPolicies>(1000, 2016, 3, false);
  proxy_suite<T, prox::Int4Weights, prox::SiLU, prox::ProxyGemvPolicies>(2048, 6144, 4, true);    // Qwen3-1.7B
  proxy_suite<T, prox::Int4Weights, prox::GeluTanh, prox::ProxyGemvPolicies>(4096, 12288, 5, false);  // Qwen3-8B
  // 19 split-K chunks with the 256-input policy: the last block's partial loads run in batches of
  // 8 splits (TileReducer::split_k), here 8 + 8 + a partial batch of 3.
  proxy_suite<T, prox::Int4Weights, prox::SiLU, prox::ProxyGemvPolicies>(4700, 544, 6, false);
}

TEMPLATE_TEST_CASE("proxy GEMV (fp16/bf16 proxies, A1): channel set and s~ match the reference", "[stage1][gpu]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  proxy_suite<T, prox::DenseWeights<T>, prox::SiLU, prox::DenseProxyGemvPolicies>(200, 96, 11, true);
  proxy_suite<T, prox::DenseWeights<T>, prox::GeluTanh, prox::DenseProxyGemvPolicies>(520, 1056, 12, false);
  proxy_suite<T, prox::DenseWeights<T>, prox::SiLU, prox::DenseProxyGemvPolicies>(2048, 6144, 13, false);
}

TEST_CASE("proxy GEMV: NaN and Inf activations never cause out-of-bounds accesses", "[stage1][gpu]") {
  const int K = 264, N = 128;
  const auto L = make_host_layer<__half>(K, N, 21);
  const DeviceLayer<__half> D(L);
  auto x = normal_vector<__half>(K, 22, 1.0);
  for (int k = 0; k < K; k += 7) x[k] = __float2half(std::numeric_limits<float>::quiet_NaN());
  for (int k = 3; k < K; k += 11) x[k] = __float2half(k % 2 ? kInf : -kInf);
  DeviceBuffer<__half> dx(x);
  DeviceBuffer<std::uint32_t> dmask(N / 32);
  DeviceBuffer<prox::SparsityCounters> dcnt(1);
  PROX_TEST_CUDA(cudaMemset(dcnt.get(), 0, sizeof(prox::SparsityCounters)));
  dmask.poison(0xAB);
  prox::ProxyGemvArgs<__half> a;
  a.x = dx.get();
  a.d_model = K;
  a.d_ff = N;
  a.tau_x = 0.5f;
  a.tau_s = 0.01f;
  set_proxy_weights(a, D);
  a.channel_mask = dmask.get();
  a.counters = dcnt.get();
  using Op = prox::ProxyGemvOp<__half, prox::SiLU>;
  const auto ws = op_workspace<Op>(a);
  REQUIRE(run_op<Op>(a, 0, ws) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  // Every mask word was written, and the kept count excludes NaN (never kept) but includes +-inf.
  for (std::uint32_t w : dmask.download()) CHECK(w != 0xABABABABu);
  const auto kept = prox_ref::kept_inputs(prox_ref::to_double(x), 0.5f);
  CHECK(dcnt.download()[0].kept_inputs == kept.size());
}

// The split-K combine through a thread-block cluster (sm_90+, ProxyGemvOp::Options::cluster, 2..8 chunks)
// must reproduce the global combine bit for bit, and leave the workspace (tile counters, partials)
// untouched. Shapes give 1 chunk, 2..8 chunks and > 8 chunks for the policies (chunks of 512, 1024,
// 256 inputs): 200 -> 1/1/1, 1003 -> 2/1/4, 4093 -> 8/4/16, 9000 -> 18/9/36; partial last tiles
// (2016 = 7 x 256 + 224, 1056 = 4 x 256 + 32) leave some cluster ranks without channels.
TEMPLATE_TEST_CASE("proxy GEMV: the cluster split-K combine is bit-identical to the global one",
                   "[stage1][cluster][gpu]", __half, __nv_bfloat16) {
  using T = TestType;
  using A = prox::SiLU;
  int dev = 0;
  int has_clusters = 0;
  PROX_TEST_CUDA(cudaGetDevice(&dev));
  PROX_TEST_CUDA(cudaDeviceGetAttribute(&has_clusters, cudaDevAttrClusterLaunch, dev));
  struct Shape {
    int K, N;
  };
  for (const Shape sh : {Shape{200, 96}, Shape{1003, 2016}, Shape{4093, 1056}, Shape{9000, 544}}) {
    const int K = sh.K, N = sh.N;
    const std::uint64_t seed = 40 + static_cast<std::uint64_t>(K);
    // INT4 proxies straight from random nn.Linear weights (no reference needed: the two paths are
    // compared with each other).
    const double sigma = 1.0 / std::sqrt(static_cast<double>(K));
    const auto wg = normal_vector<T>(static_cast<std::size_t>(N) * K, seed * 4 + 1, sigma);
    const auto wu = normal_vector<T>(static_cast<std::size_t>(N) * K, seed * 4 + 2, sigma);
    std::vector<std::uint32_t> qg(prox::int4::packed_words(K, N)), qu(prox::int4::packed_words(K, N));
    std::vector<float> sg(N), su(N);
    PROX_TEST_OK(prox::int4::pack_host(wg.data(), K, N, qg.data(), sg.data()));
    PROX_TEST_OK(prox::int4::pack_host(wu.data(), K, N, qu.data(), su.data()));
    const auto x = normal_vector<T>(K, seed + 3, 1.0);
    DeviceBuffer<T> dx(x);
    DeviceBuffer<std::uint32_t> dqg(qg), dqu(qu), dmask(N / 32);
    DeviceBuffer<float> dsg(sg), dsu(su), ds(N);
    DeviceBuffer<prox::SparsityCounters> dcnt(1);

    using Op = prox::ProxyGemvOp<T, A>;
    prox::ProxyGemvArgs<T> a;
    a.x = dx.get();
    a.d_model = K;
    a.d_ff = N;
    a.tau_x = quantile_abs(prox_ref::to_double(x), 0.5);
    a.gate = {dqg.get(), dsg.get()};
    a.up = {dqu.get(), dsu.get()};
    a.channel_mask = dmask.get();
    a.counters = dcnt.get();

    prox::for_each_policy<prox::ProxyGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      const int chunks = Op::template num_chunks<P>(K);
      cudaFuncAttributes fa{};
      PROX_TEST_CUDA(cudaFuncGetAttributes(&fa, prox::proxy_gemv_kernel<P, T, A, prox::Int4Weights>));
      // The cluster combine runs (and must leave the whole workspace untouched) where the launcher
      // forms clusters and the device code is sm_90+.
      const bool expect_cluster = has_clusters != 0 && fa.binaryVersion >= 90 && chunks >= 2 &&
                                  chunks <= prox::detail::kMaxClusterSplits;
      auto ws = op_workspace<Op>(a);
      const std::size_t sync_end = prox::detail::kHeaderBytes + Op::workspace_needs(a).sync;

      struct Out {
        std::vector<std::uint32_t> mask;
        std::vector<float> s;
        prox::SparsityCounters cnt;
      };
      const auto run = [&](prox::ProxyGemvArgs<T> args, bool cluster, bool spread = true) {
        PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
        PROX_TEST_CUDA(cudaMemset(dcnt.get(), 0, sizeof(prox::SparsityCounters)));
        dmask.poison(0xAB);
        ds.poison();  // NaN
        typename Op::Options o;
        o.pdl = false;
        o.cluster = cluster;
        o.spread = spread;
        REQUIRE(run_op<Op>(args, pi, ws, 1, o) == prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        const auto w = ws.download();
        std::size_t nonzero_counters = 0, nonzero_ws = 0;
        for (std::size_t i = prox::detail::kHeaderBytes; i < w.size(); ++i) {
          nonzero_counters += i < sync_end && w[i] != 0;
          nonzero_ws += w[i] != 0;
        }
        CHECK(nonzero_counters == 0u);  // tile counters left zero by either path
        if (cluster && expect_cluster) CHECK(nonzero_ws == 0u);  // no partials either: the DSMEM path ran
        prox::Status ws_status = prox::Status::kSuccess;
        PROX_TEST_OK(prox::read_workspace_status(ws.get(), nullptr, &ws_status));
        CHECK(ws_status == prox::Status::kSuccess);
        return Out{dmask.download(), ds.download(), dcnt.download()[0]};
      };

      // tau_s at ~70 % channel sparsity of this token's s~ (from a values-mode run with tau_s = 0).
      prox::ProxyGemvArgs<T> probe = a;
      probe.tau_s = 0.0f;
      probe.s_proxy = ds.get();
      const auto s0 = run(probe, false).s;
      const float tau70 = quantile_abs(std::vector<double>(s0.begin(), s0.end()), 0.70);

      for (const float tau_s : {tau70, 0.0f}) {
        for (const bool values : {true, false}) {
          CAPTURE(K, N, pi, P::name(), chunks, expect_cluster, tau_s, values, prox::DTypeTraits<T>::kName);
          prox::ProxyGemvArgs<T> b = a;
          b.tau_s = tau_s;
          b.s_proxy = values ? ds.get() : nullptr;
          const Out g = run(b, false);
          const Out c = run(b, true);
          const Out n = run(b, false, false);  // not spread (Options::spread): the same bits
          REQUIRE(g.mask.size() == c.mask.size());
          CHECK(std::memcmp(g.mask.data(), c.mask.data(), g.mask.size() * sizeof(std::uint32_t)) == 0);
          CHECK(std::memcmp(g.mask.data(), n.mask.data(), g.mask.size() * sizeof(std::uint32_t)) == 0);
          if (values) CHECK(std::memcmp(g.s.data(), n.s.data(), g.s.size() * sizeof(float)) == 0);
          int unwritten = 0;  // every mask word and (values mode) every s~ written, not poison
          for (std::uint32_t w : c.mask) unwritten += w == 0xABABABABu;
          if (values) {
            CHECK(std::memcmp(g.s.data(), c.s.data(), g.s.size() * sizeof(float)) == 0);
            for (float v : c.s) unwritten += bits32(v) == 0xFFFFFFFFu;
          }
          CHECK(unwritten == 0);
          CHECK(g.cnt.calls == 1u);
          CHECK(c.cnt.calls == 1u);
          CHECK(g.cnt.kept_inputs == c.cnt.kept_inputs);
          CHECK(g.cnt.selected_channels == c.cnt.selected_channels);
        }
      }
      // These grids are far smaller than the GPU: the plan spreads them with shared memory.
      prox::Operator<Op> planned;
      REQUIRE(planned.initialize(a, {}, pi) == prox::Status::kSuccess);
      const std::size_t spread_bytes = planned.launch_config().smem;
      int sms = 0;
      PROX_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
      if (Op::template num_blocks<P>(K, N) <= sms) CHECK(spread_bytes > 0u);
      std::printf("[cluster] %-5s K=%-5d N=%-5d %-26s chunks=%-2d combine=%s spread=%zu B\n",
                  prox::DTypeTraits<T>::kName, K, N, P::name().c_str(), chunks, expect_cluster ? "cluster" : "global",
                  spread_bytes);
    });
  }
}

// ======================================================================== Stage 2: GLU
namespace {
template <class T, class A>
void glu_suite(int K, int N, std::uint64_t seed) {
  const Stage2Case<T> c2(K, N, seed);
  DeviceBuffer<float> ds(N);
  const prox_ref::Act act = ref_act<A>();
  c2.each_density({0.3, 0.0, 1.0}, act, [&](double density, const auto& sel, const auto& ref, const auto& dmask) {
    prox::for_each_policy<prox::GluGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      CAPTURE(K, N, density, pi, P::name(), A::kName, prox::DTypeTraits<T>::kName);
      ds.poison();
      prox::GluGemvArgs<T> a;
      a.x = c2.dx.get();
      a.d_model = K;
      a.d_ff = N;
      a.w_gate = c2.D.wg.get();
      a.w_up = c2.D.wu.get();
      a.channel_mask = dmask.get();
      a.s = ds.get();
      DeviceBuffer<char> no_ws;
      REQUIRE(run_op<prox::GluGemvOp<T, A>>(a, pi, no_ws) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const SCompare c = compare_s(ds.download(), sel, ref.s);
      std::printf("[glu]    %-5s %-9s K=%-5d N=%-5d %-18s density=%.1f err/bound=%.3f bad=%d\n",
                  prox::DTypeTraits<T>::kName, A::kName, K, N, P::name().c_str(), density, c.worst, c.bad);
      CHECK(c.bad == 0);
      CHECK(c.untouched_bad == 0);  // unselected channels are written as +0
    });
  });
}
}  // namespace

TEMPLATE_TEST_CASE("masked GLU GEMV: exact s on selected channels, +0 elsewhere", "[stage2][glu][gpu]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  glu_suite<T, prox::SiLU>(200, 96, 31);
  glu_suite<T, prox::GeluTanh>(8, 32, 32);
  glu_suite<T, prox::GeluTanh>(1000, 2016, 33);
  glu_suite<T, prox::SiLU>(4096, 12288, 34);  // Qwen3-8B
}

// ======================================================================== Stage 2: down
namespace {
template <class T>
void down_suite(int K, int N, std::uint64_t seed) {
  const auto L = make_host_layer<T>(K, N, seed);
  const DeviceLayer<T> D(L);
  FastNormal g(seed + 3);
  std::vector<float> s(N);
  for (auto& v : s) v = static_cast<float>(g());
  DeviceBuffer<float> dsv(s);
  DeviceBuffer<T> dy(K);
  for (double density : {0.23, 0.0, 1.0}) {
    const auto sel = random_flags(N, density, seed + 4);
    const std::vector<prox_ref::Bounded> ref = prox_ref::down_gemv(s, L.dwdt, K, N, sel);
    DeviceBuffer<std::uint32_t> dmask(flags_to_mask(sel));
    prox::for_each_policy<prox::DownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      CAPTURE(K, N, density, pi, P::name(), prox::DTypeTraits<T>::kName);
      dy.poison();
      prox::DownGemvArgs<T> a;
      a.s = dsv.get();
      a.channel_mask = dmask.get();
      a.w_down_t = D.wdt.get();
      a.d_model = K;
      a.d_ff = N;
      a.y = dy.get();
      const auto ws = op_workspace<prox::DownGemvOp<T>>(a);
      REQUIRE(run_op<prox::DownGemvOp<T>>(a, pi, ws, 2) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      double worst = 0.0;
      const int bad = count_out_of_bound(dy.download(), ref, &worst);
      std::printf("[down]   %-5s K=%-5d N=%-5d %-22s density=%.2f err/bound=%.3f bad=%d\n",
                  prox::DTypeTraits<T>::kName, K, N, P::name().c_str(), density, worst, bad);
      CHECK(bad == 0);
    });
  }
}
}  // namespace

TEMPLATE_TEST_CASE("sparse down GEMV: y from the selected rows only, every element written", "[stage2][down][gpu]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  down_suite<T>(200, 96, 41);
  down_suite<T>(8, 32, 42);
  down_suite<T>(1000, 2016, 43);
  down_suite<T>(4096, 12288, 44);  // Qwen3-8B
  down_suite<T>(64, 17408, 45);    // 34 split-K chunks of 512: partial loads in batches of 32 + 2
}

// ======================================================================== bad input
TEST_CASE("ops reject bad input with a Status before launching", "[status][gpu]") {
  const int K = 64, N = 64;
  DeviceBuffer<__half> x(K + 8), w(static_cast<std::size_t>(K) * N + 8), y(K + 8);
  DeviceBuffer<std::uint32_t> q(prox::int4::packed_words(K, N) + 4), mask(N / 32);
  DeviceBuffer<float> sc(N), s(N);
  DeviceBuffer<char> ws(1 << 20);
  PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  PROX_TEST_CUDA(cudaGetLastError());
  mask.poison(0x5A);
  y.poison(0x5A);
  // initialize() (plan time) and run() (per call) both validate before anything is launched.
  const auto plan_and_run = [&](auto op_tag, const auto& args, std::size_t wsb = 1 << 20, char* wsp = nullptr) {
    using Op = decltype(op_tag);
    prox::Operator<Op> op;
    const prox::Status planned = op.initialize(args);
    const prox::Status ran = op.run(args, wsp != nullptr ? wsp : ws.get(), wsb, nullptr);
    if (planned != prox::Status::kSuccess) CHECK(ran == prox::Status::kErrorNotPlanned);
    return planned != prox::Status::kSuccess ? planned : ran;
  };

  using ProxyOp = prox::ProxyGemvOp<__half, prox::SiLU>;
  prox::ProxyGemvArgs<__half> pa;
  pa.x = x.get();
  pa.d_model = K;
  pa.d_ff = N;
  pa.tau_x = 0.1f;
  pa.tau_s = 0.1f;
  pa.gate = {q.get(), sc.get()};
  pa.up = {q.get(), sc.get()};
  pa.channel_mask = mask.get();
  const auto proxy = [&](prox::ProxyGemvArgs<__half> a, std::size_t wsb = 1 << 20, char* wsp = nullptr) {
    return plan_and_run(ProxyOp{}, a, wsb, wsp);
  };
  auto a = pa;
  a.x = nullptr;
  CHECK(proxy(a) == prox::Status::kErrorNullPointer);
  a = pa;
  a.up.scales = nullptr;
  CHECK(proxy(a) == prox::Status::kErrorNullPointer);
  a = pa;
  a.channel_mask = nullptr;
  CHECK(proxy(a) == prox::Status::kErrorNullPointer);
  a = pa;
  a.gate.packed = q.get() + 1;
  CHECK(proxy(a) == prox::Status::kErrorMisalignedPointer);
  a = pa;
  a.thresholds = reinterpret_cast<const float*>(reinterpret_cast<const char*>(sc.get()) + 2);
  CHECK(proxy(a) == prox::Status::kErrorMisalignedPointer);
  a = pa;
  a.d_ff = 48;
  CHECK(proxy(a) == prox::Status::kErrorInvalidShape);
  a = pa;
  a.d_ff = 0;
  CHECK(proxy(a) == prox::Status::kErrorInvalidShape);
  a = pa;
  a.d_model = 0;
  CHECK(proxy(a) == prox::Status::kErrorInvalidShape);
  a = pa;
  a.tau_x = nan;
  CHECK(proxy(a) == prox::Status::kErrorInvalidThreshold);
  a = pa;
  a.tau_s = -1.0f;
  CHECK(proxy(a) == prox::Status::kErrorInvalidThreshold);
  CHECK(proxy(pa, prox::Operator<ProxyOp>::workspace_bytes(pa) - 1) == prox::Status::kErrorWorkspaceTooSmall);
  CHECK(proxy(pa, 1 << 20, nullptr) == prox::Status::kSuccess);  // the good arguments launch (once)
  mask.poison(0x5A);
  {
    prox::Operator<ProxyOp> op;
    REQUIRE(op.initialize(pa) == prox::Status::kSuccess);
    CHECK(op.run(pa, nullptr, 1 << 20, nullptr) == prox::Status::kErrorNullPointer);
    CHECK(op.run(pa, ws.get() + 4, 1 << 19, nullptr) == prox::Status::kErrorMisalignedPointer);
    auto other = pa;
    other.d_model = K - 8;  // valid, but not the planned shape
    CHECK(op.run(other, ws.get(), 1 << 20, nullptr) == prox::Status::kErrorInvalidArgument);
    CHECK(prox::Operator<ProxyOp>().initialize(pa, {}, prox::ProxyGemvPolicies::kSize) ==
          prox::Status::kErrorInvalidArgument);  // no such policy
  }

  using GluOp = prox::GluGemvOp<__half, prox::SiLU>;
  prox::GluGemvArgs<__half> ga;
  ga.x = x.get();
  ga.d_model = K;
  ga.d_ff = N;
  ga.w_gate = w.get();
  ga.w_up = w.get();
  ga.channel_mask = mask.get();
  ga.s = s.get();
  auto g2 = ga;
  g2.x = x.get() + 1;
  CHECK(plan_and_run(GluOp{}, g2) == prox::Status::kErrorMisalignedPointer);
  g2 = ga;
  g2.d_model = 12;
  CHECK(plan_and_run(GluOp{}, g2) == prox::Status::kErrorInvalidShape);
  g2 = ga;
  g2.s = nullptr;
  CHECK(plan_and_run(GluOp{}, g2) == prox::Status::kErrorNullPointer);
  {
    prox::Operator<GluOp> op;
    GluOp::Options o;
    o.grid_blocks = -1;
    CHECK(op.initialize(ga, o) == prox::Status::kErrorInvalidArgument);
  }

  using DownOp = prox::DownGemvOp<__half>;
  prox::DownGemvArgs<__half> da;
  da.s = s.get();
  da.channel_mask = mask.get();
  da.w_down_t = w.get();
  da.d_model = K;
  da.d_ff = N;
  da.y = y.get();
  auto d2 = da;
  d2.w_down_t = w.get() + 4;
  CHECK(plan_and_run(DownOp{}, d2) == prox::Status::kErrorMisalignedPointer);
  d2 = da;
  d2.d_ff = 33;
  CHECK(plan_and_run(DownOp{}, d2) == prox::Status::kErrorInvalidShape);
  CHECK(plan_and_run(DownOp{}, da, 8) == prox::Status::kErrorWorkspaceTooSmall);

  using FusedOp = prox::GluDownGemvOp<__half, prox::SiLU>;
  prox::GluDownGemvArgs<__half> fa;
  static_cast<prox::GluGemvArgs<__half>&>(fa) = ga;
  fa.w_down_t = w.get();
  fa.y = reinterpret_cast<__half*>(reinterpret_cast<char*>(y.get()) + 1);  // not element-aligned
  CHECK(plan_and_run(FusedOp{}, fa) == prox::Status::kErrorMisalignedPointer);
  fa.y = y.get();
  {
    prox::Operator<FusedOp> op;
    FusedOp::Options o;
    o.grid_blocks = 1 << 20;  // more blocks than can be resident
    CHECK(op.initialize(fa, o) == prox::Status::kErrorInvalidArgument);
  }
  CHECK(plan_and_run(FusedOp{}, fa, 64) == prox::Status::kErrorWorkspaceTooSmall);

  using ThrOp = prox::ThresholdOp<__half>;
  prox::ThresholdArgs<__half> ta;
  ta.x = x.get();
  ta.n = K;
  ta.tau = nan;
  ta.mask = mask.get();
  CHECK(plan_and_run(ThrOp{}, ta) == prox::Status::kErrorInvalidThreshold);
  ta.tau = 0.5f;
  ta.n = 0;
  CHECK(plan_and_run(ThrOp{}, ta) == prox::Status::kErrorInvalidShape);
  ta.n = K;
  ta.indices = reinterpret_cast<int*>(s.get());
  CHECK(plan_and_run(ThrOp{}, ta) == prox::Status::kErrorNullPointer);  // count missing

  // Nothing else was launched: outputs keep their poison and no error is pending.
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  CHECK(cudaGetLastError() == cudaSuccess);
  for (std::uint32_t v : mask.download()) CHECK(v == 0x5A5A5A5Au);
  for (__half v : y.download()) CHECK(bits16(v) == 0x5A5Au);
}
