// SPDX-License-Identifier: Apache-2.0
//! @file test_workspace.cu  One workspace, initialized once, serves every policy of an op at one shape:
//! policies of different tile widths launched one after another on it, never re-initialized, give
//! the same bits as each on a fresh workspace. Before each op's tile-counter region had the same size
//! for every policy (detail::tile_counter_bytes), a narrow-tile policy's counters lay where a wide-tile
//! policy wrote split-K partials, and the next launch combined garbage (prox-tune rejected every
//! 256-channel Stage-1 candidate after a 512-channel one had run). The SparseFfn case (fused and
//! unfused Stage 2 re-planned on one workspace) is in test_ffn.cu.
#include "catch.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include <prox/prox.cuh>

#include "gpu_fixture.hpp"
#include "op_test.hpp"

using namespace prox_test;

namespace {

//! Random 32-bit words (INT4 proxies: any bit pattern is a valid code).
std::vector<std::uint32_t> random_words(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<std::uint32_t> v(n);
  for (auto& w : v) w = g();
  return v;
}

std::vector<float> random_positive(std::size_t n, std::uint64_t seed, float lo, float hi) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& e : v) e = d(g);
  return v;
}

//! Every output of `run(policy index, workspace)` on one shared workspace (initialized once, policies
//! cycled twice) must equal the output of the same policy on a fresh workspace, bit for bit.
template <class Op, class Run>
void check_shared_workspace(const typename Op::Args& a, Run&& run, const char* label) {
  using List = typename Op::Policies;
  std::vector<std::vector<std::uint32_t>> fresh(List::kSize);
  prox::for_each_policy<List>([&](auto, int pi) {
    const auto ws = op_workspace<Op>(a);
    fresh[pi] = run(pi, ws);
  });
  const auto shared = op_workspace<Op>(a);
  int differing = 0;
  for (int round = 0; round < 2; ++round) {
    prox::for_each_policy<List>([&](auto p, int pi) {
      const auto out = run(pi, shared);
      int diff = 0;
      for (std::size_t i = 0; i < out.size(); ++i) diff += out[i] != fresh[pi][i];
      CAPTURE(label, round, pi, decltype(p)::name());
      CHECK(out.size() == fresh[pi].size());
      CHECK(diff == 0);
      differing += diff != 0;
    });
  }
  std::printf("[workspace] %-6s %d policies, 2 rounds on one workspace: %d outputs differ from a fresh one\n", label,
              List::kSize, differing);
}

}  // namespace

TEST_CASE("proxy GEMV: one workspace serves policies of different tile widths", "[workspace][stage1][gpu]") {
  // 256- and 512-channel tiles over d_ff = 16640: 65 and 33 tiles, so the 256-channel policy's
  // counters (260 bytes) passed the 256 bytes a 512-channel policy gave its own. Two split-K chunks.
  using List = prox::PolicyList<prox::PolicyAt<0, prox::ProxyGemvPolicies>, prox::ProxyGemvPolicy<256, 512, 512, 2, 3>,
                                prox::PolicyAt<2, prox::ProxyGemvPolicies>>;
  constexpr int K = 1024;
  constexpr int N = 16640;
  const auto x = normal_vector<__half>(K, 71, 1.0);
  DeviceBuffer<__half> dx(x);
  DeviceBuffer<std::uint32_t> qg(random_words(prox::int4::packed_words(K, N), 72));
  DeviceBuffer<std::uint32_t> qu(random_words(prox::int4::packed_words(K, N), 73));
  DeviceBuffer<float> sg(random_positive(N, 74, 0.5f / 7, 1.5f / 7));
  DeviceBuffer<float> su(random_positive(N, 75, 0.5f / 7, 1.5f / 7));
  DeviceBuffer<std::uint32_t> mask(N / 32);
  DeviceBuffer<float> s(N);
  using Op = prox::ProxyGemvOp<__half, prox::SiLU, prox::Int4Weights, List>;
  prox::ProxyGemvArgs<__half> a;
  a.x = dx.get();
  a.d_model = K;
  a.d_ff = N;
  a.tau_x = 0.5f;
  a.tau_s = 0.1f;
  a.gate = {qg.get(), sg.get()};
  a.up = {qu.get(), su.get()};
  a.channel_mask = mask.get();
  a.s_proxy = s.get();
  prox::for_each_policy<List>([&](auto p, int) {
    STATIC_REQUIRE(Op::num_chunks<decltype(p)>(K) >= 2);  // split-K: partials are written
  });
  check_shared_workspace<Op>(
      a,
      [&](int pi, const DeviceBuffer<char>& ws) {
        mask.poison();
        s.poison();
        REQUIRE(run_op<Op>(a, pi, ws) == prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        std::vector<std::uint32_t> out = mask.download();
        for (float v : s.download()) out.push_back(bits32(v));
        return out;
      },
      "stage1");
}

TEST_CASE("down GEMV: one workspace serves policies of different tile widths", "[workspace][stage2][down][gpu]") {
  // The list's 256- and 128-column tiles over d_model = 8448: 33 and 66 tiles, so the 128-column
  // policy's counters (264 bytes) passed the 256 bytes a 256-column policy gave its own.
  using List = prox::DownGemvPolicies;
  constexpr int K = 8448;
  constexpr int N = 1024;
  DeviceBuffer<__half> wdt(normal_vector<__half>(static_cast<std::size_t>(N) * K, 81, 1.0 / 32));
  FastNormal normal(82);
  std::vector<float> sv(N);
  for (float& v : sv) v = static_cast<float>(normal());
  DeviceBuffer<float> ds(sv);
  std::vector<std::uint32_t> m(N / 32);
  std::mt19937 g(83);
  for (auto& w : m) w = g() & g();  // about a quarter of the channels selected
  DeviceBuffer<std::uint32_t> dmask(m);
  DeviceBuffer<__half> y(K);
  prox::DownGemvArgs<__half> a;
  a.s = ds.get();
  a.channel_mask = dmask.get();
  a.w_down_t = wdt.get();
  a.d_model = K;
  a.d_ff = N;
  a.y = y.get();
  using Op = prox::DownGemvOp<__half>;
  bool widths_differ = false;
  prox::for_each_policy<List>([&](auto p, int) {
    using P = decltype(p);
    widths_differ = widths_differ || P::kTile != prox::PolicyAt<0, List>::kTile;
  });
  REQUIRE(widths_differ);
  REQUIRE(Op::num_chunks<prox::PolicyAt<0, List>>(N) >= 2);  // its partials are written
  check_shared_workspace<Op>(
      a,
      [&](int pi, const DeviceBuffer<char>& ws) {
        y.poison();
        REQUIRE(run_op<Op>(a, pi, ws) == prox::Status::kSuccess);
        PROX_TEST_CUDA(cudaDeviceSynchronize());
        std::vector<std::uint32_t> out;
        for (__half v : y.download()) out.push_back(bits16(v));
        return out;
      },
      "down");
}
