// SPDX-License-Identifier: Apache-2.0
//! @file test_tuning_choose.cu  Host tests of <prox/tuning/choose.cuh> (include/ only, no GPU needed):
//! the keys of prox's ops (every op of the registry of tuned ops, from the fields its header states),
//! this build's policy table, and choose<Ffn>(), which fills exactly the
//! PolicyChoice fields of the Stage-2 form the plan runs, by lookup, and hands misses to the cache's
//! miss handler in mode 2 (never during capture).
#include "catch.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include <prox/sparse_ffn.cuh>
#include <prox/tuning/choose.cuh>
#include <prox/tuning/tuned_ops.cuh>

#include "tuning_fixture.hpp"

namespace pt = prox::tuning;

namespace {

using Ffn = prox::SparseFfn<__half, prox::SiLU>;

pt::Signature test_signature() {
  pt::Signature s;
  s.gpu_name = "Test GPU";
  s.sm_count = 132;
  s.cc_major = 9;
  return s;
}

pt::CacheOptions in_memory(pt::Mode mode) {
  pt::CacheOptions o;
  o.mode = mode;
  return o;
}

//! Record policy `index` of `Op`'s list for `key`.
template <class Op>
void record(pt::Cache& c, const pt::Key& key, int index) {
  const auto names = pt::policy_names<typename Op::Policies>();
  REQUIRE(c.record(key, {names.at(static_cast<std::size_t>(index)), 5.0, 4.9, 5.1, 20}) == prox::Status::kSuccess);
}

//! The keys of every op of `List` at (d_model, d_ff, density).
template <class... Ops>
std::vector<pt::Key> keys_of(pt::OpList<Ops...>, int d_model, int d_ff, double density) {
  return {pt::op_key<Ops>(d_model, d_ff, density)...};
}

//! The default candidate of op on a 132-SM device for d_model K, d_ff 12288 (the op's default_policy rule).
template <class Op>
int pick(Op op, int K) {
  prox::DeviceInfo d{};
  d.sm_count = 132;
  typename Op::Args a{};
  a.d_model = K;
  a.d_ff = 12288;
  return prox::default_policy(op, d, a);
}

}  // namespace

TEST_CASE("tuning choose: every registry op over f16/bf16 x SiLU/GeluTanh keys as the cache files do", "[tuning]") {
  // What the prox_tuning library compiles, and mode 2's miss handler maps keys back to (open.cu).
  using Instantiated = pt::TunedOpsFor<pt::TypeList<__half, __nv_bfloat16>, pt::TypeList<prox::SiLU, prox::GeluTanh>>;
  constexpr int kOps = pt::op_count(Instantiated{});
  static_assert(kOps == 2 * pt::op_count(pt::TunedTypeOps<__half>{}) +
                            4 * pt::op_count(pt::TunedLayerOps<__half, prox::SiLU>{}),
                "the registry over 2 element types and 2 x 2 layer types");
  const std::vector<pt::Key> got = keys_of(Instantiated{}, 4096, 12288, 0.3);
  REQUIRE(static_cast<int>(got.size()) == kOps);
  // Today's keys, each made by exactly one op (an op added to the registry adds keys of its own).
  const std::vector<pt::Key> want = prox_test::registry_keys(4096, 12288, 5);
  REQUIRE(want.size() == 20);
  CHECK(kOps >= 20);
  for (const pt::Key& k : want) {
    INFO(k.op << " " << k.dtype << " " << k.weights << " " << k.act << " d_ff " << k.d_ff);
    CHECK(std::count(got.begin(), got.end(), k) == 1);
  }
  for (std::size_t i = 0; i < got.size(); ++i)
    for (std::size_t j = i + 1; j < got.size(); ++j) CHECK(got[i] != got[j]);
}

TEST_CASE("tuning choose: the keys of prox's ops", "[tuning]") {
  const pt::Key p = pt::op_key<prox::ProxyGemvOp<__half, prox::SiLU, prox::Int4Weights>>(4096, 12288, 0.3);
  CHECK(p.op == "proxy_gemv");
  CHECK(p.dtype == "f16");
  CHECK(p.weights == "int4v1");
  CHECK(p.act == "silu");
  CHECK(p.d_model == 4096);
  CHECK(p.d_ff == 12288);
  CHECK(p.density16 == 5);
  CHECK(p.batch == 1);
  const pt::Key d =
      pt::op_key<prox::ProxyGemvOp<__nv_bfloat16, prox::GeluTanh, prox::DenseWeights<__nv_bfloat16>>>(64, 128, 1.0);
  CHECK(d.op == "proxy_gemv_dense");
  CHECK(d.weights == "bf16");
  CHECK(d.act == "gelu_tanh");
  CHECK(d.density16 == 16);
  const pt::Key t = pt::op_key<prox::ThresholdOp<__half>>(5120, 999, 0.45);
  CHECK(t.op == "threshold");
  CHECK(t.weights == "-");
  CHECK(t.act == "-");
  CHECK(t.d_model == 5120);
  CHECK(t.d_ff == 0);  // the threshold op has no d_ff
  CHECK(t.density16 == 8);
  CHECK(pt::op_key<prox::DownGemvOp<__half>>(64, 128, 0.0).act == "-");
  CHECK(pt::op_key<prox::GluGemvOp<__half, prox::SiLU>>(64, 128, 0.3).op == "glu_gemv");
  CHECK(pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(64, 128, 0.3).op == "glu_down_gemv");
  // A Stage 1 with a candidate list of its own has no key: the cached names are those of its format's list.
  using OwnList = prox::ProxyGemvOp<__half, prox::SiLU, prox::Int4Weights,
                                    prox::PolicyList<prox::ProxyGemvPolicy<256, 256, 512, 2, 3>>>;
  static_assert(OwnList::kTuneKey.op == nullptr, "no key for a list of its own");
  static_assert(prox::ProxyGemvOp<__half, prox::SiLU, prox::Int4Weights>::kTuneKey.op != nullptr, "a key");
}

TEST_CASE("tuning choose: the policy table holds every tuned candidate list", "[tuning]") {
  const pt::PolicyTable t = pt::policy_table();
  CHECK(t.size() == 9);  // the six native lists, FP8 per channel's fused list and FP8 block's two (fp8_policies.cuh)
  CHECK(t.at("threshold") == pt::policy_names<prox::ThresholdPolicies>());
  CHECK(t.at("proxy_gemv") == pt::policy_names<prox::ProxyGemvPolicies>());
  CHECK(t.at("proxy_gemv_dense") == pt::policy_names<prox::DenseProxyGemvPolicies>());
  CHECK(t.at("glu_gemv") == pt::policy_names<prox::GluGemvPolicies>());
  CHECK(t.at("down_gemv") == pt::policy_names<prox::DownGemvPolicies>());
  CHECK(t.at("glu_down_gemv") == pt::policy_names<prox::GluDownGemvPolicies>());
  CHECK(t.at("down_gemv_b128") == pt::policy_names<prox::Fp8BlockDownGemvPolicies>());
  CHECK(t.at("glu_down_gemv_b128") == pt::policy_names<prox::Fp8BlockGluDownGemvPolicies>());
  CHECK(t.at("glu_down_gemv_fp8") == pt::policy_names<prox::Fp8ChannelGluDownGemvPolicies>());
  // The FP8 formats key their own entries; the per-channel format shares the native lists' rows except the
  // fused Stage 2's (its own list: the native shapes spilled at 16 weights a piece).
  CHECK(pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU, prox::Fp8ChannelWeights>>(64, 128, 0.3).op ==
        "glu_down_gemv_fp8");
  CHECK(pt::op_key<prox::DownGemvOp<__half, prox::Fp8ChannelWeights>>(64, 128, 0.3).op == "down_gemv");
  CHECK(pt::op_key<prox::DownGemvOp<__half, prox::Fp8ChannelWeights>>(64, 128, 0.3).weights == "e4m3chv1");
  CHECK(pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU, prox::Fp8BlockWeights>>(64, 128, 0.3).op ==
        "glu_down_gemv_b128");
  CHECK(pt::op_key<prox::GluGemvOp<__nv_bfloat16, prox::SiLU, prox::Fp8BlockWeights>>(64, 128, 0.3).weights ==
        "e4m3b128v1");
  // Ffn's lists are the table's: a name maps back to the index plan() dispatches on.
  CHECK(Ffn::GluDownPolicies::kSize == static_cast<int>(t.at("glu_down_gemv").size()));
}

TEST_CASE("tuning choose: fills the fields of the Stage-2 form the plan runs", "[tuning]") {
  pt::Cache c(test_signature(), pt::policy_table(), in_memory(pt::Mode::kReadOnly));
  const Ffn::Config cfg{512, 2048, 0.75f, 0.0f};
  record<Ffn::Stage1Op>(c, pt::op_key<Ffn::Stage1Op>(512, 2048, 0.5), 2);
  record<Ffn::FusedStage2Op>(c, pt::op_key<Ffn::FusedStage2Op>(512, 2048, 0.3), 1);
  record<Ffn::GluOp>(c, pt::op_key<Ffn::GluOp>(512, 2048, 0.3), 2);
  record<Ffn::DownOp>(c, pt::op_key<Ffn::DownOp>(512, 2048, 0.3), 1);

  Ffn::PlanOptions fused;  // the default plan fuses Stage 2
  REQUIRE(fused.fuse_stage2);
  fused.choice.glu = 7;                                                            // stale values are reset
  REQUIRE(pt::choose<Ffn>(c, cfg, 0.45, 0.26, &fused) == prox::Status::kSuccess);  // buckets 8 and 5
  CHECK(fused.choice.proxy == 2);
  CHECK(fused.choice.glu_down == 1);
  CHECK(fused.choice.glu == -1);
  CHECK(fused.choice.down == -1);

  Ffn::PlanOptions unfused;
  unfused.fuse_stage2 = false;
  REQUIRE(pt::choose<Ffn>(c, cfg, 0.5, 0.3, &unfused) == prox::Status::kSuccess);
  CHECK(unfused.choice.proxy == 2);
  CHECK(unfused.choice.glu == 2);
  CHECK(unfused.choice.down == 1);
  CHECK(unfused.choice.glu_down == -1);

  Ffn::PlanOptions miss;
  REQUIRE(pt::choose<Ffn>(c, cfg, 0.2, 0.9, &miss) == prox::Status::kSuccess);  // read-only: misses stay -1
  CHECK(miss.choice.proxy == -1);
  CHECK(miss.choice.glu_down == -1);
  CHECK(pt::choose<Ffn>(c, cfg, 0.5, 0.3, nullptr) == prox::Status::kErrorNullPointer);

  pt::Cache off(test_signature(), pt::policy_table(), in_memory(pt::Mode::kOff));
  record<Ffn::Stage1Op>(off, pt::op_key<Ffn::Stage1Op>(512, 2048, 0.5), 2);
  Ffn::PlanOptions o;
  REQUIRE(pt::choose<Ffn>(off, cfg, 0.5, 0.3, &o) == prox::Status::kSuccess);
  CHECK(o.choice.proxy == -1);  // off: the defaults, even with an entry
}

TEST_CASE("tuning choose: mode 2 hands the misses to the miss handler, never during capture", "[tuning]") {
  pt::Cache c(test_signature(), pt::policy_table(), in_memory(pt::Mode::kTuneOnMiss));
  const Ffn::Config cfg{512, 2048, 0.75f, 0.0f};
  record<Ffn::Stage1Op>(c, pt::op_key<Ffn::Stage1Op>(512, 2048, 0.5), 3);  // a hit: not handed on
  Ffn::PlanOptions opts;
  REQUIRE(pt::choose<Ffn>(c, cfg, 0.5, 0.3, &opts) == prox::Status::kSuccess);  // no handler: a miss stays -1
  CHECK(opts.choice.proxy == 3);
  CHECK(opts.choice.glu_down == -1);
  CHECK(c.capture_misses() == 0);

  std::vector<pt::Key> handed;
  c.set_miss_handler([&](pt::Cache& cache, const std::vector<pt::Key>& missing, cudaStream_t) {
    handed.insert(handed.end(), missing.begin(), missing.end());
    for (const pt::Key& k : missing) {
      const auto names = cache.policies().at(k.op);
      PROX_RETURN_IF_ERROR(cache.record(k, {names.back(), 1.0, 1.0, 1.0, 20}));
    }
    return prox::Status::kSuccess;
  });
  REQUIRE(pt::choose<Ffn>(c, cfg, 0.5, 0.3, &opts) == prox::Status::kSuccess);
  if (pt::check_not_capturing(nullptr) == prox::Status::kSuccess) {  // a device: the handler tunes
    REQUIRE(handed.size() == 1);
    CHECK(handed[0] == pt::op_key<Ffn::FusedStage2Op>(512, 2048, 0.3));
    CHECK(opts.choice.glu_down == Ffn::GluDownPolicies::kSize - 1);
    CHECK(c.capture_misses() == 0);
  } else {  // no device: the capture state cannot be read, so nothing is tuned; the miss is counted
    CHECK(handed.empty());
    CHECK(opts.choice.glu_down == -1);
    CHECK(c.capture_misses() == 1);
  }
  CHECK(opts.choice.proxy == 3);
}

TEST_CASE("tuning choose: open_cache reads a file by its path without the tuning library", "[tuning]") {
  std::unique_ptr<pt::Cache> cache;
  pt::CacheOptions o;
  o.path = "/nonexistent/prox-test.tsv";
  CHECK(pt::open_cache(nullptr, o) == prox::Status::kErrorNullPointer);
  const prox::Status st = pt::open_cache(&cache, o);
  if (st == prox::Status::kSuccess) {  // a device: a missing file is fine
    REQUIRE(cache != nullptr);
    CHECK(cache->last_load().state == pt::FileState::kMissing);
    CHECK(cache->policies() == pt::policy_table());
  } else {
    CHECK(st == prox::Status::kErrorNoDevice);
    CHECK(cache == nullptr);
  }
}

TEST_CASE("FP8 fused Stage 2: the default is the candidate with the fewest GLU steps a row", "[tuning][fp8]") {
  using ChOp = prox::GluDownGemvOp<__half, prox::SiLU, prox::Fp8ChannelWeights>;
  using BlOp = prox::GluDownGemvOp<__nv_bfloat16, prox::SiLU, prox::Fp8BlockWeights>;
  using NatOp = prox::GluDownGemvOp<__half, prox::SiLU>;
  // 320 threads x 16 weights cover a 4096- or 5120-wide row in one step: index 0 on both (the native rule, load
  // slots, would take the 256-thread candidate on 4096).
  for (int K : {2048, 4096, 5120}) {
    CHECK(pick(ChOp{}, K) == 0);
    CHECK(pick(BlOp{}, K) == 0);
  }
  // 6144 inputs: 320 threads need 2 steps, 256 threads 2 as well: the lower index.
  CHECK(pick(ChOp{}, 6144) == 0);
  // The native ops keep their rule: 256 threads on 4096, 320 on 5120.
  CHECK(pick(NatOp{}, 4096) == 0);
  CHECK(pick(NatOp{}, 5120) == 1);
}

TEST_CASE("FP8 batched GLU: the default is the tensor-core candidate, except B = 2 on rows up to 4096", "[tuning][fp8]") {
  const auto tensor_cores = [](auto op, int i) {
    bool tc = false;
    prox::for_each_policy<typename decltype(op)::Policies>([&](auto p, int j) {
      if (j == i) tc = prox::detail::IsTensorCoreRows<decltype(p)>::value;
    });
    return tc;
  };
  using Ch2 = prox::BatchedGluGemvOp<__nv_bfloat16, prox::SiLU, 2, prox::Fp8ChannelWeights>;
  using Bl4 = prox::BatchedGluGemvOp<__half, prox::SiLU, 4, prox::Fp8BlockWeights>;
  using Ch8 = prox::BatchedGluGemvOp<__half, prox::GeluTanh, 8, prox::Fp8ChannelWeights>;
  for (int K : {16, 2048, 4096, 5120, 8192}) {
    CHECK(tensor_cores(Bl4{}, pick(Bl4{}, K)));
    CHECK(tensor_cores(Ch8{}, pick(Ch8{}, K)));
    // Capacity 2: the CUDA cores up to 4096 inputs a row, the tensor cores above.
    CHECK(tensor_cores(Ch2{}, pick(Ch2{}, K)) == (K > 4096));
  }
  CHECK_FALSE(tensor_cores(Ch2{}, 0));  // the CUDA-core candidate stays in the list, first
  // The native batched GLU keeps its rule (no tensor-core rows of this kind in its list).
  CHECK(pick(prox::BatchedGluGemvOp<__half, prox::SiLU, 4>{}, 4096) == 0);
}
