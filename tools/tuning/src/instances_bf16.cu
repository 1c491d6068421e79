// SPDX-License-Identifier: Apache-2.0
//! @file instances_bf16.cu  The tuner of the bf16 ops without an activation: TunedTypeOps<__nv_bfloat16>
//! (prox/tuning/tuned_ops.cuh: threshold, down GEMV).
#include "instances.cuh"

PROX_TUNING_INSTANTIATE(::prox::tuning::TunedTypeOps<__nv_bfloat16>)
