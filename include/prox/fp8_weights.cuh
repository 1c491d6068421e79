// SPDX-License-Identifier: Apache-2.0
//! @file fp8_weights.cuh  FP8 e4m3 Stage-2 weights with fp32 scales (L1): the Stage-2 weight-format seam's
//! second instance (stage2_weights.cuh), in the two scale layouts of fp8_format.hpp:
//!   Fp8ChannelWeights  one scale per output channel (vLLM per-channel, compressed-tensors): the GLU's g_j and
//!                      u_j and the down GEMV's y_d get one multiply each, after their sums;
//!   Fp8BlockWeights    one scale per 128 x 128 block (`weight_scale_inv[ceil(N/128)][ceil(K/128)]`, the
//!                      official Qwen3-*-FP8 and DeepSeek-V3): the GLU scales each 16-weight piece's partial
//!                      dot product (a piece lies in one block), the down GEMV folds the block scale of (row j,
//!                      its tile's column block) into s_j (a tile lies in one column block).
//! A 16-byte piece holds 16 weights (kElemsPerVec = 16): the GLU reads two 16-byte pieces of x per weight
//! piece; the down GEMV's threads own 16 output columns each. The conversion e4m3 -> fp16 -> fp32 is exact
//! (fp8.cuh: one instruction per pair on sm_89+, emulated on sm_80). The candidate lists are in
//! fp8_policies.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/config.hpp"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/vec.cuh"
#include "fp8.cuh"
#include "fp8_format.hpp"
#include "stage2_weights.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief FP8 e4m3 exact weights with fp32 scales in layout L (fp8::ScaleLayout). The dequantized weight is
 * q * scale (the checkpoint's `weight_scale` / `weight_scale_inv`).
 * @tparam L fp8::ScaleLayout::kPerChannel or fp8::ScaleLayout::kBlock128
 *
 * @code
 * using Fmt = prox::Fp8BlockWeights;
 * Fmt::Matrix gate{d_q, d_scale_inv, scale_rows, scale_cols};  // the checkpoint's tensors and the scales' shape
 * prox::SparseFfn<__nv_bfloat16, prox::SiLU, prox::Int4Weights, Fmt>::Weights w;
 * w.gate = gate;  // W_down^T and its scales: fp8::transpose_down_device
 * @endcode
 */
template <fp8::ScaleLayout L>
struct Fp8Weights {
  static_assert(fp8::is_valid(L), "a scale layout of fp8_format.hpp");
  using Element = std::uint8_t;  //!< e4m3 codes
  static constexpr fp8::ScaleLayout kLayout = L;
  static constexpr bool kBlock = L == fp8::ScaleLayout::kBlock128;
  static constexpr const char* kName = kBlock ? "fp8_e4m3_block128" : "fp8_e4m3_channel";
  //! The weights field of a tuning-cache key: the element, the scale layout, the layout version
  //! (fp8::kLayoutVersion 1).
  static constexpr const char* kKeyName = kBlock ? "e4m3b128v1" : "e4m3chv1";
  static constexpr int kElemsPerVec = fp8::kVecElems;  // 16
  static constexpr bool kHasMma = false;
  static constexpr bool kPieceScales = kBlock;
  static constexpr int kDownTileDivides = kBlock ? fp8::kBlockSize : 0;

  //! One matrix: device pointers, owned by the caller, and the shape of its scale array as the caller holds
  //! it (a checkpoint tensor's sizes; a 1-D per-channel array is [channels][1]), which plan-time validation
  //! checks against the matrix (fp8::check_scale_shape).
  struct Matrix {
    const std::uint8_t* w = nullptr;  //!< [rows][cols] e4m3 codes, row-major, 16-byte aligned
    const float* scales = nullptr;    //!< fp32, > 0 and finite: fp8::scale_shape(L, orientation, rows, cols)
    int scale_rows = 0;               //!< the scale array's rows
    int scale_cols = 0;               //!< and columns (1 for per-channel)
  };

  PROX_HOST_DEVICE static PROX_FORCEINLINE const std::uint8_t* data(const Matrix& m) noexcept { return m.w; }

  /**
   * @brief Plan time: fp8::check_matrix (null, shape, cols a multiple of 16, 16-byte aligned codes, 4-byte
   * aligned scales), then the scale array's shape against the layout (kErrorInvalidShape). The values (finite,
   * > 0) are not seen here: fp8::check_scales_device / check_scales_host, or SparseFfn's
   * PlanOptions::check_scales.
   */
  static Status check(const Matrix& m, int rows, int cols, WeightOrientation o = WeightOrientation::kOutIn) noexcept {
    PROX_RETURN_IF_ERROR(fp8::check_matrix(m.w, m.scales, rows, cols));
    return fp8::check_scale_shape(L, orientation(o), rows, cols, m.scale_rows, m.scale_cols);
  }
  //! Every scale finite and > 0 (fp8::check_scales_device: one kernel, synchronizes `stream`; refuses capture).
  static Status check_values(const Matrix& m, int rows, int cols, WeightOrientation o, cudaStream_t stream) noexcept {
    return fp8::check_scales_device(m.scales, scale_count(rows, cols, o), stream);
  }
  //! The number of scales of a matrix [rows][cols].
  static constexpr std::size_t scale_count(int rows, int cols, WeightOrientation o) noexcept {
    return fp8::scale_count(L, orientation(o), rows, cols);
  }
  static constexpr fp8::Orientation orientation(WeightOrientation o) noexcept {
    return o == WeightOrientation::kOutIn ? fp8::Orientation::kOutIn : fp8::Orientation::kInOut;
  }

#if defined(__CUDACC__)
  //! 16 e4m3 codes -> 16 exact floats, element order (no scale).
  PROX_DEVICE static PROX_FORCEINLINE void dequant(uint4 piece, float (&out)[kElemsPerVec]) {
    fp8::dequant16(piece, out);
  }
  //! Per channel: g_j (u_j) times row j's scale. Block: the pieces were scaled.
  PROX_DEVICE static PROX_FORCEINLINE float glu_out(const Matrix& m, int row, float sum) {
    if constexpr (kBlock) {
      return sum;
    } else {
      return sum * __ldg(m.scales + row);
    }
  }
  //! Block: the scale of piece q (weights 16 q .. 16 q + 15) of row `row` of a matrix of `cols` columns.
  PROX_DEVICE static PROX_FORCEINLINE float piece_scale(const Matrix& m, int row, int q, int cols) {
    return __ldg(m.scales + static_cast<std::size_t>(row / fp8::kBlockSize) * fp8::scale_blocks(cols) +
                 (q * kElemsPerVec) / fp8::kBlockSize);
  }
  //! Block: s_j times the block scale of (row j, the column block of the tile at col0) of W_down^T.
  PROX_DEVICE static PROX_FORCEINLINE float down_s(const Matrix& m, int row, int col0, int cols, float s) {
    if constexpr (kBlock) {
      return s * __ldg(m.scales + static_cast<std::size_t>(row / fp8::kBlockSize) * fp8::scale_blocks(cols) +
                       col0 / fp8::kBlockSize);
    } else {
      return s;
    }
  }
  //! Per channel: y_d times output channel d's scale (a column of W_down^T).
  PROX_DEVICE static PROX_FORCEINLINE float down_out(const Matrix& m, int col, float sum) {
    if constexpr (kBlock) {
      return sum;
    } else {
      return sum * __ldg(m.scales + col);
    }
  }
  //! Two codes (bits [0, 16): element 0 low) as a pair of T for the tensor cores (glu_mma.cuh), low half element
  //! 0, exactly: e4m3 -> f16x2 (one instruction on sm_89+), and for bf16 on through fp32 (e4m3 values are bf16
  //! values).
  template <class T>
  PROX_DEVICE static PROX_FORCEINLINE std::uint32_t mma_pair(std::uint32_t codes) {
    if constexpr (std::is_same_v<T, __half>) {
      return pair_bits(fp8::e4m3x2_to_half2(codes));
    } else {
      const float2 f = fp8::e4m3x2_to_float2(codes);
      return pair_bits(__floats2bfloat162_rn(f.x, f.y));
    }
  }
#endif
};

/**
 * @brief FP8 e4m3 weights read as Stage 1 reads its proxies (a Stage-1 format, as DenseWeights<W>): input-major
 * [d_model][d_ff] e4m3 codes with one fp32 scale per channel (the per-channel quantization of W_gate or W_up,
 * its codes transposed). ProxyGemvOp over it is the FP8 input-sparse GEMV: prox_alpha's denominator for FP8
 * layers (alpha = time(INT4 proxy GEMV) / time(FP8 input-sparse GEMV), the ratio allocate_sparsity takes).
 */
struct Fp8ProxyWeights {
  static constexpr const char* kName = "fp8_e4m3";
  static constexpr const char* kKeyName = "e4m3chv1";
  struct Matrix {
    const std::uint8_t* w = nullptr;  //!< [d_model][d_ff] e4m3 codes, row-major, 16-byte aligned
    const float* scales = nullptr;    //!< [d_ff] per-channel scales, required
  };
  static constexpr int kVecBytes = 16;
  static constexpr int kChannelsPerVec = fp8::kVecElems;  // 16
  static constexpr bool kNeedsScales = true;
  PROX_HOST_DEVICE static constexpr std::size_t row_bytes(int d_ff) noexcept { return static_cast<std::size_t>(d_ff); }
  PROX_HOST_DEVICE static constexpr std::size_t col_bytes(int n) noexcept { return static_cast<std::size_t>(n); }
  PROX_HOST_DEVICE static const void* data(const Matrix& m) noexcept { return m.w; }
  static constexpr std::uint32_t kFill = 0u;  //!< code 0x00 is +0
  using XReg = float;
#if defined(__CUDACC__)
  PROX_DEVICE static PROX_FORCEINLINE XReg make_x(float x) { return x; }
  //! acc[c] += sum_u xs[u] * q_{u,c} over the kU rows of one step, in fp32 (the scales come in the epilogue).
  template <int kU>
  PROX_DEVICE static PROX_FORCEINLINE void fma_step(float (&acc)[kChannelsPerVec], const Piece<kVecBytes> (&v)[kU],
                                                    const float (&xs)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float w[kChannelsPerVec];
      fp8::dequant16(make_uint4(v[u].w[0], v[u].w[1], v[u].w[2], v[u].w[3]), w);
#pragma unroll
      for (int c = 0; c < kChannelsPerVec; ++c) acc[c] = fmaf(xs[u], w[c], acc[c]);
    }
  }
#endif
};

//! FP8 e4m3 weights, one fp32 scale per output channel.
using Fp8ChannelWeights = Fp8Weights<fp8::ScaleLayout::kPerChannel>;
//! FP8 e4m3 weights, one fp32 scale per 128 x 128 block.
using Fp8BlockWeights = Fp8Weights<fp8::ScaleLayout::kBlock128>;

PROX_NAMESPACE_END
