// SPDX-License-Identifier: Apache-2.0
//! @file test_batched.cu  Batched decode (SparseFfn::run_batch, batched.cuh) on the GPU: every token of a
//! batch against its own batch-1 run and the float64 reference (channel set exact but for channels within
//! rounding of tau_s; y within the reference bound on the device's channel set), per-token and union
//! counters, every element written and nothing past the batch, boundary densities, determinism, graph
//! replay, a dirty workspace, and bad input.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <prox/prox.cuh>

#include "ffn_instances.hpp"
#include "gpu_fixture.hpp"
#include "op_test.hpp"

using namespace prox_test;

namespace {

//! A layer planned for batches of up to kMax tokens, with token-major buffers of kMax tokens.
template <class T, class A>
struct BatchRig {
  using Ffn = prox::SparseFfn<T, A>;
  static constexpr int kMax = prox::kMaxBatchTokens;
  BatchRig(int K, int N, std::uint64_t seed)
      : L(make_host_layer<T>(K, N, seed)),
        D(L),
        x(static_cast<std::size_t>(kMax) * K),
        y(static_cast<std::size_t>(kMax) * K),
        x1(K),
        y1(K),
        mask(static_cast<std::size_t>(kMax) * (N / 32)),
        mask1(N / 32),
        s(static_cast<std::size_t>(kMax) * N),
        cnt(kMax + 1) {
    // Every byte defined from the start: tests download whole kMax-token buffers after shorter batches
    // (initcheck), and batch-1 runs accumulate into the counters.
    for (auto* b : {&y, &y1}) b->poison();
    mask.poison();
    mask1.poison();
    s.poison();
    x.upload(std::vector<T>(x.size(), prox::from_float<T>(0.0f)));
    PROX_TEST_CUDA(cudaMemset(cnt.get(), 0, cnt.bytes()));
  }

  //! fuse: Stage 2 of 2..4 tokens as the fused batched kernel (PlanOptions::fuse_batch_stage2).
  void plan(float tau_x, float tau_s, int max_tokens = kMax, bool fuse = false) {
    typename Ffn::Config c{L.K, L.N, tau_x, tau_s};
    c.max_tokens = max_tokens;
    typename Ffn::PlanOptions po;
    po.fuse_batch_stage2 = fuse;
    PROX_TEST_OK(ffn.plan(c, ffn_weights<A>(D), po));
    REQUIRE(ffn.template fused_batch<2>() == fuse);
    REQUIRE(!ffn.template fused_batch<8>());
    REQUIRE(ffn.workspace_bytes() == Ffn::workspace_bytes(L.K, L.N, max_tokens));
    REQUIRE(ffn.workspace_bytes() >= Ffn::workspace_bytes(L.K, L.N));
    ws = DeviceBuffer<char>(ffn.workspace_bytes());
    PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
  }

  prox::Status run(int tokens, cudaStream_t stream = nullptr) {
    typename Ffn::BatchOutputs out;
    out.channel_mask = mask.get();
    out.s = s.get();
    out.counters = cnt.get();
    return ffn.run_batch(x.get(), y.get(), tokens, ws.get(), ws.bytes(), stream, out);
  }

  //! y's bits and the masks of a batch (x already uploaded).
  std::vector<std::uint32_t> run_bits(int tokens) {
    y.poison();
    REQUIRE(run(tokens) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    std::vector<std::uint32_t> out;
    for (T v : y.download()) out.push_back(bits16(v));
    for (std::uint32_t w : mask.download()) out.push_back(w);
    return out;
  }

  HostLayer<T> L;
  DeviceLayer<T> D;
  DeviceBuffer<T> x, y, x1, y1;  // x1, y1: one token (batch-1 runs)
  DeviceBuffer<std::uint32_t> mask, mask1;
  DeviceBuffer<float> s;
  DeviceBuffer<prox::SparsityCounters> cnt;
  DeviceBuffer<char> ws;
  Ffn ffn;
};

//! Tokens of a batch: independent normals, or (correlated) a shared component plus per-token noise.
template <class T>
std::vector<T> make_tokens(int K, int tokens, std::uint64_t seed, bool correlated) {
  std::vector<T> xs(static_cast<std::size_t>(BatchRig<T, prox::SiLU>::kMax) * K, prox::from_float<T>(0.0f));
  const auto shared = normal_vector<T>(K, seed, 1.0);
  for (int b = 0; b < tokens; ++b) {
    const auto own = normal_vector<T>(K, seed + 1 + b, 1.0);
    for (int k = 0; k < K; ++k) {
      const float v = correlated ? 0.8f * prox::to_float(shared[k]) + 0.6f * prox::to_float(own[k])
                                 : prox::to_float(own[k]);
      xs[static_cast<std::size_t>(b) * K + k] = prox::from_float<T>(v);
    }
  }
  return xs;
}

struct BatchStats {
  int flipped_vs_single = 0;  //!< channels the batch decided differently from batch 1 (all ambiguous)
  int ambiguous = 0;
};

//! Run `tokens` tokens of `xs` as one batch and check each against the reference and its batch-1 run.
template <class T, class A>
BatchStats check_batch(BatchRig<T, A>& r, const std::vector<T>& xs, int tokens, const char* label) {
  const int K = r.L.K, N = r.L.N, W = N / 32;
  const auto& cfg = r.ffn.config();
  r.x.upload(xs);
  r.y.poison();
  r.mask.poison();
  r.s.poison();
  PROX_TEST_CUDA(cudaMemset(r.cnt.get(), 0, sizeof(prox::SparsityCounters) * (BatchRig<T, A>::kMax + 1)));
  REQUIRE(r.run(tokens) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto y = r.y.download();
  const auto mask = r.mask.download();
  const auto s = r.s.download();
  const auto cnt = r.cnt.download();
  BatchStats st;
  std::vector<std::uint8_t> kept_union(K, 0);
  std::vector<std::uint32_t> sel_union(W, 0u);
  double worst_all = 0.0;
  for (int b = 0; b < tokens; ++b) {
    CAPTURE(label, K, N, tokens, b);
    const std::vector<T> xt(xs.begin() + static_cast<std::ptrdiff_t>(b) * K,
                            xs.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
    const auto dxv = prox_ref::to_double(xt);
    const auto st1 =
        prox_ref::stage1_int4(dxv, K, N, cfg.tau_x, cfg.tau_s, r.L.qg, r.L.sg, r.L.qu, r.L.su, ref_act<A>());
    const std::vector<std::uint32_t> mb(mask.begin() + static_cast<std::ptrdiff_t>(b) * W,
                                        mask.begin() + static_cast<std::ptrdiff_t>(b + 1) * W);
    const MaskCompare c = compare_mask(mb, st1);
    CHECK(c.mismatches == 0);
    st.ambiguous += c.ambiguous;
    // Stage 2 on the token's own channel set: s (zero off the set) and y within the reference bound.
    const auto flags = mask_to_flags(mb, N);
    const auto st2 = prox_ref::stage2(dxv, r.L.dwg, r.L.dwu, r.L.dwdt, K, N, flags, ref_act<A>());
    const std::vector<float> sb(s.begin() + static_cast<std::ptrdiff_t>(b) * N,
                                s.begin() + static_cast<std::ptrdiff_t>(b + 1) * N);
    const SCompare sc = compare_s(sb, flags, st2.s);
    CHECK(sc.bad == 0);
    CHECK(sc.untouched_bad == 0);
    const std::vector<T> yb(y.begin() + static_cast<std::ptrdiff_t>(b) * K,
                            y.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
    double worst = 0.0;
    CHECK(count_out_of_bound(yb, st2.y, &worst) == 0);
    worst_all = std::max(worst_all, worst);
    // The token alone (batch 1): the same channel set but for ambiguous channels.
    r.x1.upload(xt);
    typename BatchRig<T, A>::Ffn::Outputs o1;
    o1.channel_mask = r.mask1.get();
    REQUIRE(r.ffn.run(r.x1.get(), r.y1.get(), r.ws.get(), r.ws.bytes(), nullptr, o1) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    const auto m1 = r.mask1.download();
    for (int j = 0; j < N; ++j) {
      if (mask_bit(m1, j) != mask_bit(mb, j)) {
        ++st.flipped_vs_single;
        CHECK(st1.ambiguous[j]);
      }
    }
    // Counters: the token's own.
    CHECK(cnt[b].calls == 1u);
    CHECK(cnt[b].kept_inputs == st1.kept.size());
    CHECK(cnt[b].selected_channels == static_cast<unsigned long long>(c.selected_gpu));
    for (int k : st1.kept) kept_union[k] = 1;
    for (int w = 0; w < W; ++w) sel_union[w] |= mb[w];
  }
  // Nothing past the batch is written.
  for (std::size_t i = static_cast<std::size_t>(tokens) * K; i < y.size(); ++i) REQUIRE(bits16(y[i]) == 0xFFFFu);
  // The union's counters (tokens >= 2; a single token runs the batch-1 kernels).
  if (tokens >= 2) {
    unsigned long long kept = 0, sel = 0;
    for (auto f : kept_union) kept += f;
    for (auto w : sel_union) sel += static_cast<unsigned long long>(__builtin_popcount(w));
    CHECK(cnt[tokens].calls == 1u);
    CHECK(cnt[tokens].kept_inputs == kept);
    CHECK(cnt[tokens].selected_channels == sel);
  }
  std::printf("[batch]  %-10s %-5s %-9s K=%-5d N=%-5d B=%d ambiguous=%d flipped_vs_b1=%d y_err/bound=%.3f\n", label,
              prox::DTypeTraits<T>::kName, A::kName, K, N, tokens, st.ambiguous, st.flipped_vs_single, worst_all);
  return st;
}

//! fuse: Stage 2 of 2..4 tokens as the fused batched kernel, or the GLU and down kernels (the default).
template <class T, class A>
void batch_shape(int K, int N, std::uint64_t seed, std::initializer_list<int> token_counts, bool boundaries,
                 bool fuse = false) {
  BatchRig<T, A> r(K, N, seed);
  const auto x0 = normal_vector<T>(K, seed + 100, 1.0);
  // e = 60 %: (s1, s2) = (55 %, 70 %) on one token, as test_ffn.cu.
  const auto dx0 = prox_ref::to_double(x0);
  const float tau_x = quantile_abs(dx0, 0.55);
  const auto probe = prox_ref::stage1_int4(dx0, K, N, tau_x, 0.0f, r.L.qg, r.L.sg, r.L.qu, r.L.su, ref_act<A>());
  const float tau_s = quantile_abs(values_of(probe.s), 0.70);
  r.plan(tau_x, tau_s, BatchRig<T, A>::kMax, fuse);
  for (int tokens : token_counts) {
    check_batch(r, make_tokens<T>(K, tokens, seed + 10 * tokens, false), tokens, "independent");
    check_batch(r, make_tokens<T>(K, tokens, seed + 10 * tokens + 5, true), tokens, "correlated");
  }
  if (boundaries) {
    const auto xs = make_tokens<T>(K, 5, seed + 77, false);
    r.plan(0.0f, 0.0f, BatchRig<T, A>::kMax, fuse);  // everything kept: the dense FFN
    check_batch(r, xs, 5, "dense");
    r.plan(tau_x, prox_test::kInf, BatchRig<T, A>::kMax, fuse);  // no channel: y = 0
    check_batch(r, xs, 3, "empty");
    for (T v : r.y.download()) {
      const std::uint16_t b = bits16(v);
      CHECK((b == 0u || b == 0xFFFFu));
    }
    r.plan(prox_test::kInf, 0.0f, BatchRig<T, A>::kMax, fuse);  // no input: s~ = 0, |0| >= 0 keeps every channel
    check_batch(r, xs, 2, "noinput");
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Batched FFN: each token as its batch-1 run, small and odd shapes, both activations",
                   "[batched][gpu]", __half, __nv_bfloat16) {
  using T = TestType;
  batch_shape<T, prox::SiLU>(200, 96, 1, {2, 3, 8}, true);
  batch_shape<T, prox::GeluTanh>(8, 32, 2, {2, 5}, true);
  batch_shape<T, prox::GeluTanh>(136, 224, 3, {4, 7}, false);
  batch_shape<T, prox::SiLU>(1000, 2016, 4, {2, 4, 6, 8}, false);
  batch_shape<T, prox::GeluTanh>(2520, 608, 8, {3, 8}, false);
  // Stage 2 of 2..4 tokens as the fused batched kernel (PlanOptions::fuse_batch_stage2).
  batch_shape<T, prox::SiLU>(200, 96, 1, {2, 3}, true, true);
  batch_shape<T, prox::GeluTanh>(1000, 2016, 4, {2, 4}, false, true);
  batch_shape<T, prox::SiLU>(2560, 1056, 9, {3, 4}, false, true);  // 2560 inputs: the 320-thread candidates
}

TEMPLATE_TEST_CASE("Batched FFN: Qwen3-1.7B shape", "[batched][gpu][large]", __half, __nv_bfloat16) {
  using T = TestType;
  batch_shape<T, prox::SiLU>(2048, 6144, 5, {2, 4, 8}, false);
}

TEMPLATE_TEST_CASE("Batched Stage 1: x aligned only to its element gives the bits of an aligned x", "[batched][gpu]",
                   __half, __nv_bfloat16) {
  // The kernel loads each thread's run of x with one vector load per token where x is aligned to the run,
  // and element by element where it is not; both must give the same masks and s~.
  using T = TestType;
  using Op = prox::BatchedProxyGemvOp<T, prox::SiLU, 4>;
  constexpr int K = 1000, N = 2016, kTokens = 3;
  BatchRig<T, prox::SiLU> r(K, N, 31);
  const auto xs = make_tokens<T>(K, kTokens, 32, false);
  r.x.upload(xs);  // cudaMalloc: aligned to every run
  std::vector<T> shifted(static_cast<std::size_t>(kTokens) * K + 8, prox::from_float<T>(0.0f));
  std::copy(xs.begin(), xs.begin() + static_cast<std::ptrdiff_t>(kTokens) * K, shifted.begin() + 1);
  DeviceBuffer<T> xa(shifted.size());
  xa.upload(shifted);
  DeviceBuffer<std::uint32_t> mask(static_cast<std::size_t>(kTokens) * (N / 32)), umask(N / 32);
  DeviceBuffer<float> sp(static_cast<std::size_t>(kTokens) * N);
  const auto run = [&](const T* x) {
    prox::BatchedProxyGemvArgs<T> a;
    a.x = x;
    a.tokens = kTokens;
    a.d_model = K;
    a.d_ff = N;
    a.tau_x = 0.5f;
    a.tau_s = 0.05f;
    a.gate = {r.D.qg.get(), r.D.sg.get()};
    a.up = {r.D.qu.get(), r.D.su.get()};
    a.channel_mask = mask.get();
    a.union_mask = umask.get();
    a.s_proxy = sp.get();
    prox::Operator<Op> op;
    REQUIRE(op.initialize(a) == prox::Status::kSuccess);
    DeviceBuffer<char> ws(prox::Operator<Op>::workspace_bytes(a));
    PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
    mask.poison();
    umask.poison();
    sp.poison();
    REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    std::vector<std::uint32_t> out = mask.download();
    for (std::uint32_t w : umask.download()) out.push_back(w);
    for (float v : sp.download()) {
      CHECK(std::isfinite(v));  // every s~ written
      std::uint32_t b;
      std::memcpy(&b, &v, 4);
      out.push_back(b);
    }
    return out;
  };
  const auto aligned = run(r.x.get());
  const auto unaligned = run(xa.get() + 1);  // 2-byte aligned only
  CHECK(aligned == unaligned);
  int selected = 0;
  for (int i = 0; i < kTokens * (N / 32); ++i) selected += __builtin_popcount(aligned[i]);
  CHECK(selected > 0);  // a threshold that keeps some channels and drops others
  CHECK(selected < kTokens * N);
}

namespace {
//! Every candidate of BatchedDownGemvOp<T, Cap> on one shape: random per-token s over random channel sets
//! (each token's s zero off its set, as the GLU writes it), scaled by `mag`, against the float64 sum.
//! Bound per output: fp32 summation (gamma(rows) of the absolute sum), s as the tensor cores carry it
//! (hi + lo in T: 2^-16 of the absolute sum covers both types), the store to T. Every element of the
//! batch written, nothing past it; the same bits on a second run.
template <class T, int Cap>
void down_candidates(int K, int N, int tokens, double density, double mag, std::uint64_t seed, double w_sigma = 0.0) {
  using Op = prox::BatchedDownGemvOp<T, Cap>;
  const int W = N / 32;
  if (w_sigma == 0.0) w_sigma = 1.0 / std::sqrt(static_cast<double>(N));
  const auto wdt = normal_vector<T>(static_cast<std::size_t>(N) * K, seed, w_sigma);
  std::vector<float> s(static_cast<std::size_t>(Cap) * N, 0.0f);
  std::vector<std::uint32_t> umask(W, 0u);
  std::vector<float> noise(static_cast<std::size_t>(tokens) * N);
  FastNormal gen(seed + 1);
  for (auto& v : noise) v = static_cast<float>(mag * gen());
  for (int b = 0; b < tokens; ++b) {
    const auto chosen = random_flags(N, density, seed + 2 + static_cast<std::uint64_t>(b));
    for (int j = 0; j < N; ++j) {
      if (chosen[j]) {
        s[static_cast<std::size_t>(b) * N + j] = noise[static_cast<std::size_t>(b) * N + j];
        umask[j / 32] |= 1u << (j % 32);
      }
    }
  }
  DeviceBuffer<T> dw(wdt.size()), y(static_cast<std::size_t>(Cap) * K + 64);
  DeviceBuffer<float> ds(s.size());
  DeviceBuffer<std::uint32_t> dm(W);
  dw.upload(wdt);
  ds.upload(s);
  dm.upload(umask);
  typename Op::Args a;
  a.s = ds.get();
  a.union_mask = dm.get();
  a.w_down_t = dw.get();
  a.tokens = tokens;
  a.d_model = K;
  a.d_ff = N;
  a.y = y.get();
  const auto ws = op_workspace<Op>(a);
  // float64 reference
  std::vector<double> ref(static_cast<std::size_t>(tokens) * K, 0.0), abs_sum(ref.size(), 0.0);
  int rows = 0;
  for (int j = 0; j < N; ++j) {
    if (!((umask[j / 32] >> (j % 32)) & 1u)) continue;
    ++rows;
    for (int b = 0; b < tokens; ++b) {
      const double sv = s[static_cast<std::size_t>(b) * N + j];
      for (int k = 0; k < K; ++k) {
        const double p = sv * static_cast<double>(prox::to_float(wdt[static_cast<std::size_t>(j) * K + k]));
        ref[static_cast<std::size_t>(b) * K + k] += p;
        abs_sum[static_cast<std::size_t>(b) * K + k] += std::fabs(p);
      }
    }
  }
  const double rel = prox_ref::gamma(rows) + std::ldexp(1.0, -16);
  // y stored as a subnormal: half its spacing (fp16 2^-25; bf16's is below any y here)
  const double kSubnormalHalfUlp = std::is_same_v<T, __half> ? std::ldexp(1.0, -25) : 1e-38;
  prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
    CAPTURE(K, N, tokens, density, mag, pi, decltype(p)::name());
    std::vector<std::uint16_t> first;
    for (int rep = 0; rep < 2; ++rep) {
      y.poison();
      REQUIRE(run_op<Op>(a, pi, ws) == prox::Status::kSuccess);
      PROX_TEST_CUDA(cudaDeviceSynchronize());
      const auto got = y.download();
      std::vector<std::uint16_t> bits;
      int bad = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        bits.push_back(bits16(got[i]));
        if (i >= ref.size()) {
          if (bits16(got[i]) != 0xFFFFu) ++bad;  // past the batch: untouched
          continue;
        }
        const double tol = rel * abs_sum[i] + prox_ref::store_rel<T>() * std::fabs(ref[i]) + kSubnormalHalfUlp;
        if (!(std::fabs(static_cast<double>(prox::to_float(got[i])) - ref[i]) <= tol)) ++bad;
      }
      CHECK(bad == 0);
      if (rep == 0) first = bits;
      else CHECK(bits == first);
    }
  });
}
}  // namespace

namespace {
//! Every candidate of BatchedProxyGemvOp<T, SiLU, Cap> on one shape: each token's channel mask against
//! the float64 Stage 1 (no unambiguous channel decided differently), every s~ within its bound, the union
//! the OR of the token masks. The FFN tests run only each shape's default candidate.
template <class T, int Cap>
void proxy_candidates(int K, int N, int tokens, std::uint64_t seed) {
  using Op = prox::BatchedProxyGemvOp<T, prox::SiLU, Cap>;
  const int W = N / 32;
  BatchRig<T, prox::SiLU> r(K, N, seed);
  const auto xs = make_tokens<T>(K, tokens, seed + 1, false);
  r.x.upload(xs);
  const auto dx0 = prox_ref::to_double(std::vector<T>(xs.begin(), xs.begin() + K));
  const float tau_x = quantile_abs(dx0, 0.5);
  const auto probe = prox_ref::stage1_int4(dx0, K, N, tau_x, 0.0f, r.L.qg, r.L.sg, r.L.qu, r.L.su, ref_act<prox::SiLU>());
  const float tau_s = quantile_abs(values_of(probe.s), 0.7);
  std::vector<prox_ref::Stage1Result> ref;
  for (int b = 0; b < tokens; ++b) {
    const std::vector<T> xt(xs.begin() + static_cast<std::ptrdiff_t>(b) * K,
                            xs.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
    ref.push_back(prox_ref::stage1_int4(prox_ref::to_double(xt), K, N, tau_x, tau_s, r.L.qg, r.L.sg, r.L.qu, r.L.su,
                                        ref_act<prox::SiLU>()));
  }
  DeviceBuffer<std::uint32_t> umask(W);
  DeviceBuffer<float> sp(static_cast<std::size_t>(Cap) * N);
  typename Op::Args a;
  a.x = r.x.get();
  a.tokens = tokens;
  a.d_model = K;
  a.d_ff = N;
  a.tau_x = tau_x;
  a.tau_s = tau_s;
  a.gate = {r.D.qg.get(), r.D.sg.get()};
  a.up = {r.D.qu.get(), r.D.su.get()};
  a.channel_mask = r.mask.get();
  a.union_mask = umask.get();
  a.s_proxy = sp.get();
  const auto ws = op_workspace<Op>(a);
  prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
    CAPTURE(K, N, tokens, pi, decltype(p)::name());
    r.mask.poison();
    umask.poison();
    sp.poison();
    REQUIRE(run_op<Op>(a, pi, ws) == prox::Status::kSuccess);
    PROX_TEST_CUDA(cudaDeviceSynchronize());
    const auto mask = r.mask.download();
    const auto um = umask.download();
    const auto s = sp.download();
    std::vector<std::uint32_t> expect_union(W, 0u);
    int mismatches = 0, s_bad = 0, selected = 0;
    for (int b = 0; b < tokens; ++b) {
      const std::vector<std::uint32_t> mb(mask.begin() + static_cast<std::ptrdiff_t>(b) * W,
                                          mask.begin() + static_cast<std::ptrdiff_t>(b + 1) * W);
      const MaskCompare c = compare_mask(mb, ref[static_cast<std::size_t>(b)]);
      mismatches += c.mismatches;
      selected += c.selected_gpu;
      for (int w = 0; w < W; ++w) expect_union[w] |= mb[w];
      for (int j = 0; j < N; ++j) {
        const auto& e = ref[static_cast<std::size_t>(b)].s[j];
        const double got = s[static_cast<std::size_t>(b) * N + j];
        if (!(std::fabs(got - e.v) <= e.err)) ++s_bad;  // NaN fails
      }
    }
    CHECK(mismatches == 0);
    CHECK(s_bad == 0);
    CHECK(um == expect_union);
    CHECK(selected > 0);
    CHECK(selected < tokens * N);
  });
}
}  // namespace

TEMPLATE_TEST_CASE("Batched Stage 1: every candidate, each token against the float64 Stage 1", "[batched][gpu]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  proxy_candidates<T, 8>(2520, 608, 8, 41);  // 1024-input chunks: 3 of them, the last short
  proxy_candidates<T, 8>(1000, 2016, 5, 42);
  proxy_candidates<T, 4>(2520, 608, 3, 43);
  proxy_candidates<T, 2>(1000, 2016, 2, 44);
}

TEMPLATE_TEST_CASE("Batched Stage 1 and FFN: the Qwen3-14B shape, where the split candidate is the default",
                   "[batched][gpu][large]", __half, __nv_bfloat16) {
  using T = TestType;
  // On an H100 the split candidate's grid is 136 tiles x 5 whole 1024-input chunks (test_validation.cu);
  // every candidate runs here, the FFN with the default.
  proxy_candidates<T, 2>(5120, 17408, 2, 61);
  proxy_candidates<T, 4>(5120, 17408, 4, 62);
  batch_shape<T, prox::SiLU>(5120, 17408, 63, {2, 4}, false);
}

TEMPLATE_TEST_CASE("Batched down GEMV: every candidate against the float64 sum", "[batched][gpu]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  down_candidates<T, 8>(200, 96, 8, 0.6, 1.0, 1);       // one partial tile, one chunk
  down_candidates<T, 8>(1000, 2016, 5, 0.5, 1.0, 2);    // odd tiles and chunks, 3 of 8 slots empty
  down_candidates<T, 8>(2520, 3008, 8, 0.9, 1.0, 3);    // several chunks, a dense union
  down_candidates<T, 8>(1032, 4096, 7, 0.05, 1.0, 4);   // a sparse union: short last steps
  // |s| past fp16's range (y within it), and tiny s (fp16 subnormals unscaled): the block's power of two
  down_candidates<T, 8>(520, 1056, 8, 0.5, 1.0e5, 5, 1.0e-4);
  down_candidates<T, 8>(520, 1056, 6, 0.5, 1.0e-5, 6, 1.0);
  down_candidates<T, 8>(264, 512, 8, 0.0, 1.0, 7);      // nothing selected: y = 0
  down_candidates<T, 4>(1000, 2016, 3, 0.5, 1.0, 8);
  down_candidates<T, 4>(2520, 3008, 4, 0.8, 1.0, 9);
  down_candidates<T, 2>(1000, 2016, 2, 0.5, 1.0, 10);
  down_candidates<T, 2>(520, 1056, 1, 0.7, 1.0, 11);
}

TEMPLATE_TEST_CASE("Batched down GEMV: whole 3072-channel chunks at capacities 2 and 4", "[batched][large][gpu]",
                   __half, __nv_bfloat16) {
  // 133 tiles of 128 outputs keep the policy's own split (2 chunks: 3072 + 1056 channels), so the one-wave
  // candidates' blocks hold a full chunk of about 2765 union rows (density 0.9; at capacity 4 in dynamic
  // shared memory). 140 MB of weights: [large].
  down_candidates<TestType, 2>(16904, 4128, 2, 0.9, 1.0, 12);
  down_candidates<TestType, 4>(16904, 4128, 3, 0.9, 1.0, 13);
}

namespace {
//! Every candidate of the fused batched Stage 2 (BatchedGluDownGemvOp<T, A, Cap>) on one shape: `tokens`
//! tokens, each with its own random channel set of `density` (their union the rows read), against the
//! float64 Stage 2 of each token on its own set: s within its bound on the token's channels and +0 on the
//! others, y within the reference bound. Grids from the largest resident one to 7 and 1 block (so blocks
//! run several down tasks), cooperative and plain launches bit-identical, three launches of the largest grid
//! on one workspace bit-identical, every launch leaving it ready (barrier and tile counters at zero, nothing flagged), nothing past
//! the batch written. Then a launch on a workspace that is not ready: y = NaN, flagged, no hang.
template <class T, class A, int Cap>
void fused_candidates(int K, int N, int tokens, double density, std::uint64_t seed) {
  using Op = prox::BatchedGluDownGemvOp<T, A, Cap>;
  const int W = N / 32;
  const HostLayer<T> L = make_host_layer<T>(K, N, seed);
  const DeviceLayer<T> D(L);
  const auto xs = make_tokens<T>(K, tokens, seed + 1, false);
  std::vector<std::uint32_t> masks(static_cast<std::size_t>(Cap) * W, 0u), umask(W, 0u);
  std::vector<std::vector<std::uint8_t>> sel(tokens);
  std::vector<prox_ref::Stage2Result> refs;
  for (int b = 0; b < tokens; ++b) {
    sel[b] = random_flags(N, density, seed + 10 + static_cast<std::uint64_t>(b));
    for (int j = 0; j < N; ++j) {
      if (!sel[b][j]) continue;
      masks[static_cast<std::size_t>(b) * W + j / 32] |= 1u << (j % 32);
      umask[j / 32] |= 1u << (j % 32);
    }
    const std::vector<T> xt(xs.begin() + static_cast<std::ptrdiff_t>(b) * K,
                            xs.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
    refs.push_back(prox_ref::stage2(prox_ref::to_double(xt), L.dwg, L.dwu, L.dwdt, K, N, sel[b], ref_act<A>()));
  }
  DeviceBuffer<T> dx(xs), dy(static_cast<std::size_t>(Cap) * K + 64);
  DeviceBuffer<std::uint32_t> dmask(masks), dumask(umask);
  DeviceBuffer<float> ds(static_cast<std::size_t>(Cap) * N);
  typename Op::Args a;
  a.x = dx.get();
  a.tokens = tokens;
  a.d_model = K;
  a.d_ff = N;
  a.w_gate = D.wg.get();
  a.w_up = D.wu.get();
  a.channel_mask = dmask.get();
  a.union_mask = dumask.get();
  a.s = ds.get();
  a.w_down_t = D.wdt.get();
  a.y = dy.get();
  prox::DeviceInfo dev;
  PROX_TEST_OK(prox::query_device(&dev));
  prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
    using P = decltype(p);
    int max_blocks = 0;
    PROX_TEST_OK(Op::template max_grid_blocks<P>(dev, &max_blocks));
    REQUIRE(max_blocks > 0);
    for (int blocks : {max_blocks, 7, 1}) {
      std::vector<std::uint16_t> coop_bits;
      for (bool coop : {true, false}) {
        CAPTURE(K, N, tokens, density, pi, P::name(), A::kName, prox::DTypeTraits<T>::kName, blocks, coop);
        const auto ws = op_workspace<Op>(a);
        typename Op::Options o;
        o.cooperative = coop;
        o.grid_blocks = blocks;
        prox::Operator<Op> op;
        REQUIRE(op.initialize(a, o, pi) == prox::Status::kSuccess);
        std::vector<std::uint16_t> first;
        const int reps = blocks == max_blocks && coop ? 3 : 1;  // the other grids: against the cooperative run
        for (int rep = 0; rep < reps; ++rep) {
          ds.poison();
          dy.poison();
          REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
          PROX_TEST_CUDA(cudaDeviceSynchronize());
          std::vector<std::uint16_t> bits;
          for (T v : dy.download()) bits.push_back(bits16(v));
          if (rep == 0) first = bits;
          else CHECK(bits == first);  // deterministic, and the workspace was left ready
        }
        if (coop) coop_bits = first;
        else CHECK(first == coop_bits);
        const auto y = dy.download();
        const auto s = ds.download();
        double worst_s = 0.0, worst_y = 0.0;
        for (int b = 0; b < tokens; ++b) {
          const std::vector<float> sb(s.begin() + static_cast<std::ptrdiff_t>(b) * N,
                                      s.begin() + static_cast<std::ptrdiff_t>(b + 1) * N);
          const SCompare cs = compare_s(sb, sel[b], refs[b].s);
          CHECK(cs.bad == 0);
          CHECK(cs.untouched_bad == 0);
          worst_s = std::max(worst_s, cs.worst);
          const std::vector<T> yb(y.begin() + static_cast<std::ptrdiff_t>(b) * K,
                                  y.begin() + static_cast<std::ptrdiff_t>(b + 1) * K);
          double w = 0.0;
          CHECK(count_out_of_bound(yb, refs[b].y, &w) == 0);
          worst_y = std::max(worst_y, w);
        }
        int past = 0;  // nothing past the batch: y of the empty slots and the guard, s of the empty slots
        for (std::size_t i = static_cast<std::size_t>(tokens) * K; i < y.size(); ++i) past += bits16(y[i]) != 0xFFFFu;
        for (std::size_t i = static_cast<std::size_t>(tokens) * N; i < s.size(); ++i) past += bits32(s[i]) != 0xFFFFFFFFu;
        CHECK(past == 0);
        const FusedWorkspaceState wst = fused_workspace_state(ws, Op::template num_tiles<P>(K));
        CHECK(wst.arrivals == 0u);
        CHECK(wst.counters_not_zero == 0);
        CHECK(wst.status == prox::Status::kSuccess);
        if (coop)
          std::printf("[bgludown] %-5s %-9s K=%-5d N=%-5d B=%d %-28s blocks=%-4d density=%.2f s err/bound=%.3f y "
                      "err/bound=%.3f\n",
                      prox::DTypeTraits<T>::kName, A::kName, K, N, tokens, P::name().c_str(), blocks, density, worst_s,
                      worst_y);
      }
    }
  });
  // A workspace that is not ready (garbage header): every token's y is NaN, the header flagged, no hang;
  // initialized again, the op gives the clean bits.
  auto ws = op_workspace<Op>(a);
  prox::Operator<Op> op;
  REQUIRE(op.initialize(a) == prox::Status::kSuccess);
  dy.poison();
  REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto clean = dy.download();
  std::vector<char> junk(ws.bytes());
  for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>(i * 131 + 7);
  ws.upload(junk);
  dy.poison();
  REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto dirty = dy.download();
  int not_nan = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(tokens) * K; ++i) not_nan += !std::isnan(prox::to_float(dirty[i]));
  CHECK(not_nan == 0);
  prox::Status flag = prox::Status::kSuccess;
  PROX_TEST_OK(prox::read_workspace_status(ws.get(), nullptr, &flag));
  CHECK(flag == prox::Status::kErrorDirtyWorkspace);
  PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
  dy.poison();
  REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto again = dy.download();
  int diff = 0;
  for (std::size_t i = 0; i < again.size(); ++i) diff += bits16(again[i]) != bits16(clean[i]);
  CHECK(diff == 0);
}
}  // namespace

TEMPLATE_TEST_CASE("Fused batched Stage 2: every candidate, each token against its float64 Stage 2, any grid",
                   "[batched][gpu]", __half, __nv_bfloat16) {
  using T = TestType;
  fused_candidates<T, prox::SiLU, 2>(200, 96, 2, 0.3, 51);       // one partial tile
  fused_candidates<T, prox::GeluTanh, 2>(8, 32, 1, 0.5, 52);     // the smallest shape, one token
  fused_candidates<T, prox::SiLU, 2>(1000, 2016, 2, 1.0, 53);    // every channel
  fused_candidates<T, prox::GeluTanh, 4>(1000, 2016, 3, 0.23, 54);
  fused_candidates<T, prox::SiLU, 4>(4104, 544, 4, 0.3, 55);     // more column tiles than a small grid's blocks
  fused_candidates<T, prox::SiLU, 4>(2520, 608, 4, 0.0, 56);     // nothing selected: y = 0
  fused_candidates<T, prox::GeluTanh, 4>(5120, 1056, 2, 0.4, 57);  // 5120 inputs: the 320-thread candidate's row
}

TEST_CASE("Batched FFN: tokens = 1 runs the batch-1 kernels and gives run()'s bits", "[batched][gpu]") {
  BatchRig<__half, prox::SiLU> r(520, 1056, 11);
  r.plan(0.5f, 0.05f);
  const auto xs = make_tokens<__half>(520, 1, 12, false);
  r.x.upload(xs);
  const auto batched = r.run_bits(1);
  r.y1.poison();
  REQUIRE(r.ffn.run(r.x.get(), r.y1.get(), r.ws.get(), r.ws.bytes(), nullptr) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto y1 = r.y1.download();
  for (int k = 0; k < 520; ++k) CHECK(batched[k] == bits16(y1[k]));
}

TEST_CASE("Batched FFN: deterministic, and a captured graph replays on new tokens", "[batched][gpu][determinism]") {
  BatchRig<__nv_bfloat16, prox::SiLU> r(1000, 2016, 21);
  r.plan(0.6f, 0.04f);
  for (int tokens : {2, 3, 8}) {
    CAPTURE(tokens);
    const auto xs = make_tokens<__nv_bfloat16>(1000, tokens, 22 + tokens, false);
    r.x.upload(xs);
    const auto first = r.run_bits(tokens);
    for (int rep = 0; rep < 3; ++rep) REQUIRE(r.run_bits(tokens) == first);
  }
  // Capture a batch of 3, replay it on other tokens: the eager run's bits.
  cudaStream_t stream;
  PROX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  PROX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const prox::Status st = r.run(3, stream);
  PROX_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  REQUIRE(st == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int t = 0; t < 3; ++t) {
    const auto xs = make_tokens<__nv_bfloat16>(1000, 3, 300 + t, t == 1);
    r.x.upload(xs);
    const auto eager = r.run_bits(3);
    r.y.poison();
    PROX_TEST_CUDA(cudaGraphLaunch(exec, stream));
    PROX_TEST_CUDA(cudaStreamSynchronize(stream));
    std::vector<std::uint32_t> replay;
    for (auto v : r.y.download()) replay.push_back(bits16(v));
    for (std::uint32_t w : r.mask.download()) replay.push_back(w);
    CHECK(replay == eager);
  }
  PROX_TEST_CUDA(cudaGraphExecDestroy(exec));
  PROX_TEST_CUDA(cudaGraphDestroy(graph));
  PROX_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("Batched FFN: a workspace never initialized gives the exact dense FFN, flagged", "[batched][gpu]") {
 for (const bool fuse : {false, true}) {
  CAPTURE(fuse);
  BatchRig<__half, prox::GeluTanh> r(136, 224, 31);
  r.plan(0.7f, 0.05f, 4, fuse);
  // Garbage in place of the header: the first batch is dense and flags it; the next is sparse.
  std::vector<char> junk(r.ws.bytes());
  for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>(i * 131 + 7);
  r.ws.upload(junk);
  const auto xs = make_tokens<__half>(136, 4, 32, false);
  r.x.upload(xs);
  r.y.poison();
  REQUIRE(r.run(4) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto y = r.y.download();
  const auto mask = r.mask.download();
  for (std::size_t w = 0; w < 4 * 224 / 32; ++w) CHECK(mask[w] == 0xffffffffu);
  for (int b = 0; b < 4; ++b) {
    const std::vector<__half> xt(xs.begin() + b * 136, xs.begin() + (b + 1) * 136);
    const auto ref = prox_ref::stage2(prox_ref::to_double(xt), r.L.dwg, r.L.dwu, r.L.dwdt, 136, 224,
                                      std::vector<std::uint8_t>(224, 1), prox_ref::Act::kGeluTanh);
    const std::vector<__half> yb(y.begin() + b * 136, y.begin() + (b + 1) * 136);
    CHECK(count_out_of_bound(yb, ref.y) == 0);
  }
  prox::Status flag = prox::Status::kSuccess;
  PROX_TEST_OK(prox::read_workspace_status(r.ws.get(), nullptr, &flag));
  CHECK(flag == prox::Status::kErrorDirtyWorkspace);
  check_batch(r, xs, 4, "after");  // sparse again, each token right
 }
}

TEST_CASE("Batched FFN: bad input is refused before any launch", "[batched][gpu][validation]") {
  using Ffn = prox::SparseFfn<__half, prox::SiLU>;
  BatchRig<__half, prox::SiLU> r(200, 96, 41);
  r.plan(0.5f, 0.05f, 4);
  char* ws = r.ws.get();
  const std::size_t bytes = r.ws.bytes();
  const __half* x = r.x.get();
  __half* y = r.y.get();
  CHECK(r.ffn.run_batch(x, y, 0, ws, bytes, nullptr) == prox::Status::kErrorInvalidArgument);
  CHECK(r.ffn.run_batch(x, y, 5, ws, bytes, nullptr) == prox::Status::kErrorInvalidArgument);  // > max_tokens
  CHECK(r.ffn.run_batch(nullptr, y, 2, ws, bytes, nullptr) == prox::Status::kErrorNullPointer);
  CHECK(r.ffn.run_batch(x, nullptr, 2, ws, bytes, nullptr) == prox::Status::kErrorNullPointer);
  CHECK(r.ffn.run_batch(x + 1, y, 2, ws, bytes, nullptr) == prox::Status::kErrorMisalignedPointer);
  CHECK(r.ffn.run_batch(x, y + 4, 2, ws, bytes, nullptr) == prox::Status::kErrorMisalignedPointer);
  // The batch-1 size is too small for a plan of 4 tokens.
  CHECK(r.ffn.run_batch(x, y, 2, ws, Ffn::workspace_bytes(200, 96), nullptr) ==
        prox::Status::kErrorWorkspaceTooSmall);
  Ffn::BatchOutputs out;
  out.counters = reinterpret_cast<prox::SparsityCounters*>(ws + 4);
  CHECK(r.ffn.run_batch(x, y, 2, ws, bytes, nullptr, out) == prox::Status::kErrorMisalignedPointer);
  // max_tokens outside [1, 8]; the A1 ablation (fp16 proxies) is batch-1 only.
  Ffn f;
  Ffn::Config c{200, 96, 0.5f, 0.05f};
  c.max_tokens = 9;
  CHECK(f.plan(c, ffn_weights<prox::SiLU>(r.D)) == prox::Status::kErrorInvalidArgument);
  c.max_tokens = 0;
  CHECK(f.plan(c, ffn_weights<prox::SiLU>(r.D)) == prox::Status::kErrorInvalidArgument);
  using DenseFfn = prox::SparseFfn<__half, prox::SiLU, prox::DenseWeights<__half>>;
  DenseFfn d;
  DenseFfn::Weights dw;
  dw.gate = r.D.wg.get();
  dw.up = r.D.wu.get();
  dw.down_t = r.D.wdt.get();
  dw.proxy_gate = {r.D.wg_t.get(), nullptr};
  dw.proxy_up = {r.D.wu_t.get(), nullptr};
  DenseFfn::Config dc{200, 96, 0.5f, 0.05f};
  dc.max_tokens = 2;
  CHECK(d.plan(dc, dw) == prox::Status::kErrorInvalidArgument);
  dc.max_tokens = 1;
  CHECK(d.plan(dc, dw) == prox::Status::kSuccess);
  CHECK(d.run_batch(x, y, 2, ws, bytes, nullptr) == prox::Status::kErrorInvalidArgument);
  // An unplanned layer.
  CHECK(Ffn{}.run_batch(x, y, 2, ws, bytes, nullptr) == prox::Status::kErrorNotPlanned);
}
