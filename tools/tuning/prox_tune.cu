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
#include <prox_support/cli.hpp>
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

//! Parse the flags into *a. Returns 0 to go on, 1 after --help (usage printed), 2 after a bad flag
//! or value (one error line printed). Needs no GPU.
int parse(int argc, char** argv, Args* a) {
  namespace cli = prox_support::cli;
  CLI::App app{"prox-tune: measure prox's candidate policies on this GPU and write the tuning cache.", "prox-tune"};
  cli::setup(app, cli::Syntax::kSpace);
  const auto int_in = [](int lo, int hi) { return cli::value_check(cli::number_in(lo, hi, true)); };
  std::string shapes, dtypes = "f16,bf16", act = "silu", proxy = "int4", ops = "threshold,proxy,glu,down,glu_down";
  std::string input_densities, channel_densities;
  int rotate_mb = 0;
  bool all_buckets = false, no_verify = false;
  app.add_option("--shapes", shapes,
                 "d_model x d_ff pairs, e.g. 4096x12288,5120x17408 (default: Qwen3 1.7B/4B/8B/14B/32B FFNs)")
      ->type_name("LIST")
      ->check(cli::list_check([](const std::string& p) -> std::string {
        const std::size_t x = p.find('x');
        const auto dim = cli::number_in(1, 1 << 20, true);
        if (x != std::string::npos && dim(p.substr(0, x)).empty() && dim(p.substr(x + 1)).empty()) return {};
        return "not d_modelxd_ff, e.g. 4096x12288";
      }));
  app.add_option("--dtypes", dtypes, "f16,bf16")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(cli::one_of({"f16", "fp16", "bf16"})));
  app.add_option("--act", act, "silu | gelu_tanh | both")
      ->type_name("NAME")
      ->capture_default_str()
      ->check(cli::value_check(cli::one_of({"silu", "gelu_tanh", "both"})));
  app.add_option("--proxy", proxy, "int4 | dense | both: proxy-weight format")
      ->type_name("NAME")
      ->capture_default_str()
      ->check(cli::value_check(cli::one_of({"int4", "dense", "both"})));
  app.add_option("--ops", ops, "glu_down is the fused Stage 2 that SparseFfn runs by default")
      ->type_name("LIST")
      ->capture_default_str()
      ->check(cli::list_check(cli::one_of({"threshold", "proxy", "glu", "down", "glu_down"})));
  CLI::Option* input = app.add_option("--input-densities", input_densities,
                                      "fractions of x kept (proxy, threshold), rounded up to 1/16 (default: "
                                      "1,0.9,0.45,0.3 = the paper's allocation at e = 40..70%)")
                           ->type_name("LIST")
                           ->check(cli::list_check(cli::number_in(0.0, 1.0)));
  CLI::Option* channel = app.add_option("--channel-densities", channel_densities,
                                        "fractions of channels selected (glu, down, glu_down) (default: "
                                        "0.378,0.3,0.233)")
                             ->type_name("LIST")
                             ->check(cli::list_check(cli::number_in(0.0, 1.0)));
  app.add_flag("--all-buckets", all_buckets,
               "every bucket 1/16 .. 16/16 for both densities (a density list given as well wins)");
  app.add_option("--out", a->out,
                 "cache file (default: $PROX_AUTOTUNE_CACHE, else prox-<signature>.tsv in $PROX_CACHE_DIR, "
                 "$XDG_CACHE_HOME/prox or ~/.cache/prox)")
      ->type_name("PATH");
  app.add_option("--device", a->device, "CUDA device (default: the current one)")
      ->type_name("N")
      ->check(int_in(0, 1024));
  app.add_option("--reps", a->tune.reps, "timed reps per candidate (>= " + std::to_string(pt::kMinReps) + ")")
      ->type_name("N")
      ->capture_default_str()
      ->check(int_in(pt::kMinReps, 100000));
  app.add_option("--chain", a->tune.chain,
                 "launches per rep, back to back with PDL as in the FFN (1 times each launch alone)")
      ->type_name("N")
      ->capture_default_str()
      ->check(int_in(1, 1000));
  app.add_option("--warmup", a->tune.warmup, "untimed launches per candidate and round")
      ->type_name("N")
      ->capture_default_str()
      ->check(int_in(0, 10000));
  app.add_option("--rounds", a->tune.rounds, "rounds over the candidates")
      ->type_name("N")
      ->capture_default_str()
      ->check(int_in(1, 1000));
  app.add_option("--rotate-mb", rotate_mb, "weight MiB touched between two uses of a buffer (default: 2 x L2)")
      ->type_name("N")
      ->check(int_in(1, 1 << 20));
  app.add_flag("--no-verify", no_verify,
               "skip the output checks: policy 0 against the float64 reference, the others against policy 0");
  app.add_flag("--dry-run", a->dry_run, "tune and print, do not write the cache");
  app.add_flag("--show", a->show, "print the cache file of this GPU and exit");
  app.add_flag("-q,--quiet", a->quiet, "print only the summary");
  app.footer("The file is merged under a lock with what is already there; entries tuned now replace old ones.");
  if (const auto rc = cli::parse(app, argc, argv)) return *rc == 0 ? 1 : 2;

  // The strings were checked item by item above; turn them into Args.
  const auto has = [](const std::string& list, const char* item) {
    for (const std::string& i : cli::split_list(list))
      if (i == item) return true;
    return false;
  };
  const auto densities = [](const std::string& list) {
    std::vector<double> out;
    for (const std::string& i : cli::split_list(list)) out.push_back(std::stod(i));
    return out;
  };
  if (!shapes.empty()) {
    a->shapes.clear();
    for (const std::string& p : cli::split_list(shapes))
      a->shapes.push_back({std::stoi(p.substr(0, p.find('x'))), std::stoi(p.substr(p.find('x') + 1)), ""});
  }
  a->f16 = has(dtypes, "f16") || has(dtypes, "fp16");
  a->bf16 = has(dtypes, "bf16");
  a->silu = act == "silu" || act == "both";
  a->gelu = act == "gelu_tanh" || act == "both";
  a->int4 = proxy == "int4" || proxy == "both";
  a->dense = proxy == "dense" || proxy == "both";
  a->op_threshold = has(ops, "threshold");
  a->op_proxy = has(ops, "proxy");
  a->op_glu = has(ops, "glu");
  a->op_down = has(ops, "down");
  a->op_glu_down = has(ops, "glu_down");
  if (all_buckets) {
    a->input_densities.clear();
    for (int b = pt::kDensityBuckets; b >= 1; --b) a->input_densities.push_back(pt::bucket_density(b));
    a->channel_densities = a->input_densities;
  }
  if (input->count() > 0) a->input_densities = densities(input_densities);
  if (channel->count() > 0) a->channel_densities = densities(channel_densities);
  if (rotate_mb > 0) a->tune.rotate_bytes = static_cast<std::size_t>(rotate_mb) << 20;
  if (no_verify) a->tune.verify = false;
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
