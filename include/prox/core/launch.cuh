// SPDX-License-Identifier: Apache-2.0
//! @file launch.cuh  The one place prox launches kernels: cudaLaunchKernelEx, optional PDL attribute,
//! launch errors mapped to Status (without clearing unrelated sticky errors).
#pragma once

#include <cuda_runtime.h>

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
};

namespace detail {

template <class... KArgs, class... Args>
Status launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                     const LaunchOptions& opts, Args&&... args) noexcept {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (opts.pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
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
