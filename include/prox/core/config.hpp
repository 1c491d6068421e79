// SPDX-License-Identifier: Apache-2.0
//! @file config.hpp  Compiler-portability macros shared by every prox header (host and device).
#pragma once

#include "../version.hpp"

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define PROX_HOST_DEVICE __host__ __device__
#define PROX_DEVICE __device__
#define PROX_FORCEINLINE __forceinline__
#else
#define PROX_HOST_DEVICE
#define PROX_DEVICE
#define PROX_FORCEINLINE inline
#endif

//! Kernels get hidden visibility so that two shared objects that both instantiate a prox kernel
//! do not resolve each other's copy (CUB does the same with _CCCL_KERNEL_ATTRIBUTES). The namespace
//! (version.hpp) hides the host side too, but this stays explicit: it holds where the namespace's
//! attribute is switched off (PROX_DISABLE_HIDDEN_VISIBILITY). The namespace carries no architecture
//! suffix (CUB's SM_800_900): host-only TUs, which see no __CUDA_ARCH_LIST__, must name the same
//! types. So, within one shared object or executable, compile every TU that instantiates a prox
//! kernel with the same CUDA architecture list; across shared objects, hidden visibility keeps lists apart.
#if defined(__GNUC__) && !defined(_WIN32)
#define PROX_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#define PROX_KERNEL __global__
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define PROX_ARCH_SM90 1
#else
#define PROX_ARCH_SM90 0
#endif
