// SPDX-License-Identifier: Apache-2.0
//! @file ffn_instances.hpp  The layer types the GPU tests use are compiled once, in instances.cu:
//! every other test file declares them extern (prox/instantiate.cuh), as an engine would.
#pragma once

#include <prox/prox.cuh>

PROX_SPARSE_FFN_EXTERN(__half, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_EXTERN(__nv_bfloat16, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_EXTERN(__half, prox::GeluTanh, prox::Int4Weights)
PROX_SPARSE_FFN_EXTERN(__nv_bfloat16, prox::GeluTanh, prox::Int4Weights)
