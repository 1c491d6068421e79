// SPDX-License-Identifier: Apache-2.0
//! @file mma.cuh  L1 building block of the batched kernels: one m16n8k16 tensor-core multiply-add (fp16 or
//! bf16 in, fp32 accumulate), for the batched Stage 1 (INT4 decoded to fp16) and the batched GLU and down
//! GEMVs at capacity 8 (native fp16/bf16 weights).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../core/config.hpp"
#include "../core/types.cuh"

PROX_NAMESPACE_BEGIN
namespace detail {

#if defined(__CUDACC__)
/**
 * @brief d += A B for one m16n8k16 tensor-core tile (sm_80+): A 16 x 16 of T = fp16 or bf16 (row-major
 * fragment, two values per register, lower k in the low half: a0 rows g, k 2t..2t+1; a1 rows g+8; a2 rows
 * g, k 2t+8..2t+9; a3 rows g+8), B 16 x 8 of T (b0: k 2t..2t+1, column g; b1: k 2t+8..2t+9), fp32
 * accumulators d (rows g and g+8, columns 2t and 2t+1), where g is lane / 4 and t is lane % 4 (PTX ISA,
 * "Matrix Fragments for mma.m16n8k16").
 */
template <class T>
PROX_DEVICE PROX_FORCEINLINE void mma_16816_bits(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                                 std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16");
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
  // sm_75 (a fat binary's older target; plan() refuses the device) has no m16n8k16: for fp16, two m16n8k8
  // over k 0..7 (a0, a1, b0) and k 8..15 (a2, a3, b1) give the same sums; it has no bf16 mma at all.
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
    asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a2), "r"(a3), "r"(b1));
  } else {
    __trap();
  }
#else
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

//! mma_16816_bits for fp16 fragments given as __half2.
PROX_DEVICE PROX_FORCEINLINE void mma_16816(float (&d)[4], const __half2 (&a)[4], uint2 b) {
  mma_16816_bits<__half>(d, pair_bits(a[0]), pair_bits(a[1]), pair_bits(a[2]), pair_bits(a[3]), b.x, b.y);
}

#endif  // __CUDACC__

}  // namespace detail
PROX_NAMESPACE_END
