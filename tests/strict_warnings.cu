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

#include <memory>
#include <string>

#include <prox/calibrate.cuh>
#include <prox/tuning/choose.cuh>

namespace prox_strict_warnings {

using Ffn = prox::SparseFfn<__half, prox::SiLU, prox::Int4Weights>;
using Fp8Ffn = prox::SparseFfn<__nv_bfloat16, prox::SiLU, prox::Int4Weights, prox::Fp8BlockWeights>;

//! References the calibration templates and the run-time tuning cache (choose<Ffn>, open_cache; choose on an
//! FP8 layer's keys too) so they are compiled (never called); the measuring tuner is the prox_tuning
//! library's (tools/tuning).
prox::Status tools(Ffn& ffn, const Ffn::Weights& w, Fp8Ffn& fp8_ffn, const Fp8Ffn::Weights& fp8_w,
                   const prox::calib::LayerCalibrationArgs<__half>& a, prox::calib::ThresholdCalibrator& cal,
                   const std::string& cache_file, cudaStream_t stream) {
  prox::calib::LayerCalibration lc;
  PROX_RETURN_IF_ERROR(prox::calib::calibrate_layer(ffn, w, a, cal, stream, &lc));
  std::unique_ptr<prox::tuning::Cache> cache;
  prox::tuning::CacheOptions o;
  o.path = cache_file;
  PROX_RETURN_IF_ERROR(prox::tuning::open_cache(&cache, o));
  Fp8Ffn::PlanOptions fp8_opts;
  PROX_RETURN_IF_ERROR(prox::tuning::choose<Fp8Ffn>(*cache, fp8_ffn.config(), 0.5, 0.3, &fp8_opts, stream));
  PROX_RETURN_IF_ERROR(fp8_ffn.plan(fp8_ffn.config(), fp8_w, fp8_opts));
  Ffn::PlanOptions opts;
  PROX_RETURN_IF_ERROR(prox::tuning::choose<Ffn>(*cache, ffn.config(), 0.5, 0.3, &opts, stream));
  return ffn.plan(ffn.config(), w, opts);
}

}  // namespace prox_strict_warnings
