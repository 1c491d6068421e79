// SPDX-License-Identifier: Apache-2.0
//! @file common.hpp  Test helpers: seeded random data, fp16/bf16 conversion, RAII device buffers
//! (prox_support's), poisoning, and the throwing check macros of the tests (the library never throws).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <prox/core/status.hpp>
#include <prox/core/types.cuh>

// By its path, so that the test targets need no include directory of tools/ (the header includes
// only cuda_runtime.h and the standard library).
#include "../tools/common/include/prox_support/device_buffer.hpp"

namespace prox_test {

struct CheckError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define PROX_TEST_CUDA(expr)                                                                                     \
  do {                                                                                                           \
    const cudaError_t e_ = (expr);                                                                               \
    if (e_ != cudaSuccess)                                                                                       \
      throw ::prox_test::CheckError(std::string(#expr) + ": " + cudaGetErrorString(e_) + " at " + __FILE__ + ":" + \
                                    std::to_string(__LINE__));                                                   \
  } while (0)

#define PROX_TEST_OK(expr)                                                                                          \
  do {                                                                                                              \
    const ::prox::Status s_ = (expr);                                                                               \
    if (s_ != ::prox::Status::kSuccess)                                                                             \
      throw ::prox_test::CheckError(std::string(#expr) + ": " + ::prox::to_string(s_) + " at " + __FILE__ + ":" + \
                                    std::to_string(__LINE__));                                                      \
  } while (0)

//! v as T: fp16/bf16 rounded to nearest even, float as is (the FP8 quantizer's fp32 sources).
template <class T>
T element_from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return prox::from_float<T>(v);
  }
}

//! Normal(0, sigma) values rounded to T (fp16, bf16 or float). Never all zero; seeded.
template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double sigma = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<T> v(n);
  for (auto& e : v) e = element_from_float<T>(static_cast<float>(dist(rng)));
  return v;
}

//! Owning device buffer of n elements of T: prox_support's DeviceArray, the one the benches, tools
//! and examples use (get, size, bytes, upload, download, poison; throws on a CUDA error).
template <class T>
using DeviceBuffer = ::prox_support::DeviceArray<T>;

//! Bit pattern of a 16-bit element (to check "was it written" against the 0xFFFF poison).
template <class T>
std::uint16_t bits16(T v) {
  std::uint16_t u;
  std::memcpy(&u, &v, 2);
  return u;
}
inline std::uint32_t bits32(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

//! Exit code ctest maps to "skipped" (SKIP_RETURN_CODE) for GPU tests without a device.
constexpr int kSkipReturnCode = 77;

}  // namespace prox_test
