// SPDX-License-Identifier: Apache-2.0
//! @file gpu_main.cpp  Catch2 main of the GPU tests: with no CUDA device it prints one line and
//! exits with ctest's skip code (77), so the run reports "skipped", never "passed".
#define CATCH_CONFIG_RUNNER
#include "catch.hpp"
#include <cuda_runtime_api.h>

#include <cstdio>

#include "common.hpp"

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("prox GPU tests: no CUDA device visible (%s): skipped\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return prox_test::kSkipReturnCode;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("prox GPU tests on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  return Catch::Session().run(argc, argv);
}
