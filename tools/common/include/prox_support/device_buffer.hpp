// SPDX-License-Identifier: Apache-2.0
//! @file device_buffer.hpp  The one owning device allocation of prox's tests, benches, tools and
//! examples: DeviceBuffer (untyped bytes, for arenas carved with as<T>(offset)) and DeviceArray<T>
//! (n elements of T on top of it, with host copies). Not part of the library: the throwing
//! constructors suit programs, and alloc() is there for code that reports errors by value.
//!
//! Host-only (cuda_runtime.h and the standard library), so host-compiled tests include it too; it
//! includes nothing else of prox_support, so a file may include it by its relative path.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace prox_support {

//! Throw std::runtime_error "<what>: <CUDA error string>" when e is an error.
inline void throw_on_cuda_error(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(e));
}

/**
 * @brief An owning, movable device allocation of `bytes()` bytes (cudaMalloc: 256-byte aligned,
 * more than any prox op needs). Zero bytes hold no allocation: get() is nullptr.
 *
 * @code
 * DeviceBuffer arena(copy_bytes * copies, "weight copies");   // throws on failure
 * half* w = arena.as<half>(copy_bytes * c);                   // copy c of the arena
 * DeviceBuffer ws;
 * if (ws.alloc(bytes) != cudaSuccess) return Status::kErrorCudaRuntime;  // no exception
 * @endcode
 */
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  //! Allocate `bytes`; throws std::runtime_error naming `what` and the size when cudaMalloc fails.
  explicit DeviceBuffer(std::size_t bytes, const char* what = "device buffer") {
    const cudaError_t e = alloc(bytes);
    if (e != cudaSuccess) {
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes) + " bytes (" + what +
                               ") failed: " + cudaGetErrorString(e));
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }

  /**
   * @brief Free what is held, then allocate `bytes`, without throwing. On failure the buffer is
   * empty and the error is cleared from the runtime (out of memory is not sticky, so later calls
   * are unaffected), and returned.
   */
  cudaError_t alloc(std::size_t bytes) noexcept {
    reset();
    if (bytes == 0) return cudaSuccess;
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      p_ = nullptr;
      return e;
    }
    bytes_ = bytes;
    return cudaSuccess;
  }
  void reset() noexcept {
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }

  void* get() const noexcept { return p_; }
  //! The allocation at `byte_offset`, as U* (no bounds check: offsets come from a layout).
  template <class U = void>
  U* as(std::size_t byte_offset = 0) const noexcept {
    return reinterpret_cast<U*>(static_cast<char*>(p_) + byte_offset);
  }
  std::size_t bytes() const noexcept { return bytes_; }
  bool empty() const noexcept { return p_ == nullptr; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

/**
 * @brief n elements of T in a DeviceBuffer, with synchronous and stream-ordered host copies.
 * Every CUDA failure throws std::runtime_error.
 */
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t n, const char* what = "device array") : buf_(n * sizeof(T), what), n_(n) {}
  //! A device copy of `h` (synchronous).
  explicit DeviceArray(const std::vector<T>& h, const char* what = "device array") : DeviceArray(h.size(), what) {
    upload(h);
  }
  DeviceArray(DeviceArray&& o) noexcept : buf_(std::move(o.buf_)), n_(std::exchange(o.n_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      buf_ = std::move(o.buf_);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }

  T* get() const noexcept { return buf_.template as<T>(); }
  std::size_t size() const noexcept { return n_; }
  std::size_t bytes() const noexcept { return n_ * sizeof(T); }
  const DeviceBuffer& buffer() const noexcept { return buf_; }

  void upload(const std::vector<T>& h) {
    if (h.size() != n_) {
      throw std::invalid_argument("DeviceArray::upload: " + std::to_string(h.size()) + " elements for an array of " +
                                  std::to_string(n_));
    }
    if (n_ > 0) throw_on_cuda_error(cudaMemcpy(get(), h.data(), bytes(), cudaMemcpyHostToDevice), "upload");
  }
  //! A host copy; synchronous (waits for all prior work of the device).
  std::vector<T> download() const {
    std::vector<T> h(n_);
    if (n_ > 0) throw_on_cuda_error(cudaMemcpy(h.data(), get(), bytes(), cudaMemcpyDeviceToHost), "download");
    return h;
  }
  //! A host copy after the work queued on `stream` (synchronizes the stream).
  std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> h(n_);
    if (n_ > 0) {
      throw_on_cuda_error(cudaMemcpyAsync(h.data(), get(), bytes(), cudaMemcpyDeviceToHost, stream), "download");
      throw_on_cuda_error(cudaStreamSynchronize(stream), "download");
    }
    return h;
  }
  //! Fill every byte with `byte` (0xFF poisons floats and halves into NaN, ints into -1).
  void poison(unsigned char byte = 0xFF) const {
    if (n_ > 0) throw_on_cuda_error(cudaMemset(get(), byte, bytes()), "poison");
  }

 private:
  DeviceBuffer buf_;
  std::size_t n_ = 0;
};

}  // namespace prox_support
