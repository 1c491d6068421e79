// SPDX-License-Identifier: Apache-2.0
//! @file random.cuh  The one synthetic-data generator of prox's benches, tools and examples:
//! normal and uniform values (float, __half, __nv_bfloat16) and random 32-bit words (INT4 proxy
//! weights), made on the device. Not part of the library.
//!
//! Counter-based: element i of stream (seed, stream) is a pure function of (seed, stream, i) (two
//! splitmix64-finalizer hashes, Box-Muller for normals), so the data never depends on the launch
//! configuration or on the device, any element can be made by any thread, and filling 150 M weights
//! is one bandwidth-bound kernel. This is the generator prox_example_ffn has always used, so its
//! printed figures (README) are unchanged.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <prox/core/math.hpp>
#include <prox/core/types.cuh>
#include <type_traits>

namespace prox_support {

//! The key of random stream `stream` under `seed`: distinct streams of one seed are independent.
__host__ __device__ constexpr std::uint64_t random_key(std::uint64_t seed, std::uint64_t stream) {
  return prox::detail::mix64(seed ^ prox::detail::mix64(stream + 0x9E3779B97F4A7C15ull));
}

//! Uniform in [0, 1) with 24 random bits: element i's first hash.
__device__ __forceinline__ float uniform_at(std::uint64_t key, std::uint64_t i) {
  return static_cast<float>(prox::detail::mix64(key ^ (2 * i)) >> 40) * (1.0f / 16777216.0f);
}

//! N(0, 1) by Box-Muller on element i's two hashes (u1 in (0, 1), so the log is finite).
__device__ __forceinline__ float normal_at(std::uint64_t key, std::uint64_t i) {
  const std::uint64_t a = prox::detail::mix64(key ^ (2 * i));
  const std::uint64_t b = prox::detail::mix64(key ^ (2 * i + 1));
  const float u1 = (static_cast<float>(a >> 40) + 0.5f) * (1.0f / 16777216.0f);
  const float u2 = static_cast<float>(b >> 40) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

//! 32 random bits: the high half of element i's first hash.
__device__ __forceinline__ std::uint32_t bits_at(std::uint64_t key, std::uint64_t i) {
  return static_cast<std::uint32_t>(prox::detail::mix64(key ^ (2 * i)) >> 32);
}

//! Round a float to T (float, __half or __nv_bfloat16), and back.
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return prox::from_float<T>(v);
  }
}
template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return prox::to_float(v);
  }
}

//! Whether a normal value that rounds to zero in T is kept. Benches avoid zeros: a zero input would
//! be dropped for free and flatter the sparse kernels.
enum class Zeros { kKeep, kAvoid };

// ---------------------------------------------------------------- generators: element i of a stream
template <class T>
struct NormalGen {
  std::uint64_t key;
  float stddev;
  Zeros zeros;
  __device__ T operator()(std::size_t i) const {
    const float v = stddev * normal_at(key, i);
    T t = from_float<T>(v);
    if (zeros == Zeros::kAvoid && to_float(t) == 0.0f) t = from_float<T>(copysignf(stddev * (1.0f / 1024.0f), v));
    return t;
  }
};

template <class T>
struct UniformGen {
  std::uint64_t key;
  float lo, hi;
  __device__ T operator()(std::size_t i) const { return from_float<T>(lo + (hi - lo) * uniform_at(key, i)); }
};

struct BitsGen {
  std::uint64_t key;
  __device__ std::uint32_t operator()(std::size_t i) const { return bits_at(key, i); }
};

//! out[i] = gen(i) for i < n (grid-stride: any grid fills any n with the same values).
template <class T, class Gen>
__global__ void fill_kernel(T* __restrict__ out, std::size_t n, Gen gen) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = gen(i);
}

/**
 * @brief Launch out[i] = gen(i), i < n, on `stream` (asynchronous). Gen is a device functor of the
 * element index, e.g. NormalGen or a program's own distribution built on normal_at / uniform_at.
 * @return the launch's own error (cudaSuccess when n == 0). Not cudaGetLastError, which would take
 * an error left pending by earlier work as this launch's and clear it: the tuner (prox_tuning) fills
 * its weights inside an engine's process, whose pending errors stay the engine's, as the library's
 * own launches leave them (core/launch.cuh).
 */
template <class T, class Gen>
[[nodiscard]] cudaError_t fill(T* out, std::size_t n, const Gen& gen, cudaStream_t stream) noexcept {
  if (n == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  const std::size_t blocks = std::min<std::size_t>((n + kThreads - 1) / kThreads, std::size_t(1) << 16);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  return cudaLaunchKernelEx(&cfg, fill_kernel<T, Gen>, out, n, gen);
}

//! n values ~ N(0, stddev^2) of stream (seed, stream_id).
template <class T>
[[nodiscard]] cudaError_t fill_normal(T* out, std::size_t n, std::uint64_t seed, std::uint64_t stream_id, float stddev,
                                      cudaStream_t stream, Zeros zeros = Zeros::kKeep) noexcept {
  return fill(out, n, NormalGen<T>{random_key(seed, stream_id), stddev, zeros}, stream);
}

//! n values uniform in [lo, hi) of stream (seed, stream_id).
template <class T>
[[nodiscard]] cudaError_t fill_uniform(T* out, std::size_t n, std::uint64_t seed, std::uint64_t stream_id, float lo,
                                       float hi, cudaStream_t stream) noexcept {
  return fill(out, n, UniformGen<T>{random_key(seed, stream_id), lo, hi}, stream);
}

//! n random 32-bit words of stream (seed, stream_id): every INT4 nibble pattern is a valid weight.
[[nodiscard]] inline cudaError_t fill_bits(std::uint32_t* out, std::size_t n, std::uint64_t seed,
                                           std::uint64_t stream_id, cudaStream_t stream) noexcept {
  return fill(out, n, BitsGen{random_key(seed, stream_id)}, stream);
}

}  // namespace prox_support
