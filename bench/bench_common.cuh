// SPDX-License-Identifier: Apache-2.0
//! @file bench_common.cuh  Shared by prox's benchmarks and tools: throwing checks, device facts,
//! copy bandwidth, CUDA-graph replay timing over rotated weight copies, synthetic FFN layers made on
//! the device, and exact-quantile threshold calibration. Not part of the library (it throws, prints
//! and allocates freely). The device buffer, the random fill and the flag and list helpers are
//! prox_support's (tools/common), shared with the tests and the examples.
//!
//! Timing method (docs/benchmarks.md): R launches, launch i on weight copy i % C and token i % n_tok,
//! are captured into one CUDA graph; the graph is replayed and each replay is timed with CUDA events;
//! per-launch time = elapsed / R. Individually timed launches would add 5-10 us each at these sizes,
//! and C copies whose bytes exceed the L2 several times keep every launch reading from HBM.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <prox/fp8_policies.cuh>
#include <prox/prox.cuh>
#include <prox_support/cli.hpp>
#include <prox_support/device_buffer.hpp>
#include <prox_support/random.cuh>

#include <prox_support/dense_ffn.cuh>

#define PROX_BENCH_STR2(x) #x
#define PROX_BENCH_STR(x) PROX_BENCH_STR2(x)
//! Throw std::runtime_error naming the failed call and its place when a CUDA runtime call fails.
//! (Variadic so that template argument lists with commas need no extra parentheses.)
#define PROX_BENCH_CUDA(...) \
  ::prox_bench::check_cuda((__VA_ARGS__), #__VA_ARGS__ " at " __FILE__ ":" PROX_BENCH_STR(__LINE__))
//! Same for a call that returns prox::Status.
#define PROX_BENCH_PROX(...) \
  ::prox_bench::check_prox((__VA_ARGS__), #__VA_ARGS__ " at " __FILE__ ":" PROX_BENCH_STR(__LINE__))

#ifndef PROX_BENCH_CUDA_ARCHS
#define PROX_BENCH_CUDA_ARCHS "unknown"
#endif

namespace prox_bench {

inline void check_prox(prox::Status s, const char* what) {
  if (s != prox::Status::kSuccess) throw std::runtime_error(std::string("prox: ") + what + ": " + prox::to_string(s));
}

template <class T>
constexpr const char* dtype_name() {
  return prox::DTypeTraits<T>::kName;
}

// ---------------------------------------------------------------- shapes
//! A Qwen3 FFN shape: d_model (hidden size) and d_ff (intermediate size).
struct FfnShape {
  const char* name;
  int d_model;
  int d_ff;
};

//! The five shapes of the benchmark suite (Qwen3 config.json hidden_size / intermediate_size).
inline const std::vector<FfnShape>& qwen3_shapes() {
  static const std::vector<FfnShape> shapes = {{"Qwen3-1.7B", 2048, 6144},
                                               {"Qwen3-4B", 2560, 9728},
                                               {"Qwen3-8B", 4096, 12288},
                                               {"Qwen3-14B", 5120, 17408},
                                               {"Qwen3-32B", 5120, 25600}};
  return shapes;
}

inline std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

using prox_support::check_cuda;  // the dense baseline's (prox_support/dense_ffn.cuh)
using prox_support::cli::split_list;

/**
 * @brief The shapes named in a comma list ("8B,14B" or "Qwen3-8B"; case-insensitive, exact match,
 * so "4B" never selects "14B"), in the order of `from`. Throws on an unknown name.
 */
inline std::vector<FfnShape> select_shapes(const std::string& list, const std::vector<FfnShape>& from) {
  const std::vector<std::string> want = split_list(list);
  for (const std::string& w : want) {
    bool found = false;
    for (const FfnShape& s : from) {
      const std::string full = lower(s.name);
      const std::string shortname = full.substr(full.find('-') + 1);
      found = found || lower(w) == full || lower(w) == shortname;
    }
    if (!found) throw std::invalid_argument("unknown shape '" + w + "' (use e.g. 8B or Qwen3-8B)");
  }
  std::vector<FfnShape> out;
  for (const FfnShape& s : from) {
    const std::string full = lower(s.name);
    const std::string shortname = full.substr(full.find('-') + 1);
    for (const std::string& w : want) {
      if (lower(w) == full || lower(w) == shortname) {
        out.push_back(s);
        break;
      }
    }
  }
  return out;
}

//! A prox_support::cli::list_check item test: a shape name select_shapes takes (so a bad name is
//! refused while the flags are parsed, before any device work).
inline prox_support::cli::ItemTest shape_name_test(const std::vector<FfnShape>& from = qwen3_shapes()) {
  return [from](const std::string& v) -> std::string {
    try {
      select_shapes(v, from);
      return {};
    } catch (const std::invalid_argument&) {
      std::string names;
      for (const FfnShape& s : from) {
        const std::string full = s.name;
        names += (names.empty() ? "" : ", ") + full.substr(full.find('-') + 1);
      }
      return "not a shape of the suite: " + names + " (or Qwen3-8B etc.)";
    }
  };
}

// ---------------------------------------------------------------- bytes that must be read
//! Stage 1 (INT4 proxies): kept rows of both packed matrices, both scale vectors, x.
inline double stage1_int4_bytes(double kept_rows, int d_model, int d_ff, std::size_t act_bytes) {
  return kept_rows * (d_ff / 2.0) * 2.0 + 2.0 * d_ff * sizeof(float) + static_cast<double>(d_model) * act_bytes;
}
//! Stage 1 with fp16/bf16 proxies (the alpha denominator): kept rows of both [d_model][d_ff] matrices, x.
inline double stage1_dense_bytes(double kept_rows, int d_model, int d_ff, std::size_t w_bytes, std::size_t act_bytes) {
  return kept_rows * d_ff * static_cast<double>(w_bytes) * 2.0 + static_cast<double>(d_model) * act_bytes;
}
//! GLU: the selected rows of W_gate and W_up.
inline double glu_bytes(double selected, int d_model, std::size_t w_bytes) {
  return selected * d_model * static_cast<double>(w_bytes) * 2.0;
}
//! Down: the selected rows of W_down^T.
inline double down_bytes(double selected, int d_model, std::size_t w_bytes) {
  return selected * d_model * static_cast<double>(w_bytes);
}
//! Dense SwiGLU FFN: all three matrices.
inline double dense_ffn_bytes(int d_model, int d_ff, std::size_t w_bytes) {
  return 3.0 * d_model * static_cast<double>(d_ff) * static_cast<double>(w_bytes);
}

// ---------------------------------------------------------------- device facts
struct DeviceFacts {
  int device = 0;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  std::size_t l2_bytes = 0;
  std::size_t total_mem = 0;
  std::size_t free_mem = 0;
  int runtime_version = 0;
  int driver_version = 0;
  std::string sm() const { return "sm_" + std::to_string(cc_major) + std::to_string(cc_minor); }
};

namespace detail {
template <int kUnused>
__global__ void probe_kernel(int* out) {
  if (out != nullptr) *out = kUnused + 1;
}
}  // namespace detail

/**
 * @brief Query the current device and check that this binary has code for it (a probe launch):
 * throws with a message that says what to do when there is no device, the device is older than
 * sm_80, or the build's CMAKE_CUDA_ARCHITECTURES does not cover it.
 */
inline DeviceFacts query_device_facts() {
  DeviceFacts f;
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    throw std::runtime_error(std::string("no CUDA device visible (cudaGetDeviceCount: ") +
                             (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e)) +
                             "); run this binary on the GPU machine");
  }
  PROX_BENCH_CUDA(cudaGetDevice(&f.device));
  cudaDeviceProp p{};
  PROX_BENCH_CUDA(cudaGetDeviceProperties(&p, f.device));
  f.name = p.name;
  f.cc_major = p.major;
  f.cc_minor = p.minor;
  f.sm_count = p.multiProcessorCount;
  f.l2_bytes = static_cast<std::size_t>(p.l2CacheSize);
  f.total_mem = p.totalGlobalMem;
  PROX_BENCH_CUDA(cudaRuntimeGetVersion(&f.runtime_version));
  PROX_BENCH_CUDA(cudaDriverGetVersion(&f.driver_version));
  if (f.cc_major < 8)
    throw std::runtime_error("device " + f.name + " (" + f.sm() + ") is older than sm_80; prox needs sm_80+");
  int* d = nullptr;
  PROX_BENCH_CUDA(cudaMalloc(&d, sizeof(int)));
  detail::probe_kernel<0><<<1, 1>>>(d);
  const cudaError_t le = cudaGetLastError();
  const cudaError_t se = le == cudaSuccess ? cudaDeviceSynchronize() : le;
  cudaFree(d);
  if (se != cudaSuccess) {
    throw std::runtime_error("cannot run a kernel on " + f.name + " (" + f.sm() + "): " + cudaGetErrorString(se) +
                             "; this binary was built for CUDA architectures '" PROX_BENCH_CUDA_ARCHS
                             "' (rebuild with -DCMAKE_CUDA_ARCHITECTURES matching the device, e.g. 90a-real for H100)");
  }
  PROX_BENCH_CUDA(cudaMemGetInfo(&f.free_mem, &f.total_mem));
  return f;
}

inline std::string describe(const DeviceFacts& f) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "%s (%s, %d SMs, L2 %.0f MB, %.1f GB, %.1f GB free; CUDA runtime %d.%d, driver %d.%d)", f.name.c_str(),
                f.sm().c_str(), f.sm_count, f.l2_bytes / 1e6, f.total_mem / 1e9, f.free_mem / 1e9,
                f.runtime_version / 1000, (f.runtime_version % 1000) / 10, f.driver_version / 1000,
                (f.driver_version % 1000) / 10);
  return buf;
}

//! The commit this binary was built from (`git describe`, stamped at build time by
//! bench/git_commit.cmake into the prox_bench_git_commit library; "unknown" without git).
const char* git_commit() noexcept;

//! The commit to record: --flag value, else $PROX_COMMIT, else the one the binary was built from.
inline std::string resolve_commit(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("PROX_COMMIT"); env != nullptr && *env != '\0') return env;
  return git_commit();
}

//! The provenance a Google Benchmark program records in its JSON context (benchmark::AddCustomContext, in
//! this order): the device, the CUDA versions, the copy bandwidth of the run, prox's version and commit, the
//! command. bench/report.py's provenance lines read these keys.
inline std::vector<std::pair<std::string, std::string>> run_context(const DeviceFacts& dev, double copy_gbps,
                                                                    const std::string& commit,
                                                                    const std::string& command) {
  char buf[64];
  std::vector<std::pair<std::string, std::string>> c;
  c.emplace_back("gpu", dev.name);
  c.emplace_back("gpu_arch", dev.sm());
  c.emplace_back("gpu_sms", std::to_string(dev.sm_count));
  std::snprintf(buf, sizeof(buf), "%.1f", dev.l2_bytes / 1e6);
  c.emplace_back("gpu_l2_MB", buf);
  std::snprintf(buf, sizeof(buf), "%.1f", dev.total_mem / 1e9);
  c.emplace_back("gpu_mem_GB", buf);
  c.emplace_back("cuda_runtime", std::to_string(dev.runtime_version));
  c.emplace_back("cuda_driver", std::to_string(dev.driver_version));
  std::snprintf(buf, sizeof(buf), "%.2f", copy_gbps);
  c.emplace_back("copy_GBps", buf);
  c.emplace_back("prox_version", PROX_VERSION_STRING);
  c.emplace_back("prox_commit", commit);
  c.emplace_back("prox_command", command);
  return c;
}

//! argv joined with spaces (arguments with spaces or quotes are single-quoted), for provenance.
inline std::string join_argv(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.find_first_of(" \t\"'$") != std::string::npos) {
      std::string q = "'";
      for (char c : a) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
      a = q + "'";
    }
    if (i) out += ' ';
    out += a;
  }
  return out;
}

// ---------------------------------------------------------------- device memory
// ---------------------------------------------------------------- command lines of the Google Benchmark tools
//! The suite's --prox_shapes, --prox_dtypes and --prox_targets (prox_bench, prox_batch_bench), each value
//! checked while the flags are parsed, before any device work.
inline void add_layer_flags(CLI::App& app, std::string* shapes, std::string* dtypes, std::string* targets) {
  namespace cli = prox_support::cli;
  app.add_option("--prox_shapes", *shapes, "shapes (1.7B,4B,8B,14B,32B)")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(shape_name_test()));
  app.add_option("--prox_dtypes", *dtypes, "f16,bf16")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check([](const std::string& v) { return cli::one_of({"f16", "bf16"})(lower(v)); }));
  app.add_option("--prox_targets", *targets, "target effective sparsity, percent")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check([](const std::string& v) -> std::string {
        prox::StageSparsity st;
        if (cli::number_in(0, 93, true)(v).empty() &&
            prox::allocate_sparsity(std::stoi(v) / 100.0, &st) == prox::Status::kSuccess)
          return {};
        return "not a target the allocation reaches (an integer percent, 0 to 93)";
      }));
}

//! Whether an argument of argv starts with `prefix`.
inline bool has_arg(int argc, char** argv, const char* prefix) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) return true;
  return false;
}

//! Whether argv asks Google Benchmark only to list the benches (--benchmark_list_tests, not =false/=0).
inline bool list_only(int argc, char** argv) {
  return has_arg(argc, argv, "--benchmark_list_tests") && !has_arg(argc, argv, "--benchmark_list_tests=false") &&
         !has_arg(argc, argv, "--benchmark_list_tests=0");
}

/**
 * @brief Consume the --prox_* flags `app` defines from argv and leave the rest, in order, for Google
 * Benchmark. A bad flag or value, or an unknown --prox_ flag, ends the process: one error line, exit
 * code 2 (prox_support::cli::parse).
 */
inline void parse_own_flags(CLI::App& app, int* argc, char** argv) {
  app.allow_extras();
  if (const auto rc = prox_support::cli::parse(app, *argc, argv)) std::exit(*rc);
  // app.remaining() holds the arguments CLI11 did not take, as given and in order: keep those argv
  // entries (matched in order, so the pointers stay argv's own).
  const std::vector<std::string> rest = app.remaining();
  int out = 1;
  std::size_t k = 0;
  for (int i = 1; i < *argc && k < rest.size(); ++i) {
    if (rest[k] != argv[i]) continue;
    if (rest[k].rfind("--prox_", 0) == 0) {
      prox_support::cli::print_error(app, "unknown flag " + rest[k] + " (--help lists them)");
      std::exit(2);
    }
    argv[out++] = argv[i];
    ++k;
  }
  *argc = out;
  argv[out] = nullptr;
}

//! Owning device allocation (cudaMalloc is 256-byte aligned, more than any prox op needs); throws.
using DeviceBuffer = ::prox_support::DeviceBuffer;

inline std::size_t align_up(std::size_t v, std::size_t a = 256) { return (v + a - 1) / a * a; }

//! Throw, naming `what`, when a kernel found the workspace `ws` not ready since its
//! initialize_workspace() (prox::read_workspace_status: the flagged runs were exact-dense in a
//! SparseFfn, NaN in a standalone op, so not what was meant to be measured). Synchronizes `stream`.
inline void check_workspace(const DeviceBuffer& ws, const char* what, cudaStream_t stream) {
  prox::Status st = prox::Status::kSuccess;
  PROX_BENCH_PROX(prox::read_workspace_status(ws.get(), stream, &st));
  if (st != prox::Status::kSuccess)
    throw std::runtime_error(std::string(what) + ": " + prox::to_string(st) + " (flagged by a kernel)");
}

// ---------------------------------------------------------------- random data
/**
 * @brief Fill n elements of T with N(0, stddev^2) values of random stream `seed` on `stream`
 * (asynchronous; prox_support::fill_normal, a pure function of (seed, i)). A value that rounds to
 * zero in T is replaced by +-stddev/1024: the benches never feed zeros (a zero input would be
 * dropped for free).
 */
template <class T>
void fill_normal(T* p, std::size_t n, std::uint64_t seed, float stddev, cudaStream_t stream) {
  PROX_BENCH_CUDA(prox_support::fill_normal(p, n, seed, /*stream_id=*/0, stddev, stream, prox_support::Zeros::kAvoid));
}

//! Copy n elements of T to the host.
template <class T>
std::vector<T> to_host(const T* d, std::size_t n, cudaStream_t stream) {
  std::vector<T> h(n);
  PROX_BENCH_CUDA(cudaMemcpyAsync(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
  PROX_BENCH_CUDA(cudaStreamSynchronize(stream));
  return h;
}

// ---------------------------------------------------------------- copy bandwidth
struct CopyBandwidth {
  double GBps = 0.0;       //!< (bytes read + bytes written) / median time, 1e9 bytes/s
  double bytes = 0.0;      //!< bytes copied per memcpy (read once and written once)
  double median_s = 0.0;   //!< median time of one memcpy
};

/**
 * @brief Device-to-device cudaMemcpyAsync of `bytes` (>= 1 GiB by default: far beyond the L2),
 * timed with events, median of `reps`; the figure counts bytes read + written, the bandwidth a
 * kernel that only reads competes with.
 */
inline CopyBandwidth measure_copy_bandwidth(cudaStream_t stream, std::size_t bytes = std::size_t(1) << 30,
                                            int reps = 15) {
  DeviceBuffer src(bytes, "copy-bandwidth source");
  DeviceBuffer dst(bytes, "copy-bandwidth destination");
  PROX_BENCH_CUDA(cudaMemsetAsync(src.get(), 0x5a, bytes, stream));
  cudaEvent_t a = nullptr, b = nullptr;
  PROX_BENCH_CUDA(cudaEventCreate(&a));
  PROX_BENCH_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  try {
    for (int i = 0; i < reps + 3; ++i) {
      PROX_BENCH_CUDA(cudaEventRecord(a, stream));
      PROX_BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
      PROX_BENCH_CUDA(cudaEventRecord(b, stream));
      PROX_BENCH_CUDA(cudaEventSynchronize(b));
      float ms = 0.0f;
      PROX_BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
      if (i >= 3) t.push_back(ms * 1e-3);  // the first copies warm up clocks and TLBs
    }
  } catch (...) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    throw;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  CopyBandwidth r;
  r.bytes = static_cast<double>(bytes);
  r.median_s = t[t.size() / 2];
  r.GBps = 2.0 * r.bytes / r.median_s / 1e9;
  return r;
}

// ---------------------------------------------------------------- graph replay timing
struct Timing {
  double median_s = 0.0;  //!< median over replays of (replay time / launches)
  double min_s = 0.0;
  double max_s = 0.0;
  double mean_s = 0.0;
  int launches = 0;
  int replays = 0;
};

inline Timing summarize(std::vector<double> per_launch, int launches) {
  Timing t;
  if (per_launch.empty()) return t;
  std::sort(per_launch.begin(), per_launch.end());
  const std::size_t n = per_launch.size();
  t.median_s = n % 2 ? per_launch[n / 2] : 0.5 * (per_launch[n / 2 - 1] + per_launch[n / 2]);
  t.min_s = per_launch.front();
  t.max_s = per_launch.back();
  double s = 0.0;
  for (double v : per_launch) s += v;
  t.mean_s = s / static_cast<double>(n);
  t.launches = launches;
  t.replays = static_cast<int>(n);
  return t;
}

/**
 * @brief A CUDA graph of `launches` enqueues, replayed and timed with CUDA events.
 * enqueue(i, stream) must put launch i on `stream` (it is called during stream capture, so it may
 * not synchronize or allocate); it throws to abort, and the capture is then ended cleanly.
 *
 * @code
 * GraphReplay g(stream, 48, [&](int i, cudaStream_t s) { ffn[i % copies].run(x, y, ws, ws_bytes, s); });
 * g.replay();                        // warm-up
 * double per_launch_s = g.replay_timed();
 * @endcode
 */
class GraphReplay {
 public:
  using Enqueue = std::function<void(int, cudaStream_t)>;

  GraphReplay(cudaStream_t stream, int launches, const Enqueue& enqueue) : stream_(stream), launches_(launches) {
    if (launches < 1) throw std::invalid_argument("GraphReplay: launches must be >= 1");
    if (stream == nullptr) throw std::invalid_argument("GraphReplay: needs a created (non-default) stream");
    // One eager pass first: it loads every kernel (lazy module loading), lets cuBLAS pick its
    // kernels outside capture, and reports a failing launch with a plain error instead of an
    // invalidated capture.
    for (int i = 0; i < launches; ++i) enqueue(i, stream);
    PROX_BENCH_CUDA(cudaStreamSynchronize(stream));
    PROX_BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      for (int i = 0; i < launches; ++i) enqueue(i, stream);
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(stream, &g);  // leave the stream usable whatever happened
      if (g != nullptr) cudaGraphDestroy(g);
      cudaGetLastError();  // clear a non-sticky launch/capture error
      throw;
    }
    cudaGraph_t graph = nullptr;
    PROX_BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    const cudaError_t ie = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(ie, "cudaGraphInstantiate");
    try {
      PROX_BENCH_CUDA(cudaGraphUpload(exec_, stream));
      PROX_BENCH_CUDA(cudaEventCreate(&start_));
      PROX_BENCH_CUDA(cudaEventCreate(&stop_));
    } catch (...) {
      destroy();
      throw;
    }
  }
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;
  ~GraphReplay() { destroy(); }

  int launches() const { return launches_; }

  //! One untimed replay, synchronized (warm-up; surfaces kernel faults here).
  void replay() {
    PROX_BENCH_CUDA(cudaGraphLaunch(exec_, stream_));
    PROX_BENCH_CUDA(cudaStreamSynchronize(stream_));
  }

  //! One replay timed with events: seconds per launch (elapsed / launches).
  double replay_timed() {
    PROX_BENCH_CUDA(cudaEventRecord(start_, stream_));
    PROX_BENCH_CUDA(cudaGraphLaunch(exec_, stream_));
    PROX_BENCH_CUDA(cudaEventRecord(stop_, stream_));
    PROX_BENCH_CUDA(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    PROX_BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms * 1e-3 / launches_;
  }

  //! warmup untimed replays, then `replays` timed ones.
  Timing measure(int warmup, int replays) {
    for (int i = 0; i < warmup; ++i) replay();
    std::vector<double> t;
    t.reserve(static_cast<std::size_t>(replays));
    for (int i = 0; i < replays; ++i) t.push_back(replay_timed());
    return summarize(std::move(t), launches_);
  }

 private:
  void destroy() noexcept {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    exec_ = nullptr;
    start_ = stop_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  int launches_ = 0;
  cudaGraphExec_t exec_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

// ---------------------------------------------------------------- rotation planning
/**
 * @brief Number of weight copies to rotate over: enough that the copies hold at least
 * `min_rotate_bytes` (several times the L2, so no launch finds its weights there), at least 2,
 * at most `max_copies`, and never more than `budget_bytes` allow. Throws if one copy does not fit.
 */
inline int rotation_copies(std::size_t copy_bytes, std::size_t min_rotate_bytes, std::size_t budget_bytes,
                           int max_copies = 64) {
  if (copy_bytes == 0) throw std::invalid_argument("rotation_copies: empty copy");
  if (copy_bytes > budget_bytes) {
    throw std::runtime_error("one weight copy (" + std::to_string(copy_bytes / 1000000) +
                             " MB) exceeds the memory budget (" + std::to_string(budget_bytes / 1000000) + " MB)");
  }
  std::size_t c = (min_rotate_bytes + copy_bytes - 1) / copy_bytes;
  c = std::max<std::size_t>(c, 2);
  c = std::min<std::size_t>(c, static_cast<std::size_t>(max_copies));
  c = std::min<std::size_t>(c, budget_bytes / copy_bytes);
  return static_cast<int>(std::max<std::size_t>(c, 1));
}

//! Launches per graph: at least `min_launches` and the number of copies, a multiple of `tokens`
//! (so every token, and hence the measured mean density, is weighted equally).
inline int launches_per_graph(int copies, int tokens, int min_launches) {
  const int want = std::max(min_launches, copies);
  return (want + tokens - 1) / tokens * tokens;
}

//! Memory the benches may use: min(cap, free - 2 GiB of headroom for cuBLAS, graphs and the driver).
inline std::size_t memory_budget(std::size_t cap_bytes) {
  std::size_t free_b = 0, total_b = 0;
  PROX_BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const std::size_t headroom = std::size_t(2) << 30;
  const std::size_t avail = free_b > headroom ? free_b - headroom : 0;
  return std::min(cap_bytes, avail);
}

// ---------------------------------------------------------------- synthetic layers
//! Device pointers of one weight copy of an FFN layer in every layout prox and cuBLAS read.
template <class T>
struct LayerCopy {
  const T* w_gate = nullptr;           //!< [d_ff][d_model] nn.Linear
  const T* w_up = nullptr;             //!< [d_ff][d_model]
  const T* w_down_t = nullptr;         //!< [d_ff][d_model] = W_down^T
  prox::Int4Weights::Matrix proxy_gate{};  //!< INT4 proxy of W_gate: packed [d_model][d_ff/8], scales [d_ff]
  prox::Int4Weights::Matrix proxy_up{};    //!< INT4 proxy of W_up

  //! This copy as a SparseFfn's weights (members set by name).
  template <class Act = prox::SiLU>
  typename prox::SparseFfn<T, Act>::Weights ffn_weights() const {
    typename prox::SparseFfn<T, Act>::Weights w;
    w.gate = w_gate;
    w.up = w_up;
    w.down_t = w_down_t;
    w.proxy_gate = proxy_gate;
    w.proxy_up = proxy_up;
    return w;
  }
};

/**
 * @brief A synthetic SwiGLU FFN layer, `copies` identical weight copies in one allocation, plus
 * `tokens` input vectors. Weights ~ N(0, 1/d_in) (so g, u, y stay O(1) in fp16), x ~ N(0, 1);
 * INT4 proxies packed on the device with int4::pack_device. Copies are byte-identical (copy 0 is
 * made, then duplicated), so one calibration holds for all of them; the L2 does not care.
 */
template <class T>
class SyntheticLayer {
 public:
  struct Offsets {
    std::size_t gate, up, down_t, q_gate, q_up, sc_gate, sc_up, stride;
  };
  static Offsets offsets(int d_model, int d_ff) {
    const std::size_t w = align_up(sizeof(T) * static_cast<std::size_t>(d_model) * d_ff);
    const std::size_t q = align_up(sizeof(std::uint32_t) * prox::int4::packed_words(d_model, d_ff));
    const std::size_t sc = align_up(sizeof(float) * static_cast<std::size_t>(d_ff));
    Offsets o{};
    o.gate = 0;
    o.up = o.gate + w;
    o.down_t = o.up + w;
    o.q_gate = o.down_t + w;
    o.q_up = o.q_gate + q;
    o.sc_gate = o.q_up + q;
    o.sc_up = o.sc_gate + sc;
    o.stride = o.sc_up + sc;
    return o;
  }
  static std::size_t bytes_per_copy(const FfnShape& s) { return offsets(s.d_model, s.d_ff).stride; }

  SyntheticLayer(const FfnShape& shape, int copies, int tokens, std::uint64_t seed, cudaStream_t stream)
      : shape_(shape), copies_(copies), tokens_(tokens), off_(offsets(shape.d_model, shape.d_ff)) {
    if (copies < 1 || tokens < 1) throw std::invalid_argument("SyntheticLayer: copies and tokens must be >= 1");
    const int K = shape.d_model;
    const int N = shape.d_ff;
    const std::size_t kn = static_cast<std::size_t>(K) * N;
    arena_ = DeviceBuffer(off_.stride * copies, "weight copies");
    x_ = DeviceBuffer(align_up(sizeof(T) * K) * tokens, "tokens");
    char* c0 = arena_.as<char>();
    fill_normal(reinterpret_cast<T*>(c0 + off_.gate), kn, seed + 1, 1.0f / std::sqrt(float(K)), stream);
    fill_normal(reinterpret_cast<T*>(c0 + off_.up), kn, seed + 2, 1.0f / std::sqrt(float(K)), stream);
    fill_normal(reinterpret_cast<T*>(c0 + off_.down_t), kn, seed + 3, 1.0f / std::sqrt(float(N)), stream);
    PROX_BENCH_PROX(prox::int4::pack_device(reinterpret_cast<const T*>(c0 + off_.gate), K, N,
                                            reinterpret_cast<std::uint32_t*>(c0 + off_.q_gate),
                                            reinterpret_cast<float*>(c0 + off_.sc_gate), stream));
    PROX_BENCH_PROX(prox::int4::pack_device(reinterpret_cast<const T*>(c0 + off_.up), K, N,
                                            reinterpret_cast<std::uint32_t*>(c0 + off_.q_up),
                                            reinterpret_cast<float*>(c0 + off_.sc_up), stream));
    for (int c = 1; c < copies; ++c)
      PROX_BENCH_CUDA(cudaMemcpyAsync(c0 + off_.stride * c, c0, off_.stride, cudaMemcpyDeviceToDevice, stream));
    for (int t = 0; t < tokens; ++t)
      fill_normal(token_mut(t), static_cast<std::size_t>(K), seed + 100 + t, 1.0f, stream);
    PROX_BENCH_CUDA(cudaStreamSynchronize(stream));
  }

  const FfnShape& shape() const { return shape_; }
  int copies() const { return copies_; }
  int tokens() const { return tokens_; }
  std::size_t copy_bytes() const { return off_.stride; }
  std::size_t total_bytes() const { return off_.stride * copies_; }

  LayerCopy<T> copy(int c) const {
    const char* b = arena_.as<char>(off_.stride * static_cast<std::size_t>(c));
    LayerCopy<T> l;
    l.w_gate = reinterpret_cast<const T*>(b + off_.gate);
    l.w_up = reinterpret_cast<const T*>(b + off_.up);
    l.w_down_t = reinterpret_cast<const T*>(b + off_.down_t);
    l.proxy_gate.packed = reinterpret_cast<const std::uint32_t*>(b + off_.q_gate);
    l.proxy_gate.scales = reinterpret_cast<const float*>(b + off_.sc_gate);
    l.proxy_up.packed = reinterpret_cast<const std::uint32_t*>(b + off_.q_up);
    l.proxy_up.scales = reinterpret_cast<const float*>(b + off_.sc_up);
    return l;
  }
  //! Token t's activations [d_model], 256-byte aligned.
  const T* token(int t) const {
    return x_.as<const T>(align_up(sizeof(T) * shape_.d_model) * static_cast<std::size_t>(t));
  }

  //! |x| of every token, as the kernels see it (T -> float), for calibration.
  std::vector<float> host_abs_tokens(cudaStream_t stream) const {
    std::vector<float> out;
    out.reserve(static_cast<std::size_t>(shape_.d_model) * tokens_);
    for (int t = 0; t < tokens_; ++t) {
      const std::vector<T> h = to_host(token(t), static_cast<std::size_t>(shape_.d_model), stream);
      for (const T& v : h) out.push_back(std::fabs(prox::to_float(v)));
    }
    return out;
  }

 private:
  T* token_mut(int t) { return x_.as<T>(align_up(sizeof(T) * shape_.d_model) * static_cast<std::size_t>(t)); }

  FfnShape shape_;
  int copies_;
  int tokens_;
  Offsets off_;
  DeviceBuffer arena_;
  DeviceBuffer x_;
};

// ---------------------------------------------------------------- FP8 e4m3 copies of a synthetic layer
/**
 * @brief The weights of a SyntheticLayer quantized to FP8 e4m3 in scale layout L on the device
 * (fp8::quantize_device), W_down^T and its scales by fp8::transpose_down_device (W_down recovered from the
 * layer's W_down^T), and INT4 proxies packed from the FP8 weights (fp8::pack_int4_device): copy 0 made, then
 * duplicated into as many copies as the layer has (the rotation). Synchronizes.
 */
template <class T, prox::fp8::ScaleLayout L>
class Fp8Copies {
 public:
  using Fmt = prox::Fp8Weights<L>;
  Fp8Copies(const SyntheticLayer<T>& layer, cudaStream_t s)
      : K_(layer.shape().d_model), N_(layer.shape().d_ff), copies_(layer.copies()) {
    namespace fp8 = prox::fp8;
    using O = fp8::Orientation;
    const std::size_t kn = static_cast<std::size_t>(K_) * N_;
    sc_ = sizeof(float) * fp8::scale_count(L, O::kOutIn, N_, K_);
    sct_ = sizeof(float) * fp8::scale_count(L, O::kInOut, N_, K_);
    const std::size_t q4 = sizeof(std::uint32_t) * prox::int4::packed_words(K_, N_);
    o_.qg = 0;
    o_.qu = o_.qg + align_up(kn);
    o_.qdt = o_.qu + align_up(kn);
    o_.sg = o_.qdt + align_up(kn);
    o_.su = o_.sg + align_up(sc_);
    o_.sdt = o_.su + align_up(sc_);
    o_.pg = o_.sdt + align_up(sct_);
    o_.pu = o_.pg + align_up(q4);
    o_.psg = o_.pu + align_up(q4);
    o_.psu = o_.psg + align_up(sizeof(float) * N_);
    o_.stride = o_.psu + align_up(sizeof(float) * N_);
    arena_ = DeviceBuffer(o_.stride * copies_, "FP8 weight copies");
    char* c0 = arena_.as<char>();
    const LayerCopy<T> l = layer.copy(0);
    PROX_BENCH_PROX(fp8::quantize_device(l.w_gate, N_, K_, L, u8(c0 + o_.qg), f32(c0 + o_.sg), s));
    PROX_BENCH_PROX(fp8::quantize_device(l.w_up, N_, K_, L, u8(c0 + o_.qu), f32(c0 + o_.su), s));
    {  // W_down (nn.Linear [K][N]) from the layer's W_down^T, quantized, then transposed with its scales
      DeviceBuffer wd(sizeof(T) * kn, "W_down");
      DeviceBuffer qd(kn, "FP8 W_down");
      DeviceBuffer sd(sizeof(float) * fp8::scale_count(L, O::kOutIn, K_, N_), "FP8 W_down scales");
      PROX_BENCH_PROX(prox::transpose_device(l.w_down_t, N_, K_, wd.as<T>(), s));
      PROX_BENCH_PROX(fp8::quantize_device(wd.as<const T>(), K_, N_, L, qd.as<std::uint8_t>(), sd.as<float>(), s));
      PROX_BENCH_PROX(fp8::transpose_down_device(qd.as<const std::uint8_t>(), sd.as<const float>(), K_, N_, L,
                                                 u8(c0 + o_.qdt), f32(c0 + o_.sdt), s));
      PROX_BENCH_CUDA(cudaStreamSynchronize(s));
    }
    PROX_BENCH_PROX(fp8::pack_int4_device(u8(c0 + o_.qg), f32(c0 + o_.sg), L, K_, N_,
                                          reinterpret_cast<std::uint32_t*>(c0 + o_.pg), f32(c0 + o_.psg), s));
    PROX_BENCH_PROX(fp8::pack_int4_device(u8(c0 + o_.qu), f32(c0 + o_.su), L, K_, N_,
                                          reinterpret_cast<std::uint32_t*>(c0 + o_.pu), f32(c0 + o_.psu), s));
    for (int c = 1; c < copies_; ++c)
      PROX_BENCH_CUDA(cudaMemcpyAsync(c0 + o_.stride * c, c0, o_.stride, cudaMemcpyDeviceToDevice, s));
    PROX_BENCH_CUDA(cudaStreamSynchronize(s));
  }

  int copies() const { return copies_; }
  //! Bytes a dense FP8 FFN reads: the codes of W_gate, W_up, W_down and their scales.
  double dense_bytes() const { return 3.0 * static_cast<double>(K_) * N_ + static_cast<double>(2 * sc_ + sct_); }
  //! The scale bytes of the three matrices (read whole by any FP8 FFN, sparse or not).
  double scale_bytes() const { return static_cast<double>(2 * sc_ + sct_); }

  //! Copy c as a SparseFfn's weights.
  template <class Act>
  typename prox::SparseFfn<T, Act, prox::Int4Weights, Fmt>::Weights ffn_weights(int c) const {
    using WO = prox::WeightOrientation;
    const char* b = arena_.as<char>(o_.stride * static_cast<std::size_t>(c));
    typename prox::SparseFfn<T, Act, prox::Int4Weights, Fmt>::Weights w;
    w.gate = matrix(b + o_.qg, b + o_.sg, WO::kOutIn);
    w.up = matrix(b + o_.qu, b + o_.su, WO::kOutIn);
    w.down_t = matrix(b + o_.qdt, b + o_.sdt, WO::kInOut);
    w.proxy_gate = {reinterpret_cast<const std::uint32_t*>(b + o_.pg), reinterpret_cast<const float*>(b + o_.psg)};
    w.proxy_up = {reinterpret_cast<const std::uint32_t*>(b + o_.pu), reinterpret_cast<const float*>(b + o_.psu)};
    return w;
  }

 private:
  struct Offsets {
    std::size_t qg, qu, qdt, sg, su, sdt, pg, pu, psg, psu, stride;
  };
  static std::uint8_t* u8(char* p) { return reinterpret_cast<std::uint8_t*>(p); }
  static float* f32(char* p) { return reinterpret_cast<float*>(p); }
  typename Fmt::Matrix matrix(const char* q, const char* sc, prox::WeightOrientation o) const {
    const auto shape = prox::fp8::scale_shape(L, Fmt::orientation(o), N_, K_);
    return {reinterpret_cast<const std::uint8_t*>(q), reinterpret_cast<const float*>(sc), shape.rows, shape.cols};
  }
  int K_, N_, copies_;
  std::size_t sc_ = 0, sct_ = 0;
  Offsets o_{};
  DeviceBuffer arena_;
};

// ---------------------------------------------------------------- calibration
/**
 * @brief Threshold tau on magnitudes such that the fraction of values with v >= tau is as close as
 * possible to 1 - sparsity (the kernels keep |v| >= tau). `abs_values` are magnitudes. Exact: tau
 * is a sample value (or the next one up), chosen between the two candidates a run of tied values
 * allows. sparsity <= 0 gives 0 (keep everything, zeros included).
 */
inline float magnitude_threshold(std::vector<float> abs_values, double sparsity) {
  if (abs_values.empty()) throw std::invalid_argument("magnitude_threshold: no samples");
  if (!(sparsity > 0.0)) return 0.0f;
  std::sort(abs_values.begin(), abs_values.end());
  const std::size_t m = abs_values.size();
  const double want_keep = (1.0 - sparsity) * static_cast<double>(m);
  std::size_t drop = static_cast<std::size_t>(std::llround(sparsity * static_cast<double>(m)));
  if (drop >= m) return std::nextafter(abs_values.back(), std::numeric_limits<float>::infinity());
  const float a = abs_values[drop];
  // tau = a keeps everything from the first value equal to a; the next distinct value keeps fewer.
  const std::size_t lo =
      static_cast<std::size_t>(std::lower_bound(abs_values.begin(), abs_values.end(), a) - abs_values.begin());
  const std::size_t hi =
      static_cast<std::size_t>(std::upper_bound(abs_values.begin(), abs_values.end(), a) - abs_values.begin());
  const double keep_a = static_cast<double>(m - lo);
  const double keep_b = static_cast<double>(m - hi);
  const float b = hi < m ? abs_values[hi] : std::nextafter(a, std::numeric_limits<float>::infinity());
  return std::fabs(keep_b - want_keep) < std::fabs(keep_a - want_keep) ? b : a;
}

/**
 * @brief tau_s for a planned-once layer: the exact |s~| quantile at `s2` over the Stage-1 values
 * (SparseFfn::run_proxy_values, inputs thresholded at tau_x) of every token. Synchronizes.
 * @param w weights of one copy; @param choice the policies the timed FFN will use (s~ is
 * bit-reproducible per policy, so the realized density matches on the very same kernel).
 */
template <class T, class Act, class Fmt, class WFmt = prox::NativeWeights<T>>
float calibrate_tau_s(const typename prox::SparseFfn<T, Act, Fmt, WFmt>::Weights& w, const FfnShape& shape,
                      float tau_x, double s2, const std::vector<const T*>& tokens, const prox::PolicyChoice& choice,
                      cudaStream_t stream) {
  prox::SparseFfn<T, Act, Fmt, WFmt> ffn;
  typename prox::SparseFfn<T, Act, Fmt, WFmt>::PlanOptions po;
  po.choice = choice;
  PROX_BENCH_PROX(ffn.plan({shape.d_model, shape.d_ff, tau_x, 0.0f}, w, po));
  DeviceBuffer ws(ffn.workspace_bytes(), "calibration workspace");
  PROX_BENCH_PROX(prox::initialize_workspace(ws.get(), ws.bytes(), stream));
  DeviceBuffer s_proxy(sizeof(float) * static_cast<std::size_t>(shape.d_ff), "s~ values");
  std::vector<float> all;
  all.reserve(static_cast<std::size_t>(shape.d_ff) * tokens.size());
  for (const T* x : tokens) {
    PROX_BENCH_PROX(ffn.run_proxy_values(x, s_proxy.as<float>(), ws.get(), ws.bytes(), stream));
    const std::vector<float> h = to_host(s_proxy.as<const float>(), static_cast<std::size_t>(shape.d_ff), stream);
    for (float v : h) all.push_back(std::fabs(v));
  }
  check_workspace(ws, "calibration workspace", stream);  // not ready: the s~ were NaN
  return magnitude_threshold(std::move(all), s2);
}

}  // namespace prox_bench
