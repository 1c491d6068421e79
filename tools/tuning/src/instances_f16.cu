// SPDX-License-Identifier: Apache-2.0
//! @file instances_f16.cu  The tuner of the f16 ops without an activation: TunedTypeOps<__half>
//! (prox/tuning/tuned_ops.cuh: threshold, down GEMV).
#include "instances.cuh"

PROX_TUNING_INSTANTIATE(::prox::tuning::TunedTypeOps<__half>)
