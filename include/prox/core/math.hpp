// SPDX-License-Identifier: Apache-2.0
//! @file math.hpp  Integer helpers and pointer-alignment checks used by the L3 validators.
#pragma once

#include <cstddef>
#include <cstdint>

#include "config.hpp"

PROX_NAMESPACE_BEGIN

//! ceil(a / b) for non-negative a and positive b.
template <class I>
PROX_HOST_DEVICE constexpr I ceil_div(I a, I b) noexcept {
  return (a + b - 1) / b;
}

//! Round a up to a multiple of b (b > 0).
template <class I>
PROX_HOST_DEVICE constexpr I round_up(I a, I b) noexcept {
  return ceil_div(a, b) * b;
}

//! True when p is a multiple of `alignment` bytes (null counts as aligned; check nulls separately).
inline bool is_aligned(const void* p, std::size_t alignment) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) % alignment) == 0;
}

//! True for a power of two (compile-time policy checks).
constexpr bool is_pow2(int v) noexcept { return v > 0 && (v & (v - 1)) == 0; }

//! log2 of a power of two (compile-time loop bounds).
PROX_HOST_DEVICE constexpr int log2_pow2(int v) noexcept { return v <= 1 ? 0 : 1 + log2_pow2(v / 2); }

namespace detail {
//! The splitmix64 finalizer: a bijection on 64-bit integers with good avalanche (seeded hashes of
//! the calibration reservoir, synthetic data of the tuner and the benches).
PROX_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
//! One splitmix64 step: mix64(z + the golden-ratio increment).
PROX_HOST_DEVICE constexpr std::uint64_t splitmix64(std::uint64_t z) noexcept {
  return mix64(z + 0x9e3779b97f4a7c15ull);
}

//! FNV-1a (64-bit): the offset basis, and the hash after one more byte (the workspace layout tag, the
//! tuning cache's policy-table signature and file name).
constexpr std::uint64_t kFnv1aBasis = 1469598103934665603ull;
constexpr std::uint64_t fnv1a64_step(std::uint64_t h, unsigned char byte) noexcept {
  return (h ^ byte) * 1099511628211ull;
}
}  // namespace detail

PROX_NAMESPACE_END
