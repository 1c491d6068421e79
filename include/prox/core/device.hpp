// SPDX-License-Identifier: Apache-2.0
//! @file device.hpp  Facts about the current device that planning needs, read once per plan (never on
//! the hot path), and the per-device caches for the driver queries a plan repeats.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "config.hpp"
#include "status.hpp"

PROX_NAMESPACE_BEGIN

//! Facts about the current device that planning needs (read once, kept by the planned object).
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  bool cluster_launch = false;  //!< the device can launch thread-block clusters (sm_90+)
  bool supports_pdl() const noexcept { return cc_major >= 9; }
};

//! Query the current device (planning time only): kErrorNoDevice, kErrorUnsupportedDevice (older
//! than sm_80) or kErrorCudaRuntime on failure.
inline Status query_device(DeviceInfo* out) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return Status::kErrorNoDevice;
  DeviceInfo info;
  int cluster = 0;
  if (cudaGetDevice(&info.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, info.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, info.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, info.device) != cudaSuccess ||
      cudaDeviceGetAttribute(&cluster, cudaDevAttrClusterLaunch, info.device) != cudaSuccess) {
    return Status::kErrorCudaRuntime;
  }
  if (info.cc_major < 8) return Status::kErrorUnsupportedDevice;
  info.cluster_launch = cluster != 0;
  *out = info;
  return Status::kSuccess;
}

namespace detail {

constexpr int kMaxCachedDevices = 64;

/**
 * @brief One int per device, computed once per device and process by `compute(device, &value) ->
 * Status` (a driver query) and then read from `cache` with one atomic load. A failed compute is not
 * cached. Devices at or above kMaxCachedDevices are computed every time. Plans re-made per layer (or
 * by the tuner per candidate) then pay the occupancy queries once.
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

/**
 * @brief Blocks of `Kernel` (kThreads threads, no dynamic shared memory) that fit on one SM of
 * device `dev`, read from the driver once per device and kernel.
 */
template <auto Kernel, int kThreads>
Status occupancy(int dev, int* out) noexcept {
  static std::atomic<int> cache[kMaxCachedDevices];
  return cached_for_device(
      cache, dev,
      [](int, int* v) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, Kernel, kThreads, 0) == cudaSuccess
                   ? Status::kSuccess
                   : Status::kErrorCudaRuntime;
      },
      out);
}

}  // namespace detail

PROX_NAMESPACE_END
