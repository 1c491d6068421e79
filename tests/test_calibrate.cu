// SPDX-License-Identifier: Apache-2.0
//! @file test_calibrate.cu  Threshold calibration on the GPU against host golden computations:
//! exact quantiles (below and beyond the reservoir capacity, via the same sample priorities), ties
//! and unreachable targets, histogram totals and bin placement, NaN/Inf accounting, Status
//! returns, and calibrate_layer() against the float64 Stage-1 reference and the runtime counters.
#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include <prox/calibrate.cuh>
#include <prox/int4.cuh>
#include <prox/layout.cuh>
#include <prox/sparse_ffn.cuh>
#include <prox/stats.cuh>

#include "common.hpp"
#include "ffn_instances.hpp"
#include "reference/reference.hpp"

using prox::Status;
using prox_test::DeviceBuffer;
namespace calib = prox::calib;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- host golden model of the rule
//! The documented rule on host data: sort |v| (finite only), m = floor(s n), tau = a[m] (+inf at
//! m == n), realized = #{a < tau} / n; if that misses s by more than tol = max(1/n, 0.01) the nearer
//! of (a[m], lo/n) and (next distinct value, hi/n) is taken (the lower on equal distance), and
//! kErrorUnreachableTarget is returned when it still misses by more than tol.
struct HostThreshold {
  float tau = 0.0f;
  double realized = 0.0;
  Status status = Status::kSuccess;
};

HostThreshold host_threshold(std::vector<float> mags, double s) {
  std::sort(mags.begin(), mags.end());
  const long long n = static_cast<long long>(mags.size());
  long long m = static_cast<long long>(std::floor(s * static_cast<double>(n)));
  m = std::min(std::max(m, 0LL), n);
  HostThreshold h;
  long long lo = n, hi = n;
  float next = kInf;
  if (m < n) {
    h.tau = mags[m];
    lo = std::lower_bound(mags.begin(), mags.end(), h.tau) - mags.begin();
    hi = std::upper_bound(mags.begin(), mags.end(), h.tau) - mags.begin();
    next = hi < n ? mags[hi] : kInf;
  } else {
    h.tau = kInf;
  }
  const double dn = static_cast<double>(n);
  h.realized = static_cast<double>(lo) / dn;
  const double tol = std::max(1.0 / dn, 0.01);
  if (std::fabs(h.realized - s) > tol) {
    const double alt = static_cast<double>(hi) / dn;
    if (std::fabs(alt - s) < std::fabs(h.realized - s)) {
      h.tau = next;
      h.realized = alt;
    }
  }
  h.status = std::fabs(h.realized - s) > tol ? Status::kErrorUnreachableTarget : Status::kSuccess;
  return h;
}

std::vector<float> finite_magnitudes(const std::vector<float>& v) {
  std::vector<float> out;
  for (float x : v)
    if (std::isfinite(x)) out.push_back(std::fabs(x));
  return out;
}

template <class T>
std::vector<float> as_float(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) out[i] = v[i];
    else out[i] = prox::to_float(v[i]);
  }
  return out;
}

template <class T>
T from_f(float f) {
  if constexpr (std::is_same_v<T, float>) return f;
  else return prox::from_float<T>(f);
}

//! A planned calibrator bound to its own workspace.
struct Calibrator {
  calib::ThresholdCalibrator cal;
  DeviceBuffer<unsigned char> ws;
  explicit Calibrator(const calib::CalibratorOptions& o = {}) {
    PROX_TEST_OK(cal.plan(o));
    ws = DeviceBuffer<unsigned char>(cal.workspace_bytes());
    PROX_TEST_OK(cal.init(ws.get(), ws.size(), nullptr));
  }
};

//! Feed `d` to the calibrator in calls of the given sizes (the rest in a last call).
template <class T>
void feed(calib::ThresholdCalibrator& cal, const DeviceBuffer<T>& d, const std::vector<std::size_t>& sizes) {
  std::size_t off = 0;
  for (std::size_t sz : sizes) {
    sz = std::min(sz, d.size() - off);
    PROX_TEST_OK(cal.add_samples(d.get() + off, sz, nullptr));
    off += sz;
  }
  if (off < d.size()) PROX_TEST_OK(cal.add_samples(d.get() + off, d.size() - off, nullptr));
}

std::vector<float> normal_floats(std::size_t n, std::uint64_t seed, double sigma = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<float> v(n);
  for (auto& e : v) e = static_cast<float>(dist(rng));
  return v;
}

const double kTargets[] = {0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 0.999, 1.0};

}  // namespace

// ---------------------------------------------------------------- quantile exactness
TEST_CASE("calibrate: quantile is exact when every sample fits the reservoir", "[calibrate][gpu]") {
  const std::size_t n = 50000;
  auto h = normal_floats(n, 11);
  h[3] = 0.0f;  // exact zeros and a negative zero are ordinary samples (|v| = 0)
  h[4] = -0.0f;
  DeviceBuffer<float> d(h);
  Calibrator c;
  feed(c.cal, d, {1, 20000, 7});
  const auto mags = finite_magnitudes(h);
  for (double s : kTargets) {
    CAPTURE(s);
    const HostThreshold ref = host_threshold(mags, s);
    calib::ThresholdResult r;
    CHECK(c.cal.finalize(s, nullptr, &r) == ref.status);
    CHECK(ref.status == Status::kSuccess);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.realized == ref.realized);
    CHECK(r.realized <= s);
    CHECK(r.realized > s - 1.0 / n);
    CHECK(r.target == s);
    CHECK(r.seen == n);
    CHECK(r.finite == n);
    CHECK(r.reservoir == n);
    CHECK(r.nan == 0);
    CHECK(r.inf == 0);
    // The threshold means the prox predicate: kept iff |v| >= tau.
    std::size_t dropped = 0;
    for (float v : h) dropped += !prox::keep_magnitude(v, r.tau);
    CHECK(static_cast<double>(dropped) / n == r.realized);
  }
}

TEMPLATE_TEST_CASE("calibrate: 16-bit samples with ties follow the host rule exactly", "[calibrate][gpu]", __half,
                   __nv_bfloat16) {
  // N(0,1) rounded to 16 bits has few distinct magnitudes, so most quantiles sit inside tie runs.
  const std::size_t n = 60000;
  const auto h = prox_test::random_vector<TestType>(n, 21);
  DeviceBuffer<TestType> d(h);
  Calibrator c;
  feed(c.cal, d, {30000});
  const auto mags = finite_magnitudes(as_float(h));
  int unreachable = 0;
  for (double s : {0.0, 0.05, 0.3, 0.5, 0.7, 0.95, 0.9999, 1.0}) {
    CAPTURE(s);
    const HostThreshold ref = host_threshold(mags, s);
    calib::ThresholdResult r;
    CHECK(c.cal.finalize(s, nullptr, &r) == ref.status);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.realized == ref.realized);
    unreachable += ref.status == Status::kErrorUnreachableTarget;
  }
  INFO("unreachable targets among 8 (bf16 has coarse ties): " << unreachable);
  SUCCEED();
}

TEST_CASE("calibrate: beyond capacity the reservoir is the bottom-k of sample_priority", "[calibrate][gpu]") {
  const std::size_t n = 100000;
  calib::CalibratorOptions o;
  o.capacity = 4096;
  o.chunk = 3000;  // many internal passes, some calls spanning several
  o.seed = 1234;
  // Laplace-like magnitudes (the shape of s), with NaN/Inf that consume stream positions.
  std::mt19937_64 rng(31);
  std::exponential_distribution<double> ex(1.0);
  std::vector<float> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<float>((i % 2 ? 1.0 : -1.0) * ex(rng));
  for (std::size_t i = 17; i < n; i += 997) h[i] = kNaN;
  for (std::size_t i = 500; i < n; i += 4999) h[i] = (i % 2) ? kInf : -kInf;
  DeviceBuffer<float> d(h);
  Calibrator c(o);
  feed(c.cal, d, {1, 2999, 3000, 5001, 123, 40000});

  // Host bottom-k over the same priorities.
  std::vector<std::pair<std::uint64_t, float>> pv;
  std::size_t finite = 0;
  for (std::size_t g = 0; g < n; ++g) {
    if (!std::isfinite(h[g])) continue;
    ++finite;
    pv.emplace_back(calib::sample_priority(o.seed, g), std::fabs(h[g]));
  }
  std::partial_sort(pv.begin(), pv.begin() + o.capacity, pv.end());
  std::vector<float> kept(o.capacity);
  for (std::size_t i = 0; i < o.capacity; ++i) kept[i] = pv[i].second;

  std::vector<float> res(o.capacity);
  std::size_t count = 0;
  PROX_TEST_OK(c.cal.read_reservoir(res.data(), res.size(), &count, nullptr));
  REQUIRE(count == o.capacity);
  auto a = kept, b = res;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  CHECK(a == b);

  const auto all = finite_magnitudes(h);
  for (double s : {0.1, 0.5, 0.7, 0.9}) {
    CAPTURE(s);
    const HostThreshold ref = host_threshold(kept, s);
    calib::ThresholdResult r;
    CHECK(c.cal.finalize(s, nullptr, &r) == Status::kSuccess);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.realized == ref.realized);
    CHECK(r.reservoir == o.capacity);
    CHECK(r.finite == finite);
    CHECK(r.seen == n);
    // Over all samples: within sampling error of a uniform 4096-subset (5 sigma).
    std::size_t below = 0;
    for (float v : all) below += v < r.tau;
    const double sigma = std::sqrt(s * (1.0 - s) / o.capacity);
    CHECK(std::fabs(static_cast<double>(below) / all.size() - s) <= 5.0 * sigma + 1.0 / o.capacity);
  }

  // The split into calls and passes does not matter: one call, one pass, same threshold.
  calib::CalibratorOptions o1 = o;
  o1.chunk = n;
  Calibrator c1(o1);
  PROX_TEST_OK(c1.cal.add_samples(d.get(), n, nullptr));
  calib::ThresholdResult r0, r1;
  CHECK(c.cal.finalize(0.7, nullptr, &r0) == Status::kSuccess);
  CHECK(c1.cal.finalize(0.7, nullptr, &r1) == Status::kSuccess);
  CHECK(prox_test::bits32(r0.tau) == prox_test::bits32(r1.tau));
}

// ---------------------------------------------------------------- histogram
TEMPLATE_TEST_CASE("calibrate: histogram totals equal the finite count and bins match the host", "[calibrate][gpu]",
                   float, __half) {
  // Three calls with a growing max, so the range doubles between calls (bins merge on the device).
  std::vector<float> f;
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<double> small(-0.01, 0.01);
  for (int i = 0; i < 5000; ++i) f.push_back(static_cast<float>(small(rng)));
  const std::size_t first = f.size();
  for (float v : normal_floats(20000, 42)) f.push_back(v);
  const std::size_t second = f.size();
  for (float v : normal_floats(20000, 43, 30.0)) f.push_back(v);
  f.push_back(1000.0f);
  f.push_back(-0.0f);
  f.push_back(1e-7f);  // subnormal in fp16
  f.push_back(kNaN);
  f.push_back(kInf);
  f.push_back(-kInf);
  std::vector<TestType> h(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) h[i] = from_f<TestType>(f[i]);
  const auto hf = as_float(h);  // the values the device sees
  DeviceBuffer<TestType> d(h);
  Calibrator c;
  feed(c.cal, d, {first, second - first});

  auto hist = std::make_unique<calib::Histogram>();
  PROX_TEST_OK(c.cal.read_histogram(hist.get(), nullptr));
  const auto mags = finite_magnitudes(hf);
  const float max_abs = *std::max_element(mags.begin(), mags.end());
  CHECK(hist->total == mags.size());
  CHECK(prox_test::bits32(hist->max_abs) == prox_test::bits32(max_abs));
  const int e = calib::histogram_exponent(prox_test::bits32(max_abs));
  CHECK(hist->exponent == e);
  CHECK(hist->hi == std::ldexp(1.0, e));
  CHECK(static_cast<double>(max_abs) < hist->hi);
  CHECK(hist->hi <= 2.0 * max_abs);
  CHECK(hist->edges[0] == 0.0);
  CHECK(hist->edges[calib::kHistogramBins] == hist->hi);

  std::vector<unsigned long long> ref(calib::kHistogramBins, 0);
  std::size_t misplaced = 0;
  for (float a : mags) {
    const int b = calib::histogram_bin(a, e);
    ++ref[b];
    // The bin formula agrees with the exported edges: edges[b] <= a < edges[b + 1].
    misplaced += !(hist->edges[b] <= a && static_cast<double>(a) < hist->edges[b + 1]);
  }
  CHECK(misplaced == 0);
  std::size_t bad_bins = 0;
  unsigned long long sum = 0;
  for (int b = 0; b < calib::kHistogramBins; ++b) {
    bad_bins += hist->counts[b] != ref[b];
    sum += hist->counts[b];
  }
  CHECK(bad_bins == 0);
  CHECK(sum == hist->total);

  calib::ThresholdResult r;
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kSuccess);
  CHECK(r.finite == hist->total);
}

// ---------------------------------------------------------------- NaN / Inf, empty, invalid
TEMPLATE_TEST_CASE("calibrate: NaN and Inf samples are skipped and counted", "[calibrate][gpu]", float, __half,
                   __nv_bfloat16) {
  const std::size_t n = 10000;
  auto f = normal_floats(n, 51);
  std::size_t nans = 0, infs = 0;
  for (std::size_t i = 0; i < n; i += 37) {
    f[i] = (i % 2) ? kNaN : -kNaN;
    ++nans;
  }
  for (std::size_t i = 5; i < n; i += 101) {
    if (std::isnan(f[i])) continue;
    f[i] = (i % 2) ? kInf : -kInf;
    ++infs;
  }
  std::vector<TestType> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = from_f<TestType>(f[i]);
  DeviceBuffer<TestType> d(h);
  Calibrator c;
  feed(c.cal, d, {999});
  const auto mags = finite_magnitudes(as_float(h));
  REQUIRE(mags.size() == n - nans - infs);
  for (double s : {0.2, 0.5}) {
    CAPTURE(s);
    const HostThreshold ref = host_threshold(mags, s);
    calib::ThresholdResult r;
    CHECK(c.cal.finalize(s, nullptr, &r) == ref.status);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.nan == nans);
    CHECK(r.inf == infs);
    CHECK(r.finite == mags.size());
    CHECK(r.seen == n);
    CHECK(std::isfinite(r.max_abs));
  }
}

TEST_CASE("calibrate: empty sample sets and invalid arguments get a Status", "[calibrate][gpu]") {
  Calibrator c;
  calib::ThresholdResult r;
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kErrorEmptySamples);
  CHECK(r.finite == 0);

  CHECK(c.cal.add_samples(static_cast<const float*>(nullptr), 0, nullptr) == Status::kSuccess);
  CHECK(c.cal.add_samples(static_cast<const float*>(nullptr), 5, nullptr) == Status::kErrorNullPointer);

  DeviceBuffer<float> bad(std::vector<float>{kNaN, kInf, -kInf, kNaN});
  PROX_TEST_OK(c.cal.add_samples(bad.get(), bad.size(), nullptr));
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kErrorEmptySamples);
  CHECK(r.nan == 2);
  CHECK(r.inf == 2);
  CHECK(r.seen == 4);

  DeviceBuffer<float> good(normal_floats(100, 61));
  PROX_TEST_OK(c.cal.add_samples(good.get(), good.size(), nullptr));
  const calib::ThresholdResult before{};
  for (double s : {std::numeric_limits<double>::quiet_NaN(), -0.1, 1.5}) {
    calib::ThresholdResult untouched = before;
    CHECK(c.cal.finalize(s, nullptr, &untouched) == Status::kErrorInvalidTarget);
    CHECK(untouched.seen == 0);
  }
  CHECK(c.cal.finalize(0.5, nullptr, nullptr) == Status::kErrorNullPointer);
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kSuccess);
  CHECK(r.finite == 100);

  PROX_TEST_OK(c.cal.reset(nullptr));
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kErrorEmptySamples);
  CHECK(c.cal.samples_seen() == 0);

  calib::ThresholdCalibrator unplanned;
  CHECK(unplanned.init(c.ws.get(), c.ws.size(), nullptr) == Status::kErrorNotPlanned);
  CHECK(unplanned.finalize(0.5, nullptr, &r) == Status::kErrorNotPlanned);
  calib::CalibratorOptions zero;
  zero.capacity = 0;
  CHECK(unplanned.plan(zero) == Status::kErrorInvalidArgument);
  PROX_TEST_OK(unplanned.plan());
  CHECK(unplanned.init(c.ws.get(), unplanned.workspace_bytes() - 1, nullptr) == Status::kErrorWorkspaceTooSmall);
  CHECK(unplanned.init(nullptr, unplanned.workspace_bytes(), nullptr) == Status::kErrorNullPointer);
}

TEST_CASE("calibrate: ties that straddle the quantile make the target unreachable, with the nearest tau",
          "[calibrate][gpu]") {
  // 60 % exact zeros, 40 % distinct values in [1, 2).
  const std::size_t n = 10000;
  std::vector<float> h(n, 0.0f);
  for (std::size_t i = 6000; i < n; ++i) h[i] = 1.0f + static_cast<float>(i - 6000) / 4000.0f;
  std::shuffle(h.begin(), h.end(), std::mt19937(71));
  DeviceBuffer<float> d(h);
  Calibrator c;
  feed(c.cal, d, {});
  const auto mags = finite_magnitudes(h);
  struct Case {
    double s;
    Status status;
    float tau;
    double realized;
  };
  const Case cases[] = {
      {0.4, Status::kErrorUnreachableTarget, 1.0f, 0.6},  // 0 realizes 0 (off by 0.4), 1.0 realizes 0.6 (0.2)
      {0.3, Status::kErrorUnreachableTarget, 0.0f, 0.0},  // equally far: the lower sparsity wins
      {0.595, Status::kSuccess, 1.0f, 0.6},               // a[m] = 0 misses, the next value is within 1 %
      {0.6, Status::kSuccess, 1.0f, 0.6},                 // m = 6000 is the first non-zero
  };
  for (const auto& k : cases) {
    CAPTURE(k.s);
    const HostThreshold ref = host_threshold(mags, k.s);
    calib::ThresholdResult r;
    const Status st = c.cal.finalize(k.s, nullptr, &r);
    CHECK(st == ref.status);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.realized == ref.realized);
    CHECK(st == k.status);
    CHECK(r.tau == k.tau);
    CHECK(r.realized == k.realized);
  }
  {
    const HostThreshold ref = host_threshold(mags, 0.7);  // inside the distinct values: exact
    calib::ThresholdResult r;
    CHECK(c.cal.finalize(0.7, nullptr, &r) == Status::kSuccess);
    CHECK(prox_test::bits32(r.tau) == prox_test::bits32(ref.tau));
    CHECK(r.realized == ref.realized);
  }

  // All samples equal: 0 or 1 are the only reachable sparsities.
  PROX_TEST_OK(c.cal.reset(nullptr));
  DeviceBuffer<float> ones(std::vector<float>(1000, -1.0f));
  PROX_TEST_OK(c.cal.add_samples(ones.get(), ones.size(), nullptr));
  calib::ThresholdResult r;
  CHECK(c.cal.finalize(0.5, nullptr, &r) == Status::kErrorUnreachableTarget);
  CHECK(r.tau == 1.0f);
  CHECK(r.realized == 0.0);
  CHECK(c.cal.finalize(0.9, nullptr, &r) == Status::kErrorUnreachableTarget);
  CHECK(r.tau == kInf);
  CHECK(r.realized == 1.0);
  CHECK(c.cal.finalize(1.0, nullptr, &r) == Status::kSuccess);
  CHECK(r.tau == kInf);
  CHECK(c.cal.finalize(0.0, nullptr, &r) == Status::kSuccess);
  CHECK(r.tau == 1.0f);
}

// ---------------------------------------------------------------- one layer
namespace {
struct ProgressLog {
  int inputs_calls = 0;
  int proxy_calls = 0;
  int last_done = 0;
  int total = 0;
};
void log_progress(calib::CalibrationStage stage, int done, int total, void* user) {
  auto* p = static_cast<ProgressLog*>(user);
  if (stage == calib::CalibrationStage::kInputs) ++p->inputs_calls;
  else ++p->proxy_calls;
  p->last_done = done;
  p->total = total;
}
}  // namespace

TEMPLATE_TEST_CASE("calibrate: calibrate_layer realizes s1 and s2 on its samples (float64 reference)",
                   "[calibrate][gpu]", __half, __nv_bfloat16) {
  using T = TestType;
  const int K = 256, N = 512, tokens = 48, batch = 5;
  const prox::StageSparsity target{0.3, 0.65};
  const std::size_t nx = static_cast<std::size_t>(tokens) * K;
  const std::size_t ns = static_cast<std::size_t>(tokens) * N;

  // Layer weights (nn.Linear layouts), INT4 proxies packed on the host (bit-identical to the device packer).
  const auto wg = prox_test::random_vector<T>(static_cast<std::size_t>(N) * K, 81, 0.06);
  const auto wu = prox_test::random_vector<T>(static_cast<std::size_t>(N) * K, 82, 0.06);
  const auto wd = prox_test::random_vector<T>(static_cast<std::size_t>(K) * N, 83, 0.04);  // [K][N]
  std::vector<T> wdt(wd.size());
  PROX_TEST_OK(prox::transpose_host(wd.data(), K, N, wdt.data()));
  std::vector<std::uint32_t> qg(prox::int4::packed_words(K, N)), qu(qg.size());
  std::vector<float> sg(N), su(N);
  PROX_TEST_OK(prox::int4::pack_host(wg.data(), K, N, qg.data(), sg.data()));
  PROX_TEST_OK(prox::int4::pack_host(wu.data(), K, N, qu.data(), su.data()));
  // Inputs: N(0,1) with a few outlier coordinates, as LLM FFN inputs have.
  auto x = prox_test::random_vector<T>(nx, 84);
  for (int t = 0; t < tokens; ++t)
    for (int k : {3, 77, 200})
      x[static_cast<std::size_t>(t) * K + k] =
          prox::from_float<T>(6.0f * prox::to_float(x[static_cast<std::size_t>(t) * K + k]));

  DeviceBuffer<T> dwg(wg), dwu(wu), dwdt(wdt), dx(x), dy(K);
  DeviceBuffer<std::uint32_t> dqg(qg), dqu(qu);
  DeviceBuffer<float> dsg(sg), dsu(su), ds_proxy(static_cast<std::size_t>(batch) * N);
  prox::SparseFfn<T> ffn;
  typename prox::SparseFfn<T>::Weights w;
  w.gate = dwg.get();
  w.up = dwu.get();
  w.down_t = dwdt.get();
  w.proxy_gate = {dqg.get(), dsg.get()};
  w.proxy_up = {dqu.get(), dsu.get()};
  PROX_TEST_OK(ffn.plan({K, N, 0.0f, 0.0f}, w));
  DeviceBuffer<unsigned char> ws(ffn.workspace_bytes());
  PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.size(), nullptr));

  Calibrator c;
  auto hx = std::make_unique<calib::Histogram>();
  auto hs = std::make_unique<calib::Histogram>();
  ProgressLog plog;
  calib::LayerCalibrationArgs<T> a{dx.get(), tokens, target, ws.get(), ws.size(), ds_proxy.get(), batch};
  a.histogram_x = hx.get();
  a.histogram_s = hs.get();
  a.progress = log_progress;
  a.progress_user = &plog;
  calib::LayerCalibration lc;
  REQUIRE(calib::calibrate_layer(ffn, w, a, c.cal, nullptr, &lc) == Status::kSuccess);

  // tau_x is the exact quantile of |x| (every sample fits the reservoir).
  const auto xf = as_float(x);
  const HostThreshold ref_x = host_threshold(finite_magnitudes(xf), target.s1);
  CHECK(prox_test::bits32(lc.tau_x) == prox_test::bits32(ref_x.tau));
  CHECK(lc.x.reservoir == nx);
  CHECK(lc.s.reservoir == ns);
  // 16-bit x has ties: realized s1 follows the host rule exactly and is off by at most the tie run at tau_x.
  std::size_t x_ties = 0;
  for (float v : xf) x_ties += std::fabs(v) == lc.tau_x;
  const double x_tol = static_cast<double>(x_ties + 1) / nx;
  INFO("x samples tied at tau_x: " << x_ties);
  CHECK(lc.x.realized == ref_x.realized);
  CHECK(std::fabs(lc.x.realized - target.s1) <= x_tol);
  CHECK(std::fabs(lc.s.realized - target.s2) <= 1.0 / ns);
  CHECK(ffn.config().tau_x == lc.tau_x);
  CHECK(ffn.config().tau_s == lc.tau_s);
  CHECK(hx->total == nx);
  CHECK(hs->total == ns);
  CHECK(plog.inputs_calls == 1);
  CHECK(plog.proxy_calls == (tokens + batch - 1) / batch);
  CHECK(plog.last_done == tokens);
  CHECK(plog.total == tokens);

  // The runtime counters over the same tokens count exactly what the calibration realized: the
  // same predicate on the same x, and the same deterministic s~ in values and mask modes.
  DeviceBuffer<prox::SparsityCounters> dcnt(1);
  PROX_TEST_OK(prox::reset_counters(dcnt.get(), nullptr));
  for (int t = 0; t < tokens; ++t)
    PROX_TEST_OK(
        ffn.run(dx.get() + static_cast<std::size_t>(t) * K, dy.get(), ws.get(), ws.size(), nullptr, dcnt.get()));
  PROX_TEST_CUDA(cudaDeviceSynchronize());
  const prox::SparsityCounters cnt = dcnt.download()[0];
  CHECK(cnt.calls == static_cast<unsigned long long>(tokens));
  CHECK(cnt.kept_inputs == nx - static_cast<unsigned long long>(std::llround(lc.x.realized * nx)));
  CHECK(cnt.selected_channels == ns - static_cast<unsigned long long>(std::llround(lc.s.realized * ns)));
  prox::SparsityReport rep;
  PROX_TEST_OK(prox::make_report(cnt, K, N, &rep));
  CHECK(std::fabs(rep.s1 - target.s1) <= x_tol);
  CHECK(std::fabs(rep.s2 - target.s2) <= 1.0 / ns);

  // Against the float64 Stage-1 reference: with tau_x, the fraction of reference |s~| below tau_s is
  // s2 up to 1/n and the channels whose s~ is within the fp32 error bound of tau_s.
  std::size_t below = 0, ambiguous = 0;
  for (int t = 0; t < tokens; ++t) {
    const std::vector<double> xt(xf.begin() + static_cast<std::ptrdiff_t>(t) * K,
                                 xf.begin() + static_cast<std::ptrdiff_t>(t + 1) * K);
    const auto r1 = prox_ref::stage1_int4(xt, K, N, lc.tau_x, lc.tau_s, qg, sg, qu, su, prox_ref::Act::kSiLU);
    for (int j = 0; j < N; ++j) below += !r1.sel[j];
    ambiguous += static_cast<std::size_t>(r1.num_ambiguous);
  }
  INFO("reference below tau_s: " << below << " of " << ns << ", ambiguous " << ambiguous);
  CHECK(std::fabs(static_cast<double>(below) - target.s2 * ns) <= 1.0 + static_cast<double>(ambiguous));
}

TEST_CASE("calibrate: calibrate_layer validates before running", "[calibrate][gpu]") {
  prox::SparseFfn<__half> unplanned;
  typename prox::SparseFfn<__half>::Weights w;
  Calibrator c;
  DeviceBuffer<__half> dx(256);
  DeviceBuffer<float> ds(512);
  DeviceBuffer<unsigned char> ws(1024);
  calib::LayerCalibrationArgs<__half> a{dx.get(), 1, {0.1, 0.7}, ws.get(), ws.size(), ds.get(), 1};
  calib::LayerCalibration lc;
  CHECK(calib::calibrate_layer(unplanned, w, a, c.cal, nullptr, &lc) == Status::kErrorNotPlanned);
  CHECK(calib::calibrate_layer(unplanned, w, a, c.cal, nullptr, nullptr) == Status::kErrorNullPointer);
}

TEST_CASE("calibrate: calibrate_layer keeps every plan option of the layer", "[calibrate][gpu][safety]") {
  // Before, its re-plans kept only the policies and PDL: a layer planned unfused (because cooperative
  // launches fail on the engine's platform), with clusters or without the spread, came back fused and
  // with the defaults.
  using T = __half;
  using Ffn = prox::SparseFfn<T>;
  const int K = 512, N = 1024, tokens = 8;
  const auto wg = prox_test::random_vector<T>(static_cast<std::size_t>(N) * K, 91, 0.06);
  const auto wu = prox_test::random_vector<T>(static_cast<std::size_t>(N) * K, 92, 0.06);
  const auto wdt = prox_test::random_vector<T>(static_cast<std::size_t>(N) * K, 93, 0.04);
  std::vector<std::uint32_t> qg(prox::int4::packed_words(K, N)), qu(qg.size());
  std::vector<float> sg(N), su(N);
  PROX_TEST_OK(prox::int4::pack_host(wg.data(), K, N, qg.data(), sg.data()));
  PROX_TEST_OK(prox::int4::pack_host(wu.data(), K, N, qu.data(), su.data()));
  const auto x = prox_test::random_vector<T>(static_cast<std::size_t>(tokens) * K, 94);
  DeviceBuffer<T> dwg(wg), dwu(wu), dwdt(wdt), dx(x);
  DeviceBuffer<std::uint32_t> dqg(qg), dqu(qu);
  DeviceBuffer<float> dsg(sg), dsu(su), ds_proxy(static_cast<std::size_t>(tokens) * N);
  Ffn::Weights w;
  w.gate = dwg.get();
  w.up = dwu.get();
  w.down_t = dwdt.get();
  w.proxy_gate = {dqg.get(), dsg.get()};
  w.proxy_up = {dqu.get(), dsu.get()};
  for (const bool fuse : {false, true}) {
    Ffn::PlanOptions o;
    o.fuse_stage2 = fuse;
    o.pdl = false;
    o.cluster = true;
    o.spread = false;
    o.cooperative = false;
    o.choice.proxy = 2;
    if (fuse) {
      o.choice.glu_down = 2;
    } else {
      o.choice.glu = 1;
      o.choice.down = 2;
    }
    Ffn ffn;
    PROX_TEST_OK(ffn.plan({K, N, 0.0f, 0.0f}, w, o));
    DeviceBuffer<unsigned char> ws(Ffn::workspace_bytes(K, N));  // never initialized: calibrate_layer does
    PROX_TEST_CUDA(cudaMemset(ws.get(), 0xEE, ws.size()));
    Calibrator c;
    calib::LayerCalibrationArgs<T> a{dx.get(), tokens, {0.3, 0.7}, ws.get(), ws.size(), ds_proxy.get(), tokens};
    calib::LayerCalibration lc;
    REQUIRE(calib::calibrate_layer(ffn, w, a, c.cal, nullptr, &lc) == Status::kSuccess);
    const Ffn::PlanOptions& k = ffn.plan_options();
    CAPTURE(fuse);
    CHECK(ffn.planned());
    CHECK(k.fuse_stage2 == fuse);
    CHECK(ffn.fused_stage2() == fuse);
    CHECK(k.pdl == false);
    CHECK(k.cluster == true);
    CHECK(k.spread == false);
    CHECK(k.cooperative == false);
    CHECK(k.choice.proxy == 2);
    CHECK(k.choice.glu_down == (fuse ? 2 : -1));
    CHECK(k.choice.glu == (fuse ? -1 : 1));
    CHECK(k.choice.down == (fuse ? -1 : 2));
    CHECK(ffn.config().tau_x == lc.tau_x);
    CHECK(ffn.config().tau_s == lc.tau_s);
    // The s~ it calibrated on were real values (the workspace was initialized, not NaN-flagged).
    Status ws_status = Status::kSuccess;
    PROX_TEST_OK(prox::read_workspace_status(ws.get(), nullptr, &ws_status));
    CHECK(ws_status == Status::kSuccess);
    CHECK(lc.s.reservoir == static_cast<std::size_t>(tokens) * N);
  }
}
