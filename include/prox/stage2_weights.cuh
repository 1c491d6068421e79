// SPDX-License-Identifier: Apache-2.0
//! @file stage2_weights.cuh  The Stage-2 weight-format seam (L1): what the GLU GEMV, the down GEMV, the fused
//! Stage 2 and their batched versions ask of the exact weights they stream, and today's fp16/bf16 weights
//! (NativeWeights<W>) as its first instance.
//!
//! Stage 1 takes its proxy format as a parameter (Int4Weights, DenseWeights<W>); Stage 2 takes its exact-weight
//! format the same way. The activation type T (fp16/bf16: x, y) stays a separate parameter, as CUTLASS separates
//! ElementA from ElementB and vLLM's Marlin makes the weight type a template id (`dequant<scalar_t2, w_type_id>`).
//! A format `Fmt` states:
//!
//!   Element                  the stored element type
//!   Matrix                   one matrix's device pointers: `w` (rows x cols, row-major, 16-byte aligned rows)
//!                            and, for a scaled format, its fp32 scales
//!   kName, kKeyName          a name for messages; the weights field of a tuning-cache key (its layout version)
//!   kElemsPerVec             elements of one 16-byte load (8: fp16/bf16; 16: FP8). The GEMVs' steps, the down
//!                            GEMV's columns per thread and the GLU's x pieces per weight piece follow it.
//!   kHasMma                  the batched B = 8 tensor-core kernels take this format (else the CUDA-core ones)
//!   kPieceScales             the GLU scales each 16-byte piece's partial dot product (piece_scale)
//!   kDownTileDivides         0, or a column count every down-GEMV tile must divide (a scale block: the down
//!                            GEMV folds one block scale per row into s)
//!   data(m)                  the element pointer
//!   check(m, rows, cols, o)  plan-time validation -> Status: null, alignment, cols a multiple of kElemsPerVec,
//!                            the scales it requires and their shape (o: WeightOrientation of the matrix)
//!   check_values(m, rows, cols, o, stream)  the values a plan can check on the device (a scaled format: every
//!                            scale finite and > 0; synchronizes `stream`), kSuccess for an unscaled one
//!   dequant(piece, out)      one 16-byte piece -> kElemsPerVec floats, in registers
//! and its scale hooks, at fixed points of the kernels (each a no-op for an unscaled format):
//!   glu_out(m, row, sum)     the GLU's full dot product of row `row` (g or u), before the activation
//!   piece_scale(m, row, q, cols)  kPieceScales: the factor of piece q (elements kElemsPerVec q ..) of a GLU row
//!   down_s(m, row, col0, cols, s) s_j as the down GEMV weights row j of a tile starting at column col0
//!   down_out(m, col, sum)    the down GEMV's full sum of output column `col`, before it is stored
//!
//! docs/design.md, "Adding a Stage-2 weight format", lists what a new format touches.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief How a stored Stage-2 matrix relates to its linear map: kOutIn, nn.Linear's [out][in] (W_gate, W_up: a
 * channel per row); kInOut, the transpose [in][out] (W_down^T [d_ff][d_model]: an output per column). A
 * per-channel scale follows the outputs.
 */
enum class WeightOrientation : int { kOutIn = 0, kInOut = 1 };

/**
 * @brief The fp16/bf16 exact weights of Stage 2 (today's checkpoints): W_gate and W_up [d_ff][d_model] as
 * nn.Linear stores them, W_down^T [d_ff][d_model]. No scales: every hook is the identity, so the kernels
 * compile to what they were before the seam existed.
 * @tparam W `__half` or `__nv_bfloat16`; SparseFfn and the ops use NativeWeights<T> (weights of the activation type).
 */
template <class W>
struct NativeWeights {
  using Element = W;
  static constexpr const char* kName = DTypeTraits<W>::kName;
  //! The weights field of a tuning-cache key: the element type (the keys written before the seam).
  static constexpr const char* kKeyName = DTypeTraits<W>::kName;
  static constexpr int kElemsPerVec = 16 / static_cast<int>(sizeof(W));
  static constexpr bool kHasMma = true;
  static constexpr bool kPieceScales = false;
  static constexpr int kDownTileDivides = 0;

  /**
   * @brief One matrix: a device pointer, owned by the caller. Converts from and to `const W*`, so that code
   * written before the seam (`weights.gate = d_wg;`, `args.w_down_t = w.down_t + 1;`) reads as it did.
   */
  struct Matrix {
    const W* w = nullptr;  //!< [rows][cols] row-major, 16-byte aligned
    Matrix() = default;
    PROX_HOST_DEVICE Matrix(const W* p) noexcept : w(p) {}  // NOLINT(google-explicit-constructor): by design
    PROX_HOST_DEVICE operator const W*() const noexcept { return w; }  // NOLINT(google-explicit-constructor)
  };

  PROX_HOST_DEVICE static PROX_FORCEINLINE const W* data(const Matrix& m) noexcept { return m.w; }

  //! Plan time: non-null, 16-byte aligned (rows of cols elements: cols is a multiple of 8 by the FFN shape rule).
  static Status check(const Matrix& m, int /*rows*/, int cols,
                      WeightOrientation /*o*/ = WeightOrientation::kOutIn) noexcept {
    if (m.w == nullptr) return Status::kErrorNullPointer;
    if (cols % kElemsPerVec != 0) return Status::kErrorInvalidShape;
    return is_aligned(m.w, 16) ? Status::kSuccess : Status::kErrorMisalignedPointer;
  }
  //! No scales: nothing to check on the device.
  static Status check_values(const Matrix&, int, int, WeightOrientation, cudaStream_t) noexcept {
    return Status::kSuccess;
  }

#if defined(__CUDACC__)
  //! 16 bytes of W -> 8 floats (element order kept).
  PROX_DEVICE static PROX_FORCEINLINE void dequant(uint4 piece, float (&out)[kElemsPerVec]) { unpack8<W>(piece, out); }
  PROX_DEVICE static PROX_FORCEINLINE float glu_out(const Matrix&, int, float sum) { return sum; }
  PROX_DEVICE static PROX_FORCEINLINE float piece_scale(const Matrix&, int, int, int) { return 1.0f; }
  PROX_DEVICE static PROX_FORCEINLINE float down_s(const Matrix&, int, int, int, float s) { return s; }
  PROX_DEVICE static PROX_FORCEINLINE float down_out(const Matrix&, int, float sum) { return sum; }
#endif
};

namespace detail {
//! The GLU's steps over one row of `cols` elements: pieces of Fmt::kElemsPerVec, kThreads x kUnroll per step
//! (the last one leaves the threads past the row's end idle). Host and device.
template <class Fmt>
PROX_HOST_DEVICE constexpr int glu_steps_per_row(int cols, int threads, int unroll) noexcept {
  return ceil_div(cols / Fmt::kElemsPerVec, threads * unroll);
}
}  // namespace detail

PROX_NAMESPACE_END
