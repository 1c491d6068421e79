// SPDX-License-Identifier: Apache-2.0
//! @file instantiate.cuh  Explicit instantiation of SparseFfn: compile each layer type's kernels once.
//!
//! prox is header-only, so by default every translation unit that calls SparseFfn<T, Act, Fmt>::plan
//! or run compiles that layer type's kernels (every candidate policy of every op, for each target
//! architecture). An engine that uses a layer type in several files can compile it once instead:
//!
//! @code
//! // prox_f16_silu.cu: the one file that compiles the kernels of this layer type
//! #include <prox/prox.cuh>
//! PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
//!
//! // every other file that uses it
//! #include <prox/prox.cuh>
//! PROX_SPARSE_FFN_EXTERN(__half, prox::SiLU, prox::Int4Weights)
//! @endcode
//!
//! Use both at global scope (<prox/prox.cuh> includes this header). One instantiating file per
//! (T, Act, Fmt) keeps the builds parallel, as TensorRT-LLM's and vLLM's per-type kernel files do.
//! The instantiating file must be compiled for every architecture the program runs on (it holds the
//! device code); the declaring files need not be. An explicit instantiation also compiles the
//! members a program does not call (run_proxy_values).
//!
//! Only SparseFfn is covered: the ops' launch<Policy> are function templates instantiated per
//! policy, which a program that calls them directly declares extern itself (docs/api.md).
#pragma once

#include "sparse_ffn.cuh"

//! Declares that SparseFfn<T, Act, Fmt> is instantiated in another translation unit: this one then
//! compiles none of its kernels. Fmt is prox::Int4Weights or prox::DenseWeights<T>.
#define PROX_SPARSE_FFN_EXTERN(T, Act, Fmt) extern template class ::prox::SparseFfn<T, Act, Fmt>;

//! Instantiates SparseFfn<T, Act, Fmt> (host code and every kernel it launches) in this translation
//! unit; at most once per program for each (T, Act, Fmt).
#define PROX_SPARSE_FFN_INSTANTIATE(T, Act, Fmt) template class ::prox::SparseFfn<T, Act, Fmt>;
