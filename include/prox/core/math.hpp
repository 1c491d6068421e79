// SPDX-License-Identifier: Apache-2.0
//! @file math.hpp  Integer helpers and pointer-alignment checks used by the L3 validators.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

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
//! Most chunks balanced_chunks() makes of a reduction, as a multiple of the policy's own count.
constexpr int kMaxChunkSplit = 4;

//! Length of each of `chunks` split-K chunks of a k-long reduction: ceil(k / chunks) rounded up to
//! `align` (the last chunk may be shorter).
PROX_HOST_DEVICE constexpr int chunk_length(int k, int chunks, int align) noexcept {
  return round_up(ceil_div(k, chunks), align);
}

//! Chunk length of a split into `chunks` chunks by balanced_chunks(): `max_chunk` (the policy's own split,
//! the last chunk shorter) when `chunks` is the policy's count ceil(k / max_chunk), else chunk_length().
//! Kernels call it with their grid's chunk count (gridDim.y).
PROX_HOST_DEVICE constexpr int split_chunk_length(int k, int chunks, int max_chunk, int align) noexcept {
  return chunks <= ceil_div(k, max_chunk) ? max_chunk : chunk_length(k, chunks, align);
}

//! Most blocks a grid extended by balanced_chunks() may have: one wave of any device up to 512 SMs x 4
//! blocks. It bounds the workspace (max_balanced_chunks) without knowing the device.
constexpr long kMaxBalancedBlocks = 2048;

//! The most chunks balanced_chunks() can return for `tiles` tiles on any device: the policy's count, or
//! up to kMaxChunkSplit times it within kMaxBalancedBlocks blocks and ceil(k / align) chunks. What a
//! workspace holding every chunk's partials sizes for.
constexpr int max_balanced_chunks(int k, int max_chunk, int align, long tiles) noexcept {
  const int nominal = ceil_div(k, max_chunk);
  long cap = static_cast<long>(kMaxChunkSplit) * nominal;
  if (cap > ceil_div(k, align)) cap = ceil_div(k, align);
  if (tiles > 0 && cap > kMaxBalancedBlocks / tiles) cap = kMaxBalancedBlocks / tiles;
  return cap > nominal ? static_cast<int>(cap) : nominal;
}

/**
 * @brief Split-K chunk count that fills a grid of less than one wave. A policy's own count is ceil(k /
 * max_chunk), giving tiles x that many blocks; when that grid fits in one wave of `slots` resident blocks,
 * this takes the largest count, up to kMaxChunkSplit times the policy's, whose grid still fits and which
 * leaves no chunk empty (chunks of chunk_length(); split_chunk_length() gives either split), within
 * max_balanced_chunks(). A grid of more than one wave keeps the policy's count: filling its last wave
 * with shorter chunks made the batched FFN 7-22 % slower at B = 4, while filling a single wave made
 * it 3-7 % faster on the Qwen3-1.7B and 4B shapes at B = 2 and 4 (H100, docs/history.md).
 */
constexpr int balanced_chunks(int k, int max_chunk, int align, long tiles, long slots) noexcept {
  const int nominal = ceil_div(k, max_chunk);
  if (tiles <= 0 || slots <= 0) return nominal;
  int best = nominal;
  const int cap = max_balanced_chunks(k, max_chunk, align, tiles);
  for (int n = nominal + 1; n <= cap && tiles * n <= slots; ++n) {
    if (static_cast<long>(n - 1) * chunk_length(k, n, align) < k) best = n;
  }
  return best;
}

//! Whether a policy splits its reduction into balanced_chunks(): its `kBalanced` member, true without one.
template <class P, class = void>
struct ChunksBalanced : std::true_type {};
template <class P>
struct ChunksBalanced<P, std::void_t<decltype(P::kBalanced)>> : std::bool_constant<P::kBalanced> {};

/**
 * @brief The grid of a batched split-K op (the batched Stage 1 and down GEMV): column tiles of P::kTile
 * outputs x chunks of the reduction, balanced_chunks() of at most P::kChunk (aligned to kAlign) where the
 * policy is ChunksBalanced, else P::kChunk. kTilesOverDff: the outputs are the d_ff channels and the reduction
 * d_model (Stage 1), else the reverse (the down GEMV). The ops derive from it: Op::num_blocks<P>(...).
 */
template <int kAlign, bool kTilesOverDff>
struct BatchedSplitGrid {
  //! Column tiles over the op's n outputs.
  template <class P>
  static constexpr int num_tiles(int n) noexcept {
    return ceil_div(n, P::kTile);
  }
  //! Split-K chunks: more, shorter ones where the policy's own split leaves a grid of less than one wave.
  template <class P>
  static constexpr int num_chunks(int d_model, int d_ff, int sm_count) noexcept {
    const int k = kTilesOverDff ? d_model : d_ff;
    if constexpr (!ChunksBalanced<P>::value) return ceil_div(k, P::kChunk);
    return balanced_chunks(k, P::kChunk, kAlign, num_tiles<P>(kTilesOverDff ? d_ff : d_model),
                           static_cast<long>(sm_count) * P::kMinBlocks);
  }
  //! The most chunks num_chunks() gives on any device (what the workspace's partials are sized for).
  template <class P>
  static constexpr int max_chunks(int d_model, int d_ff) noexcept {
    const int k = kTilesOverDff ? d_model : d_ff;
    if constexpr (!ChunksBalanced<P>::value) return ceil_div(k, P::kChunk);
    return max_balanced_chunks(k, P::kChunk, kAlign, num_tiles<P>(kTilesOverDff ? d_ff : d_model));
  }
  template <class P>
  static constexpr long num_blocks(int d_model, int d_ff, int sm_count) noexcept {
    return static_cast<long>(num_tiles<P>(kTilesOverDff ? d_ff : d_model)) * num_chunks<P>(d_model, d_ff, sm_count);
  }
};

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
