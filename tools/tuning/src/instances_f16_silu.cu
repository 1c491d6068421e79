// SPDX-License-Identifier: Apache-2.0
//! @file instances_f16_silu.cu  The tuner of the f16 SiLU layer's ops (Stage 1 INT4 and f16 proxies,
//! GLU, fused Stage 2) and tune_ffn for SparseFfn<__half, prox::SiLU, prox::Int4Weights>.
#include "instances.cuh"

PROX_TUNING_INSTANTIATE_LAYER(__half, ::prox::SiLU)
