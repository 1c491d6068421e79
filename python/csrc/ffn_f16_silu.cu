// SPDX-License-Identifier: Apache-2.0
//! @file ffn_f16_silu.cu  The kernels of SparseFfn<__half, prox::SiLU, Int4Weights>, compiled once here.
#include "ffn_impl.cuh"

PROX_EXT_DEFINE_FACTORY(__half, prox::SiLU, make_plan_f16_silu)
