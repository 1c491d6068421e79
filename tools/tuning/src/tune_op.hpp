// SPDX-License-Identifier: Apache-2.0
//! @file tune_op.hpp  The one generic tuning entry point, tune_op<Op>: declared here, defined in
//! bench.cuh and compiled, with the public tune<Op>, for every op of the registry of tuned ops
//! (prox/tuning/tuned_ops.cuh) in instances_*.cu, so that translation units that only dispatch to it
//! (open.cu: the miss handler, the named functions, tune_ffn) compile no kernel.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include <prox/tuning/cache.hpp>
#include <prox_tuning/tune.hpp>

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace detail {

//! The shape an op is tuned at: (d_model, d_ff); the threshold op's length is d_model.
struct Shape {
  int d_model = 0;
  int d_ff = 0;
};

//! Whether tune_op takes the cache's tuning mutex or the caller already holds it (the miss handler).
enum class Lock { kTake, kHeld };

/**
 * @brief Tune `Op` at `shape` for every density of `densities` (deduplicated by bucket): measure,
 * verify and record each bucket's winner in `cache`; append a TuneResult per bucket to *results.
 * Refuses (kErrorCapturing) while `stream` captures.
 */
template <class Op>
Status tune_op(Cache& cache, Shape shape, const std::vector<double>& densities, cudaStream_t stream,
               const TuneOptions& options, std::vector<TuneResult>* results, Lock lock) noexcept;

}  // namespace detail
}  // namespace tuning
PROX_NAMESPACE_END
