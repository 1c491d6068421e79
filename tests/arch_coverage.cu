// SPDX-License-Identifier: Apache-2.0
//! @file arch_coverage.cu  Compile-only: the library's kernels build for architectures beyond the
//! default sm_80 + sm_90a, as an engine's fat binary may ask (tests/CMakeLists.txt picks them: sm_75,
//! the oldest a fat binary may still list, where cp.async falls back to plain copies and plan()
//! refuses the device; sm_100 and sm_120 where the toolkit knows them). Both dtypes, both
//! activations, both proxy formats, both Stage-2 formats (native, FP8 e4m3 in both scale layouts: batch 1
//! and the batched ops, which an INT4-proxy layer type plans up to 8 tokens), and the standalone ops the
//! driver does not launch (FP8's offline helpers and prox_alpha's FP8 input-sparse GEMV among them).
//! tests/strict_warnings.cu includes this file: it is also the list of what the strict build covers.
#include <prox/fp8_policies.cuh>
#include <prox/prox.cuh>

PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::GeluTanh, prox::Int4Weights)
PROX_SPARSE_FFN_INSTANTIATE(__half, prox::SiLU, prox::DenseWeights<__half>)
PROX_SPARSE_FFN_INSTANTIATE(__nv_bfloat16, prox::SiLU, prox::Int4Weights, prox::Fp8BlockWeights)
PROX_SPARSE_FFN_INSTANTIATE(__half, prox::GeluTanh, prox::Int4Weights, prox::Fp8ChannelWeights)

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

//! The FP8 offline helpers (fp8.cuh) in both scale layouts, and the FP8 input-sparse GEMV (prox_alpha's).
prox::Status fp8_standalone_ops(const __nv_bfloat16* w, int d_model, int d_ff, std::uint8_t* q, float* scales,
                                std::uint8_t* q_t, float* scales_t, std::uint32_t* packed, float* int4_scales,
                                const prox::ProxyGemvArgs<__half, prox::Fp8ProxyWeights>& g, cudaStream_t stream) {
  using prox::fp8::ScaleLayout;
  for (const ScaleLayout l : {ScaleLayout::kPerChannel, ScaleLayout::kBlock128}) {
    PROX_RETURN_IF_ERROR(prox::fp8::quantize_device(w, d_model, d_ff, l, q, scales, stream));
    PROX_RETURN_IF_ERROR(prox::fp8::transpose_down_device(q, scales, d_model, d_ff, l, q_t, scales_t, stream));
    PROX_RETURN_IF_ERROR(prox::fp8::pack_int4_device(q, scales, l, d_model, d_ff, packed, int4_scales, stream));
  }
  prox::Operator<prox::ProxyGemvOp<__half, prox::SiLU, prox::Fp8ProxyWeights>> gemv;
  PROX_RETURN_IF_ERROR(gemv.initialize(g));
  return gemv.run(nullptr, 0, stream);
}

}  // namespace prox_arch_coverage
