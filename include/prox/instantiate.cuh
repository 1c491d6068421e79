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
//! (T, Act, Fmt, WFmt) keeps the builds parallel, as TensorRT-LLM's and vLLM's per-type kernel files do.
//! The instantiating file must be compiled for every architecture the program runs on (it holds the
//! device code); the declaring files need not be. An explicit instantiation also compiles the
//! members a program does not call (run_proxy_values).
//!
//! Only SparseFfn is covered: the ops' launch<Policy> are function templates instantiated per
//! policy, which a program that calls them directly declares extern itself (docs/api.md).
#pragma once

#include "sparse_ffn.cuh"

//! Declares that SparseFfn<T, Act, Fmt[, WFmt]> is instantiated in another translation unit: this one then
//! compiles none of its kernels. Fmt is prox::Int4Weights or prox::DenseWeights<T>; the optional WFmt, the
//! Stage-2 weight format (stage2_weights.cuh), defaults to prox::NativeWeights<T>. The arguments are
//! SparseFfn's template arguments, so the 3-argument form names the same class as the 4-argument one with
//! the default (a type with a comma goes in parentheses or behind an alias).
#define PROX_SPARSE_FFN_EXTERN(...) extern template class ::prox::SparseFfn<__VA_ARGS__>;

//! Instantiates SparseFfn<T, Act, Fmt[, WFmt]> (host code and every kernel it launches) in this translation
//! unit; at most once per program for each layer type.
#define PROX_SPARSE_FFN_INSTANTIATE(...) template class ::prox::SparseFfn<__VA_ARGS__>;
