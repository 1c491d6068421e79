// SPDX-License-Identifier: Apache-2.0
//! @file layout.cuh  Offline layout helpers (not for the hot path): transposes that make the layouts
//! prox reads from nn.Linear weights.
//!  - W_down^T [d_ff][d_model] from nn.Linear W_down [d_model][d_ff]  (rows = d_model, cols = d_ff);
//!  - input-major fp16/bf16 proxy weights [d_model][d_ff] from W_gate / W_up [d_ff][d_model]
//!    (rows = d_ff, cols = d_model), for DenseWeights<T>.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/config.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/status.hpp"

PROX_NAMESPACE_BEGIN

/**
 * @brief Host transpose of a row-major [rows][cols] matrix into [cols][rows].
 * @code
 * std::vector<__half> wdt(size_t(d_ff) * d_model);
 * prox::transpose_host(w_down.data(), d_model, d_ff, wdt.data());   // W_down^T for down_gemv
 * @endcode
 */
template <class T>
Status transpose_host(const T* in, int rows, int cols, T* out) {
  if (in == nullptr || out == nullptr) return Status::kErrorNullPointer;
  if (rows < 1 || cols < 1) return Status::kErrorInvalidShape;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(c) * rows + r] = in[static_cast<std::size_t>(r) * cols + c];
  return Status::kSuccess;
}

#if defined(__CUDACC__)
namespace detail {
template <class T>
PROX_KERNEL void transpose_kernel(const T* __restrict__ in, int rows, int cols, T* __restrict__ out) {
  __shared__ T tile[32][33];  // +1 column: no bank conflicts on the transposed read
  const int c = static_cast<int>(blockIdx.x) * 32 + static_cast<int>(threadIdx.x);
  for (int dy = static_cast<int>(threadIdx.y); dy < 32; dy += static_cast<int>(blockDim.y)) {
    const int r = static_cast<int>(blockIdx.y) * 32 + dy;
    if (r < rows && c < cols) tile[dy][threadIdx.x] = in[static_cast<std::size_t>(r) * cols + c];
  }
  __syncthreads();
  const int r = static_cast<int>(blockIdx.y) * 32 + static_cast<int>(threadIdx.x);
  for (int dx = static_cast<int>(threadIdx.y); dx < 32; dx += static_cast<int>(blockDim.y)) {
    const int cc = static_cast<int>(blockIdx.x) * 32 + dx;
    if (r < rows && cc < cols) out[static_cast<std::size_t>(cc) * rows + r] = tile[threadIdx.x][dx];
  }
}
}  // namespace detail

//! Device transpose of a row-major [rows][cols] matrix into [cols][rows] on `stream` (asynchronous).
//! kErrorNullPointer, kErrorInvalidShape or kErrorMisalignedPointer (in or out not element-aligned)
//! before any launch.
template <class T>
Status transpose_device(const T* in, int rows, int cols, T* out, cudaStream_t stream) noexcept {
  if (in == nullptr || out == nullptr) return Status::kErrorNullPointer;
  if (rows < 1 || cols < 1) return Status::kErrorInvalidShape;
  if (!is_aligned(in, sizeof(T)) || !is_aligned(out, sizeof(T))) return Status::kErrorMisalignedPointer;
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, 32)), static_cast<unsigned>(ceil_div(rows, 32)));
  const LaunchConfig lc = plain_launch(grid, dim3(32, 8));
  if (lc.grid.y > 65535u) return Status::kErrorInvalidShape;
  return detail::launch_kernel(detail::transpose_kernel<T>, lc, stream, in, rows, cols, out);
}
#endif

PROX_NAMESPACE_END
