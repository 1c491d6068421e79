// SPDX-License-Identifier: Apache-2.0
//! @file fp8_format.hpp  FP8 e4m3 Stage-2 weights on the host: the e4m3 encoding, the two scale
//! layouts and their shape rules, the shared quantization arithmetic, and the host helpers (quantize,
//! dequantize, INT4 proxies from FP8, scale checks). fp8.cuh holds the register conversions, the
//! device helpers and the W_down transposes; both sides call the functions below and are bit-identical.
//!
//! Format (docs/fp8-format.md has the diagrams):
//!   element  e4m3fn (OCP FP8 E4M3, torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa
//!            bits; no infinity; S.1111.111 is NaN; largest finite 448; smallest subnormal 2^-9.
//!   weights  uint8 e4m3 [rows][cols] row-major, as a checkpoint stores nn.Linear's [N = out][K = in].
//!   scales   float32, the dequantized weight is q * scale (the checkpoint's `weight_scale` or
//!            `weight_scale_inv`: both name this multiplier; in transformers'
//!            src/transformers/integrations/finegrained_fp8.py, Fp8Dequantize computes quantized *
//!            scales, FP8Linear hands weight_scale_inv to its GEMM as the weight's scale, and Fp8Quantize
//!            stores 1 / (448 / amax); vLLM's FP8 Marlin preparation takes weight_scale_inv exactly as
//!            weight_scale), in one of two layouts (ScaleLayout):
//!            kPerChannel  one per output channel ([N], or [N][1] as compressed-tensors stores it);
//!            kBlock128    one per 128 x 128 block, [ceil(N/128)][ceil(K/128)] row-major, the last
//!                         block of a row or column partial (DeepSeek-V3, the official Qwen3-*-FP8).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/config.hpp"
#include "core/math.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/types.cuh"
#include "int4_format.hpp"

PROX_NAMESPACE_BEGIN

namespace fp8 {

//! Layout tag for tools that store prox-made FP8 tensors (W_down^T and its scales); bump with any change.
constexpr const char* kLayoutTag = "prox-fp8-e4m3-v1";
constexpr int kLayoutVersion = 1;
constexpr float kMax = 448.0f;           //!< largest finite e4m3 value
constexpr int kBlockSize = 128;          //!< side of a kBlock128 scale block
constexpr int kVecElems = 16;            //!< e4m3 values in one 16-byte piece (one LDG.128)
constexpr std::uint8_t kCodeMax = 0x7E;  //!< code of +448 (0xFE: -448)
constexpr std::uint8_t kCodeNaN = 0x7F;  //!< the NaN code this library writes (0xFF is NaN too)
//! The allocation's alpha for FP8 Stage-2 weights (AllocationRule::alpha; prox.FP8_ALPHA in Python): an INT4
//! proxy GEMV costs about half an FP8 input-sparse GEMV (the rule's default 1/3 is for fp16/bf16 weights).
//! Measured on the H100 (prox_alpha --fp8=1, docs/benchmarks.md): 0.53-0.59 on Qwen3-8B, 0.46-0.55 on 14B.
constexpr double kAllocationAlpha = 0.5;
//! Smallest scale quantize_* writes: FLT_MIN (2^-126), so that every scale stays a normal float > 0.
constexpr float kMinScale = 1.17549435082228750797e-38f;

//! Where the scales of a matrix sit.
enum class ScaleLayout : int {
  kPerChannel = 0,  //!< one fp32 per output channel
  kBlock128 = 1,    //!< one fp32 per 128 x 128 block of the stored matrix
};

constexpr const char* to_string(ScaleLayout l) noexcept {
  return l == ScaleLayout::kPerChannel ? "per-channel" : (l == ScaleLayout::kBlock128 ? "block128" : "invalid");
}

/**
 * @brief How a stored matrix [rows][cols] relates to its linear map. kOutIn: nn.Linear's own layout
 * [out][in] (W_gate, W_up, W_down as checkpoints store them): per-channel scales are per row.
 * kInOut: the transpose [in][out] (prox's W_down^T [d_ff][d_model]): per-channel scales are per
 * column. Block scales are always [ceil(rows/128)][ceil(cols/128)] of the matrix as stored.
 */
enum class Orientation : int { kOutIn = 0, kInOut = 1 };

constexpr bool is_valid(ScaleLayout l) noexcept { return l == ScaleLayout::kPerChannel || l == ScaleLayout::kBlock128; }

//! Number of 128-blocks covering n elements: ceil(n / 128).
PROX_HOST_DEVICE constexpr int scale_blocks(int n) noexcept { return (n + kBlockSize - 1) / kBlockSize; }

//! Shape of a scale array: [rows][cols] row-major (a per-channel array is [channels][1]).
struct ScaleShape {
  int rows = 0;
  int cols = 0;
};

//! Shape of the scales of a stored matrix [rows][cols].
PROX_HOST_DEVICE constexpr ScaleShape scale_shape(ScaleLayout l, Orientation o, int rows, int cols) noexcept {
  if (l == ScaleLayout::kBlock128) return ScaleShape{scale_blocks(rows), scale_blocks(cols)};
  return ScaleShape{o == Orientation::kOutIn ? rows : cols, 1};
}

//! Number of fp32 scales of a stored matrix [rows][cols].
PROX_HOST_DEVICE constexpr std::size_t scale_count(ScaleLayout l, Orientation o, int rows, int cols) noexcept {
  const ScaleShape s = scale_shape(l, o, rows, cols);
  return static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.cols);
}

/**
 * @brief Index into the scale array of element [r][c] of a stored matrix with `cols` columns.
 * @code
 * // dequantized W_gate[n][k] (nn.Linear [d_ff][d_model], block scales):
 * float w = e4m3_to_float(q[n * d_model + k]) *
 *           s[prox::fp8::scale_index(ScaleLayout::kBlock128, Orientation::kOutIn, d_model, n, k)];
 * @endcode
 */
PROX_HOST_DEVICE constexpr std::size_t scale_index(ScaleLayout l, Orientation o, int cols, int r, int c) noexcept {
  if (l == ScaleLayout::kBlock128)
    return static_cast<std::size_t>(r / kBlockSize) * static_cast<std::size_t>(scale_blocks(cols)) +
           static_cast<std::size_t>(c / kBlockSize);
  return static_cast<std::size_t>(o == Orientation::kOutIn ? r : c);
}

// ---------------------------------------------------------------- shape and pointer rules

/**
 * @brief Offline rule for one matrix (quantize, dequantize, transpose, scale layouts): 1 <= rows,
 * cols <= 2^20. Any size: block layouts take the partial last block.
 */
constexpr Status check_matrix_shape(int rows, int cols) noexcept {
  if (rows < 1 || cols < 1 || rows > kMaxFfnDim || cols > kMaxFfnDim) return Status::kErrorInvalidShape;
  return Status::kSuccess;
}

/**
 * @brief Stage-2 FP8 FFN rule: check_ffn_shape (d_ff a multiple of 32, d_model of 8) and d_model a
 * multiple of 16. W_gate, W_up and W_down^T are all [d_ff][d_model] e4m3: rows of d_model bytes,
 * read in 16-byte pieces of 16 values, so every row starts 16-byte aligned when the matrix does.
 * d_model and d_ff need not be multiples of 128 (the last scale block is partial).
 */
constexpr Status check_ffn_shape(int d_model, int d_ff) noexcept {
  if (d_model % kVecElems != 0) return Status::kErrorInvalidShape;
  return ::prox::check_ffn_shape(d_model, d_ff);
}

/**
 * @brief Check a scale array's shape, as the caller holds it (a torch tensor's sizes), against the
 * layout of a stored matrix [rows][cols]. A 1-D per-channel array passes scale_cols = 1.
 * @return kErrorInvalidShape if they differ (a block array given for per-channel, a block array
 *         of a transposed or 128-rounded shape, ...), kErrorInvalidArgument for an unknown layout.
 * @code
 * // transformers' FP8Linear: weight [N][K], weight_scale_inv [ceil(N/128)][ceil(K/128)]
 * auto st = prox::fp8::check_scale_shape(ScaleLayout::kBlock128, Orientation::kOutIn, N, K,
 *                                        sinv.size(0), sinv.size(1));
 * @endcode
 */
constexpr Status check_scale_shape(ScaleLayout l, Orientation o, int rows, int cols, long long scale_rows,
                                   long long scale_cols) noexcept {
  if (!is_valid(l)) return Status::kErrorInvalidArgument;
  PROX_RETURN_IF_ERROR(check_matrix_shape(rows, cols));
  const ScaleShape s = scale_shape(l, o, rows, cols);
  return (scale_rows == s.rows && scale_cols == s.cols) ? Status::kSuccess : Status::kErrorInvalidShape;
}

/**
 * @brief What a Stage-2 kernel needs of one FP8 matrix [rows][cols] (cheap, host only, no launch):
 * pointers set, q 16-byte aligned, scales 4-byte aligned, cols a multiple of 16 (16-byte rows) and
 * check_matrix_shape.
 * @param q       device pointer to [rows][cols] e4m3 bytes
 * @param scales  device pointer to the matrix's scales (scale_count() floats)
 * @return kErrorNullPointer, kErrorInvalidShape, kErrorMisalignedPointer, in that order of checks.
 * @code
 * PROX_RETURN_IF_ERROR(prox::fp8::check_matrix(w_gate_q, w_gate_s, d_ff, d_model));
 * PROX_RETURN_IF_ERROR(prox::fp8::check_matrix(w_down_t_q, w_down_t_s, d_ff, d_model));
 * @endcode
 */
inline Status check_matrix(const void* q, const float* scales, int rows, int cols) noexcept {
  if (q == nullptr || scales == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_matrix_shape(rows, cols));
  if (cols % kVecElems != 0) return Status::kErrorInvalidShape;
  if (!is_aligned(q, 16) || !is_aligned(scales, alignof(float))) return Status::kErrorMisalignedPointer;
  return Status::kSuccess;
}

// ---------------------------------------------------------------- the e4m3 encoding (host and device)

//! The bits of a float and back (host and device).
PROX_HOST_DEVICE PROX_FORCEINLINE std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}
PROX_HOST_DEVICE PROX_FORCEINLINE float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

/**
 * @brief A valid scale is finite and > 0 (subnormals included): the test on the bits, so that
 * neither -ffast-math nor flush-to-zero can change the verdict. NaN, +-inf, +-0 and negatives fail.
 */
PROX_HOST_DEVICE PROX_FORCEINLINE bool is_valid_scale(float s) {
  const std::uint32_t u = float_bits(s);
  return u >= 1u && u < 0x7F800000u;
}

/**
 * @brief Exact value of one e4m3 code as a float (software, host and device: references, offline
 * helpers). NaN codes (0x7F, 0xFF) give a quiet NaN. The GEMV inner loops use fp8.cuh's pair
 * conversions instead.
 * @code
 * float w = prox::fp8::e4m3_to_float(q[n * K + k]) * scale;   // 0x38 -> 1.0f, 0xFE -> -448.0f
 * @endcode
 */
PROX_HOST_DEVICE PROX_FORCEINLINE float e4m3_to_float(std::uint8_t v) {
  const std::uint32_t sign = static_cast<std::uint32_t>(v & 0x80u) << 24;
  const std::uint32_t e = (v >> 3) & 0xFu;
  const std::uint32_t m = v & 0x7u;
  if ((v & 0x7Fu) == 0x7Fu) return bits_float(0x7FC00000u);
  // Subnormal m * 2^-9 (exact); a normal moves its exponent from bias 7 to bias 127.
  if (e == 0) return bits_float(sign | float_bits(static_cast<float>(m) * 0.001953125f));
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

/**
 * @brief fp16 bits of one e4m3 code (software, host and device). Exact: every e4m3 value is an
 * fp16 value (fp16 has 10 mantissa bits and normals down to 2^-14, e4m3 needs 3 bits and 2^-9).
 * NaN codes give 0x7FFF, fp16's canonical NaN, the sign dropped, as cuda_fp8.h's conversion does.
 * The reference of fp8.cuh's pair conversions, hardware and emulated.
 */
PROX_HOST_DEVICE PROX_FORCEINLINE std::uint16_t e4m3_to_half_bits(std::uint8_t v) {
  const std::uint32_t sign = static_cast<std::uint32_t>(v & 0x80u) << 8;
  const std::uint32_t e = (v >> 3) & 0xFu;
  std::uint32_t m = v & 0x7u;
  if ((v & 0x7Fu) == 0x7Fu) return static_cast<std::uint16_t>(0x7FFFu);
  if (e != 0) return static_cast<std::uint16_t>(sign | ((e + 8u) << 10) | (m << 7));  // bias 7 -> 15
  if (m == 0) return static_cast<std::uint16_t>(sign);
  // Subnormal m * 2^-9 with m = 2^p + rest (p = 0..2): fp16 normal 2^(p-9) (1 + rest / 2^p).
  const std::uint32_t p = m >= 4u ? 2u : (m >= 2u ? 1u : 0u);
  m -= 1u << p;
  return static_cast<std::uint16_t>(sign | ((p + 6u) << 10) | (m << (10u - p)));
}

/**
 * @brief Encode a float as e4m3: round to nearest, ties to even, saturating (|x| >= 448 and +-inf
 * give +-448), NaN gives 0x7F. The same results as cuda_fp8.h's __nv_cvt_float_to_fp8(x,
 * __NV_SATFINITE, __NV_E4M3) and the sm_89+ instruction cvt.rn.satfinite.e4m3x2.f32 (the tests check
 * both), written in integer arithmetic so that the host and every device architecture give the
 * same bits whatever the compiler flags.
 * @code
 * std::uint8_t q = prox::fp8::float_to_e4m3(w / scale);   // 1.0f -> 0x38, 500.0f -> 0x7E
 * @endcode
 */
PROX_HOST_DEVICE PROX_FORCEINLINE std::uint8_t float_to_e4m3(float x) {
  const std::uint32_t u = float_bits(x);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kCodeNaN;
  if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | kCodeMax);  // >= 448: [448, 464] round to 448 anyway
  if (a >= 0x3C800000u) {  // >= 2^-6: normal; keep 3 of the 23 mantissa bits
    const std::uint32_t rem = a & 0xFFFFFu;
    std::uint32_t r = (((a >> 23) - 120u) << 3) | ((a >> 20) & 0x7u);
    if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) ++r;  // a carry into the exponent is right
    return static_cast<std::uint8_t>(sign | r);
  }
  // Below 2^-6: multiples of 2^-9, i.e. rint(|x| 2^9) in [0, 8] (8 is also the code of 2^-6).
  // |x| 2^9 = m24 >> shift, m24 the 24-bit significand; |x| < 2^-10 (float subnormals too) gives 0.
  const std::uint32_t shift = 141u - (a >> 23);
  if (shift > 24u) return static_cast<std::uint8_t>(sign);
  const std::uint32_t m24 = (a & 0x7FFFFFu) | 0x800000u;
  std::uint32_t r = m24 >> shift;
  const std::uint32_t rem = m24 & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<std::uint8_t>(sign | r);
}

// ---------------------------------------------------------------- the quantization rule (shared)

//! IEEE division and product, round to nearest (the device forms ignore --use_fast_math).
PROX_HOST_DEVICE PROX_FORCEINLINE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PROX_HOST_DEVICE PROX_FORCEINLINE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

/**
 * @brief Scale of a channel or block from its largest |w|: max(amax / 448, kMinScale), one IEEE
 * division, as vLLM and llm-compressor make per-channel and per-block scales (amax / 448). The
 * floor keeps an all-zero channel or block (and amax below 448 FLT_MIN) at a valid scale > 0;
 * transformers' Fp8Quantize gives an all-zero block scale 1 instead, which dequantizes the same.
 */
PROX_HOST_DEVICE PROX_FORCEINLINE float scale_from_amax(float amax) {
  const float s = div_rn(amax, kMax);
  return s < kMinScale ? kMinScale : s;
}

/**
 * @brief Code of weight w under `scale`: float_to_e4m3(w / scale), one IEEE division then round to
 * nearest even, saturating at +-448. vLLM's scaled_fp8_conversion divides the same way;
 * transformers' Fp8Quantize multiplies by 448 / amax, which can differ in the last bit of a code.
 */
PROX_HOST_DEVICE PROX_FORCEINLINE std::uint8_t quantize_value(float w, float scale) {
  return float_to_e4m3(div_rn(w, scale));
}

//! Dequantized weight as a float: e4m3_to_float(q) * scale, rounded once (the exact product in float64).
PROX_HOST_DEVICE PROX_FORCEINLINE float dequant_value(std::uint8_t q, float scale) {
  return mul_rn(e4m3_to_float(q), scale);
}

//! Element of a source matrix as a float: fp32, fp16 or bf16.
PROX_HOST_DEVICE PROX_FORCEINLINE float source_float(float v) { return v; }
template <class T>
PROX_HOST_DEVICE PROX_FORCEINLINE float source_float(T v) {
  return to_float(v);
}

/**
 * @brief Element source of the INT4 packers (int4::detail::pack_host_from / pack_device_from): the
 * dequantized weight W[n][k] = dequant_value(q[n][k], its scale) of an FP8 nn.Linear matrix
 * [d_ff][d_model] (Orientation::kOutIn), so INT4 proxies pack from the weights Stage 2 computes with.
 */
struct DequantSource {
  const std::uint8_t* q = nullptr;
  const float* scales = nullptr;
  ScaleLayout layout = ScaleLayout::kPerChannel;
  int d_model = 0;
  PROX_HOST_DEVICE PROX_FORCEINLINE float operator()(int n, int k) const {
    const std::size_t i = static_cast<std::size_t>(n) * static_cast<std::size_t>(d_model) + static_cast<std::size_t>(k);
    return dequant_value(q[i], scales[scale_index(layout, Orientation::kOutIn, d_model, n, k)]);
  }
};

// ---------------------------------------------------------------- host helpers (tests, tools)

/**
 * @brief Check that every scale is finite and > 0 (is_valid_scale), on the host.
 * @param scales     host pointer to `count` floats (any layout)
 * @param first_bad  optional out: index of the first invalid scale (left alone on success)
 * @return kErrorInvalidScale if one is NaN, +-inf, +-0 or negative; kErrorNullPointer; kErrorInvalidShape for count 0.
 * @code
 * std::size_t bad = 0;
 * if (prox::fp8::check_scales_host(s.data(), s.size(), &bad) != prox::Status::kSuccess)
 *   std::fprintf(stderr, "weight_scale_inv[%zu] = %g\n", bad, s[bad]);
 * @endcode
 */
inline Status check_scales_host(const float* scales, std::size_t count, std::size_t* first_bad = nullptr) {
  if (scales == nullptr) return Status::kErrorNullPointer;
  if (count == 0) return Status::kErrorInvalidShape;
  for (std::size_t i = 0; i < count; ++i) {
    if (!is_valid_scale(scales[i])) {
      if (first_bad != nullptr) *first_bad = i;
      return Status::kErrorInvalidScale;
    }
  }
  return Status::kSuccess;
}

/**
 * @brief Quantize an nn.Linear weight matrix to e4m3 with per-channel or 128 x 128 block scales, on
 * the host: per channel (row) or block, scale = scale_from_amax(max |w|), then q = quantize_value(w, scale).
 * Bit-identical to fp8::quantize_device.
 * @tparam T      float, `__half` or `__nv_bfloat16`
 * @param w       [rows][cols] row-major ([out][in], Orientation::kOutIn)
 * @param q       out: [rows][cols] e4m3 codes
 * @param scales  out: scale_count(layout, kOutIn, rows, cols) floats: [rows] or [ceil(rows/128)][ceil(cols/128)]
 * @return kErrorNullPointer, kErrorInvalidShape (check_matrix_shape), kErrorInvalidArgument (layout),
 *         kErrorNonFiniteWeight if a weight is NaN or infinite (outputs unspecified).
 * @code
 * std::vector<std::uint8_t> q(size_t(N) * K);
 * std::vector<float> s(prox::fp8::scale_count(ScaleLayout::kBlock128, Orientation::kOutIn, N, K));
 * PROX_CHECK(prox::fp8::quantize_host(w.data(), N, K, ScaleLayout::kBlock128, q.data(), s.data()));
 * @endcode
 */
template <class T>
Status quantize_host(const T* w, int rows, int cols, ScaleLayout layout, std::uint8_t* q, float* scales) {
  if (w == nullptr || q == nullptr || scales == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_matrix_shape(rows, cols));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  const std::size_t C = static_cast<std::size_t>(cols);
  const std::size_t count = scale_count(layout, Orientation::kOutIn, rows, cols);
  for (std::size_t i = 0; i < count; ++i) scales[i] = 0.0f;  // amax first, then the scale
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const float v = source_float(w[static_cast<std::size_t>(r) * C + static_cast<std::size_t>(c)]);
      if (!std::isfinite(v)) return Status::kErrorNonFiniteWeight;
      float& amax = scales[scale_index(layout, Orientation::kOutIn, cols, r, c)];
      amax = std::fabs(v) > amax ? std::fabs(v) : amax;
    }
  }
  for (std::size_t i = 0; i < count; ++i) scales[i] = scale_from_amax(scales[i]);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const std::size_t i = static_cast<std::size_t>(r) * C + static_cast<std::size_t>(c);
      q[i] = quantize_value(source_float(w[i]), scales[scale_index(layout, Orientation::kOutIn, cols, r, c)]);
    }
  }
  return Status::kSuccess;
}

/**
 * @brief Dequantize a stored FP8 matrix on the host. With Out = double the result is exact (the
 * product of a 4-bit and a 24-bit significand): the float64 reference of the tests. With Out =
 * float it is dequant_value(), what DequantSource feeds the INT4 packers.
 * @param q       [rows][cols] e4m3 codes
 * @param scales  the matrix's scales in `layout` and orientation `o`
 * @param out     [rows][cols] row-major
 * @code
 * std::vector<double> ref(size_t(d_ff) * d_model);
 * PROX_CHECK(prox::fp8::dequantize_host(q.data(), s.data(), d_ff, d_model, ScaleLayout::kPerChannel,
 *                                       Orientation::kOutIn, ref.data()));
 * @endcode
 */
template <class Out>
Status dequantize_host(const std::uint8_t* q, const float* scales, int rows, int cols, ScaleLayout layout,
                       Orientation o, Out* out) {
  static_assert(std::is_same<Out, double>::value || std::is_same<Out, float>::value, "float or double output");
  if (q == nullptr || scales == nullptr || out == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_matrix_shape(rows, cols));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      const std::size_t i = static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) + static_cast<std::size_t>(c);
      const float s = scales[scale_index(layout, o, cols, r, c)];
      if constexpr (std::is_same<Out, double>::value) {
        out[i] = static_cast<double>(e4m3_to_float(q[i])) * static_cast<double>(s);
      } else {
        out[i] = dequant_value(q[i], s);
      }
    }
  }
  return Status::kSuccess;
}

/**
 * @brief INT4 proxy (int4 layout v1) of an FP8 W_gate or W_up, on the host: the int4 packer's own
 * loops and rounding (int4::detail::pack_host_from) over the dequantized weights dequant_value(q, s),
 * i.e. bit-identical to int4-packing those fp32 weights. Bit-identical to fp8::pack_int4_device.
 * @param q            [d_ff][d_model] e4m3 (nn.Linear layout)
 * @param scales       its scales in `layout` (Orientation::kOutIn)
 * @param packed       out: [d_model][d_ff/8] uint32 (int4::packed_words)
 * @param int4_scales  out: [d_ff] float32 INT4 scales
 * @return kErrorNullPointer, kErrorInvalidShape (int4::check_pack_shape), kErrorInvalidArgument
 *         (layout), kErrorInvalidScale (check_scales_host), kErrorNonFiniteWeight (a NaN code, or
 *         q * scale overflowing).
 * @code
 * std::vector<uint32_t> p(prox::int4::packed_words(d_model, d_ff));
 * std::vector<float> ps(d_ff);
 * PROX_CHECK(prox::fp8::pack_int4_host(gate_q.data(), gate_s.data(), ScaleLayout::kBlock128, d_model, d_ff,
 *                                      p.data(), ps.data()));
 * @endcode
 */
inline Status pack_int4_host(const std::uint8_t* q, const float* scales, ScaleLayout layout, int d_model, int d_ff,
                             std::uint32_t* packed, float* int4_scales) {
  if (q == nullptr || scales == nullptr || packed == nullptr || int4_scales == nullptr)
    return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(int4::check_pack_shape(d_model, d_ff));
  if (!is_valid(layout)) return Status::kErrorInvalidArgument;
  PROX_RETURN_IF_ERROR(check_scales_host(scales, scale_count(layout, Orientation::kOutIn, d_ff, d_model)));
  return int4::detail::pack_host_from(DequantSource{q, scales, layout, d_model}, d_model, d_ff, packed, int4_scales);
}

}  // namespace fp8

PROX_NAMESPACE_END
