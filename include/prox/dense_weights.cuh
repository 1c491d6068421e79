// SPDX-License-Identifier: Apache-2.0
//! @file dense_weights.cuh  The fp16/bf16 proxy-weight format (L1): the paper's A1 ablation and the
//! denominator of the alpha ratio. Stage 1 streams it as it streams Int4Weights (int4.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"

PROX_NAMESPACE_BEGIN

#if defined(__CUDACC__)
/**
 * @brief fp16/bf16 proxy weights, input-major [d_model][d_ff]. Scales are optional (nullptr means 1).
 * Make the layout from nn.Linear weights with transpose_host / transpose_device.
 */
template <class W>
struct DenseWeights {
  static constexpr const char* kName = DTypeTraits<W>::kName;
  //! Its name in a tuning-cache key (the weights field): the element type, as kName.
  static constexpr const char* kKeyName = DTypeTraits<W>::kName;
  //! One proxy matrix (gate or up): device pointers, owned by the caller.
  struct Matrix {
    const W* w = nullptr;            //!< [d_model][d_ff] row-major, 16-byte aligned
    const float* scales = nullptr;   //!< [d_ff] per-channel scales, optional (nullptr = 1)
  };
  static constexpr int kVecBytes = 16;
  static constexpr int kChannelsPerVec = 8;
  static constexpr bool kNeedsScales = false;
  PROX_HOST_DEVICE static constexpr std::size_t row_bytes(int d_ff) noexcept {
    return static_cast<std::size_t>(d_ff) * sizeof(W);
  }
  PROX_HOST_DEVICE static constexpr std::size_t col_bytes(int n) noexcept {
    return static_cast<std::size_t>(n) * sizeof(W);
  }
  PROX_HOST_DEVICE static const void* data(const Matrix& m) noexcept { return m.w; }
  static constexpr uint32_t kFill = 0u;
  using XReg = float;
  PROX_DEVICE static PROX_FORCEINLINE XReg make_x(float x) { return x; }
  //! acc[c] += sum_u xs[u] * w_{u,c} over the kU rows of one step, in fp32.
  template <int kU>
  PROX_DEVICE static PROX_FORCEINLINE void fma_step(float (&acc)[kChannelsPerVec], const Piece<kVecBytes> (&v)[kU],
                                                    const float (&xs)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float w[8];
      unpack8<W>(make_uint4(v[u].w[0], v[u].w[1], v[u].w[2], v[u].w[3]), w);
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = fmaf(xs[u], w[c], acc[c]);
    }
  }
};
#endif  // __CUDACC__

PROX_NAMESPACE_END
