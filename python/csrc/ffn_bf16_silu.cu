// SPDX-License-Identifier: Apache-2.0
//! @file ffn_bf16_silu.cu  The kernels of SparseFfn<__nv_bfloat16, prox::SiLU, Int4Weights>, compiled once here.
#include "ffn_impl.cuh"

PROX_EXT_DEFINE_FACTORY(__nv_bfloat16, prox::SiLU, make_plan_bf16_silu)
