// SPDX-License-Identifier: Apache-2.0
//! @file vec.cuh  16-byte vector loads and stores with the cache hints the GEMVs rely on.
#pragma once

#include <cstdint>

#include "config.hpp"
#include "types.cuh"

PROX_NAMESPACE_BEGIN

//! Bytes in one vector access. Every weight stream is read in 16-byte pieces (LDG.128).
constexpr int kVecBytes = 16;

#if defined(__CUDACC__)

/**
 * @brief 16-byte load of data read exactly once (weights): non-coherent path, no L1 allocation,
 * so the small re-used vectors (x, s, scales) keep the L1. Pointer must be 16-byte aligned.
 */
PROX_DEVICE PROX_FORCEINLINE uint4 ld_stream_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

//! 16-byte read-only load through L1 (small vectors that many warps re-read).
PROX_DEVICE PROX_FORCEINLINE uint4 ld_cached_16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

//! 16-byte store.
PROX_DEVICE PROX_FORCEINLINE void st_16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

//! Reinterpret 32 bits as a pair of T (bit cast, no conversion).
template <class T>
PROX_DEVICE PROX_FORCEINLINE typename DTypeTraits<T>::Pair as_pair(uint32_t u) {
  typename DTypeTraits<T>::Pair p;
  static_assert(sizeof(p) == 4, "pair must be 32 bits");
  __builtin_memcpy(&p, &u, 4);
  return p;
}

template <class P>
PROX_DEVICE PROX_FORCEINLINE uint32_t pair_bits(P p) {
  uint32_t u;
  static_assert(sizeof(p) == 4, "pair must be 32 bits");
  __builtin_memcpy(&u, &p, 4);
  return u;
}

//! Unpack 16 bytes holding 8 elements of T into 8 floats (element order preserved).
template <class T>
PROX_DEVICE PROX_FORCEINLINE void unpack8(uint4 v, float (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = DTypeTraits<T>::to_float2(as_pair<T>(w[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

//! Pack 8 floats into 16 bytes of T (round to nearest even).
template <class T>
PROX_DEVICE PROX_FORCEINLINE uint4 pack8(const float (&in)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    typename DTypeTraits<T>::Pair p;
    p.x = from_float<T>(in[2 * i]);
    p.y = from_float<T>(in[2 * i + 1]);
    w[i] = pair_bits(p);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

#endif  // __CUDACC__

PROX_NAMESPACE_END
