// SPDX-License-Identifier: Apache-2.0
//! @file dispatch.cuh  L4, the runtime choice: the policy an op runs when nobody chose one (no tuning-
//! cache entry, no explicit index), for a device and a shape. Here: the shared helpers of the default
//! rules (the fewest waves, the fewest load slots) and the fallback of every op without a rule of its own
//! (policy 0). Each op's own rule, an overload of default_policy(), sits in the op's header next to the op,
//! so an op cannot be included without its rule; Operator (operator.cuh) finds it by argument-dependent
//! lookup. Plan time only: nothing here allocates, synchronizes or queries the device (the DeviceInfo was
//! read once by the planner).
#pragma once

#include <type_traits>

#include "core/config.hpp"
#include "core/device.hpp"
#include "core/policy.hpp"

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

//! Any op without a rule of its own: its policy 0 (the fallback every candidate list starts with). An op's
//! own rule is an overload of this in the op's header (found by argument-dependent lookup), which partial
//! ordering prefers. Ops without one: the threshold op (policy 0, 256 x 16, the fastest or within 0.5 us at
//! n = 2048-5120 on the H100: threshold.cuh) and the unfused GLU GEMV (a one-wave grid whatever the policy).
template <class Op, class Args>
int default_policy(Op, const DeviceInfo&, const Args&) noexcept {
  return 0;
}

PROX_NAMESPACE_END
