// SPDX-License-Identifier: Apache-2.0
//! @file strict_warnings.cu  Compile-only: the whole library built the way a strict engine builds its
//! own code: C++20, nvcc's warnings as errors, and the host compiler's -Wall -Wextra -Wshadow
//! -Wconversion and more as errors (tests/CMakeLists.txt lists them). The other tests build in
//! C++17, so both standards are covered. prox's headers reach a consumer that uses
//! add_subdirectory or FetchContent as ordinary (not system) includes, so their warnings would be
//! the consumer's.
//!
//! The layer types and standalone ops are arch_coverage.cu's (one list of what "everything" is);
//! this file adds the host-side tools, calibration and tuning.
#include "arch_coverage.cu"

#include <prox/calibrate.cuh>
#include <prox/tuning/tune.cuh>

namespace prox_strict_warnings {

using Ffn = prox::SparseFfn<__half, prox::SiLU, prox::Int4Weights>;

//! References the calibration and tuning templates so they are compiled (never called).
prox::Status tools(Ffn& ffn, const Ffn::Weights& w, const prox::calib::LayerCalibrationArgs<__half>& a,
                   prox::calib::ThresholdCalibrator& cal, prox::tuning::Cache& cache, int d_model, int d_ff,
                   const prox::ThresholdArgs<__half>& t, cudaStream_t stream) {
  prox::calib::LayerCalibration lc;
  PROX_RETURN_IF_ERROR(prox::calib::calibrate_layer(ffn, w, a, cal, stream, &lc));
  PROX_RETURN_IF_ERROR(prox::tuning::tune_ffn<Ffn>(cache, d_model, d_ff, {0.5}, {0.3}, stream));
  PROX_RETURN_IF_ERROR(prox::tuning::tune_threshold<__half>(cache, d_model, 0.5, stream));
  PROX_CHECK(prox::threshold::launch<prox::PolicyAt<0, prox::ThresholdPolicies>>(t, nullptr, stream));
  return prox::Status::kSuccess;
}

}  // namespace prox_strict_warnings
