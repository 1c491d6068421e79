// SPDX-License-Identifier: Apache-2.0
//! @file instances.cu  The one file of the consumer that compiles SparseFfn<__half, SiLU>'s kernels.
#include <prox/prox.cuh>

PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
