// SPDX-License-Identifier: Apache-2.0
//! @file instances_f16_gelu.cu  The tuner of the f16 GeluTanh layer's ops (Stage 1 with INT4 and f16
//! proxies, GLU GEMV, fused Stage 2): TunedLayerOps<__half, prox::GeluTanh> of prox/tuning/tuned_ops.cuh.
#include "instances.cuh"

PROX_TUNING_INSTANTIATE(::prox::tuning::TunedLayerOps<__half, ::prox::GeluTanh>)
