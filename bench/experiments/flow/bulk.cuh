// SPDX-License-Identifier: Apache-2.0
//! @file bulk.cuh  (experiment, issue 46; not part of the library) Hopper's bulk asynchronous copies (L0): shared-memory mbarriers, whole-row copies from
//! global to shared memory that complete on an mbarrier (cp.async.bulk, the copy engine TMA drives, no
//! tensor map), L2 prefetches of a byte range, and the L2 evict-first policy for data read once.
//!
//! Why: a GEMV row of 8-10 KB moves with one instruction of one thread and no registers, so a block keeps
//! 100+ KB in flight where register loads hold 16-32 KB (docs/design.md, "The one-kernel FFN").
//!
//! sm_90+ only. Compiled for an older architecture every function is a no-op (a wait returns at once):
//! the kernels that use them are planned only on sm_90+ devices (their ops refuse others before a launch),
//! and the fallback exists so that fat binaries with sm_80 code still build.
#pragma once

#include <cstdint>

#include <prox/core/config.hpp>

namespace prox_flow {

#if defined(__CUDACC__)
namespace bulk {

//! The shared-memory address (32-bit, the .shared::cta window) of a generic pointer into shared memory.
PROX_DEVICE PROX_FORCEINLINE unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

//! Initialize an mbarrier expecting `arrivals` arrivals per phase (one thread; then a block barrier).
PROX_DEVICE PROX_FORCEINLINE void mbar_init(std::uint64_t* bar, unsigned arrivals) {
#if PROX_ARCH_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
#else
  (void)bar;
  (void)arrivals;
#endif
}

//! Make the mbarrier initializations of this thread visible to the copy engine (after mbar_init).
PROX_DEVICE PROX_FORCEINLINE void fence_mbar_init() {
#if PROX_ARCH_SM90
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

//! Arrive on `bar` and add `bytes` to the transaction count its current phase waits for (the producer,
//! before it issues the copies that complete those bytes).
PROX_DEVICE PROX_FORCEINLINE void mbar_arrive_expect_tx(std::uint64_t* bar, unsigned bytes) {
#if PROX_ARCH_SM90
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
#else
  (void)bar;
  (void)bytes;
#endif
}

//! Arrive on `bar` (one of its expected arrivals), with no transaction bytes.
PROX_DEVICE PROX_FORCEINLINE void mbar_arrive(std::uint64_t* bar) {
#if PROX_ARCH_SM90
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(smem_addr(bar)) : "memory");
#else
  (void)bar;
#endif
}

//! Whether the phase of parity `parity` of `bar` has completed (no wait).
PROX_DEVICE PROX_FORCEINLINE bool mbar_test(std::uint64_t* bar, unsigned parity) {
#if PROX_ARCH_SM90
  unsigned done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0u;
#else
  (void)bar;
  (void)parity;
  return true;
#endif
}

//! Wait until the phase of parity `parity` of `bar` has completed (its bytes are in shared memory).
PROX_DEVICE PROX_FORCEINLINE void mbar_wait(std::uint64_t* bar, unsigned parity) {
#if PROX_ARCH_SM90
  unsigned done = 0;
  while (done == 0u) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
#else
  (void)bar;
  (void)parity;
#endif
}

//! An L2 cache policy for data read once (weights streamed by a GEMV): evict first, so that lines other
//! code wants to keep (a prefetched range) survive the stream.
PROX_DEVICE PROX_FORCEINLINE std::uint64_t evict_first_policy() {
  std::uint64_t p = 0;
#if PROX_ARCH_SM90
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
#endif
  return p;
}

/**
 * @brief Copy `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned); the copy
 * completes `bytes` transactions on `bar` (which the issuing thread announced with mbar_arrive_expect_tx).
 * Read under the L2 policy `policy` (evict_first_policy()).
 */
PROX_DEVICE PROX_FORCEINLINE void copy_g2s(void* dst, const void* src, unsigned bytes, std::uint64_t* bar,
                                           std::uint64_t policy) {
#if PROX_ARCH_SM90
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
#else
  (void)dst;
  (void)src;
  (void)bytes;
  (void)bar;
  (void)policy;
#endif
}

//! Bring `bytes` (a multiple of 16) of global memory at `src` (16-byte aligned) into L2, asynchronously
//! (nothing waits for it; no register, no shared memory).
PROX_DEVICE PROX_FORCEINLINE void prefetch_l2(const void* src, unsigned bytes) {
#if PROX_ARCH_SM90
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#else
  (void)src;
  (void)bytes;
#endif
}

// Relaxed and acquire/release accesses at GPU scope: the words blocks of one grid hand each other.
PROX_DEVICE PROX_FORCEINLINE unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
PROX_DEVICE PROX_FORCEINLINE unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
PROX_DEVICE PROX_FORCEINLINE void st_relaxed(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
//! atom.add at GPU scope with release and acquire semantics (an arrival that publishes the block's
//! writes, ordered after a block barrier, and sees the others'); returns the old value.
PROX_DEVICE PROX_FORCEINLINE unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
//! Four float additions into global memory (sm_90: one vector reduction), relaxed, GPU scope; p 16-byte aligned.
PROX_DEVICE PROX_FORCEINLINE void red_add_v4(float* p, float a, float b, float c, float d) {
#if PROX_ARCH_SM90
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

}  // namespace bulk
#endif  // __CUDACC__

}  // namespace prox_flow
