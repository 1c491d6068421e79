// SPDX-License-Identifier: Apache-2.0
//! @file int4_format.hpp  The INT4 proxy-weight format (layout v1): constants, the shared
//! quantization arithmetic, and the host packer. The device packer and the register dequantizer
//! live in int4.cuh; both packers call the same quantize_* functions and are bit-identical.
//!
//! Layout (docs/int4-format.md has the diagram):
//!   source   W [d_ff][d_model] row-major (nn.Linear: out x in), fp16 or bf16
//!   scales   float32 [d_ff]: scale[n] = max_k |W[n][k]| / 7   (0 for an all-zero row)
//!   packed   uint32  [d_model][d_ff / 8], input-major: row k holds all d_ff output channels of
//!            input coordinate k, so a dropped coordinate skips one contiguous row of d_ff/2 bytes.
//!   word     word w of row k holds channels 8w..8w+7; channel 8w+c sits in nibble
//!            p(c) = (c >> 1) + 4 (c & 1), i.e. nibbles 0..7 hold channels [0,2,4,6,1,3,5,7]
//!            (even channels in the low 16 bits, odd in the high 16 bits), so two lop3 + one
//!            shift turn a word into four fp16 pairs (c0,c1), (c2,c3), (c4,c5), (c6,c7).
//!   nibble   stored unsigned as q + 8, q = clamp(rint(w / scale), -7, 7) in [-7, 7]; 0 never
//!            occurs in a valid pack (it would decode to -8).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/shape.hpp"
#include "core/status.hpp"
#include "core/types.cuh"

PROX_NAMESPACE_BEGIN

namespace int4 {

//! Layout tag written next to packed weights by tools; bump with any change below.
constexpr const char* kLayoutTag = "prox-int4-kmajor-i8-v1";
constexpr int kLayoutVersion = 1;
constexpr int kChannelsPerWord = 8;
constexpr int kQMax = 7;   //!< symmetric range [-7, 7]
constexpr int kBias = 8;   //!< stored nibble = q + 8

//! Nibble position of channel c (0..7) inside its word.
PROX_HOST_DEVICE constexpr int nibble_of_channel(int c) noexcept { return (c >> 1) + 4 * (c & 1); }

//! Number of uint32 words of a packed [d_model][d_ff/8] matrix.
constexpr std::size_t packed_words(int d_model, int d_ff) noexcept {
  return static_cast<std::size_t>(d_model) * static_cast<std::size_t>(d_ff / kChannelsPerWord);
}

//! Per-channel scale from the channel's max |w|: amax / 7, rounded once (IEEE division).
PROX_HOST_DEVICE PROX_FORCEINLINE float scale_from_amax(float amax) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(amax, static_cast<float>(kQMax));
#else
  return amax / static_cast<float>(kQMax);
#endif
}

//! Stored nibble (q + 8, in [1, 15]) of weight w under `scale`; scale 0 (all-zero row) -> 8.
PROX_HOST_DEVICE PROX_FORCEINLINE std::uint32_t quantize_nibble(float w, float scale) {
  if (scale == 0.0f) return static_cast<std::uint32_t>(kBias);
#if defined(__CUDA_ARCH__)
  float q = rintf(__fdiv_rn(w, scale));
#else
  float q = std::nearbyint(w / scale);  // default rounding mode: nearest even, as rintf on device
#endif
  q = q < -static_cast<float>(kQMax) ? -static_cast<float>(kQMax) : q;
  q = q > static_cast<float>(kQMax) ? static_cast<float>(kQMax) : q;
  return static_cast<std::uint32_t>(static_cast<int>(q) + kBias);
}

//! Signed value q in [-8, 7] of channel n at input row k of a packed matrix (host-side decode).
inline int unpack_host(const std::uint32_t* packed, int d_ff, int k, int n) noexcept {
  const std::uint32_t word = packed[static_cast<std::size_t>(k) * (d_ff / kChannelsPerWord) + n / kChannelsPerWord];
  const int nib = nibble_of_channel(n % kChannelsPerWord);
  return static_cast<int>((word >> (4 * nib)) & 0xFu) - kBias;
}

/**
 * @brief Check a proxy-pack shape: d_model >= 1, d_ff >= 8 and a multiple of 32 (the Stage-1 kernel
 * reads 16-byte pieces of 32 channels), both below 2^20.
 */
constexpr Status check_pack_shape(int d_model, int d_ff) noexcept { return check_proxy_shape(d_model, d_ff); }

/**
 * @brief Element source of the packers: weight W[n][k] of an nn.Linear matrix [d_ff][d_model] of T
 * (row-major), as a float. Both packers read their weights through a source, so that a packer of
 * weights held in another format (fp8.cuh: dequantized FP8) runs the same loops and arithmetic.
 */
template <class T>
struct RowMajorSource {
  const T* w = nullptr;
  int d_model = 0;
  PROX_HOST_DEVICE PROX_FORCEINLINE float operator()(int n, int k) const {
    return to_float(w[static_cast<std::size_t>(n) * static_cast<std::size_t>(d_model) + static_cast<std::size_t>(k)]);
  }
};

namespace detail {

/**
 * @brief pack_host over any element source: `src(n, k)` returns W[n][k] as a float (n < d_ff,
 * k < d_model). Callers check pointers and the shape first.
 */
template <class Src>
Status pack_host_from(const Src& src, int d_model, int d_ff, std::uint32_t* packed, float* scales) {
  for (int n = 0; n < d_ff; ++n) {
    float amax = 0.0f;
    for (int k = 0; k < d_model; ++k) {
      const float v = src(n, k);
      if (!std::isfinite(v)) return Status::kErrorNonFiniteWeight;
      amax = std::fabs(v) > amax ? std::fabs(v) : amax;
    }
    scales[n] = scale_from_amax(amax);
  }
  const int words_per_row = d_ff / kChannelsPerWord;
  for (int k = 0; k < d_model; ++k) {
    for (int wi = 0; wi < words_per_row; ++wi) {
      std::uint32_t word = 0;
      for (int c = 0; c < kChannelsPerWord; ++c) {
        const int n = wi * kChannelsPerWord + c;
        word |= quantize_nibble(src(n, k), scales[n]) << (4 * nibble_of_channel(c));
      }
      packed[static_cast<std::size_t>(k) * static_cast<std::size_t>(words_per_row) + static_cast<std::size_t>(wi)] = word;
    }
  }
  return Status::kSuccess;
}

}  // namespace detail

/**
 * @brief Quantize and pack one fp16/bf16 weight matrix on the host.
 * @tparam T      `__half` or `__nv_bfloat16`
 * @param w       [d_ff][d_model] row-major (nn.Linear layout of W_gate / W_up)
 * @param packed  out: [d_model][d_ff/8] uint32 (packed_words() words)
 * @param scales  out: [d_ff] float32
 * @return kErrorNonFiniteWeight (outputs unspecified) if any weight is NaN or infinite.
 *
 * @code
 * std::vector<uint32_t> q(prox::int4::packed_words(K, N));
 * std::vector<float> sc(N);
 * auto st = prox::int4::pack_host(w_gate.data(), K, N, q.data(), sc.data());
 * @endcode
 */
template <class T>
Status pack_host(const T* w, int d_model, int d_ff, std::uint32_t* packed, float* scales) {
  if (w == nullptr || packed == nullptr || scales == nullptr) return Status::kErrorNullPointer;
  PROX_RETURN_IF_ERROR(check_pack_shape(d_model, d_ff));
  return detail::pack_host_from(RowMajorSource<T>{w, d_model}, d_model, d_ff, packed, scales);
}

}  // namespace int4

PROX_NAMESPACE_END
