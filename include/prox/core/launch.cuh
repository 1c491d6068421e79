// SPDX-License-Identifier: Apache-2.0
//! @file launch.cuh  The one place prox launches kernels: cudaLaunchKernelEx, optional PDL attribute,
//! launch errors mapped to Status (without clearing unrelated sticky errors).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
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
};

namespace detail {

constexpr int kMaxCachedDevices = 64;

/**
 * @brief One int per device for the current device, computed once per device and process by
 * `compute(device, &value) -> Status` (a driver query) and then read from `cache`: after the first
 * launch on a device, a launcher that needs a device fact pays a cudaGetDevice and an atomic load.
 */
template <class Compute>
Status cached_per_device(std::atomic<int> (&cache)[kMaxCachedDevices], Compute&& compute, int* out) noexcept {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return Status::kErrorCudaRuntime;
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

//! An attribute of the current device, read from the driver once per device (see cached_per_device).
template <cudaDeviceAttr kAttr>
Status current_device_attribute(int* out) noexcept {
  static std::atomic<int> cache[kMaxCachedDevices];
  return cached_per_device(
      cache,
      [](int dev, int* v) {
        return cudaDeviceGetAttribute(v, kAttr, dev) == cudaSuccess ? Status::kSuccess : Status::kErrorCudaRuntime;
      },
      out);
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
