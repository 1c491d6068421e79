// SPDX-License-Identifier: Apache-2.0
//! @file policy.hpp  Compile-time tile-policy lists and the runtime index -> policy dispatch.
//!
//! Conventions (see docs/design.md): a policy is a *type* with `static constexpr int` members
//! (kThreads first) and a host-only `static std::string name()` describing it; an op's candidates
//! form a `PolicyList<...>`. Tuning and tests iterate the list; changing a tile size is a one-line
//! edit of the list.
#pragma once

#include <cstdint>
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
 * Status st = dispatch_policy<Candidates>(idx, [&](auto p) {
 *   return launch<decltype(p)>(args, ws, stream);
 * });
 * @endcode
 */
template <class List, class F>
Status dispatch_policy(int index, F&& f);

template <class... Ps, class F>
Status dispatch_policy_impl(PolicyList<Ps...>, int index, F&& f) {
  Status st = Status::kErrorInvalidArgument;
  int i = 0;
  (void)((i++ == index ? (st = f(Ps{}), true) : false) || ...);
  return st;
}

template <class List, class F>
Status dispatch_policy(int index, F&& f) {
  return dispatch_policy_impl(List{}, index, std::forward<F>(f));
}

//! Call f(Policy{}, index) for every policy of the list, in order.
template <class... Ps, class F>
void for_each_policy_impl(PolicyList<Ps...>, F&& f) {
  int i = 0;
  (f(Ps{}, i++), ...);
}
template <class List, class F>
void for_each_policy(F&& f) {
  for_each_policy_impl(List{}, std::forward<F>(f));
}

//! FNV-1a 64-bit hash (the tuning cache's policy-table signature).
inline std::uint64_t fnv1a64(const std::string& s, std::uint64_t h = 1469598103934665603ull) noexcept {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

//! Names of every policy in a list, joined with ';' (hashed into the tuning-cache signature).
template <class List>
std::string policy_list_names() {
  std::string out;
  for_each_policy<List>([&](auto p, int) {
    if (!out.empty()) out += ';';
    out += decltype(p)::name();
  });
  return out;
}

PROX_NAMESPACE_END
