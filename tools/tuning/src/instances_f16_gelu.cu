// SPDX-License-Identifier: Apache-2.0
//! @file instances_f16_gelu.cu  The tuner of the f16 GeluTanh layer's ops (Stage 1 INT4 and f16 proxies,
//! GLU, fused Stage 2) and tune_ffn for SparseFfn<__half, prox::GeluTanh, prox::Int4Weights>.
#include "instances.cuh"

PROX_TUNING_INSTANTIATE_LAYER(__half, ::prox::GeluTanh)
