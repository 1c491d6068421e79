// SPDX-License-Identifier: Apache-2.0
//! @file instances_bf16.cu  The tuner of the bf16 ops without an activation (threshold, down GEMV).
#include "instances.cuh"

PROX_TUNING_INSTANTIATE_TYPE(__nv_bfloat16)
