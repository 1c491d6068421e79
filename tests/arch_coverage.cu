// SPDX-License-Identifier: Apache-2.0
//! @file arch_coverage.cu  Compile-only: the library's kernels build for architectures beyond the
//! default sm_80 + sm_90a, as an engine's fat binary may ask (tests/CMakeLists.txt picks them: sm_75,
//! the oldest a fat binary may still list, where cp.async falls back to plain copies and plan()
//! refuses the device; sm_100 and sm_120 where the toolkit knows them). Both dtypes, both
//! activations, both proxy formats, and the standalone ops the driver does not launch.
//! tests/strict_warnings.cu includes this file: it is also the list of what the strict build covers.
#include <prox/prox.cuh>

PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::GeluTanh, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::DenseWeights<__half>)

namespace prox_arch_coverage {

//! Host functions that reference the standalone ops' kernels (never called: this file only compiles).
prox::Status standalone_ops(const __nv_bfloat16* w, int d_model, int d_ff, std::uint32_t* packed, float* scales,
                            __nv_bfloat16* wt, const prox::ThresholdArgs<__nv_bfloat16>& t, cudaStream_t stream) {
  PROX_RETURN_IF_ERROR(prox::int4::pack_device(w, d_model, d_ff, packed, scales, stream));
  PROX_RETURN_IF_ERROR(prox::transpose_device(w, d_ff, d_model, wt, stream));
  prox::Operator<prox::ThresholdOp<__nv_bfloat16>> thr;
  PROX_RETURN_IF_ERROR(thr.initialize(t));
  return thr.run(nullptr, 0, stream);
}

}  // namespace prox_arch_coverage
