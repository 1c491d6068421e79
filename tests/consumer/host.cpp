// SPDX-License-Identifier: Apache-2.0
//! @file host.cpp  The consumer's process: a host-only C++ translation unit (no nvcc) that includes
//! prox headers through prox::prox's include path alone, and calls the engine module (main.cu +
//! instances.cu, a shared library).
#include <prox/core/status.hpp>
#include <prox/core/device.hpp>  // includes <cuda_runtime.h>: prox::prox brings the toolkit's include path

#include <cstdio>

extern "C" int consumer_checks();

int main() {
  const int failed = consumer_checks();
  if (failed != 0) {
    std::printf("consumer: check %d failed\n", failed);
    return failed;
  }
  std::printf("consumer host: %s\n", prox::to_string(prox::Status::kSuccess));
  return 0;
}
