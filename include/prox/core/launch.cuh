// SPDX-License-Identifier: Apache-2.0
//! @file launch.cuh  The one place prox launches kernels: cudaLaunchKernelEx with the launch shape an op
//! fixed at plan time (LaunchConfig), launch errors mapped to Status without clearing unrelated sticky
//! errors; and the plan-time helper that spreads a small grid over the SMs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <utility>
#if defined(PROX_DEBUG)
#include <cstdio>
#endif

#include "config.hpp"
#include "device.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

namespace detail {
//! Dynamic shared memory a kernel may take without raising cudaFuncAttributeMaxDynamicSharedMemorySize.
inline constexpr std::size_t kDefaultDynamicSmem = 48 * 1024;
}  // namespace detail

/**
 * @brief Everything about a launch that a plan fixes: grid, block, dynamic shared memory and launch
 * attributes. Ops compute it once (Op::configure, at plan time, where device queries are allowed);
 * a run only reads it.
 */
struct LaunchConfig {
  dim3 grid{1, 1, 1};
  dim3 block{1, 1, 1};
  std::size_t smem = 0;      //!< dynamic shared memory bytes
  unsigned cluster_y = 0;    //!< > 1: thread-block clusters of (1, cluster_y, 1) blocks (sm_90+)
  bool cooperative = false;  //!< all blocks co-resident, or the launch fails (grid-wide barriers)
  //! Programmatic stream serialization (PDL, sm_90+): the kernel may start while the previous kernel
  //! of the stream drains; it waits (griddepcontrol.wait) before reading its inputs. Set only when the
  //! previous kernel is a prox kernel or PDL-aware.
  bool pdl = false;
};

//! A plain launch: grid and block, no dynamic shared memory, no attributes (offline helpers).
inline LaunchConfig plain_launch(dim3 grid, dim3 block) noexcept {
  LaunchConfig lc;
  lc.grid = grid;
  lc.block = block;
  return lc;
}

namespace detail {

/**
 * @brief Dynamic shared memory that lets at most cap = ceil(blocks / sms) blocks of a kernel reside
 * on one SM, or 0 where none is needed or it cannot: cap >= fit (the kernel's occupancy without
 * it), or shared memory cannot express the cap. The kernel does not use the bytes.
 *
 * Why: the hardware places a block on any SM with room. A grid launched while the previous kernel
 * drains (PDL) gets the SMs in the order they are freed, so a grid of 192 blocks at 3 per SM can land
 * on 64 SMs, where spread evenly it would run 2 per SM on 96. Measured on the H100 (Stage 1 of the
 * Qwen3-1.7B FFN, 192 blocks): FFN 0.4-2.5 us faster at e = 40-70 %; Stage 1 alone unchanged.
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
 * @brief spread_smem_bytes() for `Kernel` (kThreads threads, no dynamic shared memory of its own) on
 * device `dev`. Plan time only: the driver facts are read once per device and kernel, and the first
 * call also raises the kernel's dynamic shared memory limit to the most this can ask for.
 */
template <auto Kernel, int kThreads>
Status spread_smem_for(int dev, long blocks, std::size_t* out) noexcept {
  static std::atomic<int> static_cache[kMaxCachedDevices];
  *out = 0;
  int sms = 0;
  int smem_per_sm = 0;
  int reserved = 0;
  int fit = 0;
  int static_bytes = 0;
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrMultiProcessorCount>(dev, &sms));
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(dev, &smem_per_sm));
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(dev, &reserved));
  PROX_RETURN_IF_ERROR((occupancy<Kernel, kThreads>(dev, &fit)));
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

/**
 * @brief Plan time: let `Kernel` take `bytes` of dynamic shared memory on device `dev` (the current
 * device). Above kDefaultDynamicSmem this raises the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize;
 * a device whose per-block opt-in limit is smaller gives kErrorUnsupportedDevice, before any launch.
 */
template <auto Kernel>
Status allow_dynamic_smem(int dev, std::size_t bytes) noexcept {
  if (bytes <= kDefaultDynamicSmem) return Status::kSuccess;
  int optin = 0;
  PROX_RETURN_IF_ERROR(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(dev, &optin));
  if (bytes > static_cast<std::size_t>(optin)) return Status::kErrorUnsupportedDevice;
  return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)) ==
                 cudaSuccess
             ? Status::kSuccess
             : Status::kErrorCudaRuntime;
}

//! Launch `kernel` with the planned configuration. Returns cudaLaunchKernelEx's own error as
//! kErrorCudaRuntime (no cudaGetLastError: an engine's pending error stays the engine's).
template <class... KArgs, class... Args>
Status launch_kernel(void (*kernel)(KArgs...), const LaunchConfig& lc, cudaStream_t stream, Args&&... args) noexcept {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = lc.grid;
  cfg.blockDim = lc.block;
  cfg.dynamicSmemBytes = lc.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[3];
  unsigned n = 0;
  if (lc.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (lc.cluster_y > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = 1;
    attr[n].val.clusterDim.y = lc.cluster_y;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (lc.cooperative) {
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

}  // namespace detail

PROX_NAMESPACE_END
