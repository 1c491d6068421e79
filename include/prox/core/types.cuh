// SPDX-License-Identifier: Apache-2.0
//! @file types.cuh  Element types (fp16, bf16): names, enum tags and float conversions, host and device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "config.hpp"

PROX_NAMESPACE_BEGIN

//! Runtime tag of an activation / weight element type (tuning-cache keys, messages).
enum class DType : int { kF16 = 0, kBF16 = 1 };

constexpr const char* to_string(DType t) noexcept { return t == DType::kF16 ? "f16" : "bf16"; }

/**
 * @brief Traits of the 16-bit element types prox accepts: `__half` and `__nv_bfloat16`.
 * @tparam T the element type. Other types do not compile (no primary definition).
 */
template <class T>
struct DTypeTraits;

#if defined(__CUDACC__)
//! The 32 bits of a pair of 16-bit elements (bit cast, no conversion); as_pair (vec.cuh) is the inverse.
template <class P>
PROX_DEVICE PROX_FORCEINLINE std::uint32_t pair_bits(P p) {
  std::uint32_t u;
  static_assert(sizeof(p) == 4, "pair must be 32 bits");
  __builtin_memcpy(&u, &p, 4);
  return u;
}
#endif

template <>
struct DTypeTraits<__half> {
  static constexpr DType kDType = DType::kF16;
  static constexpr const char* kName = "f16";
  using Pair = __half2;
  PROX_HOST_DEVICE static PROX_FORCEINLINE float to_float(__half v) { return __half2float(v); }
  PROX_HOST_DEVICE static PROX_FORCEINLINE __half from_float(float v) { return __float2half_rn(v); }
#if defined(__CUDACC__)
  PROX_DEVICE static PROX_FORCEINLINE float2 to_float2(__half2 v) { return __half22float2(v); }
#endif
};

template <>
struct DTypeTraits<__nv_bfloat16> {
  static constexpr DType kDType = DType::kBF16;
  static constexpr const char* kName = "bf16";
  using Pair = __nv_bfloat162;
  PROX_HOST_DEVICE static PROX_FORCEINLINE float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  PROX_HOST_DEVICE static PROX_FORCEINLINE __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
#if defined(__CUDACC__)
  //! bf16 -> fp32 is exact: an element's 16 bits are the high half of its float. Two integer ops a
  //! pair; __bfloat1622float2 compiled to three on sm_90 (a PRMT moves the high element down, then
  //! both are shifted up). Same bits, NaN payloads included.
  PROX_DEVICE static PROX_FORCEINLINE float2 to_float2(__nv_bfloat162 v) {
    const std::uint32_t u = pair_bits(v);
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  }
#endif
};

//! Convenience: element -> float.
template <class T>
PROX_HOST_DEVICE PROX_FORCEINLINE float to_float(T v) {
  return DTypeTraits<T>::to_float(v);
}

//! Convenience: float -> element, round to nearest even.
template <class T>
PROX_HOST_DEVICE PROX_FORCEINLINE T from_float(float v) {
  return DTypeTraits<T>::from_float(v);
}

PROX_NAMESPACE_END
