// SPDX-License-Identifier: Apache-2.0
//! @file launch.cuh  The one place prox launches kernels: cudaLaunchKernelEx, optional PDL attribute,
//! launch errors mapped to Status (without clearing unrelated sticky errors).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <utility>
#if defined(PROX_DEBUG)
#include <cstdio>
#endif

#include "config.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

//! Options every L3 launcher accepts.
struct LaunchOptions {
  //! Launch with programmatic stream serialization (PDL, sm_90+): the kernel may start while the
  //! previous kernel in the stream drains; it waits (griddepcontrol.wait) before reading its inputs.
  //! Set it only when the previous kernel in the stream is a prox kernel or PDL-aware; the
  //! SparseFfn driver sets it for the kernels after the first on devices that support it.
  bool pdl = false;
  //! sm_90+: allow kernels that can use thread-block clusters to do so (Stage 1 combines its split-K
  //! partials through distributed shared memory instead of global memory). Ignored where a kernel
  //! or the device cannot; results are bit-identical either way (SparseFfn: PlanOptions::cluster).
  bool cluster = false;
  //! Launch kernels that contain a grid-wide barrier (the fused Stage 2) as cooperative kernels, so
  //! a grid that cannot be resident at once fails to launch instead of hanging. Leave it on unless a
  //! platform rejects cooperative launches; the grid is sized to fit either way.
  bool cooperative = true;
  //! Stage 1: a grid of fewer blocks than the GPU holds at once is launched with unused dynamic
  //! shared memory so that at most ceil(blocks / SMs) of its blocks fit on one SM. A grid that
  //! starts while the previous kernel drains (PDL) is otherwise placed onto the first SMs freed, up
  //! to its full occupancy each, and runs on fewer SMs than it could (detail::spread_smem_bytes).
  bool spread = true;
};

namespace detail {

constexpr int kMaxCachedDevices = 64;

/**
 * @brief One int per device, computed once per device and process by `compute(device, &value) ->
 * Status` (a driver query) and then read from `cache` with one atomic load. A failed compute is not
 * cached. Devices at or above kMaxCachedDevices are computed every time.
 */
template <class Compute>
Status cached_for_device(std::atomic<int> (&cache)[kMaxCachedDevices], int dev, Compute&& compute,
                         int* out) noexcept {
  const bool slot = dev >= 0 && dev < kMaxCachedDevices;
  if (slot) {
    const int cached = cache[dev].load(std::memory_order_relaxed);  // value + 1; 0 = not read yet
    if (cached != 0) {
      *out = cached - 1;
      return Status::kSuccess;
    }
  }
  int v = 0;
  PROX_RETURN_IF_ERROR(compute(dev, &v));
  if (slot) cache[dev].store(v + 1, std::memory_order_relaxed);
  *out = v;
  return Status::kSuccess;
}

//! The current device (cudaGetDevice), as a Status.
inline Status current_device(int* dev) noexcept {
  return cudaGetDevice(dev) == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
}

//! An attribute of device `dev`, read from the driver once per device (see cached_for_device).
template <cudaDeviceAttr kAttr>
Status device_attribute(int dev, int* out) noexcept {
  static std::atomic<int> cache[kMaxCachedDevices];
  return cached_for_device(
      cache, dev,
      [](int d, int* v) {
        return cudaDeviceGetAttribute(v, kAttr, d) == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
      },
      out);
}

//! An attribute of the current device, read from the driver once per device.
template <cudaDeviceAttr kAttr>
Status current_device_attribute(int* out) noexcept {
  int dev = 0;
  PROX_RETURN_IF_ERROR(current_device(&dev));
  return device_attribute<kAttr>(dev, out);
}

/**
 * @brief Dynamic shared memory that lets at most cap = ceil(blocks / sms) blocks of a kernel reside
 * on one SM, or 0 where none is needed or it cannot: cap >= fit (the kernel's occupancy without
 * it), or shared memory cannot express the cap. The kernel does not use the bytes.
 *
 * Why: the hardware places a block on any SM with room. A grid launched while the previous kernel
 * drains (PDL) gets the SMs in the order they are freed, so a grid of 192 blocks at 3 per SM can land
 * on 64 SMs, where spread evenly it would run 2 per SM on 96 (our reading of the measurements, the
 * placement itself was not observed). Measured on the H100 (Stage 1 of the Qwen3-1.7B FFN, 192
 * blocks, docs/benchmarks.md): FFN 0.4-2.5 us faster at e = 40-70 %; Stage 1 alone unchanged.
 *
 * Each block then asks for per_block = floor(smem_per_sm / cap) bytes in all (static + dynamic +
 * the per-block reservation), rounded down to 128 bytes: cap of them fit, cap + 1 do not.
 */
constexpr std::size_t spread_smem_bytes(long blocks, int sms, int fit, int smem_per_sm, std::size_t static_bytes,
                                        int reserved_per_block) noexcept {
  if (blocks <= 0 || sms <= 0 || fit <= 1 || smem_per_sm <= 0 || reserved_per_block < 0) return 0;
  const long cap = (blocks + sms - 1) / sms;
  if (cap >= fit) return 0;
  const std::size_t per_block = (static_cast<std::size_t>(smem_per_sm) / static_cast<std::size_t>(cap)) &
                                ~static_cast<std::size_t>(127);
  const std::size_t fixed = static_bytes + static_cast<std::size_t>(reserved_per_block);
  if (per_block <= fixed) return 0;
  if (static_cast<std::size_t>(cap + 1) * per_block <= static_cast<std::size_t>(smem_per_sm)) return 0;
  return per_block - fixed;
}

/**
 * @brief spread_smem_bytes() for `Kernel` (launched with kThreads threads and no dynamic shared
 * memory of its own) on the current device. The driver facts are read once per device (after that a
 * call costs one cudaGetDevice and five atomic loads); the first call also raises the kernel's
 * dynamic shared memory limit to the most this can ask for.
 */
template <auto Kernel, int kThreads>
Status spread_smem_for(long blocks, std::size_t* out) noexcept {
  static std::atomic<int> fit_cache[kMaxCachedDevices];
  static std::atomic<int> static_cache[kMaxCachedDevices];
  *out = 0;
  int dev = 0;
  int sms = 0;
  int smem_per_sm = 0;
  int reserved = 0;
  int fit = 0;
  int static_bytes = 0;
  PROX_RETURN_IF_ERROR(current_device(&dev));  // once: the five facts below are cached per device
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrMultiProcessorCount>(dev, &sms));
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(dev, &smem_per_sm));
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(dev, &reserved));
  PROX_RETURN_IF_ERROR(cached_for_device(
      fit_cache, dev,
      [](int, int* v) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, Kernel, kThreads, 0) == cudaSuccess
                   ? Status::kSuccess
                   : Status::kErrorCudaRuntime;
      },
      &fit));
  PROX_RETURN_IF_ERROR(cached_for_device(
      static_cache, dev,
      [](int d, int* v) {
        cudaFuncAttributes fa{};
        int optin = 0;
        if (cudaFuncGetAttributes(&fa, Kernel) != cudaSuccess ||
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess)
          return Status::kErrorCudaRuntime;
        const int room = optin - static_cast<int>(fa.sharedSizeBytes);
        if (room > 0 && cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, room) != cudaSuccess)
          return Status::kErrorCudaRuntime;
        *v = static_cast<int>(fa.sharedSizeBytes);
        return Status::kSuccess;
      },
      &static_bytes));
  *out = spread_smem_bytes(blocks, sms, fit, smem_per_sm, static_cast<std::size_t>(static_bytes), reserved);
  return Status::kSuccess;
}

//! Launch attributes beyond PDL that individual kernels need (L3 launchers set them, not users).
struct LaunchExtras {
  unsigned cluster_y = 0;    //!< > 1: thread-block clusters of (1, cluster_y, 1) blocks (sm_90+)
  bool cooperative = false;  //!< all blocks co-resident, or the launch fails (grid-wide barriers)
};

template <class... KArgs, class... Args>
Status launch_kernel_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                        const LaunchOptions& opts, const LaunchExtras& extras, Args&&... args) noexcept {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  unsigned n = 0;
  if (opts.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (extras.cluster_y > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = 1;
    attr[n].val.clusterDim.y = extras.cluster_y;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (extras.cooperative) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n].val.cooperative = 1;
    ++n;
  }
  cfg.attrs = n > 0 ? attr : nullptr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
#if defined(PROX_DEBUG)
    fprintf(stderr, "prox: launch failed: %s\n", cudaGetErrorString(err));
#endif
    return Status::kErrorCudaRuntime;
  }
  return Status::kSuccess;
}

template <class... KArgs, class... Args>
Status launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                     const LaunchOptions& opts, Args&&... args) noexcept {
  return launch_kernel_ex(kernel, grid, block, smem, stream, opts, LaunchExtras{}, std::forward<Args>(args)...);
}

}  // namespace detail

PROX_NAMESPACE_END
