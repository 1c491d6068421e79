// SPDX-License-Identifier: Apache-2.0
//! @file ffn_f16_gelu.cu  The kernels of SparseFfn<__half, prox::GeluTanh, Int4Weights>, compiled once here.
#include "ffn_impl.cuh"

PROX_EXT_DEFINE_FACTORY(__half, prox::GeluTanh, make_plan_f16_gelu)
