// SPDX-License-Identifier: Apache-2.0
//! @file alpha_ratio.cu  prox_alpha: the measured proxy-cost ratio
//!   alpha = time(INT4 proxy GEMV) / time(fp16 input-sparse GEMV)
//! with one kernel family (proxy_gemv<Int4Weights> vs proxy_gemv<DenseWeights<__half>>), the same
//! tokens, the same tau_x and hence the same kept inputs, at input sparsity 0, 10, 55, 70 % on the
//! Qwen3-4B/8B/14B/32B FFN shapes. Prints a table laid out like the paper's "Measured proxy-cost
//! ratio" table (rows = models, columns = input sparsity) and writes CSV and JSON.
//!
//! Both formats are timed under CUDA graphs over rotated weight copies (bench_common.cuh), every
//! policy of each format's candidate list; alpha pairs the best policy of each list (the ratio of
//! what each format can do), and the table of alpha with the plan-time default policies is printed
//! too. Stage 1's mask mode is used (channel bitmask out, tau_s = 0): the epilogue costs the same
//! for any tau_s.
//!
//! Each kernel also has a fixed cost that does not depend on the kept rows (read x, threshold,
//! combine the split-K partials, write the mask). The tool times the two best policies again with
//! tau_x = +inf (nothing kept, no weight byte read) and reports
//!   alpha_streaming = (t_int4 - t_int4_empty) / t_fp16,
//! alpha without the INT4 kernel's fixed cost: how far its streaming is from the byte ratio, and
//!   int4_fixed_budget = 0.28 t_fp16 - (t_int4 - t_int4_empty),
//! the fixed cost at which alpha would meet the 0.28 target with the streaming as it is. The fp16
//! kernel's empty time is reported but not subtracted: its grid is 3-12 times larger and runs in
//! several waves, whose block scheduling overlaps the streaming once rows are kept (at s1 = 0 it
//! streams at 98-102 % of copy in total), so it is not an additive cost of that kernel.
//! --pdl=1 launches as SparseFfn launches Stage 1 (programmatic dependent launch).
//!
//! --fp8=1: alpha for FP8 e4m3 layers, alpha = time(INT4 proxy GEMV) / time(FP8 input-sparse GEMV): the
//! denominator (the "fp16" columns of the outputs, then the FP8 kernel's) is proxy_gemv<Fp8ProxyWeights>, the
//! same kernel family over input-major e4m3 codes with per-channel scales (W_gate and W_up quantized per channel,
//! fp8::quantize_device, their codes transposed), which reads 1 byte a weight instead of 2. The INT4 proxies are
//! those of the fp16 weights (the FP8 layer's, packed from the dequantized FP8 weights, cost the same).

#include <fmt/core.h>
#include <fmt/format.h>

#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <prox_support/cli.hpp>
#include <prox_support/json.hpp>

#include "bench_common.cuh"

namespace {

using prox_bench::DeviceBuffer;
using prox_bench::FfnShape;
using prox_bench::GraphReplay;
using prox_bench::Timing;
using Half = __half;
using Int4Fmt = prox::Int4Weights;
using Fp16Fmt = prox::DenseWeights<Half>;
using Fp8Fmt = prox::Fp8ProxyWeights;

constexpr double kTargetAlpha = 0.28;  // the H100 target (docs/benchmarks.md, "Targets")

struct Options {
  std::string shapes = "4B,8B,14B,32B";
  std::string sparsities = "0,10,55,70";
  std::string csv = "alpha.csv";
  std::string json = "alpha.json";
  int iterations = 30;
  int warmup = 3;
  int tokens = 8;
  int min_launches = 32;
  double rotate_gb = 2.0;
  double max_device_gb = 40.0;
  bool quick = false;
  //! Launch with programmatic dependent launch (sm_90+), as SparseFfn launches Stage 1: each launch's
  //! start overlaps the previous one's tail. Off by default (each launch waits for the previous).
  bool pdl = false;
  //! The denominator is the FP8 input-sparse GEMV (proxy_gemv<Fp8ProxyWeights>) instead of the fp16 one.
  bool fp8 = false;
  std::string commit;
};

// ---------------------------------------------------------------- rotated proxy weights of one format
/**
 * @brief `copies` identical copies of one format's gate and up proxies (+ scales for INT4).
 * INT4: packed [d_model][d_ff/8] uint32 + float scales [d_ff] (int4::pack_device);
 * fp16: input-major [d_model][d_ff] (transpose_device of nn.Linear [d_ff][d_model]).
 */
struct ProxySet {
  std::size_t mat = 0, sc = 0, stride = 0;
  int copies = 0;
  DeviceBuffer arena;
  const void* gate(int c) const { return arena.as<const char>(stride * c); }
  const void* up(int c) const { return arena.as<const char>(stride * c + mat); }
  const float* sc_gate(int c) const { return sc ? arena.as<const float>(stride * c + 2 * mat) : nullptr; }
  const float* sc_up(int c) const { return sc ? arena.as<const float>(stride * c + 2 * mat + sc) : nullptr; }
};

struct Row {
  std::string model;
  int d_model = 0, d_ff = 0;
  int s1_pct = 0;
  double s1_measured = 0.0;
  double kept_rows = 0.0;  // mean per token
  Timing int4_best, fp16_best, int4_default, fp16_default;
  std::string int4_best_name, fp16_best_name, int4_default_name, fp16_default_name;
  int int4_best_index = 0, fp16_best_index = 0;
  //! The best policies again with tau_x = +inf: nothing kept, no weight byte read (fixed costs).
  Timing int4_empty, fp16_empty;
  double int4_bytes = 0.0, fp16_bytes = 0.0;
  double alpha() const { return int4_best.median_s / fp16_best.median_s; }
  double alpha_default() const { return int4_default.median_s / fp16_default.median_s; }
  //! alpha without the INT4 kernel's fixed cost (its time with nothing kept); see the file comment.
  double alpha_streaming() const { return (int4_best.median_s - int4_empty.median_s) / fp16_best.median_s; }
  //! The INT4 fixed cost (us) at which alpha would be kTargetAlpha, the streaming unchanged.
  double int4_fixed_budget_us() const {
    return (kTargetAlpha * fp16_best.median_s - (int4_best.median_s - int4_empty.median_s)) * 1e6;
  }
};

struct PolicyTime {
  std::string model;
  int s1_pct;
  std::string format;
  int index;
  std::string policy;
  Timing t;
};

class AlphaTool {
 public:
  AlphaTool(const Options& o, const prox_bench::DeviceFacts& dev, cudaStream_t s) : opt_(o), dev_(dev), stream_(s) {}

  void run_shape(const FfnShape& shape, const std::vector<int>& s1_list) {
    const int K = shape.d_model;
    const int N = shape.d_ff;
    const std::size_t kn = static_cast<std::size_t>(K) * N;
    const std::size_t budget = prox_bench::memory_budget(static_cast<std::size_t>(opt_.max_device_gb * 1e9));
    const std::size_t src_bytes = 2 * prox_bench::align_up(sizeof(Half) * kn);
    if (src_bytes >= budget)
      throw std::runtime_error(std::string(shape.name) + ": source weights exceed the memory budget");
    const std::size_t per_format = (budget - src_bytes) / 2;
    const std::size_t rotate = static_cast<std::size_t>(opt_.rotate_gb * 1e9);

    // nn.Linear sources W_gate, W_up [d_ff][d_model] ~ N(0, 1/d_model); freed once both formats exist.
    ProxySet q4, q16;
    {
      DeviceBuffer src(src_bytes, "source weights");
      Half* wg = src.as<Half>();
      Half* wu = src.as<Half>(prox_bench::align_up(sizeof(Half) * kn));
      const std::uint64_t seed = 0xa1fa0000ull + static_cast<std::uint64_t>(K) * 131 + N;
      prox_bench::fill_normal(wg, kn, seed + 1, 1.0f / std::sqrt(float(K)), stream_);
      prox_bench::fill_normal(wu, kn, seed + 2, 1.0f / std::sqrt(float(K)), stream_);

      q4.mat = prox_bench::align_up(sizeof(std::uint32_t) * prox::int4::packed_words(K, N));
      q4.sc = prox_bench::align_up(sizeof(float) * N);
      q4.stride = 2 * q4.mat + 2 * q4.sc;
      q4.copies = prox_bench::rotation_copies(q4.stride, rotate, per_format);
      q4.arena = DeviceBuffer(q4.stride * q4.copies, "INT4 proxy copies");
      char* b4 = q4.arena.as<char>();
      PROX_BENCH_PROX(prox::int4::pack_device(wg, K, N, reinterpret_cast<std::uint32_t*>(b4),
                                              reinterpret_cast<float*>(b4 + 2 * q4.mat), stream_));
      PROX_BENCH_PROX(prox::int4::pack_device(wu, K, N, reinterpret_cast<std::uint32_t*>(b4 + q4.mat),
                                              reinterpret_cast<float*>(b4 + 2 * q4.mat + q4.sc), stream_));
      for (int c = 1; c < q4.copies; ++c)
        PROX_BENCH_CUDA(cudaMemcpyAsync(b4 + q4.stride * c, b4, q4.stride, cudaMemcpyDeviceToDevice, stream_));

      q16.mat = prox_bench::align_up((opt_.fp8 ? 1 : sizeof(Half)) * kn);
      q16.sc = opt_.fp8 ? prox_bench::align_up(sizeof(float) * N) : 0;
      q16.stride = 2 * q16.mat + 2 * q16.sc;
      q16.copies = prox_bench::rotation_copies(q16.stride, rotate, per_format);
      q16.arena = DeviceBuffer(q16.stride * q16.copies, opt_.fp8 ? "FP8 input-major copies" : "fp16 proxy copies");
      char* b16 = q16.arena.as<char>();
      if (opt_.fp8) {
        // Per-channel e4m3 of nn.Linear [d_ff][d_model] (a scale per row = channel), codes -> input-major.
        namespace fp8 = prox::fp8;
        DeviceBuffer q(kn, "FP8 codes");
        for (int m = 0; m < 2; ++m) {
          PROX_BENCH_PROX(fp8::quantize_device(m == 0 ? wg : wu, N, K, fp8::ScaleLayout::kPerChannel,
                                               q.as<std::uint8_t>(), reinterpret_cast<float*>(b16 + 2 * q16.mat + m * q16.sc),
                                               stream_));
          PROX_BENCH_PROX(prox::transpose_device(q.as<const std::uint8_t>(), N, K,
                                                 reinterpret_cast<std::uint8_t*>(b16 + m * q16.mat), stream_));
          PROX_BENCH_CUDA(cudaStreamSynchronize(stream_));
        }
      } else {
        // [d_ff][d_model] (rows = d_ff) -> input-major [d_model][d_ff].
        PROX_BENCH_PROX(prox::transpose_device(wg, N, K, reinterpret_cast<Half*>(b16), stream_));
        PROX_BENCH_PROX(prox::transpose_device(wu, N, K, reinterpret_cast<Half*>(b16 + q16.mat), stream_));
      }
      for (int c = 1; c < q16.copies; ++c)
        PROX_BENCH_CUDA(cudaMemcpyAsync(b16 + q16.stride * c, b16, q16.stride, cudaMemcpyDeviceToDevice, stream_));
      PROX_BENCH_CUDA(cudaStreamSynchronize(stream_));
    }

    // Tokens x ~ N(0, 1), each 256-byte aligned.
    const std::size_t xstride = prox_bench::align_up(sizeof(Half) * K);
    DeviceBuffer xbuf(xstride * opt_.tokens, "tokens");
    std::vector<float> abs_x;
    for (int t = 0; t < opt_.tokens; ++t) {
      Half* x = xbuf.as<Half>(xstride * t);
      prox_bench::fill_normal(x, static_cast<std::size_t>(K), 0x70c0ull + 977ull * K + t, 1.0f, stream_);
      for (const Half& v : prox_bench::to_host(x, static_cast<std::size_t>(K), stream_))
        abs_x.push_back(std::fabs(prox::to_float(v)));
    }
    const auto token = [&](int t) { return xbuf.as<const Half>(xstride * t); };
    DeviceBuffer mask(sizeof(std::uint32_t) * (N / 32), "channel mask");
    DeviceBuffer counters(sizeof(prox::SparsityCounters), "counters");

    const int l4 = prox_bench::launches_per_graph(q4.copies, opt_.tokens, opt_.min_launches);
    const int l16 = prox_bench::launches_per_graph(q16.copies, opt_.tokens, opt_.min_launches);
    fmt::print(stderr,
               "[prox_alpha] {}: INT4 {} copies x {:.1f} MB, fp16 {} copies x {:.1f} MB; {} / {} launches per graph\n",
               shape.name, q4.copies, q4.stride / 1e6, q16.copies, q16.stride / 1e6, l4, l16);

    for (int s1_pct : s1_list) {
      Row row;
      row.model = shape.name;
      row.d_model = K;
      row.d_ff = N;
      row.s1_pct = s1_pct;
      const float tau_x = prox_bench::magnitude_threshold(abs_x, s1_pct / 100.0);

      // Same kept inputs in both formats, checked on the device counters.
      const unsigned long long kept4 = count_kept<Int4Fmt>(q4, K, N, tau_x, token, mask, counters);
      const unsigned long long kept16 = opt_.fp8 ? count_kept<Fp8Fmt>(q16, K, N, tau_x, token, mask, counters)
                                                 : count_kept<Fp16Fmt>(q16, K, N, tau_x, token, mask, counters);
      if (kept4 != kept16)
        throw std::runtime_error(
            fmt::format("{} s1={}%: INT4 kept {} inputs, fp16 kept {}", shape.name, s1_pct, kept4, kept16));
      row.kept_rows = static_cast<double>(kept4) / opt_.tokens;
      row.s1_measured = 1.0 - row.kept_rows / K;
      row.int4_bytes = prox_bench::stage1_int4_bytes(row.kept_rows, K, N, sizeof(Half));
      row.fp16_bytes = opt_.fp8 ? prox_bench::stage1_dense_bytes(row.kept_rows, K, N, 1, sizeof(Half)) + 8.0 * N
                               : prox_bench::stage1_dense_bytes(row.kept_rows, K, N, sizeof(Half), sizeof(Half));

      time_all<Int4Fmt>("int4", q4, shape, s1_pct, tau_x, token, mask, l4, &row.int4_best, &row.int4_best_name,
                        &row.int4_best_index, &row.int4_default, &row.int4_default_name);
      if (opt_.fp8) {
        time_all<Fp8Fmt>("fp8", q16, shape, s1_pct, tau_x, token, mask, l16, &row.fp16_best, &row.fp16_best_name,
                         &row.fp16_best_index, &row.fp16_default, &row.fp16_default_name);
      } else {
        time_all<Fp16Fmt>("fp16", q16, shape, s1_pct, tau_x, token, mask, l16, &row.fp16_best, &row.fp16_best_name,
                          &row.fp16_best_index, &row.fp16_default, &row.fp16_default_name);
      }
      constexpr float kNothingKept = std::numeric_limits<float>::infinity();
      row.int4_empty = time_policy<Int4Fmt>(row.int4_best_index, q4, shape, kNothingKept, token, mask, l4);
      row.fp16_empty = opt_.fp8 ? time_policy<Fp8Fmt>(row.fp16_best_index, q16, shape, kNothingKept, token, mask, l16)
                                : time_policy<Fp16Fmt>(row.fp16_best_index, q16, shape, kNothingKept, token, mask, l16);
      fmt::print(
          stderr,
          "[prox_alpha] {} s1={:>2}% (measured {:.4f}): INT4 {:.2f} us ({}), fp16 {:.2f} us ({}), alpha {:.3f} "
          "(default policies {:.3f}); nothing kept: INT4 {:.2f} us, fp16 {:.2f} us; alpha without the INT4 fixed cost "
          "{:.3f}\n",
          shape.name, s1_pct, row.s1_measured, row.int4_best.median_s * 1e6, row.int4_best_name,
          row.fp16_best.median_s * 1e6, row.fp16_best_name, row.alpha(), row.alpha_default(),
          row.int4_empty.median_s * 1e6, row.fp16_empty.median_s * 1e6, row.alpha_streaming());
      rows_.push_back(row);
    }
  }

  const std::vector<Row>& rows() const { return rows_; }
  const std::vector<PolicyTime>& per_policy() const { return per_policy_; }

 private:
  //! The Stage-1 op of a proxy format, driven through prox::Operator.
  template <class Fmt>
  using ProxyOp = prox::Operator<prox::ProxyGemvOp<Half, prox::SiLU, Fmt>>;

  //! Copy c's gate or up proxy as the typed matrix of Fmt.
  template <class Fmt>
  static typename Fmt::Matrix matrix(const void* w, const float* scales) {
    typename Fmt::Matrix m;
    if constexpr (std::is_same_v<Fmt, Int4Fmt>) {
      m.packed = static_cast<const std::uint32_t*>(w);
    } else if constexpr (std::is_same_v<Fmt, Fp8Fmt>) {
      m.w = static_cast<const std::uint8_t*>(w);
    } else {
      m.w = static_cast<const Half*>(w);
    }
    m.scales = scales;  // nullptr for fp16 proxies: scale 1
    return m;
  }

  template <class Fmt>
  prox::ProxyGemvArgs<Half, Fmt> args(const ProxySet& set, int c, int K, int N, float tau_x, const Half* x,
                                      std::uint32_t* mask) const {
    prox::ProxyGemvArgs<Half, Fmt> a;
    a.x = x;
    a.d_model = K;
    a.d_ff = N;
    a.tau_x = tau_x;
    a.tau_s = 0.0f;
    a.gate = matrix<Fmt>(set.gate(c), set.sc_gate(c));
    a.up = matrix<Fmt>(set.up(c), set.sc_up(c));
    a.channel_mask = mask;
    return a;
  }

  //! Kept inputs summed over all tokens, from SparsityCounters of one eager launch per token.
  template <class Fmt, class TokenFn>
  unsigned long long count_kept(const ProxySet& set, int K, int N, float tau_x, const TokenFn& token,
                                const DeviceBuffer& mask, const DeviceBuffer& counters) {
    const prox::ProxyGemvArgs<Half, Fmt> probe = args<Fmt>(set, 0, K, N, tau_x, token(0), mask.as<std::uint32_t>());
    ProxyOp<Fmt> op;
    PROX_BENCH_PROX(op.initialize(probe, {}, 0));  // policy 0, no PDL
    DeviceBuffer ws(ProxyOp<Fmt>::workspace_bytes(probe), "proxy workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(ws.get(), ws.bytes(), stream_));
    auto* cnt = counters.as<prox::SparsityCounters>();
    PROX_BENCH_PROX(prox::reset_counters(cnt, stream_));
    for (int t = 0; t < opt_.tokens; ++t) {
      prox::ProxyGemvArgs<Half, Fmt> a = args<Fmt>(set, 0, K, N, tau_x, token(t), mask.as<std::uint32_t>());
      a.counters = cnt;
      PROX_BENCH_PROX(op.run(a, ws.get(), ws.bytes(), stream_));
    }
    prox::SparsityCounters h{};
    PROX_BENCH_CUDA(cudaMemcpyAsync(&h, cnt, sizeof(h), cudaMemcpyDeviceToHost, stream_));
    PROX_BENCH_CUDA(cudaStreamSynchronize(stream_));
    prox_bench::check_workspace(ws, "proxy workspace", stream_);
    if (h.calls != static_cast<unsigned long long>(opt_.tokens))
      throw std::runtime_error(fmt::format("SparsityCounters counted {} calls, expected {}", h.calls, opt_.tokens));
    return h.kept_inputs;
  }

  //! The median per-launch time of the policy at `index` of the format's list over graph replays
  //! (launch i: weight copy i mod copies, token i mod tokens); planned once, launched per graph node.
  template <class Fmt, class TokenFn>
  Timing time_policy(int index, const ProxySet& set, const FfnShape& shape, float tau_x, const TokenFn& token,
                     const DeviceBuffer& mask, int launches) {
    const int K = shape.d_model;
    const int N = shape.d_ff;
    const prox::ProxyGemvArgs<Half, Fmt> probe = args<Fmt>(set, 0, K, N, tau_x, token(0), mask.as<std::uint32_t>());
    typename ProxyOp<Fmt>::Options o;  // the op's defaults (no clusters, spread on), PDL where asked and possible
    o.pdl = opt_.pdl && dev_.cc_major >= 9;
    ProxyOp<Fmt> op;
    PROX_BENCH_PROX(op.initialize(probe, o, index));
    DeviceBuffer ws(ProxyOp<Fmt>::workspace_bytes(probe), "proxy workspace");
    PROX_BENCH_PROX(prox::initialize_workspace(ws.get(), ws.bytes(), stream_));
    GraphReplay graph(stream_, launches, [&](int i, cudaStream_t s) {
      const prox::ProxyGemvArgs<Half, Fmt> a =
          args<Fmt>(set, i % set.copies, K, N, tau_x, token(i % opt_.tokens), mask.as<std::uint32_t>());
      PROX_BENCH_PROX(op.run(a, ws.get(), ws.bytes(), s));
    });
    const Timing t = graph.measure(opt_.warmup, opt_.iterations);
    prox_bench::check_workspace(ws, "proxy workspace", stream_);
    return t;
  }

  //! Time every policy of the format's list; report the best and the plan-time default (dispatch.cuh's rule).
  template <class Fmt, class TokenFn>
  void time_all(const char* fmt_name, const ProxySet& set, const FfnShape& shape, int s1_pct, float tau_x,
                const TokenFn& token, const DeviceBuffer& mask, int launches, Timing* best, std::string* best_name,
                int* best_index, Timing* dflt, std::string* dflt_name) {
    const int K = shape.d_model;
    const int N = shape.d_ff;
    ProxyOp<Fmt> planner;  // the policy Operator::initialize picks for this device and shape
    PROX_BENCH_PROX(planner.initialize(args<Fmt>(set, 0, K, N, tau_x, token(0), mask.as<std::uint32_t>())));
    const int default_index = planner.policy();
    best->median_s = std::numeric_limits<double>::infinity();
    prox::for_each_policy<typename ProxyOp<Fmt>::Policies>([&](auto p, int index) {
      using P = decltype(p);
      const Timing t = time_policy<Fmt>(index, set, shape, tau_x, token, mask, launches);
      per_policy_.push_back({shape.name, s1_pct, fmt_name, index, P::name(), t});
      if (t.median_s < best->median_s) {
        *best = t;
        *best_name = P::name();
        *best_index = index;
      }
      if (index == default_index) {
        *dflt = t;
        *dflt_name = P::name();
      }
    });
  }

  Options opt_;
  prox_bench::DeviceFacts dev_;
  cudaStream_t stream_;
  std::vector<Row> rows_;
  std::vector<PolicyTime> per_policy_;
};

// ---------------------------------------------------------------- output
enum class Alpha { kBest, kDefault, kStreaming, kFixedBudget };

double alpha_of(const Row& r, Alpha which) {
  switch (which) {
    case Alpha::kDefault:
      return r.alpha_default();
    case Alpha::kStreaming:
      return r.alpha_streaming();
    case Alpha::kFixedBudget:
      return r.int4_fixed_budget_us();
    default:
      return r.alpha();
  }
}

//! A table laid out like the paper's measured-alpha table: "Input sparsity" over the s1 columns, and
//! the GPU as a group row above the models.
void print_table(const std::vector<Row>& rows, const std::vector<int>& s1_list, Alpha which, const std::string& gpu,
                 const std::string& title) {
  fmt::print("\n{}\n", title);
  fmt::print("{:<12} {}\n", "Model", "Input sparsity");
  fmt::print("{:<12}", "");
  for (int s : s1_list) fmt::print(" {:>7}", fmt::format("{}%", s));
  fmt::print("\n{}\n", gpu);
  std::vector<std::string> models;
  for (const Row& r : rows)
    if (std::find(models.begin(), models.end(), r.model) == models.end()) models.push_back(r.model);
  for (const std::string& m : models) {
    fmt::print("{:<12}", m);
    for (int s : s1_list) {
      const Row* hit = nullptr;
      for (const Row& r : rows)
        if (r.model == m && r.s1_pct == s) hit = &r;
      std::string cell = "-";
      if (hit != nullptr) {
        const double v = alpha_of(*hit, which);
        cell = which == Alpha::kFixedBudget ? fmt::format("{:.2f}", v) : fmt::format("{:.3f}", v);
      }
      fmt::print(" {:>7}", cell);
    }
    fmt::print("\n");
  }
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return buf;
}

void write_csv(const std::string& path, const std::vector<Row>& rows, double copy_gbps) {
  std::ofstream f(path);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << "model,d_model,d_ff,s1_target,s1_measured,kept_rows,t_int4_us,policy_int4,t_fp16_us,policy_fp16,alpha,"
       "t_int4_default_us,policy_int4_default,t_fp16_default_us,policy_fp16_default,alpha_default,"
       "bytes_int4,bytes_fp16,byte_ratio,int4_GBps,fp16_GBps,int4_frac_copy,fp16_frac_copy,t_int4_empty_us,"
       "t_fp16_empty_us,alpha_streaming,int4_fixed_budget_us\n";
  for (const Row& r : rows) {
    const double g4 = r.int4_bytes / r.int4_best.median_s / 1e9;
    const double g16 = r.fp16_bytes / r.fp16_best.median_s / 1e9;
    f << fmt::format(
        "{},{},{},{:.2f},{:.5f},{:.1f},{:.3f},{},{:.3f},{},{:.4f},{:.3f},{},{:.3f},{},{:.4f},{:.0f},{:.0f},{:.4f},"
        "{:.1f},{:.1f},{:.4f},{:.4f},{:.3f},{:.3f},{:.4f},{:.3f}\n",
        r.model, r.d_model, r.d_ff, r.s1_pct / 100.0, r.s1_measured, r.kept_rows, r.int4_best.median_s * 1e6,
        r.int4_best_name, r.fp16_best.median_s * 1e6, r.fp16_best_name, r.alpha(), r.int4_default.median_s * 1e6,
        r.int4_default_name, r.fp16_default.median_s * 1e6, r.fp16_default_name, r.alpha_default(), r.int4_bytes,
        r.fp16_bytes, r.int4_bytes / r.fp16_bytes, g4, g16, g4 / copy_gbps, g16 / copy_gbps,
        r.int4_empty.median_s * 1e6, r.fp16_empty.median_s * 1e6, r.alpha_streaming(), r.int4_fixed_budget_us());
  }
  if (!f) throw std::runtime_error("error writing " + path);
}

/**
 * @brief The JSON document of a run (docs/data/alpha-h100.json is one; bench/report.py reads it).
 * Figures keep the digits the CSV has: times 1e-4 us, ratios 1e-5, bandwidths 1e-2 GB/s.
 */
prox_support::json::Json alpha_document(const std::vector<Row>& rows, const std::vector<PolicyTime>& per_policy,
                                        const prox_bench::DeviceFacts& dev, double copy_gbps,
                                        const std::string& commit, const std::string& command, const Options& o,
                                        const std::string& date) {
  using prox_support::json::Json;
  using prox_support::json::rounded;
  Json doc;
  doc["tool"] = "prox_alpha";
  Json& c = doc["context"];
  c["date"] = date;
  c["gpu"] = dev.name;
  c["gpu_arch"] = dev.sm();
  c["gpu_sms"] = dev.sm_count;
  c["gpu_l2_MB"] = rounded(dev.l2_bytes / 1e6, 1);
  c["cuda_runtime"] = dev.runtime_version;
  c["cuda_driver"] = dev.driver_version;
  c["copy_GBps"] = rounded(copy_gbps, 2);
  c["prox_version"] = PROX_VERSION_STRING;
  c["prox_commit"] = commit;
  c["prox_command"] = command;
  c["prox_cuda_archs"] = PROX_BENCH_CUDA_ARCHS;
  c["options"] = fmt::format("iterations={} warmup={} tokens={} min_launches={} rotate_gb={:.2f} pdl={} fp8={}{}",
                             o.iterations, o.warmup, o.tokens, o.min_launches, o.rotate_gb, o.pdl ? 1 : 0,
                             o.fp8 ? 1 : 0, o.quick ? " quick" : "");
  if (o.fp8) c["denominator"] = "proxy_gemv<Fp8ProxyWeights>: the FP8 input-sparse GEMV (the fp16 fields hold it)";
  doc["target_alpha_max"] = kTargetAlpha;
  doc["alpha_definition"] =
      "median per-launch time of proxy_gemv<Int4Weights> / proxy_gemv<DenseWeights<half>>, best policy of each "
      "candidate list; alpha_default uses the plan-time default policies; alpha_streaming = (t_int4 - t_int4_empty) / "
      "t_fp16, alpha without the INT4 kernel's fixed cost, the empty times being the same policies with tau_x = +inf "
      "(nothing kept); int4_fixed_budget_us = 0.28 t_fp16 - (t_int4 - t_int4_empty), the INT4 fixed cost at which "
      "alpha would be 0.28";
  const auto us = [&](const Timing& t) { return rounded(t.median_s * 1e6, 4); };
  Json& jr = doc["rows"] = Json::array();
  for (const Row& r : rows) {
    Json j;
    j["model"] = r.model;
    j["d_model"] = r.d_model;
    j["d_ff"] = r.d_ff;
    j["s1_target"] = rounded(r.s1_pct / 100.0, 2);
    j["s1_measured"] = rounded(r.s1_measured, 5);
    j["kept_rows"] = rounded(r.kept_rows, 1);
    j["t_int4_us"] = us(r.int4_best);
    j["policy_int4"] = r.int4_best_name;
    j["t_fp16_us"] = us(r.fp16_best);
    j["policy_fp16"] = r.fp16_best_name;
    j["alpha"] = rounded(r.alpha(), 5);
    j["t_int4_default_us"] = us(r.int4_default);
    j["policy_int4_default"] = r.int4_default_name;
    j["t_fp16_default_us"] = us(r.fp16_default);
    j["policy_fp16_default"] = r.fp16_default_name;
    j["alpha_default"] = rounded(r.alpha_default(), 5);
    j["bytes_int4"] = std::llround(r.int4_bytes);
    j["bytes_fp16"] = std::llround(r.fp16_bytes);
    j["byte_ratio"] = rounded(r.int4_bytes / r.fp16_bytes, 5);
    j["int4_GBps"] = rounded(r.int4_bytes / r.int4_best.median_s / 1e9, 2);
    j["fp16_GBps"] = rounded(r.fp16_bytes / r.fp16_best.median_s / 1e9, 2);
    j["t_int4_empty_us"] = us(r.int4_empty);
    j["t_fp16_empty_us"] = us(r.fp16_empty);
    j["alpha_streaming"] = rounded(r.alpha_streaming(), 5);
    j["int4_fixed_budget_us"] = rounded(r.int4_fixed_budget_us(), 4);
    jr.push_back(std::move(j));
  }
  Json& jp = doc["per_policy"] = Json::array();
  for (const PolicyTime& p : per_policy) {
    Json j;
    j["model"] = p.model;
    j["s1_target"] = rounded(p.s1_pct / 100.0, 2);
    j["format"] = p.format;
    j["index"] = p.index;
    j["policy"] = p.policy;
    j["t_us"] = us(p.t);
    j["t_min_us"] = rounded(p.t.min_s * 1e6, 4);
    j["launches"] = p.t.launches;
    j["replays"] = p.t.replays;
    jp.push_back(std::move(j));
  }
  return doc;
}

// ---------------------------------------------------------------- flags
//! Parse the flags into *o. Returns the exit code when the program should stop (0 after --help,
//! 2 after a bad flag, its error printed), nullopt to go on. Needs no GPU.
std::optional<int> parse_flags(int argc, char** argv, Options* o) {
  namespace cli = prox_support::cli;
  CLI::App app{"prox_alpha: measured proxy-cost ratio alpha = t(INT4 proxy GEMV) / t(fp16 input-sparse GEMV)",
               "prox_alpha"};
  cli::setup(app, cli::Syntax::kEquals);
  const auto count = [](int lo) { return cli::value_check(cli::number_in(lo, 1e9, true)); };
  const auto positive = cli::value_check(cli::positive_number());
  app.add_option("--shapes", o->shapes, "4B,8B,14B,32B (also 1.7B)")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(prox_bench::shape_name_test()));
  app.add_option("--sparsities", o->sparsities, "input sparsity s1, percent")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(cli::number_in(0, 99, true)));
  app.add_option("--csv", o->csv, "CSV output")->type_name("PATH")->capture_default_str();
  app.add_option("--json", o->json, "JSON output")->type_name("PATH")->capture_default_str();
  app.add_flag("--quick", o->quick, "10 replays, 1 GB rotation, 16 launches per graph (a fast look)");
  CLI::Option* iterations = app.add_option("--iterations", o->iterations, "timed graph replays per policy")
                                ->type_name("N")
                                ->capture_default_str()
                                ->check(count(1));
  CLI::Option* warmup = app.add_option("--warmup", o->warmup, "untimed replays first")
                            ->type_name("N")
                            ->capture_default_str()
                            ->check(count(0));
  app.add_option("--tokens", o->tokens, "distinct tokens cycled")
      ->type_name("N")
      ->capture_default_str()
      ->check(count(1));
  CLI::Option* min_launches = app.add_option("--min-launches", o->min_launches, "launches per graph, at least")
                                  ->type_name("N")
                                  ->capture_default_str()
                                  ->check(count(1));
  CLI::Option* rotate = app.add_option("--rotate-gb", o->rotate_gb, "bytes rotated per format, at least")
                            ->type_name("G")
                            ->capture_default_str()
                            ->check(positive);
  app.add_option("--max-device-gb", o->max_device_gb, "device memory cap")
      ->type_name("G")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--pdl", o->pdl, "launch with PDL (sm_90+), as SparseFfn launches Stage 1")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(cli::value_check(cli::one_of({"0", "1"})));
  app.add_option("--fp8", o->fp8, "alpha for FP8 layers: the denominator is the FP8 input-sparse GEMV")
      ->type_name("0|1")
      ->capture_default_str()
      ->check(cli::value_check(cli::one_of({"0", "1"})));
  app.add_option("--commit", o->commit, "commit to record (else $PROX_COMMIT, else the one built from)")
      ->type_name("SHA");
  if (const auto rc = cli::parse(app, argc, argv)) return rc;
  if (o->quick) {  // --quick's values, where the flag itself was not given
    if (iterations->count() == 0) o->iterations = 10;
    if (warmup->count() == 0) o->warmup = 2;
    if (rotate->count() == 0) o->rotate_gb = 1.0;
    if (min_launches->count() == 0) o->min_launches = 16;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string command = prox_bench::join_argv(argc, argv);
  Options opt;
  if (const auto rc = parse_flags(argc, argv, &opt)) return *rc;
  cudaStream_t stream = nullptr;
  try {
    // Both lists were checked by parse_flags.
    const std::vector<FfnShape> shapes = prox_bench::select_shapes(opt.shapes, prox_bench::qwen3_shapes());
    std::vector<int> s1_list;
    for (const std::string& s : prox_bench::split_list(opt.sparsities)) s1_list.push_back(std::stoi(s));

    const prox_bench::DeviceFacts dev = prox_bench::query_device_facts();
    fmt::print(stderr, "[prox_alpha] device: {}\n", prox_bench::describe(dev));
    PROX_BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const prox_bench::CopyBandwidth copy = prox_bench::measure_copy_bandwidth(stream);
    const std::string commit = prox_bench::resolve_commit(opt.commit);
    fmt::print(stderr, "[prox_alpha] copy bandwidth (D2D 1 GiB, read + write): {:.1f} GB/s; commit {}\n", copy.GBps,
               commit);

    AlphaTool tool(opt, dev, stream);
    for (const FfnShape& s : shapes) tool.run_shape(s, s1_list);

    fmt::print("\nGPU: {} ({}, {} SMs), copy bandwidth {:.0f} GB/s, CUDA runtime {}, commit {}\n", dev.name, dev.sm(),
               dev.sm_count, copy.GBps, dev.runtime_version, commit);
    fmt::print("command: {}\n", command);
    print_table(tool.rows(), s1_list, Alpha::kBest, dev.name,
                "Measured proxy-cost ratio alpha = t(INT4 proxy GEMV) / t(FP16 input-sparse GEMV), same kernel "
                "family, same kept inputs (best policy of each list)");
    print_table(tool.rows(), s1_list, Alpha::kDefault, dev.name,
                "Same, with the plan-time default policy of each list");
    print_table(tool.rows(), s1_list, Alpha::kStreaming, dev.name,
                "Alpha without the INT4 kernel's fixed cost, (t_INT4 - t_INT4,empty) / t_FP16 (empty: the same "
                "policy with nothing kept, tau_x = +inf)");
    print_table(tool.rows(), s1_list, Alpha::kFixedBudget, dev.name,
                "INT4 fixed cost (us) at which alpha would be 0.28, the streaming as measured");
    double lo = 1e9, hi = 0.0;
    int pass = 0;
    for (const Row& r : tool.rows()) {
      lo = std::min(lo, r.alpha());
      hi = std::max(hi, r.alpha());
      pass += r.alpha() <= kTargetAlpha;
    }
    fmt::print("\nalpha range {:.3f} - {:.3f}; target alpha <= {:.2f}: {} of {} cells meet it\n", lo, hi, kTargetAlpha,
               pass, tool.rows().size());
    fmt::print("paper (A6000, RTX 3090, A100): 0.234 - 0.351, pooled mean 0.285; the byte ratio is 0.25 plus scales\n");

    write_csv(opt.csv, tool.rows(), copy.GBps);
    prox_support::json::write_file(
        opt.json, alpha_document(tool.rows(), tool.per_policy(), dev, copy.GBps, commit, command, opt, utc_now()));
    fmt::print("wrote {} and {}\n", opt.csv, opt.json);
    cudaStreamDestroy(stream);
    return 0;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "prox_alpha: error: {}\n", e.what());
    if (stream != nullptr) cudaStreamDestroy(stream);
    return 1;
  }
}
