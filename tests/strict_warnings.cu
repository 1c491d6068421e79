// SPDX-License-Identifier: Apache-2.0
//! @file strict_warnings.cu  Compile-only: the whole library, every layer type and the host-side
//! tools (calibration, tuning, packing, PROX_CHECK), built the way a strict engine builds its own
//! code: C++20, nvcc's warnings as errors, and the host compiler's -Wall -Wextra -Wshadow
//! -Wconversion and more as errors (tests/CMakeLists.txt lists them). The other tests build in
//! C++17, so both standards are covered. prox's headers reach a consumer that uses
//! add_subdirectory or FetchContent as ordinary (not system) includes, so their warnings would be
//! the consumer's.
#include <prox/calibrate.cuh>
#include <prox/prox.cuh>
#include <prox/tuning/tune.cuh>

PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::GeluTanh, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::DenseWeights<__half>)

namespace prox_strict_warnings {

using Ffn = prox::SparseFfn<__half, prox::SiLU, prox::Int4Weights>;

//! References the host-side entry points' templates so they are compiled (never called).
prox::Status everything(Ffn& ffn, const Ffn::Weights& w, const prox::calib::LayerCalibrationArgs<__half>& a,
                        prox::calib::ThresholdCalibrator& cal, prox::tuning::Cache& cache,
                        const __nv_bfloat16* wb, int d_model, int d_ff, std::uint32_t* packed, float* scales,
                        __nv_bfloat16* wt, const prox::ThresholdArgs<__nv_bfloat16>& t, cudaStream_t stream) {
  prox::calib::LayerCalibration lc;
  PROX_RETURN_IF_ERROR(prox::calib::calibrate_layer(ffn, w, a, cal, stream, &lc));
  PROX_RETURN_IF_ERROR(prox::tuning::tune_ffn<Ffn>(cache, d_model, d_ff, {0.5}, {0.3}, stream));
  PROX_RETURN_IF_ERROR(prox::tuning::tune_threshold<__half>(cache, d_model, 0.5, stream));
  PROX_RETURN_IF_ERROR(prox::int4::pack_device(wb, d_model, d_ff, packed, scales, stream));
  PROX_RETURN_IF_ERROR(prox::transpose_device(wb, d_ff, d_model, wt, stream));
  PROX_CHECK(prox::threshold::launch<prox::PolicyAt<0, prox::ThresholdPolicies>>(t, nullptr, stream));
  return prox::Status::kSuccess;
}

}  // namespace prox_strict_warnings
