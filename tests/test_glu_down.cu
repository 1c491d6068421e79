// SPDX-License-Identifier: Apache-2.0
//! @file test_glu_down.cu  The fused Stage-2 op (glu_down_gemv: GLU + down in one grid with a
//! grid-wide barrier) against the float64 reference: s on selected channels (+0 elsewhere), y from
//! the selected rows, every element written; grids from 1 block to the largest resident grid (so
//! blocks run several down tasks), repeated launches on one workspace (the barrier and the tile
//! counters are left ready), cooperative and plain launches bit-identical, bad input.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <prox/glu_down_gemv.cuh>
#include <prox/sparse_ffn.cuh>

#include "gpu_fixture.hpp"
#include "op_test.hpp"

using namespace prox_test;

namespace {

template <class T, class A>
void glu_down_suite(int K, int N, std::uint64_t seed) {
  const Stage2Case<T> c2(K, N, seed);
  DeviceBuffer<float> ds(N);
  DeviceBuffer<T> dy(K);
  const prox_ref::Act act = ref_act<A>();
  c2.each_density({0.23, 0.0, 1.0}, act, [&](double density, const auto& sel, const auto& ref, const auto& dmask) {
    using Op = prox::GluDownGemvOp<T, A>;
    prox::for_each_policy<prox::GluDownGemvPolicies>([&](auto p, int pi) {
      using P = decltype(p);
      prox::DeviceInfo dev;
      PROX_TEST_OK(prox::query_device(&dev));
      int max_blocks = 0;
      PROX_TEST_OK(Op::template max_grid_blocks<P>(dev, &max_blocks));
      REQUIRE(max_blocks > 0);
      std::vector<T> first_y;
      for (int blocks : {max_blocks, 7, 1}) {
        for (bool coop : {true, false}) {
          CAPTURE(K, N, density, pi, P::name(), A::kName, prox::DTypeTraits<T>::kName, blocks, coop);
          prox::GluDownGemvArgs<T> a;
          a.x = c2.dx.get();
          a.d_model = K;
          a.d_ff = N;
          a.w_gate = c2.D.wg.get();
          a.w_up = c2.D.wu.get();
          a.w_down_t = c2.D.wdt.get();
          a.channel_mask = dmask.get();
          a.s = ds.get();
          a.y = dy.get();
          const auto ws = op_workspace<Op>(a);
          typename Op::Options o;
          o.cooperative = coop;
          o.grid_blocks = blocks;
          prox::Operator<Op> op;
          REQUIRE(op.initialize(a, o, pi) == prox::Status::kSuccess);
          std::vector<T> y_prev;
          for (int rep = 0; rep < 3; ++rep) {  // the barrier and counters must be ready for the next launch
            ds.poison();
            dy.poison();
            REQUIRE(op.run(a, ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
            PROX_TEST_CUDA(cudaDeviceSynchronize());
            const auto y = dy.download();
            if (rep > 0) {
              int diff = 0;
              for (std::size_t k = 0; k < y.size(); ++k) diff += bits16(y[k]) != bits16(y_prev[k]);
              CHECK(diff == 0);  // deterministic
            }
            y_prev = y;
          }
          // Cooperative and plain launches of the same grid are bit-identical.
          if (coop) {
            first_y = y_prev;
          } else {
            int diff = 0;
            for (std::size_t k = 0; k < y_prev.size(); ++k) diff += bits16(y_prev[k]) != bits16(first_y[k]);
            CHECK(diff == 0);
          }
          const SCompare cs = compare_s(ds.download(), sel, ref.s);
          double worst_y = 0.0;
          const int bad_y = count_out_of_bound(y_prev, ref.y, &worst_y);
          // Workspace left ready: barrier arrivals and tile counters back at zero, nothing flagged.
          const FusedWorkspaceState wst = fused_workspace_state(ws, Op::template num_tiles<P>(K));
          CHECK(wst.arrivals == 0u);
          CHECK(wst.counters_not_zero == 0);
          CHECK(wst.status == prox::Status::kSuccess);
          if (coop)
            std::printf(
                "[gludown] %-5s %-9s K=%-5d N=%-5d %-28s blocks=%-4d density=%.2f s err/bound=%.3f y err/bound=%.3f\n",
                prox::DTypeTraits<T>::kName, A::kName, K, N, P::name().c_str(), blocks, density, cs.worst, worst_y);
          CHECK(cs.bad == 0);
          CHECK(cs.untouched_bad == 0);  // unselected channels are written as +0
          CHECK(bad_y == 0);
        }
      }
    });
  });
}

}  // namespace

TEMPLATE_TEST_CASE("fused Stage 2 (glu_down_gemv): exact s and y, any grid, repeated launches",
                   "[stage2][gludown][gpu]", __half, __nv_bfloat16) {
  using T = TestType;
  glu_down_suite<T, prox::SiLU>(200, 96, 51);
  glu_down_suite<T, prox::GeluTanh>(8, 32, 52);
  glu_down_suite<T, prox::SiLU>(1000, 2016, 53);
  glu_down_suite<T, prox::GeluTanh>(4104, 544, 54);  // more column tiles than a small grid has blocks
}

TEMPLATE_TEST_CASE("fused Stage 2 (glu_down_gemv): Qwen3-8B shape", "[stage2][gludown][gpu][large]", __half,
                   __nv_bfloat16) {
  glu_down_suite<TestType, prox::SiLU>(4096, 12288, 55);
}

TEST_CASE("fused Stage 2 (glu_down_gemv): bad input gets a Status before any launch",
          "[stage2][gludown][status][gpu]") {
  using Op = prox::GluDownGemvOp<__half, prox::SiLU>;
  const int K = 64, N = 64;
  DeviceBuffer<__half> x(K + 8), w(static_cast<std::size_t>(K) * N + 8), y(K + 8);
  DeviceBuffer<std::uint32_t> mask(N / 32);
  DeviceBuffer<float> s(N);
  PROX_TEST_CUDA(cudaMemset(mask.get(), 0xFF, N / 8));
  prox::DeviceInfo dev;
  PROX_TEST_OK(prox::query_device(&dev));
  int max_blocks = 0;
  PROX_TEST_OK((Op::max_grid_blocks<prox::PolicyAt<0, prox::GluDownGemvPolicies>>(dev, &max_blocks)));
  y.poison(0x5A);
  s.poison(0x5A);
  prox::GluDownGemvArgs<__half> a;
  a.x = x.get();
  a.d_model = K;
  a.d_ff = N;
  a.w_gate = w.get();
  a.w_up = w.get();
  a.w_down_t = w.get();
  a.channel_mask = mask.get();
  a.s = s.get();
  a.y = y.get();
  const auto ws = op_workspace<Op>(a);
  const auto plan = [&](const prox::GluDownGemvArgs<__half>& args, int grid_blocks = 0) {
    prox::Operator<Op> op;
    Op::Options o;
    o.grid_blocks = grid_blocks;
    return op.initialize(args, o, 0);
  };
  auto b = a;
  b.w_down_t = nullptr;
  CHECK(plan(b) == prox::Status::kErrorNullPointer);
  b = a;
  b.y = nullptr;
  CHECK(plan(b) == prox::Status::kErrorNullPointer);
  b = a;
  b.w_up = w.get() + 1;
  CHECK(plan(b) == prox::Status::kErrorMisalignedPointer);
  b = a;
  b.d_model = 12;
  CHECK(plan(b) == prox::Status::kErrorInvalidShape);
  b = a;
  b.d_ff = 48;
  CHECK(plan(b) == prox::Status::kErrorInvalidShape);
  CHECK(plan(a, -1) == prox::Status::kErrorInvalidArgument);
  CHECK(plan(a, max_blocks + 1) == prox::Status::kErrorInvalidArgument);  // could not all be resident: refused
  prox::Operator<Op> op;
  Op::Options o;
  o.grid_blocks = max_blocks;
  REQUIRE(op.initialize(a, o, 0) == prox::Status::kSuccess);
  CHECK(op.run(a, ws.get(), prox::Operator<Op>::workspace_bytes(a) - 1, nullptr) ==
        prox::Status::kErrorWorkspaceTooSmall);
  CHECK(op.run(a, nullptr, ws.bytes(), nullptr) == prox::Status::kErrorNullPointer);
  CHECK(op.run(a, ws.get() + 4, ws.bytes(), nullptr) == prox::Status::kErrorMisalignedPointer);
  b = a;
  b.x = nullptr;
  CHECK(op.run(b, ws.get(), ws.bytes(), nullptr) == prox::Status::kErrorNullPointer);  // per-call args checked
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  for (__half v : y.download()) CHECK(bits16(v) == 0x5A5Au);
  for (float v : s.download()) CHECK(bits32(v) == 0x5A5A5A5Au);
}
