// SPDX-License-Identifier: Apache-2.0
//! @file vec.cuh  16-byte vector loads and stores with the cache hints the GEMVs rely on.
#pragma once

#include <cstdint>
#include <type_traits>

#include "config.hpp"
#include "types.cuh"

PROX_NAMESPACE_BEGIN

//! Bytes in one vector access. Every weight stream is read in 16-byte pieces (LDG.128).
constexpr int kVecBytes = 16;

#if defined(__CUDACC__)

/**
 * @brief 16-byte load of data read exactly once (weights): non-coherent path, no L1 allocation,
 * so the small re-used vectors (x, s, scales) keep the L1. Pointer must be 16-byte aligned.
 *
 * Predicated form: when `pred` is false nothing is read (the address may be anything) and the
 * result is `fill` in every word. It is a single predicated instruction, not a branch, so the
 * compiler keeps a whole unrolled batch of loads in flight ahead of the arithmetic (a branch per
 * load made ptxas interleave loads with FMAs and serialize the memory latency).
 */
PROX_DEVICE PROX_FORCEINLINE uint4 ld_stream_16(const void* p, bool pred = true, uint32_t fill = 0u) {
  uint4 v = make_uint4(fill, fill, fill, fill);
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
      "@q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

//! 16-byte read-only load through L1 (small vectors that many warps re-read); predicated like
//! ld_stream_16.
PROX_DEVICE PROX_FORCEINLINE uint4 ld_cached_16(const void* p, bool pred = true, uint32_t fill = 0u) {
  uint4 v = make_uint4(fill, fill, fill, fill);
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
      "@q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

/**
 * @brief Asynchronous copy of kBytes (8 or 16) from global to shared memory (cp.async, sm_80+).
 * When `pred` is false no byte is read (src-size 0) and the destination is zero-filled. 16-byte
 * copies bypass L1 (.cg); 8-byte ones must go through it (.ca).
 *
 * prox runs on sm_80 and newer (SparseFfn::plan refuses older devices). So that a fat binary that
 * also targets an older architecture still builds, device code compiled for one (__CUDA_ARCH__ <
 * 800) copies synchronously instead (same bytes, same zero fill); commit and wait do nothing there.
 */
template <int kBytes>
PROX_DEVICE PROX_FORCEINLINE void cp_async(void* smem, const void* gmem, bool pred) {
  static_assert(kBytes == 8 || kBytes == 16, "cp.async copies 8 or 16 bytes here");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
  using Word = std::conditional_t<kBytes == 16, uint4, uint2>;
  *static_cast<Word*>(smem) = pred ? *static_cast<const Word*>(gmem) : Word{};
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = pred ? kBytes : 0;
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_size) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(gmem), "r"(src_size) : "memory");
  }
#endif
}
//! Close the current group of cp.async copies.
PROX_DEVICE PROX_FORCEINLINE void cp_async_commit() {
#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 800)
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
//! Wait until at most kPending of this thread's cp.async groups are still in flight.
template <int kPending>
PROX_DEVICE PROX_FORCEINLINE void cp_async_wait() {
#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 800)
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

/**
 * @brief A piece of kBytes (8 or 16) bytes of a weight row, as 32-bit words. The GEMVs read weights
 * in pieces: 16 bytes is the widest load, 8 bytes halves the registers a thread needs per row.
 */
template <int kBytes>
struct Piece {
  static_assert(kBytes == 8 || kBytes == 16, "pieces are 8 or 16 bytes");
  static constexpr int kWords = kBytes / 4;
  uint32_t w[kWords];
};

//! Predicated streaming load of one piece (see ld_stream_16).
template <int kBytes>
PROX_DEVICE PROX_FORCEINLINE Piece<kBytes> ld_stream_piece(const void* p, bool pred, uint32_t fill = 0u) {
  Piece<kBytes> v;
  if constexpr (kBytes == 16) {
    const uint4 u = ld_stream_16(p, pred, fill);
    v.w[0] = u.x;
    v.w[1] = u.y;
    v.w[2] = u.z;
    v.w[3] = u.w;
  } else {
    v.w[0] = v.w[1] = fill;
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %3, 0;\n\t"
                 "@q ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n\t}"
                 : "+r"(v.w[0]), "+r"(v.w[1])
                 : "l"(p), "r"(static_cast<int>(pred)));
  }
  return v;
}


//! Reinterpret 32 bits as a pair of T (bit cast, no conversion).
template <class T>
PROX_DEVICE PROX_FORCEINLINE typename DTypeTraits<T>::Pair as_pair(uint32_t u) {
  typename DTypeTraits<T>::Pair p;
  static_assert(sizeof(p) == 4, "pair must be 32 bits");
  __builtin_memcpy(&p, &u, 4);
  return p;
}

//! Unpack kW 32-bit words, each a pair of T, into 2 kW floats (element order preserved).
template <class T, int kW>
PROX_DEVICE PROX_FORCEINLINE void unpack_words(const uint32_t (&w)[kW], float (&out)[2 * kW]) {
#pragma unroll
  for (int i = 0; i < kW; ++i) {
    const float2 f = DTypeTraits<T>::to_float2(as_pair<T>(w[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

//! Unpack 16 bytes holding 8 elements of T into 8 floats (element order preserved).
template <class T>
PROX_DEVICE PROX_FORCEINLINE void unpack8(uint4 v, float (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  unpack_words<T>(w, out);
}

/**
 * @brief Load kN (2, 4 or 8) consecutive elements of T as floats: one vector load of kN * sizeof(T)
 * bytes when `vec` (p aligned to that), else kN scalar loads. The same values either way.
 */
template <int kN, class T>
PROX_DEVICE PROX_FORCEINLINE void load_run(const T* p, bool vec, float (&out)[kN]) {
  static_assert(kN == 2 || kN == 4 || kN == 8, "runs of 2, 4 or 8");
  static_assert(sizeof(T) == 2, "16-bit elements");
  if (vec) {
    if constexpr (kN == 8) {
      unpack8<T>(*reinterpret_cast<const uint4*>(p), out);
    } else if constexpr (kN == 4) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      const uint32_t w[2] = {u.x, u.y};
      unpack_words<T>(w, out);
    } else {
      const uint32_t w[1] = {*reinterpret_cast<const uint32_t*>(p)};
      unpack_words<T>(w, out);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = to_float(p[i]);
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
