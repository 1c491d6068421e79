// SPDX-License-Identifier: Apache-2.0
//! @file instances_bf16_gelu.cu  The tuner of the bf16 GeluTanh layer's ops (Stage 1 INT4 and bf16 proxies,
//! GLU, fused Stage 2) and tune_ffn for SparseFfn<__nv_bfloat16, prox::GeluTanh, prox::Int4Weights>.
#include "instances.cuh"

PROX_TUNING_INSTANTIATE_LAYER(__nv_bfloat16, ::prox::GeluTanh)
