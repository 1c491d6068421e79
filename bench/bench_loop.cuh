// SPDX-License-Identifier: Apache-2.0
//! @file bench_loop.cuh  The Google Benchmark timed loops of prox_bench and prox_batch_bench over
//! GraphReplay (bench_common.cuh): one graph replayed once per iteration, or the Prox and dense graphs
//! replayed in alternation, the iteration's manual time being Prox's per-launch time; and the main() both
//! binaries share (bench_main).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.cuh"

namespace prox_bench {

//! `warmup` untimed replays, then one timed replay of `graph` per benchmark iteration (the manual time
//! is the per-launch time); the summary over those iterations.
inline Timing run_loop(benchmark::State& st, GraphReplay& graph, int warmup) {
  for (int i = 0; i < warmup; ++i) graph.replay();
  std::vector<double> per_launch;
  per_launch.reserve(static_cast<std::size_t>(st.max_iterations));
  for (auto _ : st) {
    const double t = graph.replay_timed();
    st.SetIterationTime(t);
    per_launch.push_back(t);
  }
  return summarize(std::move(per_launch), graph.launches());
}

//! run_paired_loop's summaries: `ratio` summarizes dense / prox per pair (its fields are ratios, not seconds).
struct PairedTiming {
  Timing prox, dense, ratio;
};

//! The Prox and dense graphs timed in alternation, one pair per benchmark iteration (the iteration time is
//! Prox's), after `warmup` untimed pairs. Which goes first alternates, so neither always runs right after
//! the other.
inline PairedTiming run_paired_loop(benchmark::State& st, GraphReplay& prox, GraphReplay& dense, int warmup) {
  for (int i = 0; i < warmup; ++i) {
    dense.replay();
    prox.replay();
  }
  std::vector<double> tp, td, ratio;
  int pair = 0;
  for (auto _ : st) {
    double d = 0.0, p = 0.0;
    if (pair++ % 2 == 0) {
      d = dense.replay_timed();
      p = prox.replay_timed();
    } else {
      p = prox.replay_timed();
      d = dense.replay_timed();
    }
    st.SetIterationTime(p);
    tp.push_back(p);
    td.push_back(d);
    ratio.push_back(d / p);
  }
  return {summarize(std::move(tp), prox.launches()), summarize(std::move(td), dense.launches()),
          summarize(std::move(ratio), 1)};
}

//! What a benchmark binary's main() holds for the whole run: the device, the copy bandwidth measured once,
//! one stream and one cuBLAS handle (the dense baselines).
struct BenchGlobals {
  DeviceFacts dev;
  CopyBandwidth copy;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
};

//! What differs between the binaries' main(): the name (messages), --help, the flags, the registration, the
//! binary's own run context (after the shared one; may be null) and what it releases before the handles go.
struct BenchMain {
  const char* name;
  void (*help)();
  void (*parse)(int* argc, char** argv);
  void (*register_all)();
  void (*add_context)();
  void (*release)();
};

/**
 * @brief A benchmark binary's main(): --help; the flags; registration (listing needs no GPU); the device,
 * stream, cuBLAS handle and copy bandwidth into `g`; the run context; the run; the teardown. Returns the
 * exit code (1 with a message on an exception or an unrecognized argument).
 */
inline int bench_main(int argc, char** argv, BenchGlobals& g, const BenchMain& m, const std::string& commit_flag) {
  const std::string command = join_argv(argc, argv);
  try {
    if (has_arg(argc, argv, "--help") || has_arg(argc, argv, "-h")) {
      m.help();
      return 0;
    }
    m.parse(&argc, argv);
    const bool listing = list_only(argc, argv);
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    m.register_all();
    if (listing) {
      benchmark::RunSpecifiedBenchmarks();
      benchmark::Shutdown();
      return 0;
    }
    g.dev = query_device_facts();
    std::fprintf(stderr, "[%s] device: %s\n", m.name, describe(g.dev).c_str());
    PROX_BENCH_CUDA(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    prox_support::check_cublas(cublasCreate(&g.cublas), "cublasCreate");
    g.copy = measure_copy_bandwidth(g.stream);
    const std::string commit = resolve_commit(commit_flag);
    std::fprintf(stderr, "[%s] copy bandwidth (D2D 1 GiB, read + write): %.1f GB/s; commit %s\n", m.name, g.copy.GBps,
                 commit.c_str());
    for (const auto& [key, value] : run_context(g.dev, g.copy.GBps, commit, command))
      benchmark::AddCustomContext(key, value);
    if (m.add_context != nullptr) m.add_context();
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    cudaStreamSynchronize(g.stream);
    if (m.release != nullptr) m.release();
    cublasDestroy(g.cublas);
    cudaStreamDestroy(g.stream);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", m.name, e.what());
    return 1;
  }
}

}  // namespace prox_bench
