// SPDX-License-Identifier: Apache-2.0
//! @file test_tuning_gpu.cu  The tuner (the prox_tuning library): every op (the fused Stage 2
//! glu_down_gemv included) tunes a small shape to a valid choice, policy 0 verified against the
//! float64 reference and every other candidate against policy 0; choices persist across save/load
//! and feed SparseFfn::plan() (the fused and the unfused Stage 2); choose() follows the mode (off /
//! read-only / tune-on-miss through the library's miss handler, fixed once chosen); nothing tunes
//! during stream capture.
#include "catch.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <prox/glu_down_gemv.cuh>
#include <prox/int4_format.hpp>
#include <prox/sparse_ffn.cuh>
#include <prox/tuning/choose.cuh>
#include <prox_tuning/tune.hpp>

#include "common.hpp"
#include "ffn_instances.hpp"
#include "tuning_fixture.hpp"

namespace fs = std::filesystem;
namespace pt = prox::tuning;
using prox_test::DeviceBuffer;
using prox_test::TempDir;
using prox_test::WarningCapture;

namespace {

//! Fast but still the full protocol (>= 20 timed reps, default 2 x L2 rotation).
pt::TuneOptions quick() {
  pt::TuneOptions o;
  o.warmup = 2;
  o.reps = 20;
  o.rounds = 1;
  return o;
}

//! A cache of this device and build at `path` ("" = in memory), no environment; in mode 2 the
//! library's miss handler tunes with quick().
std::unique_ptr<pt::Cache> make_cache(pt::Mode mode, const std::string& path = std::string()) {
  int device = 0;
  PROX_TEST_CUDA(cudaGetDevice(&device));
  pt::Signature sig;
  PROX_TEST_OK(pt::query_signature(device, &sig));
  pt::CacheOptions o;
  o.path = path;
  o.mode = mode;
  auto c = std::make_unique<pt::Cache>(sig, pt::policy_table(), o);
  pt::install_miss_handler(*c, quick());
  return c;
}

std::string describe(const pt::TuneResult& r) {
  std::ostringstream ss;
  ss << r.key.op << " " << r.key.dtype << " " << r.key.weights << " " << r.key.act << " " << r.key.d_model << "x"
     << r.key.d_ff << " bucket " << r.key.density16 << "/16: chosen " << r.chosen << ", " << r.rotation_sets
     << " rotation sets (" << r.rotation_bytes / (1 << 20) << " MiB)\n";
  for (std::size_t i = 0; i < r.candidates.size(); ++i) {
    const auto& c = r.candidates[i];
    ss << "  [" << i << "] " << c.policy << ": " << prox::to_string(c.status) << (c.verified ? ", verified" : "")
       << ", median " << c.median_us << " us (p20 " << c.p20_us << ", p80 " << c.p80_us << ", " << c.reps
       << " reps)" << (c.failure.empty() ? "" : ", failure: " + c.failure) << "\n";
  }
  return ss.str();
}

//! Every candidate launched, matched policy 0 and was timed; the choice obeys the near-tie rule
//! and is in the cache under its name.
void check_result(const pt::TuneResult& r, const std::vector<std::string>& names, const pt::Cache& cache) {
  INFO(describe(r));
  REQUIRE(r.candidates.size() == names.size());
  REQUIRE(r.chosen >= 0);
  REQUIRE(r.chosen < static_cast<int>(names.size()));
  CHECK(r.rotation_sets >= 1);
  std::vector<double> medians;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto& c = r.candidates[i];
    CHECK(c.policy == names[i]);
    CHECK(c.status == prox::Status::kSuccess);
    CHECK(c.verified);
    CHECK(c.failure.empty());
    CHECK(std::isfinite(c.median_us));
    CHECK(c.median_us > 0.0);
    CHECK(c.p20_us <= c.median_us);
    CHECK(c.median_us <= c.p80_us);
    CHECK(c.reps >= pt::kMinReps);
    medians.push_back(c.median_us);
  }
  CHECK(pt::choose_index(medians) == r.chosen);
  CHECK(r.recorded);
  const auto e = cache.find(r.key);
  REQUIRE(e.has_value());
  CHECK(e->policy == names[static_cast<std::size_t>(r.chosen)]);
  CHECK(e->median_us == Approx(r.candidates[static_cast<std::size_t>(r.chosen)].median_us));
  CHECK(cache.index_of(r.key) == r.chosen);
}

//! The fused Stage-2 grid SparseFfn::plan gives policy `index` of GluDownGemvPolicies (SiLU).
template <class T>
int glu_down_grid(int index) {
  prox::DeviceInfo d;
  PROX_TEST_OK(prox::query_device(&d));
  int blocks = -1;
  const prox::Status st = prox::dispatch_policy<prox::GluDownGemvPolicies>(index, [&](auto p) {
    return prox::GluDownGemvOp<T, prox::SiLU>::template max_grid_blocks<decltype(p)>(d, &blocks);
  });
  PROX_TEST_OK(st);
  return blocks;
}

//! The grid the plan's fused Stage 2 launches.
template <class Ffn>
int planned_glu_down_grid(const Ffn& ffn) {
  return static_cast<int>(ffn.fused_stage2_op().launch_config().grid.x);
}

//! choose<Ffn>() for a plan with (`fused`) or without a fused Stage 2, its PolicyChoice in *out.
template <class Ffn>
prox::Status choose_choice(pt::Cache& cache, const typename Ffn::Config& cfg, double input_density,
                           double channel_density, prox::PolicyChoice* out, cudaStream_t stream = nullptr,
                           bool fused = true) {
  typename Ffn::PlanOptions o;
  o.fuse_stage2 = fused;
  o.choice = *out;
  const prox::Status st = pt::choose<Ffn>(cache, cfg, input_density, channel_density, &o, stream);
  *out = o.choice;
  return st;
}

//! Device buffers of one SparseFfn layer (zeros: plan() and one run() only check the choice works).
template <class T>
struct ZeroLayer {
  DeviceBuffer<T> wg, wu, wdt;
  DeviceBuffer<std::uint32_t> qg, qu;
  DeviceBuffer<float> sg, su;
  ZeroLayer(int K, int N)
      : wg(static_cast<std::size_t>(K) * N),
        wu(static_cast<std::size_t>(K) * N),
        wdt(static_cast<std::size_t>(K) * N),
        qg(prox::int4::packed_words(K, N)),
        qu(prox::int4::packed_words(K, N)),
        sg(N),
        su(N) {
    for (auto* b : {&wg, &wu, &wdt}) b->poison(0);
    qg.poison(0x88);  // nibble 8 = weight 0
    qu.poison(0x88);
    sg.poison(0);
    su.poison(0);
  }
  typename prox::SparseFfn<T>::Weights weights() const {
    typename prox::SparseFfn<T>::Weights w;
    w.gate = wg.get();
    w.up = wu.get();
    w.down_t = wdt.get();
    w.proxy_gate = {qg.get(), sg.get()};
    w.proxy_up = {qu.get(), su.get()};
    return w;
  }
};

//! Plan a SparseFfn with `opts` on a zero layer, run one token and check y = 0 was written everywhere.
template <class T>
void plan_and_run_zero_layer(int K, int N, const typename prox::SparseFfn<T>::PlanOptions& opts,
                             prox::SparseFfn<T>* ffn) {
  ZeroLayer<T> layer(K, N);
  const typename prox::SparseFfn<T>::Config cfg{K, N, 0.75f, 0.0f};
  REQUIRE(ffn->plan(cfg, layer.weights(), opts) == prox::Status::kSuccess);
  DeviceBuffer<char> ws(ffn->workspace_bytes());
  DeviceBuffer<T> x(prox_test::random_vector<T>(K, 11));
  DeviceBuffer<T> y(K);
  y.poison();
  REQUIRE(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
  REQUIRE(ffn->run(x.get(), y.get(), ws.get(), ws.bytes(), nullptr) == prox::Status::kSuccess);
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const auto hy = y.download();
  std::size_t nonzero = 0;
  for (const auto& v : hy) nonzero += prox_test::bits16(v) != 0 && prox_test::bits16(v) != 0x8000;
  CHECK(nonzero == 0);  // zero weights: y = 0 (and every element written)
}

}  // namespace

TEST_CASE("tuning: every op tunes a small shape to a valid, verified choice", "[tuning][gpu]") {
  WarningCapture warnings;
  auto cache = make_cache(pt::Mode::kReadOnly);
  const auto opts = quick();
  constexpr int K = 512;
  constexpr int N = 2048;
  SECTION("threshold") {
    pt::TuneResult r;
    REQUIRE(pt::tune_threshold<__half>(*cache, 5120, 0.45, nullptr, opts, &r) == prox::Status::kSuccess);
    CHECK(r.key.op == "threshold");
    CHECK(r.key.density16 == 8);
    check_result(r, pt::policy_names<prox::ThresholdPolicies>(), *cache);
  }
  SECTION("proxy GEMV, INT4 weights") {
    pt::TuneResult r;
    REQUIRE((pt::tune_proxy_gemv<__half, prox::Int4Weights, prox::SiLU>(*cache, K, N, 0.5, nullptr, opts, &r)) ==
            prox::Status::kSuccess);
    CHECK(r.key.op == "proxy_gemv");
    CHECK(r.key.weights == "int4v1");
    CHECK(r.key.act == "silu");
    CHECK(r.key.density16 == 8);
    check_result(r, pt::policy_names<prox::ProxyGemvPolicies>(), *cache);
  }
  SECTION("proxy GEMV, fp16 weights") {
    pt::TuneResult r;
    REQUIRE((pt::tune_proxy_gemv<__half, prox::DenseWeights<__half>, prox::SiLU>(*cache, K, N, 0.9, nullptr, opts,
                                                                                 &r)) == prox::Status::kSuccess);
    CHECK(r.key.op == "proxy_gemv_dense");
    CHECK(r.key.weights == "f16");
    CHECK(r.key.density16 == 15);
    check_result(r, pt::policy_names<prox::DenseProxyGemvPolicies>(), *cache);
  }
  SECTION("GLU GEMV") {
    pt::TuneResult r;
    REQUIRE((pt::tune_glu_gemv<__half, prox::SiLU>(*cache, K, N, 0.3, nullptr, opts, &r)) == prox::Status::kSuccess);
    CHECK(r.key.op == "glu_gemv");
    CHECK(r.key.density16 == 5);
    check_result(r, pt::policy_names<prox::GluGemvPolicies>(), *cache);
  }
  SECTION("down GEMV, fp16 and bf16") {
    pt::TuneResult r;
    REQUIRE(pt::tune_down_gemv<__half>(*cache, K, N, 0.3, nullptr, opts, &r) == prox::Status::kSuccess);
    check_result(r, pt::policy_names<prox::DownGemvPolicies>(), *cache);
    pt::TuneResult rb;
    REQUIRE(pt::tune_down_gemv<__nv_bfloat16>(*cache, K, N, 0.25, nullptr, opts, &rb) == prox::Status::kSuccess);
    CHECK(rb.key.dtype == "bf16");
    CHECK(rb.key.density16 == 4);
    check_result(rb, pt::policy_names<prox::DownGemvPolicies>(), *cache);
    CHECK(cache->size() == 2);
  }
  SECTION("fused Stage 2 (glu_down_gemv), on the FFN's cooperative grid") {
    pt::TuneResult r;
    REQUIRE((pt::tune_glu_down_gemv<__half, prox::SiLU>(*cache, K, N, 0.3, nullptr, opts, &r)) ==
            prox::Status::kSuccess);
    CHECK(r.key.op == "glu_down_gemv");
    CHECK(r.key.dtype == "f16");
    CHECK(r.key.weights == "f16");
    CHECK(r.key.act == "silu");
    CHECK(r.key.d_model == K);
    CHECK(r.key.d_ff == N);
    CHECK(r.key.density16 == 5);
    CHECK(r.key == (pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(K, N, 0.3)));
    check_result(r, pt::policy_names<prox::GluDownGemvPolicies>(), *cache);
    CHECK(cache->size() == 1);
    // Empty and full masks (y = 0 must still be written; every s is +0 or computed).
    pt::TuneResult r0;
    REQUIRE((pt::tune_glu_down_gemv<__half, prox::SiLU>(*cache, K, N, 0.0, nullptr, opts, &r0)) ==
            prox::Status::kSuccess);
    CHECK(r0.key.density16 == 0);
    check_result(r0, pt::policy_names<prox::GluDownGemvPolicies>(), *cache);
    std::vector<pt::TuneResult> r1;  // the multi-density form
    REQUIRE((pt::tune_glu_down_gemv<__half, prox::SiLU>(*cache, K, N, std::vector<double>{1.0, 0.99}, nullptr, opts,
                                                        &r1)) == prox::Status::kSuccess);
    REQUIRE(r1.size() == 1);  // 1.0 and 0.99 share bucket 16
    CHECK(r1[0].key.density16 == 16);
    check_result(r1[0], pt::policy_names<prox::GluDownGemvPolicies>(), *cache);
    CHECK(cache->size() == 3);
  }
  SECTION("tune<Op>: any registry op, the threshold op without d_ff") {
    pt::TuneResult r;
    REQUIRE((pt::tune<prox::ThresholdOp<__nv_bfloat16>>(*cache, 4096, 999, 0.3, nullptr, opts, &r)) ==
            prox::Status::kSuccess);
    CHECK(r.key == (pt::op_key<prox::ThresholdOp<__nv_bfloat16>>(4096, 0, 0.3)));
    CHECK(r.key.d_ff == 0);
    check_result(r, pt::policy_names<prox::ThresholdPolicies>(), *cache);
    std::vector<pt::TuneResult> rs;
    REQUIRE((pt::tune<prox::GluGemvOp<__nv_bfloat16, prox::GeluTanh>>(*cache, K, N, {0.3, 0.5}, nullptr, opts, &rs)) ==
            prox::Status::kSuccess);
    REQUIRE(rs.size() == 2);
    CHECK(rs[1].key == (pt::op_key<prox::GluGemvOp<__nv_bfloat16, prox::GeluTanh>>(K, N, 0.5)));
    check_result(rs[1], pt::policy_names<prox::GluGemvPolicies>(), *cache);
    CHECK(cache->size() == 3);
  }
  SECTION("density 0 and 1 (empty and full masks) tune too") {
    pt::TuneResult r0, r1;
    REQUIRE(pt::tune_down_gemv<__half>(*cache, K, N, 0.0, nullptr, opts, &r0) == prox::Status::kSuccess);
    CHECK(r0.key.density16 == 0);
    check_result(r0, pt::policy_names<prox::DownGemvPolicies>(), *cache);
    REQUIRE((pt::tune_glu_gemv<__half, prox::SiLU>(*cache, K, N, 1.0, nullptr, opts, &r1)) == prox::Status::kSuccess);
    CHECK(r1.key.density16 == 16);
    check_result(r1, pt::policy_names<prox::GluGemvPolicies>(), *cache);
  }
  SECTION("a bad shape is refused before anything runs") {
    pt::TuneResult r;
    CHECK((pt::tune_glu_gemv<__half, prox::SiLU>(*cache, 100, N, 0.3, nullptr, opts, &r)) ==
          prox::Status::kErrorInvalidShape);
    CHECK(pt::tune_down_gemv<__half>(*cache, K, 33, 0.3, nullptr, opts, &r) == prox::Status::kErrorInvalidShape);
    CHECK((pt::tune_glu_down_gemv<__half, prox::SiLU>(*cache, 100, N, 0.3, nullptr, opts, &r)) ==
          prox::Status::kErrorInvalidShape);
    CHECK(cache->size() == 0);
  }
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning: a rep times a chain of launches and records one launch's share", "[tuning][gpu]") {
  // chain = 1 times every launch alone; chain = 8 times eight launches back to back (chained with
  // PDL where the device has it) and records one launch's share. Were the rep not divided by its
  // launches, its time would be about 8x a lone launch's; the bound below is loose enough to hold
  // under a sanitizer, which serializes the launches. Whether chaining is faster is a timing
  // question for the benchmarks (docs/tuning.md), not asserted here.
  WarningCapture warnings;
  auto alone_cache = make_cache(pt::Mode::kReadOnly);
  auto chained_cache = make_cache(pt::Mode::kReadOnly);
  pt::TuneOptions alone = quick();
  alone.chain = 1;
  pt::TuneOptions chained = quick();
  chained.chain = 8;
  constexpr int K = 2048;
  constexpr int N = 6144;
  pt::TuneResult ra, rc;
  REQUIRE((pt::tune_glu_down_gemv<__half, prox::SiLU>(*alone_cache, K, N, 0.3, nullptr, alone, &ra)) ==
          prox::Status::kSuccess);
  REQUIRE((pt::tune_glu_down_gemv<__half, prox::SiLU>(*chained_cache, K, N, 0.3, nullptr, chained, &rc)) ==
          prox::Status::kSuccess);
  const auto names = pt::policy_names<prox::GluDownGemvPolicies>();
  check_result(ra, names, *alone_cache);
  check_result(rc, names, *chained_cache);
  for (std::size_t i = 0; i < names.size(); ++i) {
    INFO(describe(ra) << describe(rc));
    CHECK(rc.candidates[i].reps == ra.candidates[i].reps);
    CHECK(rc.candidates[i].median_us < 2.0 * ra.candidates[i].median_us);
  }
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning: a tuned layer persists across save and load and plans a SparseFfn", "[tuning][gpu]") {
  using Ffn = prox::SparseFfn<__half>;
  WarningCapture warnings;
  TempDir dir;
  const std::string path = dir.file("prox-tuning-test.tsv");
  constexpr int K = 1024;
  constexpr int N = 4096;
  const std::vector<std::string> fused_names = pt::policy_names<prox::GluDownGemvPolicies>();
  REQUIRE(fused_names.size() >= 2);
  // A hand-made entry (bucket 12) naming the fused list's last policy, so one plan below must take
  // a non-default fused policy from the file (the tuned winners may well all be policy 0).
  const int forced = static_cast<int>(fused_names.size()) - 1;
  const pt::Key forced_key = pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(K, N, 0.75);
  std::vector<pt::TuneResult> results;
  {
    auto a = make_cache(pt::Mode::kReadOnly, path);
    // 0.5 and 0.45 share bucket 8: tuned once. Channel densities 0.3 -> 5, 0.25 -> 4.
    REQUIRE(pt::tune_ffn<Ffn>(*a, K, N, {0.5, 0.45, 1.0}, {0.3, 0.25}, nullptr, quick(), &results) ==
            prox::Status::kSuccess);
    REQUIRE(results.size() == 8);  // proxy x 2, glu x 2, down x 2, glu_down x 2
    int fused_results = 0;
    for (const auto& r : results) {
      const auto& names = a->policies().at(r.key.op);
      check_result(r, names, *a);
      fused_results += r.key.op == "glu_down_gemv";
    }
    CHECK(fused_results == 2);
    CHECK(a->size() == 8);
    REQUIRE(a->record(forced_key, {fused_names[static_cast<std::size_t>(forced)], 9.0, 8.9, 9.1, 20}) ==
            prox::Status::kSuccess);
    REQUIRE(pt::save(*a) == prox::Status::kSuccess);
    CHECK(a->warnings() == 0);
  }
  REQUIRE(fs::exists(path));
  auto b = make_cache(pt::Mode::kReadOnly, path);
  REQUIRE(b->load() == prox::Status::kSuccess);
  INFO("last warning: " << b->last_warning());
  CHECK(b->warnings() == 0);
  CHECK(b->last_load().state == pt::FileState::kLoaded);
  CHECK(b->size() == 9);
  for (const auto& r : results) CHECK(b->index_of(r.key) == r.chosen);
  CHECK(b->index_of(forced_key) == forced);

  const auto chosen_for = [&](const std::string& op, int bucket) {
    for (const auto& r : results)
      if (r.key.op == op && r.key.density16 == bucket) return r.chosen;
    return -2;
  };
  const Ffn::Config cfg{K, N, 0.75f, 0.0f};

  // The default plan fuses Stage 2: proxy and glu_down come from the file, glu/down are not needed.
  prox::PolicyChoice pc;
  REQUIRE(choose_choice<Ffn>(*b, cfg, 0.5, 0.3, &pc) == prox::Status::kSuccess);
  CHECK(pc.proxy == chosen_for("proxy_gemv", 8));
  CHECK(pc.glu_down == chosen_for("glu_down_gemv", 5));
  CHECK(pc.glu_down >= 0);
  CHECK(pc.glu == -1);
  CHECK(pc.down == -1);
  // The unfused plan: glu and down from the file, no fused choice.
  prox::PolicyChoice pu;
  REQUIRE(choose_choice<Ffn>(*b, cfg, 0.5, 0.25, &pu, nullptr, /*fused=*/false) == prox::Status::kSuccess);
  CHECK(pu.proxy == chosen_for("proxy_gemv", 8));
  CHECK(pu.glu == chosen_for("glu_gemv", 4));
  CHECK(pu.down == chosen_for("down_gemv", 4));
  CHECK(pu.glu_down == -1);
  prox::PolicyChoice miss;
  REQUIRE(choose_choice<Ffn>(*b, cfg, 0.2, 0.9, &miss) == prox::Status::kSuccess);  // read-only: misses stay -1
  CHECK(miss.proxy == -1);
  CHECK(miss.glu_down == -1);
  REQUIRE(choose_choice<Ffn>(*b, cfg, 0.2, 0.9, &miss, nullptr, false) == prox::Status::kSuccess);
  CHECK(miss.glu == -1);
  CHECK(miss.down == -1);

  // (Plain scopes, not SECTIONs: Catch2 would re-run the tuning above once per section.)
  {
    INFO("the fused plan launches the tuned glu_down policy on its grid");
    Ffn::PlanOptions opts;
    REQUIRE(opts.fuse_stage2);
    opts.choice = pc;
    Ffn ffn;
    plan_and_run_zero_layer<__half>(K, N, opts, &ffn);
    CHECK(ffn.fused_stage2());
    CHECK(ffn.choice().proxy == pc.proxy);
    CHECK(ffn.choice().glu_down == pc.glu_down);
    CHECK(planned_glu_down_grid(ffn) == glu_down_grid<__half>(pc.glu_down));
  }
  {
    INFO("the PlanOptions form takes a non-default fused policy from the file");
    Ffn::PlanOptions opts;
    REQUIRE(pt::choose<Ffn>(*b, cfg, 0.5, 0.75, &opts) == prox::Status::kSuccess);  // 0.75 -> bucket 12
    CHECK(opts.choice.proxy == chosen_for("proxy_gemv", 8));
    CHECK(opts.choice.glu_down == forced);
    CHECK(opts.choice.glu == -1);
    CHECK(opts.choice.down == -1);
    Ffn ffn;
    plan_and_run_zero_layer<__half>(K, N, opts, &ffn);
    CHECK(ffn.choice().glu_down == forced);
    CHECK(planned_glu_down_grid(ffn) == glu_down_grid<__half>(forced));
  }
  {
    INFO("the unfused plan launches the tuned glu and down policies");
    Ffn::PlanOptions opts;
    opts.fuse_stage2 = false;
    REQUIRE(pt::choose<Ffn>(*b, cfg, 0.5, 0.25, &opts) == prox::Status::kSuccess);
    CHECK(opts.choice.glu == pu.glu);
    CHECK(opts.choice.down == pu.down);
    CHECK(opts.choice.glu_down == -1);
    Ffn ffn;
    plan_and_run_zero_layer<__half>(K, N, opts, &ffn);
    CHECK_FALSE(ffn.fused_stage2());
    CHECK(ffn.choice().proxy == pu.proxy);
    CHECK(ffn.choice().glu == pu.glu);
    CHECK(ffn.choice().down == pu.down);
  }
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning: nothing is tuned during stream capture", "[tuning][gpu]") {
  using Ffn = prox::SparseFfn<__half>;
  WarningCapture warnings;
  auto cache = make_cache(pt::Mode::kTuneOnMiss);
  cudaStream_t stream = nullptr;
  PROX_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{stream};
  const Ffn::Config cfg{512, 2048, 0.75f, 0.0f};
  const auto opts = quick();

  // Global mode, as engines capture: any unsafe call (cudaMalloc, sync) from this thread would
  // invalidate the capture, and EndCapture would report it.
  PROX_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const prox::Status st_glu = pt::tune_glu_gemv<__half, prox::SiLU>(*cache, 512, 2048, 0.3, stream, opts);
  const prox::Status st_thr = pt::tune_threshold<__half>(*cache, 512, 0.5, stream, opts);
  const prox::Status st_fused = pt::tune_glu_down_gemv<__half, prox::SiLU>(*cache, 512, 2048, 0.3, stream, opts);
  std::vector<pt::TuneResult> rs;
  const prox::Status st_ffn = pt::tune_ffn<Ffn>(*cache, 512, 2048, {0.5}, {0.3}, stream, opts, &rs);
  prox::PolicyChoice pc;
  pc.proxy = pc.glu = pc.down = pc.glu_down = 7;
  const prox::Status st_choose = choose_choice<Ffn>(*cache, cfg, 0.5, 0.3, &pc, stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);

  CHECK(st_glu == prox::Status::kErrorCapturing);
  CHECK(st_thr == prox::Status::kErrorCapturing);
  CHECK(st_fused == prox::Status::kErrorCapturing);
  CHECK(st_ffn == prox::Status::kErrorCapturing);
  CHECK(rs.empty());
  CHECK(st_choose == prox::Status::kSuccess);  // falls back to the defaults, counts the miss
  CHECK(pc.proxy == -1);
  CHECK(pc.glu == -1);
  CHECK(pc.down == -1);
  CHECK(pc.glu_down == -1);
  CHECK(cache->capture_misses() == 1);
  CHECK(cache->size() == 0);
  INFO("cudaStreamEndCapture: " << cudaGetErrorString(end));
  CHECK(end == cudaSuccess);  // the capture was not invalidated
  CHECK(cudaGetLastError() == cudaSuccess);

  // Outside capture, the same call tunes what the default (fused) plan runs: proxy and glu_down.
  REQUIRE(choose_choice<Ffn>(*cache, cfg, 0.5, 0.3, &pc, stream) == prox::Status::kSuccess);
  CHECK(pc.proxy >= 0);
  CHECK(pc.glu_down >= 0);
  CHECK(pc.glu == -1);
  CHECK(pc.down == -1);
  CHECK(cache->size() == 2);
  CHECK(cache->index_of(pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(512, 2048, 0.3)) == pc.glu_down);
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning: choose() follows the mode; a choice once made is fixed", "[tuning][gpu]") {
  using Ffn = prox::SparseFfn<__half>;
  WarningCapture warnings;
  const Ffn::Config cfg{512, 2048, 0.75f, 0.0f};
  const auto opts = quick();
  SECTION("off: defaults, even with an entry") {
    auto c = make_cache(pt::Mode::kOff);
    const pt::Key k = pt::op_key<prox::GluGemvOp<__half, prox::SiLU>>(512, 2048, 0.3);
    REQUIRE(c->record(k, {pt::policy_names<prox::GluGemvPolicies>()[1], 5.0, 4.9, 5.1, 20}) == prox::Status::kSuccess);
    const pt::Key kf = pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(512, 2048, 0.3);
    REQUIRE(c->record(kf, {pt::policy_names<prox::GluDownGemvPolicies>()[1], 5.0, 4.9, 5.1, 20}) ==
            prox::Status::kSuccess);
    prox::PolicyChoice pc;
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &pc) == prox::Status::kSuccess);
    CHECK(pc.proxy == -1);
    CHECK(pc.glu_down == -1);
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &pc, nullptr, false) == prox::Status::kSuccess);
    CHECK(pc.glu == -1);
    CHECK(pc.down == -1);
  }
  SECTION("read-only: hits by name, misses stay -1, nothing is tuned") {
    auto c = make_cache(pt::Mode::kReadOnly);
    const pt::Key k = pt::op_key<prox::GluGemvOp<__half, prox::SiLU>>(512, 2048, 0.3);
    REQUIRE(c->record(k, {pt::policy_names<prox::GluGemvPolicies>()[1], 5.0, 4.9, 5.1, 20}) == prox::Status::kSuccess);
    const pt::Key kf = pt::op_key<prox::GluDownGemvOp<__half, prox::SiLU>>(512, 2048, 0.3);
    REQUIRE(c->record(kf, {pt::policy_names<prox::GluDownGemvPolicies>()[1], 5.0, 4.9, 5.1, 20}) ==
            prox::Status::kSuccess);
    prox::PolicyChoice pc;
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.26, &pc) == prox::Status::kSuccess);  // 0.26 -> bucket 5, like 0.3
    CHECK(pc.proxy == -1);
    CHECK(pc.glu_down == 1);  // the default plan fuses Stage 2
    CHECK(pc.glu == -1);
    CHECK(pc.down == -1);
    prox::PolicyChoice pu;
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.26, &pu, nullptr, false) == prox::Status::kSuccess);
    CHECK(pu.proxy == -1);
    CHECK(pu.glu == 1);
    CHECK(pu.down == -1);
    CHECK(pu.glu_down == -1);
    CHECK(c->size() == 2);
  }
  SECTION("tune-on-miss: tunes once, saves, then reuses") {
    TempDir dir;
    const std::string path = dir.file("auto.tsv");
    auto c = make_cache(pt::Mode::kTuneOnMiss, path);
    prox::PolicyChoice first;  // the default (fused) plan: proxy + glu_down
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &first) == prox::Status::kSuccess);
    CHECK(first.proxy >= 0);
    CHECK(first.glu_down >= 0);
    CHECK(c->size() == 2);
    CHECK(fs::exists(path));  // mode 2 saves what it tuned
    // The unfused plan tunes its own two ops on their miss; the proxy entry is reused.
    prox::PolicyChoice unfused;
    REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &unfused, nullptr, false) == prox::Status::kSuccess);
    CHECK(unfused.proxy == first.proxy);
    CHECK(unfused.glu >= 0);
    CHECK(unfused.down >= 0);
    CHECK(unfused.glu_down == -1);
    first.glu = unfused.glu;
    first.down = unfused.down;
    CHECK(c->size() == 4);
    for (int i = 0; i < 3; ++i) {
      prox::PolicyChoice again, again_unfused;
      REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &again) == prox::Status::kSuccess);
      REQUIRE(choose_choice<Ffn>(*c, cfg, 0.5, 0.3, &again_unfused, nullptr, false) == prox::Status::kSuccess);
      CHECK(again.proxy == first.proxy);
      CHECK(again.glu_down == first.glu_down);
      CHECK(again_unfused.glu == first.glu);
      CHECK(again_unfused.down == first.down);
    }
    CHECK(c->size() == 4);  // no re-tuning
    // An explicit re-tune measures again but cannot change the recorded choice.
    pt::TuneResult r;
    REQUIRE((pt::tune_glu_gemv<__half, prox::SiLU>(*c, 512, 2048, 0.3, nullptr, opts, &r)) == prox::Status::kSuccess);
    CHECK_FALSE(r.recorded);
    CHECK(c->index_of(r.key) == first.glu);
    // Another process's view: a read-only cache on the same file gives the same choice.
    auto ro = make_cache(pt::Mode::kReadOnly, path);
    REQUIRE(ro->load() == prox::Status::kSuccess);
    prox::PolicyChoice seen, seen_unfused;
    REQUIRE(choose_choice<Ffn>(*ro, cfg, 0.5, 0.3, &seen) == prox::Status::kSuccess);
    REQUIRE(choose_choice<Ffn>(*ro, cfg, 0.5, 0.3, &seen_unfused, nullptr, false) == prox::Status::kSuccess);
    CHECK(seen.proxy == first.proxy);
    CHECK(seen.glu_down == first.glu_down);
    CHECK(seen_unfused.glu == first.glu);
    CHECK(seen_unfused.down == first.down);
  }
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning: the device signature and the per-device default cache", "[tuning][gpu]") {
  WarningCapture warnings;
  TempDir dir;
  pt::OpenOptions o;
  o.path = dir.file("open.tsv");
  o.use_environment = false;
  std::unique_ptr<pt::Cache> c;
  REQUIRE(pt::open_cache(&c, o) == prox::Status::kSuccess);  // a missing file is fine
  REQUIRE(c != nullptr);
  const pt::Signature& s = c->signature();
  INFO(s.gpu_name << ", " << s.sm_count << " SMs, cc " << s.cc_major << "." << s.cc_minor << ", L2 " << s.l2_bytes);
  CHECK_FALSE(s.gpu_name.empty());
  CHECK(s.sm_count > 0);
  CHECK(s.cc_major >= 8);
  CHECK(s.l2_bytes > 0);
  CHECK(s.mem_bus_bits > 0);
  CHECK(s.cudart_version == CUDART_VERSION);
  CHECK(s.policy_hash == pt::policy_table_hash(pt::policy_table()));
  CHECK(c->path() == o.path);
  CHECK(c->last_load().state == pt::FileState::kMissing);
  pt::Cache* d1 = pt::default_cache();
  pt::Cache* d2 = pt::default_cache();
  REQUIRE(d1 != nullptr);
  CHECK(d1 == d2);
  CHECK(d1->signature().hash_hex() == c->signature().hash_hex());
}
