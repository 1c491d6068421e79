// SPDX-License-Identifier: Apache-2.0
//! @file instances_bf16_silu.cu  The tuner of the bf16 SiLU layer's ops (Stage 1 with INT4 and bf16
//! proxies, GLU GEMV, fused Stage 2): TunedLayerOps<__nv_bfloat16, prox::SiLU> of prox/tuning/tuned_ops.cuh.
#include "instances.cuh"

PROX_TUNING_INSTANTIATE(::prox::tuning::TunedLayerOps<__nv_bfloat16, ::prox::SiLU>)
