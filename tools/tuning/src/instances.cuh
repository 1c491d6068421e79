// SPDX-License-Identifier: Apache-2.0
//! @file instances.cuh  What instances_*.cu compile: tune<Op> (the public entry, prox_tuning/tune.hpp)
//! and tune_op<Op> (tune_op.hpp) for every op of one list of the registry of tuned ops
//! (prox/tuning/tuned_ops.cuh), measured through the op's TuneIO adapter. Every adapter, src/io_*.cuh,
//! is included through prox_tuning_io.cuh, which tools/tuning/CMakeLists.txt generates, so a new op's
//! adapter needs no include line.
//!
//! One translation unit per list instance: instances_<T>.cu compiles TunedTypeOps<T> and
//! instances_<T>_<act>.cu TunedLayerOps<T, Act>, so the kernels of one layer type compile in one TU
//! and each op's kernels in exactly one. Everything else reaches these functions by their declarations
//! alone (open.cu: the named functions, tune_ffn and mode 2's miss handler).
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include <prox/tuning/choose.cuh>
#include <prox/tuning/tuned_ops.cuh>
#include <prox_tuning/tune.hpp>

#include "bench.cuh"
#include "prox_tuning_io.cuh"  // generated: every io_*.cuh
#include "tune_op.hpp"

PROX_NAMESPACE_BEGIN
namespace tuning {

template <class Op>
Status tune(Cache& cache, int d_model, int d_ff, const std::vector<double>& densities, cudaStream_t stream,
            const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  const detail::Shape shape{d_model, OpKey<Op>::kFields.has_d_ff ? d_ff : 0};
  return detail::tune_op<Op>(cache, shape, densities, stream, options, results, detail::Lock::kTake);
}

namespace detail {

using TuneFn = Status (*)(Cache&, int, int, const std::vector<double>&, cudaStream_t, const TuneOptions&,
                          std::vector<TuneResult>*) noexcept;
using TuneOpFn = Status (*)(Cache&, Shape, const std::vector<double>&, cudaStream_t, const TuneOptions&,
                            std::vector<TuneResult>*, Lock) noexcept;

/**
 * @brief Compiles tune<Op> and tune_op<Op> of every op of an OpList in this translation unit. An
 * explicit instantiation names one function, not a list; this class, explicitly instantiated
 * (PROX_TUNING_INSTANTIATE), holds their addresses, which instantiates them here and makes the
 * compiler emit them (as it emitted the explicit instantiations they replace: weak symbols).
 */
template <class List>
struct Instantiate;
template <class... Ops>
struct Instantiate<OpList<Ops...>> {
  static const TuneFn kTune[sizeof...(Ops)];
  static const TuneOpFn kTuneOp[sizeof...(Ops)];
};
template <class... Ops>
const TuneFn Instantiate<OpList<Ops...>>::kTune[sizeof...(Ops)] = {&tune<Ops>...};
template <class... Ops>
const TuneOpFn Instantiate<OpList<Ops...>>::kTuneOp[sizeof...(Ops)] = {&tune_op<Ops>...};

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END

//! Compiles tune<Op> and tune_op<Op> for every op of an OpList (parenthesized: the type may hold commas).
#define PROX_TUNING_INSTANTIATE(...) template struct ::prox::tuning::detail::Instantiate<__VA_ARGS__>;
