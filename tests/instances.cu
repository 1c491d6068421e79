// SPDX-License-Identifier: Apache-2.0
//! @file instances.cu  The one file of prox_gpu_tests that compiles the kernels of these layer types
//! (ffn_instances.hpp declares them extern for the others).
#include "ffn_instances.hpp"

PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__half, prox::GeluTanh, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::GeluTanh, prox::Int4Weights)
