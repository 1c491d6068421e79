// SPDX-License-Identifier: Apache-2.0
//! @file activation.cuh  GLU activation functors: SiLU (SwiGLU) and tanh-GELU (GeGLU, Gemma-3).
//! Each is a stateless type with `float operator()(float) const`, usable on host and device.
#pragma once

#include <cmath>

#include "core/config.hpp"

PROX_NAMESPACE_BEGIN

//! SiLU(g) = g * sigmoid(g) = g / (1 + exp(-g)). Accurate expf (not __expf), so the proxy and the
//! exact stage agree with the float64 reference to a few ulp.
struct SiLU {
  static constexpr const char* kName = "silu";
  PROX_HOST_DEVICE PROX_FORCEINLINE float operator()(float g) const {
#if defined(__CUDA_ARCH__)
    return g / (1.0f + expf(-g));
#else
    return g / (1.0f + std::exp(-g));
#endif
  }
};

//! tanh-approximated GELU: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as in Gemma-3's GeGLU.
struct GeluTanh {
  static constexpr const char* kName = "gelu_tanh";
  PROX_HOST_DEVICE PROX_FORCEINLINE float operator()(float g) const {
    constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
    const float inner = kC * (g + 0.044715f * g * g * g);
#if defined(__CUDA_ARCH__)
    return 0.5f * g * (1.0f + tanhf(inner));
#else
    return 0.5f * g * (1.0f + std::tanh(inner));
#endif
  }
};

PROX_NAMESPACE_END
