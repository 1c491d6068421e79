// SPDX-License-Identifier: Apache-2.0
//! @file parallel.hpp  The one host-side parallel loop of prox's tools and tests: the float64 references
//! (the tuner's and the tests') and the tests' seeded 8B/14B layers (90-270 M values) take seconds on one
//! core. Each index is in exactly one range, so a loop whose iterations write disjoint outputs, each in a
//! fixed order, gives the serial loop's bits on any number of threads.
//!
//! Standard library only, so host-compiled tests include it too; a file may include it by its relative
//! path (as tests/reference/reference.hpp does).
#pragma once

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace prox_support {

//! Most threads parallel_for starts.
constexpr unsigned kMaxHostThreads = 16;

//! Threads parallel_for uses: 0 (the default) = one per hardware thread, at most kMaxHostThreads. Tests
//! set it to compare thread counts.
inline unsigned& parallel_threads() {
  static unsigned n = 0;
  return n;
}

/**
 * @brief fn(begin, end) over [0, n) split into contiguous ranges, one per thread (at least `grain`
 * items each). Runs a range inline where its thread cannot be started.
 */
template <class Fn>
void parallel_for(std::size_t n, std::size_t grain, Fn&& fn) {
  const unsigned want = parallel_threads() != 0 ? parallel_threads() : std::thread::hardware_concurrency();
  const unsigned hw = std::max(1u, std::min(kMaxHostThreads, want));
  const std::size_t parts = std::max<std::size_t>(1, std::min<std::size_t>(hw, n / std::max<std::size_t>(grain, 1)));
  const std::size_t chunk = (n + parts - 1) / parts;
  std::vector<std::thread> threads;
  std::size_t begin = 0;
  for (std::size_t p = 1; p < parts && begin + chunk < n; ++p, begin += chunk) {
    try {
      threads.emplace_back([&fn, begin, chunk] { fn(begin, begin + chunk); });
    } catch (...) {
      fn(begin, begin + chunk);  // no thread: this range inline
    }
  }
  fn(begin, n);
  for (auto& t : threads) t.join();
}

}  // namespace prox_support
