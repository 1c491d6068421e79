// SPDX-License-Identifier: Apache-2.0
//! @file rank_range.cuh  L1 building block of the Stage-2 GEMVs: split the selected channels of a
//! bitmask evenly over the blocks of a grid by their rank (position among the selected channels),
//! so every block gets the same number of rows whatever the mask looks like.
//!
//! Why: with a static split of the channel *index* range, a block's work is a binomial count; the
//! busiest SM then carried ~1.5x the mean at 23 % density (measured on the H100, Qwen3-8B GLU:
//! 22.4 us against a 15.7 us byte floor). Splitting by rank costs each block one pass over the
//! d_ff/32 mask words (L2-resident) and a block scan.
#pragma once

#include <cstdint>

#include "../core/config.hpp"
#include "../core/warp.cuh"

PROX_NAMESPACE_BEGIN
namespace detail {

#if defined(__CUDACC__)

/**
 * @brief Rank range [lo, hi) of part `part` of `parts` equal parts of the `total` selected channels.
 */
PROX_DEVICE PROX_FORCEINLINE void rank_range(int total, int part, int parts, int* lo, int* hi) {
  *lo = static_cast<int>((static_cast<long long>(total) * part) / parts);
  *hi = static_cast<int>((static_cast<long long>(total) * (part + 1)) / parts);
}

/**
 * @brief Count the selected channels before this thread's mask words.
 * Thread t owns words [t * wpt, (t + 1) * wpt) with wpt = ceil(n_words / kThreads).
 * Returns the thread's exclusive rank offset; `*total` gets the number of selected channels.
 * Contains __syncthreads().
 */
template <int kThreads>
PROX_DEVICE int mask_rank_offset(const std::uint32_t* __restrict__ mask, int n_words, int* warp_scratch, int* total) {
  // The words are loaded in batches of kBatch, all issued before the first popcount: this is the
  // first thing a Stage-2 block does after its launch, so each round trip here delays every weight
  // load. (A plain loop with the run-time bound wpt compiled to unrolled-by-16/8/4 pieces and a
  // one-word remainder loop: wpt = 2 on the Qwen3-8B shape and 3 on 14B were 2 and 3 serialized
  // loads. The mask is L2-resident, so the measured gain is small: within 0.2 us on the H100.)
  constexpr int kBatch = 8;
  const int wpt = (n_words + kThreads - 1) / kThreads;
  const int w0 = static_cast<int>(threadIdx.x) * wpt;
  const int w1 = min(w0 + wpt, n_words);
  int mine = 0;
#pragma unroll 1
  for (int w = w0; w < w1; w += kBatch) {
    std::uint32_t bits[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) bits[i] = w + i < w1 ? mask[w + i] : 0u;
#pragma unroll
    for (int i = 0; i < kBatch; ++i) mine += __popc(bits[i]);
  }
  return block_exclusive_sum<kThreads>(mine, warp_scratch, total);
}

/**
 * @brief Write, in order, the channel index of every selected channel with rank in [lo, hi) to
 * out[rank - lo]. `offset` is this thread's result of mask_rank_offset. No barrier inside; the
 * caller synchronizes before reading out.
 */
template <int kThreads>
PROX_DEVICE void gather_rank_range(const std::uint32_t* __restrict__ mask, int n_words, int offset, int lo, int hi,
                                   int* out) {
  const int wpt = (n_words + kThreads - 1) / kThreads;
  const int w0 = static_cast<int>(threadIdx.x) * wpt;
  int r = offset;
  for (int w = w0; w < w0 + wpt && w < n_words && r < hi; ++w) {
    std::uint32_t bits = mask[w];
    const int c = __popc(bits);
    if (r + c <= lo) {  // the whole word lies before the range
      r += c;
      continue;
    }
    while (bits != 0u && r < hi) {
      const int b = __ffs(static_cast<int>(bits)) - 1;
      bits &= bits - 1u;
      if (r >= lo) out[r - lo] = w * kWarpSize + b;
      ++r;
    }
  }
}

#endif  // __CUDACC__

}  // namespace detail
PROX_NAMESPACE_END
