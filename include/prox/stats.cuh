// SPDX-License-Identifier: Apache-2.0
//! @file stats.cuh  Runtime sparsity statistics: device-side counters that Stage 1 accumulates
//! (integer atomics, so totals are exact and order-independent; graph-safe; per call one atomic per
//! K-chunk of x and one per mask word that holds a selected channel, so at most d_ff/32 + a few),
//! and the host read-out of s^1, s^2 and the effective sparsity e^.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "allocation.hpp"
#include "core/config.hpp"
#include "core/status.hpp"

PROX_NAMESPACE_BEGIN

/**
 * @brief Device-resident counters, accumulated across calls until the caller resets them
 * (cudaMemsetAsync to zero, or reset_counters()). Pass a device pointer to one of these in
 * ProxyGemvArgs::counters / SparseFfn::run to turn counting on; nullptr turns it off.
 */
struct SparsityCounters {
  unsigned long long calls = 0;              //!< Stage-1 launches counted
  unsigned long long kept_inputs = 0;        //!< sum over calls of |{i : |x_i| >= tau_x}|
  unsigned long long selected_channels = 0;  //!< sum over calls of |{j : |s~_j| >= tau_s}|
  unsigned long long reserved = 0;
};

//! What the host read-out reports.
struct SparsityReport {
  unsigned long long calls = 0;
  double s1 = 0.0;         //!< measured Stage-1 sparsity: 1 - kept / (calls * d_model)
  double s2 = 0.0;         //!< measured Stage-2 sparsity: 1 - selected / (calls * d_ff)
  double effective = 0.0;  //!< e^ = s2 - 2 alpha (1 - s1) / 3
};

//! Zero the counters on `stream` (asynchronous, graph-capturable).
inline Status reset_counters(SparsityCounters* d_counters, cudaStream_t stream) noexcept {
  if (d_counters == nullptr) return Status::kErrorNullPointer;
  return cudaMemsetAsync(d_counters, 0, sizeof(SparsityCounters), stream) == cudaSuccess ? Status::kSuccess
                                                                                         : Status::kErrorCudaRuntime;
}

//! Turn host-side counter values into a report (no device access).
inline Status make_report(const SparsityCounters& c, int d_model, int d_ff, SparsityReport* out,
                          double alpha = 1.0 / 3.0) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  if (d_model < 1 || d_ff < 1) return Status::kErrorInvalidShape;
  out->calls = c.calls;
  if (c.calls == 0) {
    *out = SparsityReport{};
    return Status::kSuccess;
  }
  const double calls = static_cast<double>(c.calls);
  out->s1 = 1.0 - static_cast<double>(c.kept_inputs) / (calls * d_model);
  out->s2 = 1.0 - static_cast<double>(c.selected_channels) / (calls * d_ff);
  out->effective = effective_sparsity(out->s1, out->s2, alpha);
  return Status::kSuccess;
}

/**
 * @brief Copy the counters to the host and report. Not for the hot path: it synchronizes `stream`.
 */
inline Status read_report(const SparsityCounters* d_counters, int d_model, int d_ff, cudaStream_t stream,
                          SparsityReport* out, double alpha = 1.0 / 3.0) noexcept {
  if (d_counters == nullptr || out == nullptr) return Status::kErrorNullPointer;
  SparsityCounters h{};
  if (cudaMemcpyAsync(&h, d_counters, sizeof(h), cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess) {
    return Status::kErrorCudaRuntime;
  }
  return make_report(h, d_model, d_ff, out, alpha);
}

PROX_NAMESPACE_END
