// SPDX-License-Identifier: Apache-2.0
//! @file dense_ffn.cuh  The dense FFN baseline (cuBLAS), shared by the benchmarks, the alpha tool and the
//! example (prox_support: header-only; its users link CUDA::cublas). Not part of the library: prox::prox never
//! links cuBLAS.
//!
//!   g = W_gate x, u = W_up x   (two cublasGemmEx GEMVs, fp32 compute)
//!   s = u * act(g)             (one small kernel, s stored in T as a framework would)
//!   y = W_down s               (one cublasGemmEx GEMV)
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include <prox/activation.cuh>
#include <prox/core/types.cuh>
#include <prox_support/device_buffer.hpp>

namespace prox_support {

inline void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLAS: ") + what + " failed (" + std::to_string(int(s)) + ")");
}
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

template <class T>
constexpr cudaDataType_t cuda_type() {
  return std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF;
}

template <class T, class Act>
__global__ void glu_act_mul_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ s, float* s32,
                                   int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = prox::to_float(u[i]) * Act{}(prox::to_float(g[i]));
  s[i] = prox::from_float<T>(v);
  if (s32 != nullptr) s32[i] = v;
}

/**
 * @brief y = W_down (W_up x * act(W_gate x)) with cuBLAS GEMVs (batch 1) or, for `tokens` > 1 (at most
 * the constructor's max_tokens), skinny GEMMs over x [tokens][d_model] (row-major, one token per row).
 * Weights: w_gate, w_up [d_ff][d_model] row-major (nn.Linear); w_down [d_model][d_ff] row-major
 * (nn.Linear). Owns its intermediate buffers; run() is graph-capturable (the handle's workspace is
 * set to a buffer owned here, so cuBLAS allocates nothing during capture).
 */
template <class T, class Act = prox::SiLU>
class DenseFfn {
 public:
  DenseFfn(cublasHandle_t handle, int d_model, int d_ff, int max_tokens = 1)
      : h_(handle),
        K_(d_model),
        N_(d_ff),
        max_tokens_(max_tokens),
        g_(static_cast<std::size_t>(d_ff) * max_tokens, "dense FFN g"),
        u_(static_cast<std::size_t>(d_ff) * max_tokens, "dense FFN u"),
        s_(static_cast<std::size_t>(d_ff) * max_tokens, "dense FFN s"),
        s32_(static_cast<std::size_t>(d_ff) * max_tokens, "dense FFN s (float)"),
        ws_(kWorkspace, "cuBLAS workspace") {}

  //! y[tokens][n_out] = x[tokens][n_in] W^T with W [n_out][n_in] row-major: one cublasGemmEx
  //! (m = n_out, n = tokens, k = n_in); tokens = 1 is a GEMV.
  void gemv(const T* w, const T* x, T* y, int n_out, int n_in, cudaStream_t stream, int tokens = 1) const {
    check_cublas(cublasSetStream(h_, stream), "set stream");
    check_cublas(cublasSetWorkspace(h_, ws_.get(), ws_.bytes()), "set workspace");
    const float one = 1.0f, zero = 0.0f;
    check_cublas(cublasGemmEx(h_, CUBLAS_OP_T, CUBLAS_OP_N, n_out, tokens, n_in, &one, w, cuda_type<T>(), n_in, x,
                              cuda_type<T>(), n_in, &zero, y, cuda_type<T>(), n_out, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT),
                 "GemmEx");
  }

  void run(const T* w_gate, const T* w_up, const T* w_down, const T* x, T* y, cudaStream_t stream,
           int tokens = 1) const {
    if (tokens < 1 || tokens > max_tokens_) throw std::invalid_argument("DenseFfn::run: tokens out of range");
    const int n = N_ * tokens;
    gemv(w_gate, x, g_.get(), N_, K_, stream, tokens);
    gemv(w_up, x, u_.get(), N_, K_, stream, tokens);
    glu_act_mul_kernel<T, Act><<<(n + 255) / 256, 256, 0, stream>>>(g_.get(), u_.get(), s_.get(), s32_.get(), n);
    check_cuda(cudaGetLastError(), "act-mul launch");
    // W_down [d_model][d_ff]: y[d_model] = W_down s.
    gemv(w_down, s_.get(), y, K_, N_, stream, tokens);
  }

  const T* gate() const { return g_.get(); }
  const T* up() const { return u_.get(); }
  const T* s() const { return s_.get(); }
  //! The intermediate state in float (before rounding to T), for oracle-s selection.
  const float* s_float() const { return s32_.get(); }

 private:
  static constexpr std::size_t kWorkspace = 4u << 20;
  cublasHandle_t h_;
  int K_, N_, max_tokens_;
  prox_support::DeviceArray<T> g_, u_, s_;
  prox_support::DeviceArray<float> s32_;
  prox_support::DeviceBuffer ws_;
};

}  // namespace prox_support
