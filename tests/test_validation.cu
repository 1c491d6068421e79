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
#include <type_traits>

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

//! A proxy matrix of format Fmt at fabricated addresses (data `offset` bytes past its slot).
template <class Fmt>
typename Fmt::Matrix matrix(int data_slot, int scale_slot, std::uintptr_t offset = 0) {
  typename Fmt::Matrix m;
  if constexpr (std::is_same_v<Fmt, prox::Int4Weights>) {
    m.packed = fake<const std::uint32_t>(data_slot, offset);
  } else {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(m.w)>>;
    m.w = fake<const W>(data_slot, offset);
  }
  m.scales = fake<const float>(scale_slot);
  return m;
}

template <class T, class Fmt = prox::Int4Weights>
prox::ProxyGemvArgs<T, Fmt> proxy_args() {
  prox::ProxyGemvArgs<T, Fmt> a;
  a.x = fake<const T>(0);
  a.d_model = 4096;
  a.d_ff = 12288;
  a.tau_x = 0.5f;
  a.tau_s = 0.25f;
  a.gate = matrix<Fmt>(1, 3);
  a.up = matrix<Fmt>(2, 4);
  a.channel_mask = fake<std::uint32_t>(5);
  return a;
}

//! Plan an op as an engine would (Operator::initialize): bad arguments or options return their
//! Status before the device is asked anything; good ones then need a device (kErrorNoDevice here).
template <class Op>
Status plan(const typename Op::Args& a, const typename Op::Options& o = {}, int policy = -1) {
  prox::Operator<Op> op;
  const Status st = op.initialize(a, o, policy);
  (void)cudaGetLastError();  // the test's own: a failed device query leaves no error behind anyway
  return st;
}

//! Whether this machine has a CUDA device (the workspace checks of run() need a planned op).
bool have_device() {
  int n = 0;
  const bool yes = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return yes;
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
  using Op = prox::ThresholdOp<T>;
  prox::ThresholdArgs<T> good{fake<const T>(0), 4096, 0.5f, fake<std::uint32_t>(1), fake<int>(2), fake<int>(3)};
  REQUIRE(Op::can_implement(good) == Status::kSuccess);
  const auto launch = [](const prox::ThresholdArgs<T>& a) { return plan<Op>(a); };
  auto a = good;
  a.x = nullptr;
  CHECK(launch(a) == Status::kErrorNullPointer);
  a = good;
  a.mask = nullptr;
  CHECK(launch(a) == Status::kErrorNullPointer);
  a = good;
  a.count = nullptr;  // indices without a count
  CHECK(launch(a) == Status::kErrorNullPointer);
  for (int n : {0, -1, prox::kMaxThresholdLength + 1}) {
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
  CHECK(plan<Op>(good, {}, prox::ThresholdPolicies::kSize) == Status::kErrorInvalidArgument);  // no such policy
  CHECK(plan<Op>(good, {}, -2) == Status::kErrorInvalidArgument);
  CHECK(prox::Operator<Op>::workspace_bytes(good) == 0u);  // needs none
}

TEMPLATE_TEST_CASE("proxy GEMV: bad input gets a Status before any launch", "[validation]", prox::Int4Weights,
                   prox::DenseWeights<__half>) {
  using Fmt = TestType;
  using T = __half;
  using Op = prox::ProxyGemvOp<T, prox::SiLU, Fmt>;
  const prox::ProxyGemvArgs<T, Fmt> good = proxy_args<T, Fmt>();
  REQUIRE(Op::can_implement(good) == Status::kSuccess);
  const auto with = [&](auto mutate) {
    prox::ProxyGemvArgs<T, Fmt> a = good;
    mutate(a);
    return plan<Op>(a);
  };
  CHECK(with([](auto& a) { a.x = nullptr; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.gate = typename Fmt::Matrix{}; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.up = typename Fmt::Matrix{}; }) == Status::kErrorNullPointer);
  CHECK(with([](auto& a) { a.channel_mask = nullptr; }) == Status::kErrorNullPointer);  // and no s_proxy
  if (Fmt::kNeedsScales) {
    CHECK(with([](auto& a) { a.gate.scales = nullptr; }) == Status::kErrorNullPointer);
    CHECK(with([](auto& a) { a.up.scales = nullptr; }) == Status::kErrorNullPointer);
  } else {  // fp16 proxies carry no scales
    prox::ProxyGemvArgs<T, Fmt> a = good;
    a.gate.scales = a.up.scales = nullptr;
    CHECK(Op::can_implement(a) == Status::kSuccess);
  }
  {  // values mode alone is a valid output
    prox::ProxyGemvArgs<T, Fmt> a = good;
    a.channel_mask = nullptr;
    a.s_proxy = fake<float>(6);
    CHECK(Op::can_implement(a) == Status::kSuccess);
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
  CHECK(with([](auto& a) { a.gate = matrix<Fmt>(1, 3, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.up = matrix<Fmt>(2, 4, 4); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.gate.scales = fake<const float>(3, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.channel_mask = fake<std::uint32_t>(5, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.s_proxy = fake<float>(6, 1); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.thresholds = fake<const float>(7, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(with([](auto& a) { a.counters = fake<prox::SparsityCounters>(8, 4); }) == Status::kErrorMisalignedPointer);
  CHECK(plan<Op>(good, {}, Op::Policies::kSize) == Status::kErrorInvalidArgument);
  // The workspace (run() on a planned op).
  const std::size_t need = prox::Operator<Op>::workspace_bytes(good);
  REQUIRE(need > prox::detail::kHeaderBytes);
  if (have_device()) {
    prox::Operator<Op> op;
    REQUIRE(op.initialize(good) == Status::kSuccess);
    CHECK(op.run(good, nullptr, need, nullptr) == Status::kErrorNullPointer);
    CHECK(op.run(good, fake<void>(9), need - 1, nullptr) == Status::kErrorWorkspaceTooSmall);
    CHECK(op.run(good, fake<void>(9, 8), need, nullptr) == Status::kErrorMisalignedPointer);
    prox::ProxyGemvArgs<T, Fmt> other = good;
    other.d_ff = 12288 - 32;  // a valid shape, not the planned one
    CHECK(op.run(other, fake<void>(9), need, nullptr) == Status::kErrorInvalidArgument);
  } else {
    CHECK(plan<Op>(good) == Status::kErrorNoDevice);
    CHECK(prox::Operator<Op>().run(good, fake<void>(9), need, nullptr) == Status::kErrorNotPlanned);
  }
}

TEMPLATE_TEST_CASE("GLU, down and fused Stage-2 GEMVs: bad input gets a Status before any launch", "[validation]",
                   __half, __nv_bfloat16) {
  using T = TestType;
  using Glu = prox::GluGemvOp<T, prox::SiLU>;
  using Down = prox::DownGemvOp<T>;
  using Fused = prox::GluDownGemvOp<T, prox::SiLU>;

  // Fused Stage 2 (its GLU part follows the GLU GEMV's rules).
  const prox::GluDownGemvArgs<T> good = glu_down_args<T>();
  REQUIRE(Fused::can_implement(good) == Status::kSuccess);
  const auto fused = [](auto mutate) {
    prox::GluDownGemvArgs<T> a = glu_down_args<T>();
    mutate(a);
    return plan<Fused>(a);
  };
  CHECK(fused([](auto& a) { a.x = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.channel_mask = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.s = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.w_down_t = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.y = nullptr; }) == Status::kErrorNullPointer);
  CHECK(fused([](auto& a) { a.d_model = 4100; }) == Status::kErrorInvalidShape);  // not a multiple of 8
  CHECK(fused([](auto& a) { a.d_model = 0; }) == Status::kErrorInvalidShape);
  CHECK(fused([](auto& a) { a.d_ff = 12300; }) == Status::kErrorInvalidShape);
  CHECK(fused([](auto& a) { a.x = fake<const T>(0, 8); }) == Status::kErrorMisalignedPointer);  // 16 bytes needed
  CHECK(fused([](auto& a) { a.w_gate = fake<const T>(1, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.s = fake<float>(4, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.w_down_t = fake<const T>(5, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(fused([](auto& a) { a.y = fake<T>(6, 1); }) == Status::kErrorMisalignedPointer);
  typename Fused::Options fo;
  fo.grid_blocks = -1;
  CHECK(plan<Fused>(good, fo) == Status::kErrorInvalidArgument);

  // GLU GEMV alone.
  const prox::GluGemvArgs<T> glu_good = good;
  REQUIRE(Glu::can_implement(glu_good) == Status::kSuccess);
  const auto glu = [&](auto mutate) {
    prox::GluGemvArgs<T> a = glu_good;
    mutate(a);
    return plan<Glu>(a);
  };
  CHECK(glu([](auto& a) { a.w_up = nullptr; }) == Status::kErrorNullPointer);
  CHECK(glu([](auto& a) { a.d_model = 12; }) == Status::kErrorInvalidShape);
  CHECK(glu([](auto& a) { a.d_ff = 16; }) == Status::kErrorInvalidShape);
  CHECK(glu([](auto& a) { a.channel_mask = fake<const std::uint32_t>(3, 1); }) == Status::kErrorMisalignedPointer);
  typename Glu::Options go;
  go.grid_blocks = -2;
  CHECK(plan<Glu>(glu_good, go) == Status::kErrorInvalidArgument);

  // Down GEMV alone.
  const prox::DownGemvArgs<T> down_good = down_args<T>();
  REQUIRE(Down::can_implement(down_good) == Status::kSuccess);
  const auto down = [&](auto mutate) {
    prox::DownGemvArgs<T> a = down_good;
    mutate(a);
    return plan<Down>(a);
  };
  CHECK(down([](auto& a) { a.s = nullptr; }) == Status::kErrorNullPointer);
  CHECK(down([](auto& a) { a.d_ff = 33; }) == Status::kErrorInvalidShape);
  CHECK(down([](auto& a) { a.d_model = (1 << 20) + 8; }) == Status::kErrorInvalidShape);
  CHECK(down([](auto& a) { a.w_down_t = fake<const T>(2, 4); }) == Status::kErrorMisalignedPointer);
  CHECK(down([](auto& a) { a.y = fake<T>(3, 1); }) == Status::kErrorMisalignedPointer);
  if (have_device()) {
    const std::size_t need = prox::Operator<Down>::workspace_bytes(down_good);
    prox::Operator<Down> op;
    REQUIRE(op.initialize(down_good) == Status::kSuccess);
    CHECK(op.run(down_good, nullptr, need, nullptr) == Status::kErrorNullPointer);
    CHECK(op.run(down_good, fake<void>(9), need - 1, nullptr) == Status::kErrorWorkspaceTooSmall);
    CHECK(op.run(down_good, fake<void>(9, 4), need, nullptr) == Status::kErrorMisalignedPointer);
  }
}

TEMPLATE_TEST_CASE("fused batched Stage 2: bad input gets a Status before any launch", "[validation]", __half,
                   __nv_bfloat16) {
  using T = TestType;
  using Op = prox::BatchedGluDownGemvOp<T, prox::GeluTanh, 4>;
  prox::BatchedGluDownGemvArgs<T> good;
  good.x = fake<const T>(0);
  good.tokens = 3;
  good.d_model = 5120;
  good.d_ff = 17408;
  good.w_gate = fake<const T>(1);
  good.w_up = fake<const T>(2);
  good.channel_mask = fake<const std::uint32_t>(3);
  good.union_mask = fake<const std::uint32_t>(4);
  good.s = fake<float>(5);
  good.w_down_t = fake<const T>(6);
  good.y = fake<T>(7);
  REQUIRE(Op::can_implement(good) == Status::kSuccess);
  const auto bad = [&](auto mutate) {
    prox::BatchedGluDownGemvArgs<T> a = good;
    mutate(a);
    return plan<Op>(a);
  };
  CHECK(bad([](auto& a) { a.x = nullptr; }) == Status::kErrorNullPointer);
  CHECK(bad([](auto& a) { a.union_mask = nullptr; }) == Status::kErrorNullPointer);
  CHECK(bad([](auto& a) { a.channel_mask = nullptr; }) == Status::kErrorNullPointer);
  CHECK(bad([](auto& a) { a.w_down_t = nullptr; }) == Status::kErrorNullPointer);
  CHECK(bad([](auto& a) { a.y = nullptr; }) == Status::kErrorNullPointer);
  CHECK(bad([](auto& a) { a.tokens = 0; }) == Status::kErrorInvalidArgument);
  CHECK(bad([](auto& a) { a.tokens = 5; }) == Status::kErrorInvalidArgument);  // past the capacity
  CHECK(bad([](auto& a) { a.d_model = 5124; }) == Status::kErrorInvalidShape);
  CHECK(bad([](auto& a) { a.d_ff = 17400; }) == Status::kErrorInvalidShape);
  CHECK(bad([](auto& a) { a.x = fake<const T>(0, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(bad([](auto& a) { a.union_mask = fake<const std::uint32_t>(4, 2); }) == Status::kErrorMisalignedPointer);
  CHECK(bad([](auto& a) { a.w_down_t = fake<const T>(6, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(bad([](auto& a) { a.y = fake<T>(7, 1); }) == Status::kErrorMisalignedPointer);
  typename Op::Options o;
  o.grid_blocks = -1;
  CHECK(plan<Op>(good, o) == Status::kErrorInvalidArgument);
  CHECK(plan<Op>(good, {}, 2) == Status::kErrorInvalidArgument);  // no such candidate
}

namespace {
//! A candidate of default_policy(): its grid size, residency and pipeline depth.
template <int Blocks, int MinBlocks, int Stages = 0>
struct G {
  static constexpr int kBlocks = Blocks;
  static constexpr int kMinBlocks = MinBlocks;
  static constexpr int kStages = Stages;
  static std::string name() { return "g" + std::to_string(Blocks) + "_" + std::to_string(Stages); }
};
}  // namespace

TEST_CASE("default_fewest_waves: fewest waves, then the multi-wave preference, then most blocks, then lower index",
          "[policy]") {
  const auto blocks = [](auto p) { return long(decltype(p)::kBlocks); };
  const auto pipelined = [](auto p) { return decltype(p)::kStages > 0; };
  // 132 SMs x 3 resident blocks: a wave holds 396 blocks. The lists mirror the Stage-1 grids of the
  // Qwen3 shapes for ProxyGemvPolicies (512-, 1024-, 256-input chunks, 1024 pipelined).
  using L8B = prox::PolicyList<G<384, 3>, G<192, 3>, G<768, 3>, G<192, 3, 3>>;
  using L14B = prox::PolicyList<G<680, 3>, G<340, 3>, G<1360, 3>, G<340, 3, 3>>;
  using L32B = prox::PolicyList<G<1000, 3>, G<500, 3>, G<2000, 3>, G<500, 3, 3>>;
  CHECK(prox::detail::default_fewest_waves<L8B>(132, blocks, pipelined) == 0);   // one wave, most blocks
  CHECK(prox::detail::default_fewest_waves<L14B>(132, blocks, pipelined) == 1);  // one wave: no preference, lower index
  CHECK(prox::detail::default_fewest_waves<L32B>(132, blocks, pipelined) == 3);  // two waves: the pipelined one
  CHECK(prox::detail::default_fewest_waves<L32B>(132, blocks) == 1);             // no preference given: lower index
  // The preference never outweighs a wave, and among preferred candidates more blocks still win.
  CHECK(prox::detail::default_fewest_waves<prox::PolicyList<G<800, 3, 3>, G<396, 3>>>(132, blocks, pipelined) == 1);
  CHECK(prox::detail::default_fewest_waves<prox::PolicyList<G<500, 3, 3>, G<700, 3, 3>, G<790, 3>>>(132, blocks, pipelined) == 1);
}

TEST_CASE("fused Stage 2: the plan's default policy covers a row with the fewest GLU load slots", "[validation]") {
  using L = prox::GluDownGemvPolicies;
  using P0 = prox::PolicyAt<0, L>;  // 256 threads
  using P1 = prox::PolicyAt<1, L>;  // 320 threads
  STATIC_REQUIRE(P0::kThreads == 256);
  STATIC_REQUIRE(P1::kThreads == 320);
  using W = prox::NativeWeights<__half>;
  using R0 = prox::detail::GluRowsOf<typename P0::Glu, __half, W>;
  using R1 = prox::detail::GluRowsOf<typename P1::Glu, __half, W>;
  CHECK(R0::row_slots(4096) == 512);  // 512 pieces: 2 full steps
  CHECK(R0::row_slots(5120) == 768);  // 640 pieces: 3 steps, the last half idle
  CHECK(R1::row_slots(5120) == 640);
  CHECK(R1::row_slots(8) == 320);     // 1 piece still takes a step
  const auto dflt = [](int d_model) {
    prox::GluDownGemvArgs<__half> a;
    a.d_model = d_model;
    return prox::default_policy(prox::GluDownGemvOp<__half, prox::SiLU>{}, prox::DeviceInfo{}, a);
  };
  CHECK(dflt(2048) == 0);  // Qwen3-1.7B: 256 slots against 320
  CHECK(dflt(2560) == 1);  // Qwen3-4B: 320 against 512
  CHECK(dflt(4096) == 0);  // Qwen3-8B: a tie of 0 and 2 goes to the lower index
  CHECK(dflt(5120) == 1);  // Qwen3-14B and 32B: 640 against 768
  CHECK(dflt(7168) == 1);  // 896 pieces: 960 against 1024
  CHECK(dflt(3584) == 0);  // 448 pieces: 512 against 640
  CHECK(dflt(8) == 0);
}

namespace {
//! The planner's view of an H100: 132 SMs, sm_90 (the default-policy tests need no device).
prox::DeviceInfo h100_info() {
  prox::DeviceInfo d;
  d.sm_count = 132;
  d.cc_major = 9;
  return d;
}
//! The candidate default_policy() gives Op on an H100 for a (d_model, d_ff) shape.
template <class Op>
int h100_default(int d_model, int d_ff) {
  typename Op::Args a;
  a.d_model = d_model;
  a.d_ff = d_ff;
  return prox::default_policy(Op{}, h100_info(), a);
}
}  // namespace

TEST_CASE("Stage 1: the plan's default policy takes the fewest waves, then cp.async past one wave", "[validation]") {
  using Op = prox::ProxyGemvOp<__half, prox::SiLU>;
  const auto dflt = h100_default<Op>;
  // Qwen3-32B: every candidate needs two waves of 396 slots; the cp.async candidate (3) is preferred.
  CHECK(Op::num_blocks<prox::PolicyAt<0, prox::ProxyGemvPolicies>>(5120, 25600) > 396);
  CHECK(dflt(5120, 25600) == 3);
  CHECK(dflt(4096, 12288) == 0);  // Qwen3-8B: 384 blocks, one wave
}

TEST_CASE("batched Stage 1 at B = 2 and 4: the split candidate only where its grid needs two waves", "[validation]") {
  const auto check = [](auto op) {
    using Op = decltype(op);
    const auto dflt = h100_default<Op>;
    using Split = prox::PolicyAt<2, typename Op::Policies>;
    static_assert(Split::kSplitMats && Split::kTwoWaves && Split::kMinBlocks == 3 && Split::kChunk == 1024,
                  "candidate 2 is the split one");
    CAPTURE(Op::kTokens);
    // Qwen3-14B: 136 tiles x 5 chunks = 680 blocks in 396 slots (2 waves), against 408 in 264 (2 waves) for
    // candidate 1: the most blocks.
    CHECK(Op::template num_blocks<Split>(5120, 17408, 132) == 680);
    CHECK(Op::template num_blocks<prox::PolicyAt<1, typename Op::Policies>>(5120, 17408, 132) == 408);
    CHECK(dflt(5120, 17408) == 2);
    // Qwen3-8B: one wave (384 blocks in 396 slots): left out; candidate 1 (192 blocks, one wave of 264).
    CHECK(Op::template num_blocks<Split>(4096, 12288, 132) == 384);
    CHECK(dflt(4096, 12288) == 1);
    // Qwen3-32B: three waves (1000 blocks): left out; candidate 1 (600 blocks, 3 waves of 264).
    CHECK(Op::template num_blocks<Split>(5120, 25600, 132) == 1000);
    CHECK(dflt(5120, 25600) == 1);
    // Qwen3-4B and 1.7B: one wave after the balanced split: left out.
    CHECK(Op::template num_blocks<Split>(2560, 9728, 132) <= 396);
    CHECK(dflt(2560, 9728) == 0);
    CHECK(Op::template num_blocks<Split>(2048, 6144, 132) <= 396);
    CHECK(dflt(2048, 6144) == 0);
  };
  check(prox::BatchedProxyGemvOp<__half, prox::SiLU, 2>{});
  check(prox::BatchedProxyGemvOp<__half, prox::SiLU, 4>{});
}

TEST_CASE("batched down GEMV at B = 2: the one-wave-only 3072-channel candidate on Qwen3-14B only", "[validation]") {
  using Op = prox::BatchedDownGemvOp<__half, 2>;
  const auto dflt = h100_default<Op>;
  using OneWave = prox::PolicyAt<2, Op::Policies>;
  static_assert(OneWave::kOneWave && OneWave::kChunk == 3072, "candidate 2 is the one-wave 3072-channel one");
  // Qwen3-14B: 40 tiles x 6 chunks = 240 blocks in 264 slots, against 360 (2 waves) for candidate 0.
  CHECK(Op::num_blocks<OneWave>(5120, 17408, 132) == 240);
  CHECK(Op::num_blocks<prox::PolicyAt<0, Op::Policies>>(5120, 17408, 132) == 360);
  CHECK(dflt(5120, 17408) == 2);
  // Qwen3-32B: 360 blocks, more than one wave: left out. 8B and 4B: candidate 0 fills one wave after the
  // balanced split (256, 260 blocks) and the one-wave candidate has no more: the tie goes to candidate 0.
  // 1.7B: the 512-channel candidate's split has the most blocks (256, against 192 and 128).
  CHECK(Op::num_blocks<OneWave>(5120, 25600, 132) > 264);
  CHECK(dflt(5120, 25600) == 0);
  CHECK(Op::num_blocks<OneWave>(4096, 12288, 132) == 256);
  CHECK(dflt(4096, 12288) == 0);
  CHECK(dflt(2560, 9728) == 0);
  CHECK(Op::num_blocks<OneWave>(2048, 6144, 132) == 128);
  CHECK(dflt(2048, 6144) == 1);
}

TEST_CASE("batched down GEMV at B = 4: the one-wave-only candidates where their grids fit one wave", "[validation]") {
  using Op = prox::BatchedDownGemvOp<__half, 4>;
  const auto dflt = h100_default<Op>;
  using OneWave = prox::PolicyAt<2, Op::Policies>;
  static_assert(OneWave::kOneWave && OneWave::kChunk == 1536, "candidate 2 is the one-wave 1536-channel one");
  // Qwen3-8B: 32 tiles x 8 chunks = 256 blocks in 264 slots, against 384 (2 waves) for candidate 0.
  CHECK(Op::num_blocks<OneWave>(4096, 12288, 132) == 256);
  CHECK(dflt(4096, 12288) == 2);
  // Qwen3-14B and 32B: the candidate would only take 3 waves to 2 (4 to 3); it is left out. On 14B the
  // 3072-channel one-wave candidate (3) fits: 40 tiles x 6 chunks = 240 blocks (77 KB of dynamic shared
  // memory). On 8B it ties candidate 2 (256 blocks): the lower index.
  using OneWide = prox::PolicyAt<3, Op::Policies>;
  static_assert(OneWide::kOneWave && OneWide::kChunk == 3072, "candidate 3 is the one-wave 3072-channel one");
  STATIC_REQUIRE(prox::detail::BatchedDownSmemDynamic<OneWide>::value);
  STATIC_REQUIRE(!prox::detail::BatchedDownSmemDynamic<OneWave>::value);
  CHECK(Op::num_blocks<OneWave>(5120, 17408, 132) > 264);
  CHECK(Op::num_blocks<OneWide>(5120, 17408, 132) == 240);
  CHECK(Op::num_blocks<OneWide>(4096, 12288, 132) == 256);
  CHECK(dflt(5120, 17408) == 3);
  CHECK(Op::num_blocks<OneWide>(5120, 25600, 132) > 264);
  CHECK(dflt(5120, 25600) == 0);
  // Qwen3-1.7B: every candidate fits one wave after the balanced split; the tie goes to candidate 0.
  CHECK(dflt(2048, 6144) == 0);
}

TEST_CASE("fused batched Stage 2: the default candidate covers a row with the fewest GLU load slots",
          "[validation]") {
  const auto b4 = h100_default<prox::BatchedGluDownGemvOp<__half, prox::SiLU, 4>>;
  const auto b2 = h100_default<prox::BatchedGluDownGemvOp<__half, prox::SiLU, 2>>;
  // 320 threads where 256 leave a half-idle step: d_model 2560 (Qwen3-4B: 1 step of 320 pieces against 2 of
  // 256) and 5120 (14B, 32B: 2 steps against 3); 256 on 2048 and 4096. Capacity 2 has the 256-thread one only.
  CHECK(b4(2048, 6144) == 0);
  CHECK(b4(2560, 9728) == 1);
  CHECK(b4(4096, 12288) == 0);
  CHECK(b4(5120, 17408) == 1);
  CHECK(b4(5120, 25600) == 1);
  CHECK(b2(5120, 17408) == 0);
  STATIC_REQUIRE(prox::PolicyAt<1, prox::BatchedGluDownPoliciesFor<4>::type>::kThreads == 320);
}

TEST_CASE("batched ops at capacity 8: the default candidates by shape", "[validation]") {
  const auto proxy = h100_default<prox::BatchedProxyGemvOp<__half, prox::SiLU, 8>>;
  const auto down = h100_default<prox::BatchedDownGemvOp<__half, 8>>;
  // Stage 1: 1024-input chunks where they take fewer waves (Qwen3-8B: 384 blocks in 396 slots, not 768);
  // where shorter ones also fit one wave, the most blocks (1.7B: 256-input chunks, 384 blocks; 4B: 512).
  CHECK(proxy(4096, 12288) == 0);
  CHECK(proxy(5120, 17408) == 0);
  CHECK(proxy(2048, 6144) == 2);
  CHECK(proxy(2560, 9728) == 1);
  // Down GEMV (tensor cores): the one-wave-only 256-output candidate on Qwen3-8B (256 blocks), not on 14B.
  using Down = prox::BatchedDownGemvOp<__half, 8>;
  static_assert(prox::PolicyAt<0, Down::Policies>::kMma && prox::PolicyAt<1, Down::Policies>::kOneWave, "lists");
  CHECK(Down::num_blocks<prox::PolicyAt<1, Down::Policies>>(4096, 12288, 132) == 256);
  CHECK(down(4096, 12288) == 1);
  CHECK(down(5120, 17408) == 0);
  CHECK(down(2048, 6144) == 0);
}

namespace {
//! Bytes of split-K partials a policy writes (0 without split-K).
constexpr std::size_t partial_bytes(int chunks, int mats, int columns) {
  return chunks > 1 ? sizeof(float) * static_cast<std::size_t>(mats) * static_cast<std::size_t>(chunks) *
                          static_cast<std::size_t>(columns)
                    : 0;
}

template <class Fmt>
void check_proxy_regions(int K, int N) {
  using Op = prox::ProxyGemvOp<__half, prox::SiLU, Fmt>;
  prox::ProxyGemvArgs<__half, Fmt> a;
  a.d_model = K;
  a.d_ff = N;
  const prox::WorkspaceNeeds n = Op::workspace_needs(a);
  CHECK(n.sync == prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(N));
  prox::for_each_policy<typename Op::Policies>([&](auto p, int pi) {
    using P = decltype(p);
    CAPTURE(K, N, pi, P::name());
    // Its counters fit the common region, and its partials the scratch.
    CHECK(sizeof(unsigned) * static_cast<std::size_t>(Op::template num_tiles<P>(N)) <= n.sync);
    CHECK(partial_bytes(Op::template num_chunks<P>(K), 2, N) <= n.scratch);
  });
}
}  // namespace

TEST_CASE("workspace: every policy of an op keeps its tile counters in one region of the same size",
          "[validation][workspace]") {
  // A workspace initialized once serves every policy of an op at one shape only if no policy's
  // split-K partials land on another policy's counters (tests/test_workspace.cu runs it on the GPU).
  for (int N : {32, 1056, 2080, 16640, 17408, 25600, 1 << 20}) {
    check_proxy_regions<prox::Int4Weights>(4096, N);
    check_proxy_regions<prox::DenseWeights<__half>>(1032, N);
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
    using Down = prox::DownGemvOp<__half>;
    const prox::WorkspaceNeeds nd = Down::workspace_needs(d);
    CHECK(nd.sync == prox::detail::tile_counter_bytes<prox::detail::kMinTileWidth>(K));
    prox::for_each_policy<prox::DownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      CAPTURE(K, pi, P::name());
      CHECK(sizeof(unsigned) * static_cast<std::size_t>(Down::num_tiles<P>(K)) <= nd.sync);
      CHECK(partial_bytes(Down::num_chunks<P>(12288), 1, K) <= nd.scratch);
    });
    // The fused Stage 2: the barrier, then the down counters as the down GEMV lays them out (SparseFfn
    // shares them between its fused and unfused Stage 2), and partials for the largest grid.
    prox::GluDownGemvArgs<__half> f;
    f.d_model = K;
    f.d_ff = 12288;
    using Fused = prox::GluDownGemvOp<__half, prox::SiLU>;
    const prox::WorkspaceNeeds nf = Fused::workspace_needs(f);
    CHECK(nf.sync == sizeof(unsigned) * prox::detail::kBarrierWords + nd.sync);
    prox::for_each_policy<prox::GluDownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      CAPTURE(K, pi, P::name());
      const int parts = prox::kMaxFusedGridBlocks / Fused::num_tiles<P>(K);
      CHECK(partial_bytes(parts, 1, K) <= nf.scratch);
    });
  }
}

TEST_CASE("SparseFfn: the workspace size depends on the shape only", "[validation][workspace]") {
  for (const auto& [K, N] : {std::pair{2048, 6144}, std::pair{4096, 12288}, std::pair{5120, 17408}, std::pair{8, 32}}) {
    CAPTURE(K, N);
    const std::size_t f16 = prox::SparseFfn<__half, prox::SiLU>::workspace_bytes(K, N);
    CHECK(f16 == prox::SparseFfn<__nv_bfloat16, prox::SiLU>::workspace_bytes(K, N));
    CHECK(f16 == prox::SparseFfn<__half, prox::GeluTanh>::workspace_bytes(K, N));
    CHECK(f16 == prox::SparseFfn<__nv_bfloat16, prox::GeluTanh>::workspace_bytes(K, N));
    // It holds the header, both stages' sync words, mask, s, and the largest scratch of any kernel.
    prox::ProxyGemvArgs<__half> a;
    a.d_model = K;
    a.d_ff = N;
    prox::GluDownGemvArgs<__half> g;
    g.d_model = K;
    g.d_ff = N;
    const auto n1 = prox::ProxyGemvOp<__half, prox::SiLU>::workspace_needs(a);
    const auto n2 = prox::GluDownGemvOp<__half, prox::SiLU>::workspace_needs(g);
    CHECK(f16 >= prox::detail::kHeaderBytes + n1.sync + n2.sync + sizeof(float) * N + N / 8 +
                     std::max(n1.scratch, n2.scratch));
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
  w.gate = fake<const T>(0);
  w.up = fake<const T>(1);
  w.down_t = fake<const T>(2);
  w.proxy_gate = {fake<const std::uint32_t>(3), fake<const float>(5)};
  w.proxy_up = {fake<const std::uint32_t>(4), fake<const float>(6)};
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
  CHECK(plan([](auto& c) { c.thresholds = fake<const float>(8, 2); }, none) == Status::kErrorMisalignedPointer);
  CHECK(plan(none, [](auto& ww) { ww.gate = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.down_t = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_up.packed = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_gate.scales = nullptr; }) == Status::kErrorNullPointer);
  CHECK(plan(none, [](auto& ww) { ww.up = fake<const T>(1, 8); }) == Status::kErrorMisalignedPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_gate.packed = fake<const std::uint32_t>(3, 4); }) ==
        Status::kErrorMisalignedPointer);
  CHECK(plan(none, [](auto& ww) { ww.proxy_up.scales = fake<const float>(6, 2); }) ==
        Status::kErrorMisalignedPointer);
  typename Ffn::PlanOptions bad_choice;
  bad_choice.choice.proxy = Ffn::ProxyPolicies::kSize;
  CHECK(f.plan(cfg, w, bad_choice) == Status::kErrorInvalidArgument);

  // A failed plan leaves the layer unplanned: run and values mode refuse before touching anything.
  CHECK(!f.planned());
  CHECK(f.workspace_bytes() == 0);
  CHECK(f.config().d_model == 0);
  CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), std::size_t(1) << 30, nullptr) == Status::kErrorNotPlanned);
  CHECK(f.run_proxy_values(fake<const T>(7), fake<float>(8), fake<void>(9), std::size_t(1) << 30, nullptr) ==
        Status::kErrorNotPlanned);

  // A valid layer: without a device plan says so (kErrorNoDevice); with one it plans, and run
  // then checks its own arguments before launching.
  if (!have_device()) {
    CHECK(f.plan(cfg, w) == Status::kErrorNoDevice);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), std::size_t(1) << 30, nullptr) ==
          Status::kErrorNotPlanned);
  } else {
    REQUIRE(f.plan(cfg, w) == Status::kSuccess);
    const std::size_t ws = f.workspace_bytes();
    CHECK(ws == Ffn::workspace_bytes(cfg));
    CHECK(f.run(nullptr, fake<T>(8), fake<void>(9), ws, nullptr) == Status::kErrorNullPointer);
    CHECK(f.run(fake<const T>(7, 2), fake<T>(8), fake<void>(9), ws, nullptr) == Status::kErrorMisalignedPointer);
    CHECK(f.run(fake<const T>(7), fake<T>(8, 8), fake<void>(9), ws, nullptr) == Status::kErrorMisalignedPointer);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), ws - 1, nullptr) == Status::kErrorWorkspaceTooSmall);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), ws,
                nullptr, fake<prox::SparsityCounters>(10, 4)) == Status::kErrorMisalignedPointer);
    typename Ffn::Outputs out;
    out.channel_mask = fake<std::uint32_t>(11, 2);
    CHECK(f.run(fake<const T>(7), fake<T>(8), fake<void>(9), ws, nullptr, out) == Status::kErrorMisalignedPointer);
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
