// SPDX-License-Identifier: Apache-2.0
//! @file dispatch.hpp  L4 runtime choice: device facts read once at plan time, and the constexpr
//! default policy when the tuning cache has no entry. No allocation, no sync, no device query on
//! the hot path: the choice is an index fixed at plan().
#pragma once

#include <cuda_runtime.h>

#include "core/config.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"

PROX_NAMESPACE_BEGIN

//! Facts about the current device that planning needs (read once, cached by the planner).
struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc_major = 0;
  int cc_minor = 0;
  bool supports_pdl() const noexcept { return cc_major >= 9; }
};

//! Query the current device (planning time only).
inline Status query_device(DeviceInfo* out) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  int dev = 0;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return Status::kErrorNoDevice;
  if (cudaGetDevice(&dev) != cudaSuccess) return Status::kErrorCudaRuntime;
  DeviceInfo info;
  info.device = dev;
  if (cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return Status::kErrorCudaRuntime;
  }
  if (info.cc_major < 8) return Status::kErrorUnsupportedDevice;
  *out = info;
  return Status::kSuccess;
}

//! default_policy()'s preference for multi-wave grids when none is given: no candidate preferred.
struct NoWavePreference {
  template <class P>
  constexpr bool operator()(P) const noexcept {
    return false;
  }
};

/**
 * @brief Default policy of a list for a shape: the candidate whose grid needs the fewest waves
 * (a wave = SMs x P::kMinBlocks resident blocks); when that is more than one wave, a candidate for
 * which `prefer_multi_wave(policy)` holds; then the one with the most blocks (more bytes in
 * flight); ties go to the lower index. `blocks(policy)` returns the grid size of a policy.
 * Measured reasons (H100): a Qwen3-8B Stage-1 grid of 1.45 waves ran as slowly as 2 full waves;
 * on the Qwen3-32B shape, whose Stage-1 grid needs 2 waves, the cp.async-pipelined candidate was
 * 3-8 us faster than the register-buffered one with the same grid at every target (benchmarks.md).
 */
template <class List, class BlocksFn, class PreferFn = NoWavePreference>
int default_policy(int sm_count, BlocksFn&& blocks, PreferFn&& prefer_multi_wave = PreferFn{}) {
  int best_index = 0;
  long best_waves = -1;
  long best_blocks = -1;
  bool best_preferred = false;
  for_each_policy<List>([&](auto p, int i) {
    const long b = blocks(p);
    const long slots = static_cast<long>(sm_count) * decltype(p)::kMinBlocks;
    const long waves = slots > 0 ? (b + slots - 1) / slots : b;
    const bool preferred = waves > 1 && prefer_multi_wave(p);
    bool better = false;
    if (best_waves < 0 || waves < best_waves) {
      better = true;
    } else if (waves == best_waves) {
      better = preferred != best_preferred ? preferred : b > best_blocks;
    }
    if (better) {
      best_index = i;
      best_waves = waves;
      best_blocks = b;
      best_preferred = preferred;
    }
  });
  return best_index;
}

PROX_NAMESPACE_END
