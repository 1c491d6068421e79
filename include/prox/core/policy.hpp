// SPDX-License-Identifier: Apache-2.0
//! @file policy.hpp  Compile-time tile-policy lists and the runtime index -> policy dispatch.
//!
//! A policy is a *type* with `static constexpr int` members and a host-only `static std::string name()`
//! (the tuning cache stores names); an op's candidates form a `PolicyList<...>`, index 0 being the
//! fallback that implements every valid shape. Tuning, benches and tests iterate the list, so a tile
//! change is a one-line edit of the list.
//!
//! One vocabulary for the members of every op's policy (template parameters in this order, as far as
//! an op has them):
//!   kThreads    threads per block
//!   kTile       output columns (channels) one block produces: its split-N tile
//!   kChunk      reduction-dimension elements one block sums: its split-K chunk
//!   kRows       selected rows a block holds in shared memory at a time (longer lists go in rounds)
//!   kBatch      selected rows reduced together (GLU: gate and up of kBatch rows per reduction)
//!   kUnroll     rows (or 16-byte pieces of a row) each thread has in flight per step
//!   kItems      elements each thread handles per step (the threshold op)
//!   kMinBlocks  resident blocks per SM asked of the compiler (__launch_bounds__); grids sized "one
//!               wave" are SMs x kMinBlocks
//!   kStages     cp.async pipeline depth (0: register double buffering)
//!   kOneWave    (bool) a candidate of the default rule only where its grid fits one wave
//!   kTwoWaves   (bool) ... only where its grid needs exactly two waves (dispatch.cuh)
//! Kernels and launchers order their template parameters <Policy, T, Act, Fmt>.
#pragma once

#include <string>
#include <utility>

#include "config.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

//! An ordered list of policy types. Index 0 is the fallback that must implement every valid shape.
template <class... Ps>
struct PolicyList {
  static constexpr int kSize = static_cast<int>(sizeof...(Ps));
};

namespace detail {
template <int I, class List>
struct PolicyAt;
template <int I, class P, class... Ps>
struct PolicyAt<I, PolicyList<P, Ps...>> : PolicyAt<I - 1, PolicyList<Ps...>> {};
template <class P, class... Ps>
struct PolicyAt<0, PolicyList<P, Ps...>> {
  using type = P;
};

template <class... Ps, class F>
Status dispatch_policy_impl(PolicyList<Ps...>, int index, F&& f) {
  Status st = Status::kErrorInvalidArgument;
  int i = 0;
  (void)((i++ == index ? (st = f(Ps{}), true) : false) || ...);
  return st;
}

template <class... Ps, class F>
void for_each_policy_impl(PolicyList<Ps...>, F&& f) {
  int i = 0;
  (f(Ps{}, i++), ...);
}
}  // namespace detail

//! The I-th policy of a PolicyList.
template <int I, class List>
using PolicyAt = typename detail::PolicyAt<I, List>::type;

/**
 * @brief Call `f(Policy{})` for the policy at runtime `index` of `List` and return its Status.
 * An index out of range returns kErrorInvalidArgument without calling f.
 *
 * @code
 * using Candidates = PolicyList<PolicyA, PolicyB>;
 * Status st = dispatch_policy<Candidates>(idx, [&](auto p) { return Op::launch<decltype(p)>(...); });
 * @endcode
 */
template <class List, class F>
Status dispatch_policy(int index, F&& f) {
  return detail::dispatch_policy_impl(List{}, index, std::forward<F>(f));
}

//! Call f(Policy{}, index) for every policy of the list, in order.
template <class List, class F>
void for_each_policy(F&& f) {
  detail::for_each_policy_impl(List{}, std::forward<F>(f));
}

PROX_NAMESPACE_END
