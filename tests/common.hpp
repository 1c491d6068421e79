// SPDX-License-Identifier: Apache-2.0
//! @file common.hpp  Test helpers: seeded random data, fp16/bf16 conversion, RAII device buffers,
//! poisoning, and the throwing check macros of tests/bench/examples (the library never throws).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <prox/core/status.hpp>
#include <prox/core/types.cuh>

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

//! Normal(0, sigma) values rounded to T. Never all zero; seeded.
template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double sigma = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<T> v(n);
  for (auto& e : v) e = prox::from_float<T>(static_cast<float>(dist(rng)));
  return v;
}

//! Owning device buffer of n elements of T.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n_ > 0) PROX_TEST_CUDA(cudaMalloc(&p_, n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  std::size_t bytes() const { return n_ * sizeof(T); }
  void upload(const std::vector<T>& h) {
    if (h.size() != n_) throw CheckError("upload size mismatch");
    if (n_ > 0) PROX_TEST_CUDA(cudaMemcpy(p_, h.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) PROX_TEST_CUDA(cudaMemcpy(h.data(), p_, bytes(), cudaMemcpyDeviceToHost));
    return h;
  }
  //! Fill every byte with `byte` (0xFF poisons floats and halves into NaN, ints into -1).
  void poison(unsigned char byte = 0xFF) const {
    if (n_ > 0) PROX_TEST_CUDA(cudaMemset(p_, byte, bytes()));
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

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
