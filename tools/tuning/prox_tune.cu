// SPDX-License-Identifier: Apache-2.0
//! @file prox_tune.cu  The `prox-tune` command: tunes every op's candidate policies for a list of
//! FFN shapes, dtypes and density buckets on synthetic random weights, and writes the tuning cache
//! of this GPU (docs/tuning.md). `prox-tune --help` lists the flags.
#include <cuda_runtime.h>

#include <fmt/core.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <prox/sparse_ffn.cuh>
#include <prox/tuning/choose.cuh>
#include <prox_tuning/tune.hpp>

namespace pt = prox::tuning;

namespace {

struct Shape {
  int d_model;
  int d_ff;
  const char* label;
};

//! Qwen3 dense models' FFN shapes (d_model, d_ff).
const std::vector<Shape> kDefaultShapes = {{2048, 6144, "Qwen3-1.7B"},
                                           {2560, 9728, "Qwen3-4B"},
                                           {4096, 12288, "Qwen3-8B"},
                                           {5120, 17408, "Qwen3-14B"},
                                           {5120, 25600, "Qwen3-32B"}};

//! Densities of the paper's allocation rule (target e -> (s1, s2)): 40% -> (0, 62.2%), 50% -> (10%,
//! 70%), 60% -> (55%, 70%), 70% -> (70%, 76.7%); density = 1 - sparsity.
const std::vector<double> kDefaultInputDensities = {1.0, 0.9, 0.45, 0.3};
const std::vector<double> kDefaultChannelDensities = {0.378, 0.3, 0.233};

struct Args {
  std::vector<Shape> shapes = kDefaultShapes;
  bool f16 = true, bf16 = true;
  bool silu = true, gelu = false;
  bool int4 = true, dense = false;
  bool op_threshold = true, op_proxy = true, op_glu = true, op_down = true, op_glu_down = true;
  std::vector<double> input_densities = kDefaultInputDensities;
  std::vector<double> channel_densities = kDefaultChannelDensities;
  std::string out;
  int device = -1;
  pt::TuneOptions tune;
  bool show = false;
  bool dry_run = false;
  bool quiet = false;
};

void usage(std::FILE* f) {
  fmt::print(f,
             "prox-tune: measure prox's candidate policies on this GPU and write the tuning cache.\n"
             "\n"
             "usage: prox-tune [options]\n"
             "  --shapes LIST            d_model x d_ff pairs, e.g. 4096x12288,5120x17408\n"
             "                           (default: Qwen3 1.7B/4B/8B/14B/32B FFNs)\n"
             "  --dtypes LIST            f16,bf16 (default: both)\n"
             "  --act NAME               silu | gelu_tanh | both (default: silu)\n"
             "  --proxy NAME             int4 | dense | both: proxy-weight format (default: int4)\n"
             "  --ops LIST               threshold,proxy,glu,down,glu_down (default: all; glu_down is the\n"
             "                           fused Stage 2 that SparseFfn runs by default)\n"
             "  --input-densities LIST   fractions of x kept (proxy, threshold), rounded up to 1/16\n"
             "                           (default: 1,0.9,0.45,0.3 = the paper's allocation at e = 40..70%)\n"
             "  --channel-densities LIST fractions of channels selected (glu, down, glu_down)\n"
             "                           (default: 0.378,0.3,0.233)\n"
             "  --all-buckets            every bucket 1/16 .. 16/16 for both densities\n"
             "  --out PATH               cache file (default: $PROX_AUTOTUNE_CACHE, else prox-<signature>.tsv in\n"
             "                           $PROX_CACHE_DIR, $XDG_CACHE_HOME/prox or ~/.cache/prox)\n"
             "  --device N               CUDA device (default: the current one)\n"
             "  --reps N                 timed reps per candidate (>= 20; default 25)\n"
             "  --chain N                launches per rep, back to back with PDL as in the FFN (default 8;\n"
             "                           1 times each launch alone)\n"
             "  --warmup N               untimed launches per candidate and round (default 3)\n"
             "  --rounds N               rounds over the candidates (default 2)\n"
             "  --rotate-mb N            weight MiB touched between two uses of a buffer (default: 2 x L2)\n"
             "  --no-verify              skip the check of every candidate against policy 0\n"
             "  --dry-run                tune and print, do not write the cache\n"
             "  --show                   print the cache file of this GPU and exit\n"
             "  -q, --quiet              print only the summary\n"
             "  -h, --help               this text\n"
             "The file is merged under a lock with what is already there; entries tuned now replace old ones.\n");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t pos = s.find(sep, start);
    std::string part = s.substr(start, pos == std::string::npos ? std::string::npos : pos - start);
    if (!part.empty()) out.push_back(part);
    if (pos == std::string::npos) return out;
    start = pos + 1;
  }
}

bool parse_int_arg(const std::string& s, int lo, int hi, int* out) {
  char* end = nullptr;
  const long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v < lo || v > hi) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parse_densities(const std::string& s, std::vector<double>* out) {
  out->clear();
  for (const auto& p : split(s, ',')) {
    char* end = nullptr;
    const double v = std::strtod(p.c_str(), &end);
    if (*end != '\0' || !(v >= 0.0 && v <= 1.0)) return false;
    out->push_back(v);
  }
  return !out->empty();
}

//! Returns 0 to go on, 1 for --help, 2 for a usage error.
int parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](std::string* v) {
      if (i + 1 >= argc) return false;
      *v = argv[++i];
      return true;
    };
    std::string v;
    if (arg == "-h" || arg == "--help") {
      usage(stdout);
      return 1;
    } else if (arg == "--shapes" && value(&v)) {
      a->shapes.clear();
      for (const auto& p : split(v, ',')) {
        const std::size_t x = p.find('x');
        int k = 0, n = 0;
        if (x == std::string::npos || !parse_int_arg(p.substr(0, x), 1, 1 << 20, &k) ||
            !parse_int_arg(p.substr(x + 1), 1, 1 << 20, &n)) {
          fmt::print(stderr, "prox-tune: bad shape '{}' (want d_modelxd_ff, e.g. 4096x12288)\n", p);
          return 2;
        }
        a->shapes.push_back({k, n, ""});
      }
      if (a->shapes.empty()) return 2;
    } else if (arg == "--dtypes" && value(&v)) {
      a->f16 = a->bf16 = false;
      for (const auto& p : split(v, ',')) {
        if (p == "f16" || p == "fp16") a->f16 = true;
        else if (p == "bf16") a->bf16 = true;
        else {
          fmt::print(stderr, "prox-tune: unknown dtype '{}' (f16, bf16)\n", p);
          return 2;
        }
      }
    } else if (arg == "--act" && value(&v)) {
      a->silu = v == "silu" || v == "both";
      a->gelu = v == "gelu_tanh" || v == "both";
      if (!a->silu && !a->gelu) {
        fmt::print(stderr, "prox-tune: unknown activation '{}' (silu, gelu_tanh, both)\n", v);
        return 2;
      }
    } else if (arg == "--proxy" && value(&v)) {
      a->int4 = v == "int4" || v == "both";
      a->dense = v == "dense" || v == "both";
      if (!a->int4 && !a->dense) {
        fmt::print(stderr, "prox-tune: unknown proxy format '{}' (int4, dense, both)\n", v);
        return 2;
      }
    } else if (arg == "--ops" && value(&v)) {
      a->op_threshold = a->op_proxy = a->op_glu = a->op_down = a->op_glu_down = false;
      for (const auto& p : split(v, ',')) {
        if (p == "threshold") a->op_threshold = true;
        else if (p == "proxy") a->op_proxy = true;
        else if (p == "glu") a->op_glu = true;
        else if (p == "down") a->op_down = true;
        else if (p == "glu_down") a->op_glu_down = true;
        else {
          fmt::print(stderr, "prox-tune: unknown op '{}' (threshold, proxy, glu, down, glu_down)\n", p);
          return 2;
        }
      }
    } else if (arg == "--input-densities" && value(&v)) {
      if (!parse_densities(v, &a->input_densities)) {
        fmt::print(stderr, "prox-tune: bad --input-densities '{}' (fractions in [0, 1])\n", v);
        return 2;
      }
    } else if (arg == "--channel-densities" && value(&v)) {
      if (!parse_densities(v, &a->channel_densities)) {
        fmt::print(stderr, "prox-tune: bad --channel-densities '{}' (fractions in [0, 1])\n", v);
        return 2;
      }
    } else if (arg == "--all-buckets") {
      a->input_densities.clear();
      for (int b = pt::kDensityBuckets; b >= 1; --b) a->input_densities.push_back(pt::bucket_density(b));
      a->channel_densities = a->input_densities;
    } else if (arg == "--out" && value(&v)) {
      a->out = v;
    } else if (arg == "--device" && value(&v)) {
      if (!parse_int_arg(v, 0, 1024, &a->device)) return 2;
    } else if (arg == "--reps" && value(&v)) {
      if (!parse_int_arg(v, pt::kMinReps, 100000, &a->tune.reps)) {
        fmt::print(stderr, "prox-tune: --reps must be >= {}\n", pt::kMinReps);
        return 2;
      }
    } else if (arg == "--chain" && value(&v)) {
      if (!parse_int_arg(v, 1, 1000, &a->tune.chain)) return 2;
    } else if (arg == "--warmup" && value(&v)) {
      if (!parse_int_arg(v, 0, 10000, &a->tune.warmup)) return 2;
    } else if (arg == "--rounds" && value(&v)) {
      if (!parse_int_arg(v, 1, 1000, &a->tune.rounds)) return 2;
    } else if (arg == "--rotate-mb" && value(&v)) {
      int mb = 0;
      if (!parse_int_arg(v, 1, 1 << 20, &mb)) return 2;
      a->tune.rotate_bytes = static_cast<std::size_t>(mb) << 20;
    } else if (arg == "--no-verify") {
      a->tune.verify = false;
    } else if (arg == "--dry-run") {
      a->dry_run = true;
    } else if (arg == "--show") {
      a->show = true;
    } else if (arg == "-q" || arg == "--quiet") {
      a->quiet = true;
    } else {
      fmt::print(stderr, "prox-tune: unknown or incomplete option '{}'\n\n", arg);
      usage(stderr);
      return 2;
    }
  }
  return 0;
}

std::string us(double v) { return std::isfinite(v) ? fmt::format("{:.2f}", v) : std::string("-"); }

void print_result(const pt::TuneResult& r) {
  fmt::print("{:<16} {:<4} {:<6} {:<9} {:>5}x{:<6} {:>2}/16  {} sets", r.key.op, r.key.dtype, r.key.weights, r.key.act,
             r.key.d_model, r.key.d_ff, r.key.density16, r.rotation_sets);
  for (std::size_t i = 0; i < r.candidates.size(); ++i) {
    const auto& c = r.candidates[i];
    fmt::print("  [{}]{} {}", i, static_cast<int>(i) == r.chosen ? "*" : " ",
               c.verified && c.status == prox::Status::kSuccess ? us(c.median_us) + " us" : std::string("FAIL"));
  }
  fmt::print("\n");
  for (std::size_t i = 0; i < r.candidates.size(); ++i)
    if (!r.candidates[i].failure.empty())
      fmt::print("    [{}] {} rejected: {}\n", i, r.candidates[i].policy, r.candidates[i].failure);
}

struct Run {
  const Args& args;
  pt::Cache& cache;
  cudaStream_t stream;
  int keys = 0;
  int failures = 0;

  void report(prox::Status st, const std::vector<pt::TuneResult>& rs, const std::string& what) {
    for (const auto& r : rs) {
      ++keys;
      if (!args.quiet) print_result(r);
      for (const auto& c : r.candidates)
        if (!c.failure.empty()) ++failures;
    }
    if (st != prox::Status::kSuccess) {
      ++failures;
      fmt::print(stderr, "prox-tune: {}: {}\n", what, prox::to_string(st));
    }
  }

  template <class T, class Act>
  void tune_act(const Shape& s) {
    std::vector<pt::TuneResult> rs;
    const std::string where = fmt::format("{}x{} {} {}", s.d_model, s.d_ff, prox::DTypeTraits<T>::kName, Act::kName);
    if (args.op_proxy && args.int4) {
      rs.clear();
      report(pt::tune_proxy_gemv<T, prox::Int4Weights, Act>(cache, s.d_model, s.d_ff, args.input_densities, stream,
                                                            args.tune, &rs),
             rs, "proxy_gemv " + where);
    }
    if (args.op_proxy && args.dense) {
      rs.clear();
      report(pt::tune_proxy_gemv<T, prox::DenseWeights<T>, Act>(cache, s.d_model, s.d_ff, args.input_densities,
                                                                stream, args.tune, &rs),
             rs, "proxy_gemv_dense " + where);
    }
    if (args.op_glu) {
      rs.clear();
      report(pt::tune_glu_gemv<T, Act>(cache, s.d_model, s.d_ff, args.channel_densities, stream, args.tune, &rs), rs,
             "glu_gemv " + where);
    }
    if (args.op_glu_down) {  // the fused Stage 2 (GLU + down in one cooperative grid)
      rs.clear();
      report(pt::tune_glu_down_gemv<T, Act>(cache, s.d_model, s.d_ff, args.channel_densities, stream, args.tune, &rs),
             rs, "glu_down_gemv " + where);
    }
  }

  template <class T>
  void tune_dtype(const Shape& s) {
    std::vector<pt::TuneResult> rs;
    const std::string where = fmt::format("{}x{} {}", s.d_model, s.d_ff, prox::DTypeTraits<T>::kName);
    if (args.op_threshold) {
      rs.clear();
      report(pt::tune_threshold<T>(cache, s.d_model, args.input_densities, stream, args.tune, &rs), rs,
             "threshold " + where);
    }
    if (args.silu) tune_act<T, prox::SiLU>(s);
    if (args.gelu) tune_act<T, prox::GeluTanh>(s);
    if (args.op_down) {  // the down GEMV has no activation
      rs.clear();
      report(pt::tune_down_gemv<T>(cache, s.d_model, s.d_ff, args.channel_densities, stream, args.tune, &rs), rs,
             "down_gemv " + where);
    }
  }
};

int show(const pt::Cache& cache) {
  const pt::LoadReport rep = cache.last_load();
  fmt::print("{}: {} ({} entries)\n", cache.path().empty() ? "<no location>" : cache.path(), pt::to_string(rep.state),
             cache.size());
  if (cache.size() == 0) return rep.state == pt::FileState::kLoaded || rep.state == pt::FileState::kMissing ? 0 : 1;
  fmt::print("{:<16} {:<4} {:<6} {:<9} {:>7} {:>6} {:>7} {:<28} {:>9} {:>9} {:>9} {:>5}\n", "op", "type", "wts", "act",
             "d_model", "d_ff", "density", "policy", "median", "p20", "p80", "reps");
  for (const auto& [k, e] : cache.entries()) {
    fmt::print("{:<16} {:<4} {:<6} {:<9} {:>7} {:>6} {:>4}/16 {:<28} {:>9} {:>9} {:>9} {:>5}\n", k.op, k.dtype,
               k.weights, k.act, k.d_model, k.d_ff, k.density16, e.policy, us(e.median_us), us(e.p20_us),
               us(e.p80_us), e.reps);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  const int pr = parse(argc, argv, &args);
  if (pr == 1) return 0;
  if (pr != 0) return 2;

  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    fmt::print(stderr, "prox-tune: no CUDA device visible\n");
    return 1;
  }
  if (args.device >= 0 && cudaSetDevice(args.device) != cudaSuccess) {
    fmt::print(stderr, "prox-tune: cannot use device {}\n", args.device);
    return 1;
  }
  pt::OpenOptions copts;
  copts.path = args.out;
  copts.mode = pt::Mode::kReadOnly;  // the tool tunes explicitly, whatever PROX_AUTOTUNE says
  std::unique_ptr<pt::Cache> cache;
  if (args.show) {
    const prox::Status st = pt::open_cache(&cache, copts);
    if (cache == nullptr) {
      fmt::print(stderr, "prox-tune: {}\n", prox::to_string(st));
      return 1;
    }
    return show(*cache);
  }
  {
    // An empty cache: what is measured now replaces the file's rows of the same keys when merged.
    int device = 0;
    pt::Signature sig;
    const prox::Status st = cudaGetDevice(&device) == cudaSuccess ? pt::query_signature(device, &sig)
                                                                   : prox::Status::kErrorNoDevice;
    if (st != prox::Status::kSuccess) {
      fmt::print(stderr, "prox-tune: {}\n", prox::to_string(st));
      return 1;
    }
    cache = pt::make_cache(sig, pt::policy_table(), copts);
    if (cache == nullptr) {
      fmt::print(stderr, "prox-tune: out of memory\n");
      return 1;
    }
  }
  const pt::Signature& sig = cache->signature();
  fmt::print("prox-tune: {} (sm_{}{}, {} SMs, L2 {} MiB), CUDA runtime {}, prox {}, policy table {}\n", sig.gpu_name,
             sig.cc_major, sig.cc_minor, sig.sm_count, sig.l2_bytes >> 20, sig.cudart_version, sig.prox_version,
             pt::to_hex64(sig.policy_hash));
  fmt::print("prox-tune: cache {}{}\n", cache->path().empty() ? "<no location: use --out>" : cache->path(),
             args.dry_run ? " (dry run: not written)" : "");
  if (cache->path().empty() && !args.dry_run) {
    fmt::print(stderr, "prox-tune: no cache location (set --out, PROX_CACHE_DIR or HOME)\n");
    return 1;
  }

  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    fmt::print(stderr, "prox-tune: cannot create a stream\n");
    return 1;
  }
  Run run{args, *cache, stream};
  for (const Shape& s : args.shapes) {
    if (!args.quiet)
      fmt::print("-- {}x{}{}{}\n", s.d_model, s.d_ff, s.label[0] ? "  " : "", s.label[0] ? s.label : "");
    if (args.f16) run.tune_dtype<__half>(s);
    if (args.bf16) run.tune_dtype<__nv_bfloat16>(s);
  }
  (void)cudaStreamDestroy(stream);

  fmt::print("prox-tune: {} keys tuned, {} entries in memory, {} problems\n", run.keys, cache->size(), run.failures);
  if (args.dry_run) return run.failures == 0 ? 0 : 1;
  const prox::Status st = pt::save(*cache);
  if (st != prox::Status::kSuccess) {
    fmt::print(stderr, "prox-tune: could not write {}: {}{}\n", cache->path(), prox::to_string(st),
               cache->last_warning().empty() ? "" : " (" + cache->last_warning() + ")");
    return 3;
  }
  fmt::print("prox-tune: wrote {} ({} entries)\n", cache->path(), cache->size());
  return run.failures == 0 ? 0 : 1;
}
