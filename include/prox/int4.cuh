// SPDX-License-Identifier: Apache-2.0
//! @file int4.cuh  INT4 proxy weights on the device: the register dequantizer and the Int4Weights
//! format Stage 1 streams (L1), and the device packer (bit-identical to int4::pack_host). The layout
//! is documented in int4_format.hpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "core/vec.cuh"
#include "core/warp.cuh"
#include "int4_format.hpp"

PROX_NAMESPACE_BEGIN

#if defined(__CUDACC__)
namespace int4 {


template <uint32_t kLut>
PROX_DEVICE PROX_FORCEINLINE uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(kLut));
  return d;
}

/**
 * @brief Dequantize one packed word (8 channels) into four fp16 pairs holding q = nibble - 8,
 * exactly, in channel order (c0,c1), (c2,c3), (c4,c5), (c6,c7).
 *
 * Why it is cheap: OR-ing a nibble into the mantissa of fp16 1024.0 (0x6400) gives 1024 + q
 * without a conversion; the nibble interleave puts channels (2i, 2i+1) into the two halves of the
 * same 32-bit register, so 4 lop3 + 1 shift + 2 hsub2 + 2 hfma2 decode 8 weights (the scheme of
 * FasterTransformer / Marlin, with the -8 zero point folded into the subtract and the fma).
 */
PROX_DEVICE PROX_FORCEINLINE void dequant_word(uint32_t q, __half2 (&h)[4]) {
  constexpr uint32_t kLo = 0x000f000fu;
  constexpr uint32_t kHi = 0x00f000f0u;
  constexpr uint32_t kEx = 0x64006400u;
  constexpr uint32_t kLut = (0xf0 & 0xcc) | 0xaa;  // (a & b) | c
  const uint32_t lo0 = lop3<kLut>(q, kLo, kEx);
  const uint32_t hi0 = lop3<kLut>(q, kHi, kEx);
  q >>= 8;
  const uint32_t lo1 = lop3<kLut>(q, kLo, kEx);
  const uint32_t hi1 = lop3<kLut>(q, kHi, kEx);
  const __half2 sub = as_pair<__half>(0x64086408u);  // {1032, 1032}: 1024 bias + 8 zero point
  const __half2 mul = as_pair<__half>(0x2c002c00u);  // {1/16, 1/16}
  const __half2 add = as_pair<__half>(0xd480d480u);  // {-72, -72} = -(1024/16 + 8)
  h[0] = __hsub2(as_pair<__half>(lo0), sub);
  h[1] = __hfma2(as_pair<__half>(hi0), mul, add);
  h[2] = __hsub2(as_pair<__half>(lo1), sub);
  h[3] = __hfma2(as_pair<__half>(hi1), mul, add);
}

//! Dequantize one packed word into 8 floats q in [-8, 7], channel order.
PROX_DEVICE PROX_FORCEINLINE void dequant_word(uint32_t q, float (&out)[8]) {
  __half2 h[4];
  dequant_word(q, h);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

}  // namespace int4

/**
 * @brief The INT4 proxy-weight format as Stage 1 reads it (the method): packed [d_model][d_ff/8]
 * uint32 words (layout above and int4_format.hpp) with float scales [d_ff]. One 8-byte piece holds
 * 16 channels of one input row.
 */
struct Int4Weights {
  static constexpr const char* kName = "int4";
  //! Its name in a tuning-cache key (the weights field): the format and its layout version.
  static constexpr const char* kKeyName = "int4v1";
  //! One proxy matrix (gate or up): device pointers, owned by the caller.
  struct Matrix {
    const std::uint32_t* packed = nullptr;  //!< [d_model][d_ff/8] words, 16-byte aligned (pack_host/pack_device)
    const float* scales = nullptr;          //!< [d_ff] per-channel scales, required
  };
  static constexpr int kVecBytes = 8;  //!< 8-byte pieces: 16 channels, 32 fp32 accumulators for gate+up
  static constexpr int kChannelsPerVec = 16;
  static constexpr bool kNeedsScales = true;
  PROX_HOST_DEVICE static constexpr std::size_t row_bytes(int d_ff) noexcept {
    return static_cast<std::size_t>(d_ff) / 2;
  }
  PROX_HOST_DEVICE static constexpr std::size_t col_bytes(int n) noexcept { return static_cast<std::size_t>(n) / 2; }
  PROX_HOST_DEVICE static const void* data(const Matrix& m) noexcept { return m.packed; }
  //! Word whose every nibble decodes to 0 (fills predicated-off loads).
  static constexpr uint32_t kFill = 0x88888888u;
  //! Most rows one step may sum in fp16 (see fma_step): kMaxStepRows * 1024 * 8 stays finite.
  static constexpr int kMaxStepRows = 4;
  //! x is scaled by 2^-6 before the fp16 products (every finite fp16 |x| <= 65504 becomes <= 1024)
  //! and the step's sums by 2^6 after: both exact powers of two.
  static constexpr float kXScale = 0.015625f;
  static constexpr float kXUnscale = 64.0f;
  //! A kept x as a step consumes it: x 2^-6 in both halves (converted when the step is loaded).
  using XReg = __half2;
  PROX_DEVICE static PROX_FORCEINLINE XReg make_x(float x) { return __float2half2_rn(x * kXScale); }

  /**
   * @brief acc[c] += sum_u xs[u] * q_{u,c} over the kU rows of one step.
   *
   * The decode is what limits the INT4 proxy (it moves a quarter of the bytes of an fp16 GEMV per
   * weight), so the step is summed in fp16 pairs: per 32-bit word, 4 lop3 + 1 shift + 4 half2 ops
   * decode q exactly and 4 HFMA2 accumulate (x 2^-6) * q, against 8 conversions + 8 FFMA in fp32;
   * the kU-row partial sums then go to the fp32 accumulators once per step. The fp16 rounding
   * (relative 2^-11 per operation, kU <= 4 rows) is far below the INT4 quantization error of the
   * proxy itself, and tests/reference bounds it. |x 2^-6| <= 1024, |q| <= 8, kU <= 4 rows: no
   * partial sum can overflow for any finite fp16 x (bf16 x above 2^26 in magnitude would).
   */
  template <int kU>
  PROX_DEVICE static PROX_FORCEINLINE void fma_step(float (&acc)[kChannelsPerVec], const Piece<kVecBytes> (&v)[kU],
                                                    const __half2 (&x2)[kU]) {
    static_assert(kU >= 1 && kU <= kMaxStepRows, "fp16 step sums hold at most kMaxStepRows rows");
    // One word (8 channels) at a time keeps 4 partial-sum registers live, not 8 (the kernel runs at
    // 3 blocks of 256 threads per SM: 80 registers).
#pragma unroll
    for (int i = 0; i < Piece<kVecBytes>::kWords; ++i) {
      __half2 h[4];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        __half2 q[4];
        int4::dequant_word(v[u].w[i], q);  // channel pairs (8i + 2c, 8i + 2c + 1)
#pragma unroll
        for (int c = 0; c < 4; ++c) h[c] = u == 0 ? __hmul2(x2[u], q[c]) : __hfma2(x2[u], q[c], h[c]);
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float2 f = __half22float2(h[c]);
        acc[8 * i + 2 * c] = fmaf(f.x, kXUnscale, acc[8 * i + 2 * c]);
        acc[8 * i + 2 * c + 1] = fmaf(f.y, kXUnscale, acc[8 * i + 2 * c + 1]);
      }
    }
  }
};
static_assert(int4::kLayoutVersion == 1, "Int4Weights::kKeyName names layout version 1: bump it with the layout");

namespace int4 {

namespace detail {

//! One warp per output channel: scale = max|w| / 7; a non-finite weight makes the scale NaN.
//! `src(n, k)` gives W[n][k] as a float (RowMajorSource, or fp8.cuh's dequantizing source).
template <class Src>
PROX_KERNEL void int4_scale_kernel(const Src src, int d_model, int d_ff, float* __restrict__ scales) {
  const int n = static_cast<int>(blockIdx.x) * (blockDim.x / kWarpSize) + warp_id();
  if (n >= d_ff) return;
  bool finite = true;
  const float amax = warp_abs_max([&](int k) { return src(n, k); }, d_model, finite);
  if (lane_id() == 0) scales[n] = finite ? scale_from_amax(amax) : __int_as_float(0x7fc00000);
}

//! One thread per packed word.
template <class Src>
PROX_KERNEL void int4_pack_kernel(const Src src, int d_model, int d_ff, const float* __restrict__ scales,
                                  uint32_t* __restrict__ packed) {
  const int words_per_row = d_ff / kChannelsPerWord;
  const std::size_t idx = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<std::size_t>(d_model) * words_per_row) return;
  const int k = static_cast<int>(idx / words_per_row);
  const int wi = static_cast<int>(idx % words_per_row);
  uint32_t word = 0;
#pragma unroll
  for (int c = 0; c < kChannelsPerWord; ++c) {
    const int n = wi * kChannelsPerWord + c;
    word |= quantize_nibble(src(n, k), scales[n]) << (4 * nibble_of_channel(c));
  }
  packed[idx] = word;
}

/**
 * @brief pack_device over any element source (see int4_scale_kernel): the two launches, the
 * synchronization and the non-finite check. Callers check pointers, alignment and the shape first.
 */
template <class Src>
Status pack_device_from(const Src& src, int d_model, int d_ff, uint32_t* packed, float* scales, cudaStream_t stream,
                        float* host_scales) {
  constexpr int kThreads = 256;
  LaunchConfig lc = plain_launch(dim3(static_cast<unsigned>(ceil_div(d_ff, kThreads / kWarpSize))), dim3(kThreads));
  PROX_RETURN_IF_ERROR(prox::detail::launch_kernel(int4_scale_kernel<Src>, lc, stream, src, d_model, d_ff, scales));
  std::vector<float> tmp;
  if (host_scales == nullptr) {
    tmp.resize(static_cast<std::size_t>(d_ff));
    host_scales = tmp.data();
  }
  if (cudaMemcpyAsync(host_scales, scales, sizeof(float) * d_ff, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    return Status::kErrorCudaRuntime;
  }
  for (int n = 0; n < d_ff; ++n)
    if (!(host_scales[n] == host_scales[n])) return Status::kErrorNonFiniteWeight;
  const std::size_t words = packed_words(d_model, d_ff);
  lc.grid = dim3(static_cast<unsigned>((words + kThreads - 1) / kThreads));
  return prox::detail::launch_kernel(int4_pack_kernel<Src>, lc, stream, src, d_model, d_ff,
                                     static_cast<const float*>(scales), packed);
}

}  // namespace detail

/**
 * @brief Quantize and pack on the device; bit-identical to pack_host.
 * Offline helper, not for the hot path: it synchronizes `stream` and copies the scales to the host
 * once to check for non-finite weights (kErrorNonFiniteWeight; then `packed` is not written).
 * @param w [d_ff][d_model] device pointer (nn.Linear layout); packed [d_model][d_ff/8] and
 *        scales [d_ff] device outputs; host_scales optional host buffer of d_ff floats (else a
 *        temporary host vector is used).
 * @return kErrorNullPointer, kErrorInvalidShape (check_pack_shape) or kErrorMisalignedPointer (w
 *         not element-aligned, packed or scales not 4-byte aligned) before any launch.
 */
template <class T>
Status pack_device(const T* w, int d_model, int d_ff, uint32_t* packed, float* scales, cudaStream_t stream,
                   float* host_scales = nullptr) {
  if (w == nullptr || packed == nullptr || scales == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_pack_shape(d_model, d_ff));
  // Element-aligned, else the kernels' loads and stores fault (a sticky error on the context).
  if (!is_aligned(w, sizeof(T)) || !is_aligned(packed, 4) || !is_aligned(scales, 4))
    return Status::kErrorMisalignedPointer;
  return detail::pack_device_from(RowMajorSource<T>{w, d_model}, d_model, d_ff, packed, scales, stream, host_scales);
}

}  // namespace int4
#endif  // __CUDACC__

PROX_NAMESPACE_END
