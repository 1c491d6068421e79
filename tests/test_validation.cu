// SPDX-License-Identifier: Apache-2.0
//! @file test_validation.cu  Host test (no GPU needed, runs on every CI build): every public launcher
//! refuses bad input with the documented Status before it launches or touches the device.
//!
//! The pointers are fabricated, well-aligned addresses that are never dereferenced: a launcher that
//! let one of these cases through would try to launch (no device: a CUDA runtime error, not the
//! Status expected; with a device: a fault), so every CHECK below can fail. Each case changes one
//! field of arguments that can_implement() accepts, which is checked first.
#include "catch.hpp"

#include <cstdint>
#include <limits>

#include <prox/calibrate.cuh>
#include <prox/glu_down_gemv.cuh>
#include <prox/prox.cuh>

namespace {

using prox::Status;

constexpr std::uintptr_t kBase = std::uintptr_t(1) << 40;  // 256-byte aligned, never dereferenced

//! A fabricated device address `offset` bytes past an aligned base (distinct per `slot`).
template <class P>
P* fake(int slot, std::uintptr_t offset = 0) {
  return reinterpret_cast<P*>(kBase + static_cast<std::uintptr_t>(slot) * (std::uintptr_t(1) << 28) + offset);
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

template <class T>
prox::ProxyGemvArgs<T> proxy_args() {
  prox::ProxyGemvArgs<T> a;
  a.x = fake<const T>(0);
  a.d_model = 4096;
  a.d_ff = 12288;
  a.tau_x = 0.5f;
  a.tau_s = 0.25f;
  a.w_gate = fake<const void>(1);
  a.w_up = fake<const void>(2);
  a.scale_gate = fake<const float>(3);
  a.scale_up = fake<const float>(4);
  a.channel_mask = fake<std::uint32_t>(5);
  return a;
}

template <class T>
prox::GluDownGemvArgs<T> glu_down_args() {
  prox::GluDownGemvArgs<T> a;
  a.x = fake<const T>(0);
  a.d_model = 4096;
  a.d_ff = 12288;
  a.w_gate = fake<const T>(1);
  a.w_up = fake<const T>(2);
  a.channel_mask = fake<const std::uint32_t>(3);
  a.s = fake<float>(4);
  a.w_down_t = fake<const T>(5);
  a.y = fake<T>(6);
  return a;
}

template <class T>
prox::DownGemvArgs<T> down_args() {
  prox::DownGemvArgs<T> a;
  a.s = fake<const float>(0);
  a.channel_mask = fake<const std::uint32_t>(1);
  a.w_down_t = fake<const T>(2);
  a.d_model = 4096;
  a.d_ff = 12288;
  a.y = fake<T>(3);
  return a;
}

}  // namespace

TEST_CASE("thresholds: NaN and negative values are refused, +0, -0 and +inf accepted", "[validation]") {
  CHECK(prox::valid_threshold(0.0f));
  CHECK(prox::valid_threshold(-0.0f));
  CHECK(prox::valid_threshold(0.5f));
  CHECK(prox::valid_threshold(kInf));  // keeps nothing: a legal, empty selection
  CHECK_FALSE(prox::valid_threshold(kNaN));
  CHECK_FALSE(prox::valid_threshold(-1e-30f));
  CHECK_FALSE(prox::valid_threshold(-kInf));
}

TEMPLATE_TEST_CASE("threshold op: bad input gets a Status before any launch", "[validation]", __half, __nv_bfloat16) {
  using T = TestType;
  using P = prox::PolicyAt<0, prox::ThresholdPolicies>;
  prox::ThresholdArgs<T> good{fake<const T>(0), 4096, 0.5f, fake<std::uint32_t>(1), fake<int>(2), fake<int>(3)};
  REQUIRE(prox::threshold::can_implement(good) == Status::kSuccess);
  const auto launch = [](const prox::ThresholdArgs<T>& a) { return prox::threshold::launch<P>(a, nullptr, nullptr); };
  auto a = good;
  a.x = nullptr;
  CHECK(launch(a) == Status::kErrorNullPointer);
  a = good;
  a.mask = nullptr;
  CHECK(launch(a) == Status::kErrorNullPointer);
  a = good;
  a.count = nullptr;  // indices without a count
  CHECK(launch(a) == Status::kErrorNullPointer);
  for (int n : {0, -1, (1 << 24) + 1}) {
    a = good;
    a.n = n;
    CHECK(launch(a) == Status::kErrorInvalidShape);
  }
  for (float tau : {kNaN, -1.0f}) {
    a = good;
    a.tau = tau;
    CHECK(launch(a) == Status::kErrorInvalidThreshold);
  }
  a = good;
  a.x = fake<const T>(0, 1);
  CHECK(launch(a) == Status::kErrorMisalignedPointer);
  a = good;
  a.mask = fake<std::uint32_t>(1, 2);
  CHECK(launch(a) == Status::kErrorMisalignedPointer);
  a = good;
  a.indices = fake<int>(2, 2);
  CHECK(launch(a) == Status::kErrorMisalignedPointer);
  a = good;
  a.x_sparse = fake<T>(4, 1);
  CHECK(launch(a) == Status::kErrorMisalignedPointer);
}

TEMPLATE_TEST_CASE("proxy GEMV: bad input gets a Status before any launch", "[validation]", prox::Int4Weights,
                   prox::DenseWeights<__half>) {
  using Fmt = TestType;
  using T = __half;
  using Policies = typename prox::SparseFfn<T, prox::SiLU, Fmt>::ProxyPolicies;
  using P = prox::PolicyAt<0, Policies>;
  const prox::ProxyGemvArgs<T> good = proxy_args<T>();
  REQUIRE(prox::proxy_gemv::can_implement<Fmt>(good) == Status::kSuccess);
  const std::size_t need = prox::proxy_gemv::workspace_bytes<P>(good);
  REQUIRE(need > 0);
  void* ws = fake<void>(7);
  const auto launch = [&](const prox::ProxyGemvArgs<T>& a, void* w, std::size_t bytes) {
    return prox::proxy_gemv::launch<P, Fmt, prox::SiLU>(a, w, bytes, nullptr);
  };
  const auto with = [&](auto mutate) {
    prox::ProxyGemvArgs<T> a = good;
    mutate(a);
    return launch(a, ws, need);
  };
  CHECK(with([](auto& a) { a.x = nullptr; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.w_gate = nullptr; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.w_up = nullptr; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.channel_mask = nullptr; }) == Status::kErrorNullPointer);  // and no s_proxy
  if (Fmt::kNeedsScales) {
    CHECK(with([](auto& a) { a.scale_gate = nullptr; }) == Status::kErrorNullPointer);
    CHECK(with([](auto& a) { a.scale_up = nullptr; }) == Status::kErrorNullPointer);
  } else {  // fp16 proxies carry no scales
    prox::ProxyGemvArgs<T> a = good;
    a.scale_gate = a.scale_up = nullptr;
    CHECK(prox::proxy_gemv::can_implement<Fmt>(a) == Status::kSuccess);
  }
  {  // values mode alone is a valid output
    prox::ProxyGemvArgs<T> a = good;
    a.channel_mask = nullptr;
    a.s_proxy = fake<float>(6);
    CHECK(prox::proxy_gemv::can_implement<Fmt>(a) == Status::kSuccess);
  }
  CHECK(with([](auto& a) { a.d_model = 0; }) == Status::kErrorInvalidShape);
  CHECK(with([](auto& a) { a.d_model = (1 << 20) + 1; }) == Status::kErrorInvalidShape);
  CHECK(with([](auto& a) { a.d_ff = 0; }) == Status::kErrorInvalidShape);
  CHECK(with([](auto& a) { a.d_ff = 48; }) == Status::kErrorInvalidShape);
  CHECK(with([](auto& a) { a.d_ff = (1 << 20) + 32; }) == Status::kErrorInvalidShape);
  CHECK(with([](auto& a) { a.tau_x = kNaN; }) == Status::kErrorInvalidThreshold);
  CHECK(with([](auto& a) { a.tau_x = -0.5f; }) == Status::kErrorInvalidThreshold);
  CHECK(with([](auto& a) { a.tau_s = kNaN; }) == Status::kErrorInvalidThreshold);
  CHECK(with([](auto& a) { a.tau_s = -kInf; }) == Status::kErrorInvalidThreshold);
  CHECK(with([](auto& a) { a.x = fake<const T>(0, 1); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.w_gate = fake<const void>(1, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.w_up = fake<const void>(2, 4); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.scale_gate = fake<const float>(3, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.channel_mask = fake<std::uint32_t>(5, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.s_proxy = fake<float>(6, 1); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.counters = fake<prox::SparsityCounters>(8, 4); }) == Status::kErrorMisalignedPointer);
  // The workspace.
  CHECK(launch(good, nullptr, need) == Status::kErrorNullPointer);
  CHECK(launch(good, ws, need - 1) == Status::kErrorWorkspaceTooSmall);
  CHECK(launch(good, fake<void>(7, 8), need) == Status::kErrorMisalignedPointer);
}

TEMPLATE_TEST_CASE("GLU, down and fused Stage-2 GEMVs: bad input gets a Status before any launch", "[validation]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  using GP = prox::PolicyAt<0, prox::GluGemvPolicies>;
  using DP = prox::PolicyAt<0, prox::DownGemvPolicies>;
  using FP = prox::PolicyAt<0, prox::GluDownGemvPolicies>;

  // Fused Stage 2 (its GLU part follows the GLU GEMV's rules).
  const prox::GluDownGemvArgs<T> good = glu_down_args<T>();
  REQUIRE(prox::glu_down_gemv::can_implement(good) == Status::kSuccess);
  const auto fused = [](auto mutate) {
    prox::GluDownGemvArgs<T> a = glu_down_args<T>();
    mutate(a);
    return prox::glu_down_gemv::launch<FP, prox::SiLU>(a, fake<void>(9), std::size_t(1) << 30, nullptr);
  };
  CHECK(fused([](auto& a) { a.x = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.channel_mask = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.s = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.w_down_t = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.y = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.d_model = 4100; }) == Status::kErrorInvalidShape);  // not a multiple of 8
  CHECK(fused([](auto& a) { a.d_model = 0; }) == Status::kErrorInvalidShape);
  CHECK(fused([](auto& a) { a.d_ff = 12300; }) == Status::kErrorInvalidShape);
  CHECK(fused([](auto& a) { a.grid_blocks = -1; }) == Status::kErrorInvalidArgument);
  CHECK(fused([](auto& a) { a.x = fake<const T>(0, 8); }) == Status::kErrorMisalignedPointer);  // 16 bytes needed
  CHECK(fused([](auto& a) { a.w_gate = fake<const T>(1, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.s = fake<float>(4, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.w_down_t = fake<const T>(5, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.y = fake<T>(6, 1); }) == Status::kErrorMisalignedPointer);

  // GLU GEMV alone.
  const prox::GluGemvArgs<T> glu_good = good;
  REQUIRE(prox::glu_gemv::can_implement(glu_good) == Status::kSuccess);
  const auto glu = [&](auto mutate) {
    prox::GluGemvArgs<T> a = glu_good;
    mutate(a);
    return prox::glu_gemv::launch<GP, prox::SiLU>(a, nullptr, 0, nullptr);
  };
  CHECK(glu([](auto& a) { a.w_up = nullptr; }) == Status::kErrorNullPointer);
  CHECK(glu([](auto& a) { a.d_model = 12; }) == Status::kErrorInvalidShape);
  CHECK(glu([](auto& a) { a.d_ff = 16; }) == Status::kErrorInvalidShape);
  CHECK(glu([](auto& a) { a.grid_blocks = -2; }) == Status::kErrorInvalidArgument);
  CHECK(glu([](auto& a) { a.channel_mask = fake<const std::uint32_t>(3, 1); }) == Status::kErrorMisalignedPointer);

  // Down GEMV alone, with its workspace.
  const prox::DownGemvArgs<T> down_good = down_args<T>();
  REQUIRE(prox::down_gemv::can_implement(down_good) == Status::kSuccess);
  const std::size_t need = prox::down_gemv::workspace_bytes<DP>(down_good);
  const auto down = [&](auto mutate, void* ws, std::size_t bytes) {
    prox::DownGemvArgs<T> a = down_good;
    mutate(a);
    return prox::down_gemv::launch<DP>(a, ws, bytes, nullptr);
  };
  const auto none = [](auto&) {};
  void* ws = fake<void>(9);
  CHECK(down([](auto& a) { a.s = nullptr; }, ws, need) == Status::kErrorNullPointer);
  CHECK(down([](auto& a) { a.d_ff = 33; }, ws, need) == Status::kErrorInvalidShape);
  CHECK(down([](auto& a) { a.d_model = (1 << 20) + 8; }, ws, need) == Status::kErrorInvalidShape);
  CHECK(down([](auto& a) { a.w_down_t = fake<const T>(2, 4); }, ws, need) == Status::kErrorMisalignedPointer);
  CHECK(down([](auto& a) { a.y = fake<T>(3, 1); }, ws, need) == Status::kErrorMisalignedPointer);
  CHECK(down(none, nullptr, need) == Status::kErrorNullPointer);
  CHECK(down(none, ws, need - 1) == Status::kErrorWorkspaceTooSmall);
  CHECK(down(none, fake<void>(9, 4), need) == Status::kErrorMisalignedPointer);
}

TEST_CASE("fused Stage 2: the plan's default policy covers a row with the fewest GLU load slots", "[validation]") {
  using L = prox::GluDownGemvPolicies;
  namespace gd = prox::glu_down_gemv;
  using P0 = prox::PolicyAt<0, L>;  // 256 threads
  using P1 = prox::PolicyAt<1, L>;  // 320 threads
  STATIC_REQUIRE(P0::kThreads == 256);
  STATIC_REQUIRE(P1::kThreads == 320);
  CHECK(gd::glu_row_slots<P0>(4096) == 512);  // 512 pieces: 2 full steps
  CHECK(gd::glu_row_slots<P0>(5120) == 768);  // 640 pieces: 3 steps, the last half idle
  CHECK(gd::glu_row_slots<P1>(5120) == 640);
  CHECK(gd::glu_row_slots<P1>(8) == 320);     // 1 piece still takes a step
  CHECK(gd::default_policy<L>(2048) == 0);    // Qwen3-1.7B: 256 slots against 320
  CHECK(gd::default_policy<L>(2560) == 1);    // Qwen3-4B: 320 against 512
  CHECK(gd::default_policy<L>(4096) == 0);    // Qwen3-8B: a tie of 0 and 2 goes to the lower index
  CHECK(gd::default_policy<L>(5120) == 1);    // Qwen3-14B and 32B: 640 against 768
  CHECK(gd::default_policy<L>(7168) == 1);    // 896 pieces: 960 against 1024
  CHECK(gd::default_policy<L>(3584) == 0);    // 448 pieces: 512 against 640
  CHECK(gd::default_policy<L>(8) == 0);
}

namespace {
//! Bytes of split-K partials an op's launch puts after its counter region (0 without split-K).
constexpr std::size_t partial_bytes(int chunks, int mats, int columns) {
  return chunks > 1 ? sizeof(float) * static_cast<std::size_t>(mats) * static_cast<std::size_t>(chunks) *
                          static_cast<std::size_t>(columns)
                    : 0;
}

template <class List>
void check_proxy_counter_region(int K, int N) {
  prox::ProxyGemvArgs<__half> a;
  a.d_model = K;
  a.d_ff = N;
  const std::size_t region = prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N);
  prox::for_each_policy<List>([&](auto p, int pi) {
    using P = decltype(p);
    CAPTURE(K, N, pi, P::name());
    // Its counters fit the common region, and its partials start right after it.
    CHECK(sizeof(unsigned) * static_cast<std::size_t>(prox::proxy_gemv::num_tiles<P>(N)) <= region);
    CHECK(prox::proxy_gemv::workspace_bytes<P>(a) ==
          region + partial_bytes(prox::proxy_gemv::num_chunks<P>(K), 2, N));
  });
}
}  // namespace

TEST_CASE("workspace: every policy of an op keeps its tile counters in one region of the same size",
          "[validation][workspace]") {
  // A workspace zeroed once serves every policy of an op at one shape only if no policy's split-K
  // partials land on another policy's counters (tests/test_workspace.cu runs it on the GPU).
  for (int N : {32, 1056, 2080, 16640, 17408, 25600, 1 << 20}) {
    check_proxy_counter_region<prox::ProxyGemvPolicies>(4096, N);
    check_proxy_counter_region<prox::DenseProxyGemvPolicies>(1032, N);
    // The narrowest tile any policy may have fits too.
    CHECK(sizeof(unsigned) * static_cast<std::size_t>((N + prox::detail::kMinTileWidth - 1) /
                                                      prox::detail::kMinTileWidth) <=
          prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N));
    CHECK(prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N) % 256 == 0);
    // The launching policy's tile only checks its width: the region is the same for every tile.
    CHECK(prox::detail::tile_counter_bytes<256>(N) == prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N));
    CHECK(prox::detail::tile_counter_bytes<512>(N) == prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N));
  }
  for (int K : {8, 1032, 4096, 8448, 1 << 20}) {
    prox::DownGemvArgs<__half> d;
    d.d_model = K;
    d.d_ff = 12288;
    const std::size_t region = prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(K);
    prox::for_each_policy<prox::DownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      CAPTURE(K, pi, P::name());
      CHECK(sizeof(unsigned) * static_cast<std::size_t>(prox::down_gemv::num_tiles<P>(K)) <= region);
      CHECK(prox::down_gemv::workspace_bytes<P>(d) ==
            region + partial_bytes(prox::down_gemv::num_chunks<P>(12288), 1, K));
    });
    prox::for_each_policy<prox::GluDownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      for (int blocks : {1, 7, 264, 396}) {
        CAPTURE(K, pi, P::name(), blocks);
        const auto l = prox::glu_down_gemv::workspace_layout<P>(K, blocks);
        CHECK(l.barrier == 0u);  // the same offsets for every policy and grid
        CHECK(l.counters == 256u);
        CHECK(l.partials == 256u + region);
        CHECK(sizeof(unsigned) * static_cast<std::size_t>(prox::glu_down_gemv::num_tiles<P>(K)) <= region);
        CHECK(l.total >= l.partials);
      }
    });
  }
}

TEMPLATE_TEST_CASE("packing and transpose: bad input gets a Status before any launch", "[validation]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  const T* w = fake<const T>(0);
  std::uint32_t* packed = fake<std::uint32_t>(1);
  float* scales = fake<float>(2);
  CHECK(prox::int4::pack_device<T>(nullptr, 64, 64, packed, scales, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::int4::pack_device(w, 64, 64, nullptr, scales, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::int4::pack_device(w, 64, 64, packed, nullptr, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::int4::pack_device(w, 64, 40, packed, scales, nullptr) == Status::kErrorInvalidShape);
  CHECK(prox::int4::pack_device(w, 0, 64, packed, scales, nullptr) == Status::kErrorInvalidShape);
  CHECK(prox::int4::pack_device(fake<const T>(0, 1), 64, 64, packed, scales, nullptr) ==
        Status::kErrorMisalignedPointer);
  CHECK(prox::int4::pack_device(w, 64, 64, fake<std::uint32_t>(1, 2), scales, nullptr) ==
        Status::kErrorMisalignedPointer);
  CHECK(prox::int4::pack_device(w, 64, 64, packed, fake<float>(2, 2), nullptr) == Status::kErrorMisalignedPointer);

  T* out = fake<T>(3);
  CHECK(prox::transpose_device<T>(nullptr, 8, 8, out, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::transpose_device<T>(w, 8, 8, nullptr, nullptr) == Status::kErrorNullPointer);
  CHECK(prox::transpose_device(w, 0, 8, out, nullptr) == Status::kErrorInvalidShape);
  CHECK(prox::transpose_device(w, 8, -1, out, nullptr) == Status::kErrorInvalidShape);
  CHECK(prox::transpose_device(fake<const T>(0, 1), 8, 8, out, nullptr) == Status::kErrorMisalignedPointer);
  CHECK(prox::transpose_device(w, 8, 8, fake<T>(3, 1), nullptr) == Status::kErrorMisalignedPointer);
}

TEMPLATE_TEST_CASE("SparseFfn: plan refuses bad layers before it asks the device; nothing runs unplanned",
                   "[validation]", __half, __nv_bfloat16) {
  using T = TestType;
  using Ffn = prox::SparseFfn<T>;
  typename Ffn::Weights w;
  w.w_gate = fake<const T>(0);
  w.w_up = fake<const T>(1);
  w.w_down_t = fake<const T>(2);
  w.proxy_gate = fake<const void>(3);
  w.proxy_up = fake<const void>(4);
  w.proxy_scale_gate = fake<const float>(5);
  w.proxy_scale_up = fake<const float>(6);
  const typename Ffn::Config cfg{4096, 12288, 0.5f, 0.25f};
  Ffn f;
  const auto plan = [&](auto mutate_cfg, auto mutate_w) {
    typename Ffn::Config c = cfg;
    typename Ffn::Weights ww = w;
    mutate_cfg(c);
    mutate_w(ww);
    return f.plan(c, ww);
  };
  const auto none = [](auto&) {};
  CHECK(plan([](auto& c) { c.d_model = 4100; }, none) == Status::kErrorInvalidShape);
  CHECK(plan([](auto& c) { c.d_model = 0; }, none) == Status::kErrorInvalidShape);
  CHECK(plan([](auto& c) { c.d_ff = 12300; }, none) == Status::kErrorInvalidShape);
  CHECK(plan([](auto& c) { c.d_ff = (1 << 20) + 32; }, none) == Status::kErrorInvalidShape);
  CHECK(plan([](auto& c) { c.tau_x = kNaN; }, none) == Status::kErrorInvalidThreshold);
  CHECK(plan([](auto& c) { c.tau_s = -1.0f; }, none) == Status::kErrorInvalidThreshold);
  CHECK(plan(none, [](auto& ww) { ww.w_gate = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.w_down_t = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_up = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_scale_gate = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.w_up = fake<const T>(1, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_gate = fake<const void>(3, 4); }) == Status::kErrorMisalignedPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_scale_up = fake<const float>(6, 2); }) ==
        Status::kErrorMisalignedPointer);

  // A failed plan leaves the layer unplanned: run and values mode refuse before touching anything.
  CHECK(f.workspace_bytes() == 0);
  CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), std::size_t(1) << 30, nullptr) == Status::kErrorNotPlanned);
  CHECK(f.run_proxy_values(fake<const T>(7), fake<float>(8), fake<void>(9), std::size_t(1) << 30, nullptr) ==
        Status::kErrorNotPlanned);

  // A valid layer: without a device plan says so (kErrorNoDevice); with one it plans, and run
  // then checks its own arguments before launching.
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    CHECK(f.plan(cfg, w) == Status::kErrorNoDevice);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), std::size_t(1) << 30, nullptr) ==
          Status::kErrorNotPlanned);
    (void)cudaGetLastError();
  } else {
    REQUIRE(f.plan(cfg, w) == Status::kSuccess);
    const std::size_t ws = f.workspace_bytes();
    CHECK(f.run(nullptr, fake<T>(8), fake<void>(9), ws, nullptr) == Status::kErrorNullPointer);
    CHECK(f.run(fake<const T>(7, 2), fake<T>(8), fake<void>(9), ws, nullptr) == Status::kErrorMisalignedPointer);
    CHECK(f.run(fake<const T>(7), fake<T>(8, 8), fake<void>(9), ws, nullptr) == Status::kErrorMisalignedPointer);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), ws - 1, nullptr) == Status::kErrorWorkspaceTooSmall);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), ws,
                nullptr, fake<prox::SparsityCounters>(10, 4)) == Status::kErrorMisalignedPointer);
  }
}

TEST_CASE("calibrate_layer: bad arguments get a Status before any launch", "[validation]") {
  using T = __half;
  using Ffn = prox::SparseFfn<T>;
  typename Ffn::Weights w;
  Ffn f;  // unplanned
  prox::calib::ThresholdCalibrator cal;
  prox::calib::LayerCalibrationArgs<T> a;
  a.x = fake<const T>(0);
  a.tokens = 16;
  a.target = {0.1, 0.7};
  a.ffn_workspace = fake<void>(1);
  a.ffn_workspace_bytes = std::size_t(1) << 30;
  a.s_proxy = fake<float>(2);
  prox::calib::LayerCalibration out;
  CHECK(prox::calib::calibrate_layer(f, w, a, cal, nullptr, nullptr) == Status::kErrorNullPointer);
  auto b = a;
  b.x = nullptr;
  CHECK(prox::calib::calibrate_layer(f, w, b, cal, nullptr, &out) == Status::kErrorNullPointer);
  CHECK(prox::calib::calibrate_layer(f, w, a, cal, nullptr, &out) == Status::kErrorNotPlanned);
}
