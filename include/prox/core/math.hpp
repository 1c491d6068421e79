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

PROX_NAMESPACE_END
