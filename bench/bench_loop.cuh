// SPDX-License-Identifier: Apache-2.0
//! @file bench_loop.cuh  The Google Benchmark timed loops of prox_bench and prox_batch_bench over
//! GraphReplay (bench_common.cuh): one graph replayed once per iteration, or the Prox and dense graphs
//! replayed in alternation, the iteration's manual time being Prox's per-launch time.
#pragma once

#include <benchmark/benchmark.h>

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

}  // namespace prox_bench
