// SPDX-License-Identifier: Apache-2.0
//! @file dispatch.cuh  L4, the runtime choice: the policy an op runs when nobody chose one (no tuning-
//! cache entry, no explicit index), for a device and a shape. Every default rule of prox is here, one
//! overload of default_policy() per op. Plan time only: nothing here allocates, synchronizes or
//! queries the device (the DeviceInfo was read once by the planner).
#pragma once

#include <type_traits>

#include "core/config.hpp"
#include "core/device.hpp"
#include "core/policy.hpp"
#include "batched.cuh"
#include "batched_glu_down.cuh"
#include "down_gemv.cuh"
#include "glu_down_gemv.cuh"
#include "glu_gemv.cuh"
#include "proxy_gemv.cuh"
#include "threshold.cuh"

PROX_NAMESPACE_BEGIN

namespace detail {

//! Whether a policy is a candidate only where its grid fits one wave (a `kOneWave` member set true).
template <class P, class = void>
struct OneWaveOnly : std::false_type {};
template <class P>
struct OneWaveOnly<P, std::void_t<decltype(P::kOneWave)>> : std::bool_constant<P::kOneWave> {};

//! Whether a policy is a candidate only where its grid needs exactly two waves (a `kTwoWaves` member set
//! true).
template <class P, class = void>
struct TwoWavesOnly : std::false_type {};
template <class P>
struct TwoWavesOnly<P, std::void_t<decltype(P::kTwoWaves)>> : std::bool_constant<P::kTwoWaves> {};

//! default_fewest_waves()'s preference for multi-wave grids when none is given: no candidate preferred.
struct NoWavePreference {
  template <class P>
  constexpr bool operator()(P) const noexcept {
    return false;
  }
};

/**
 * @brief The candidate of `List` whose grid needs the fewest waves (a wave = SMs x P::kMinBlocks
 * resident blocks); when that is more than one wave, a candidate for which `prefer_multi_wave(policy)`
 * holds; then the one with the most blocks (more bytes in flight); ties go to the lower index.
 * `blocks(policy)` returns the grid size of a policy. A policy with `kOneWave` set (OneWaveOnly) is a
 * candidate only where its grid fits one wave, one with `kTwoWaves` set (TwoWavesOnly) only where it
 * needs exactly two; candidate 0 must be neither. Measured reasons (H100): a Qwen3-8B Stage-1 grid of
 * 1.45 waves ran as slowly as 2 full waves; on the Qwen3-32B shape, whose Stage-1 grid needs 2 waves,
 * the cp.async-pipelined candidate was 3-8 us faster than the register-buffered one; the batched down
 * GEMV's one-wave candidate lost where it only made a multi-wave grid shorter; the batched Stage 1's
 * split candidate (3 blocks per SM) lost in one wave and in three, won in two (BatchedProxyPoliciesFor).
 */
template <class List, class BlocksFn, class PreferFn = NoWavePreference>
int default_fewest_waves(int sm_count, BlocksFn&& blocks, PreferFn&& prefer_multi_wave = PreferFn{}) {
  static_assert(!OneWaveOnly<typename PolicyAt<0, List>::type>::value &&
                    !TwoWavesOnly<typename PolicyAt<0, List>::type>::value,
                "candidate 0 is the fallback of every grid");
  int best_index = 0;
  long best_waves = -1;
  long best_blocks = -1;
  bool best_preferred = false;
  for_each_policy<List>([&](auto p, int i) {
    const long b = blocks(p);
    const long slots = static_cast<long>(sm_count) * decltype(p)::kMinBlocks;
    const long waves = slots > 0 ? (b + slots - 1) / slots : b;
    if (waves > 1 && OneWaveOnly<decltype(p)>::value) return;  // not a candidate for this grid
    if (waves != 2 && TwoWavesOnly<decltype(p)>::value) return;
    const bool preferred = waves > 1 && prefer_multi_wave(p);
    bool better = false;
    if (best_waves < 0 || waves < best_waves) {
      better = true;
    } else if (waves == best_waves) {
      better = preferred != best_preferred ? preferred : b > best_blocks;
    }
    if (better) {
      best_index = i;
      best_waves = waves;
      best_blocks = b;
      best_preferred = preferred;
    }
  });
  return best_index;
}

/**
 * @brief Load slots a fused Stage-2 block's GLU part spends on one selected row of d_model inputs:
 * its steps (GluGemvPolicy::steps_per_row) times the pieces a step loads.
 */
template <class Policy>
constexpr long glu_row_slots(int d_model) noexcept {
  using G = typename Policy::Glu;
  return static_cast<long>(G::steps_per_row(d_model)) * G::kThreads * G::kUnroll;
}

//! Load slots a batched GLU policy (BatchedGluPolicy) spends on one row of d_model inputs: its steps x its
//! threads (a CUDA-core thread loads one 16-byte piece of a row per step).
template <class G>
constexpr long batched_glu_row_slots(int d_model) noexcept {
  return static_cast<long>(G::steps_per_row(d_model)) * G::kThreads;
}

/**
 * @brief The candidate of `List` with the fewest load slots per row (`slots(policy)`), ties to the lower
 * index: the fused Stage 2s' and the batched GLU's rule (their GLU steps cover a row with the fewest slots).
 */
template <class List, class SlotsFn>
int fewest_load_slots(SlotsFn&& slots) noexcept {
  int best = 0;
  long best_slots = -1;
  for_each_policy<List>([&](auto p, int i) {
    const long n = slots(p);
    if (best_slots < 0 || n < best_slots) {
      best = i;
      best_slots = n;
    }
  });
  return best;
}

}  // namespace detail

//! Any op without a rule of its own: its policy 0 (the fallback every candidate list starts with). A
//! new op needs an overload here only when a measured rule beats that.
template <class Op, class Args>
int default_policy(Op, const DeviceInfo&, const Args&) noexcept {
  return 0;
}

// Threshold op: the fallback, policy 0 (256 x 16), the fastest or within 0.5 us at n = 2048-5120 on the
// H100 (threshold.cuh).

//! Stage 1: the fewest waves, preferring a cp.async-pipelined candidate (kStages > 0) when the grid
//! needs more than one wave, then the most blocks (detail::default_fewest_waves).
template <class T, class Act, class Fmt, class List>
int default_policy(ProxyGemvOp<T, Act, Fmt, List>, const DeviceInfo& d, const ProxyGemvArgs<T, Fmt>& a) noexcept {
  using Op = ProxyGemvOp<T, Act, Fmt, List>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff); },
      [](auto p) { return decltype(p)::kStages > 0; });
}

// Unfused GLU GEMV: the fallback, policy 0. Its grid is one wave whatever the policy (rows split evenly
// by rank).

//! Unfused down GEMV: the fewest waves, then the most blocks (detail::default_fewest_waves).
template <class T>
int default_policy(DownGemvOp<T>, const DeviceInfo& d, const DownGemvArgs<T>& a) noexcept {
  return detail::default_fewest_waves<DownGemvPolicies>(
      d.sm_count, [&](auto p) { return DownGemvOp<T>::template num_blocks<decltype(p)>(a.d_model, a.d_ff); });
}

/**
 * @brief Fused Stage 2: the candidate whose GLU steps cover a row of d_model inputs with the fewest
 * load slots (detail::glu_row_slots), ties to the lower index. Measured on the H100: with 256 threads
 * a 5120-wide row takes 3 steps of which the last is half idle, and 320 threads (2 full steps) made
 * the FFN 0.7-2.5 us faster on Qwen3-14B and 32B; 256 threads stayed faster where they fit (2048, 4096).
 */
template <class T, class Act>
int default_policy(GluDownGemvOp<T, Act>, const DeviceInfo&, const GluDownGemvArgs<T>& a) noexcept {
  return detail::fewest_load_slots<GluDownGemvPolicies>(
      [&](auto p) { return detail::glu_row_slots<decltype(p)>(a.d_model); });
}

//! Batched Stage 1 and batched down GEMV: the fewest waves, then the most blocks, as the batch-1 ops
//! (detail::default_fewest_waves). The batched GLU GEMV (a one-wave grid, rows by rank): below.
template <class T, class Act, int B>
int default_policy(BatchedProxyGemvOp<T, Act, B>, const DeviceInfo& d, const BatchedProxyGemvArgs<T>& a) noexcept {
  using Op = BatchedProxyGemvOp<T, Act, B>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff, d.sm_count); });
}
template <class T, int B>
int default_policy(BatchedDownGemvOp<T, B>, const DeviceInfo& d, const BatchedDownGemvArgs<T>& a) noexcept {
  using Op = BatchedDownGemvOp<T, B>;
  return detail::default_fewest_waves<typename Op::Policies>(
      d.sm_count, [&](auto p) { return Op::template num_blocks<decltype(p)>(a.d_model, a.d_ff, d.sm_count); });
}

/**
 * @brief Batched GLU GEMV and fused batched Stage 2: as the batch-1 fused Stage 2's rule, the fewest GLU load
 * slots per row of d_model inputs (detail::fewest_load_slots): at B = 4, 320 threads on d_model 2560 and
 * 5120, 256 on 2048 and 4096.
 */
template <class T, class Act, int B>
int default_policy(BatchedGluGemvOp<T, Act, B>, const DeviceInfo&, const BatchedGluGemvArgs<T>& a) noexcept {
  return detail::fewest_load_slots<typename BatchedGluGemvOp<T, Act, B>::Policies>(
      [&](auto p) { return detail::batched_glu_row_slots<decltype(p)>(a.d_model); });
}
template <class T, class Act, int B>
int default_policy(BatchedGluDownGemvOp<T, Act, B>, const DeviceInfo&, const BatchedGluDownGemvArgs<T>& a) noexcept {
  return detail::fewest_load_slots<typename BatchedGluDownGemvOp<T, Act, B>::Policies>(
      [&](auto p) { return detail::batched_glu_row_slots<typename decltype(p)::Glu>(a.d_model); });
}

PROX_NAMESPACE_END
