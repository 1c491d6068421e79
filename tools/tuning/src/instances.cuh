// SPDX-License-Identifier: Apache-2.0
//! @file instances.cuh  The public tune_* functions over tune_op<Op>, and the list of what the
//! library is compiled for: instances_*.cu instantiate them per element type and activation, so the
//! build compiles the kernels of one layer type per translation unit.
#pragma once

#include "bench.cuh"
#include "io_down.cuh"
#include "io_glu.cuh"
#include "io_glu_down.cuh"
#include "io_proxy.cuh"
#include "io_threshold.cuh"

PROX_NAMESPACE_BEGIN
namespace tuning {

using detail::Lock;

template <class T>
Status tune_threshold(Cache& cache, int n, const std::vector<double>& densities, cudaStream_t stream,
                      const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return detail::tune_op<ThresholdOp<T>>(cache, {n, 0}, densities, stream, options, results, Lock::kTake);
}
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                       cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return detail::tune_op<ProxyGemvOp<T, Act, Fmt>>(cache, {d_model, d_ff}, input_densities, stream, options, results,
                                                   Lock::kTake);
}
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                     cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return detail::tune_op<GluGemvOp<T, Act>>(cache, {d_model, d_ff}, channel_densities, stream, options, results,
                                            Lock::kTake);
}
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                      cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return detail::tune_op<DownGemvOp<T>>(cache, {d_model, d_ff}, channel_densities, stream, options, results,
                                        Lock::kTake);
}
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                          cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return detail::tune_op<GluDownGemvOp<T, Act>>(cache, {d_model, d_ff}, channel_densities, stream, options, results,
                                                Lock::kTake);
}
template <class Ffn>
Status tune_ffn(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                const std::vector<double>& channel_densities, cudaStream_t stream, const TuneOptions& options,
                std::vector<TuneResult>* results) noexcept {
  const detail::Shape s{d_model, d_ff};
  PROX_RETURN_IF_ERROR(
      detail::tune_op<typename Ffn::Stage1Op>(cache, s, input_densities, stream, options, results, Lock::kTake));
  PROX_RETURN_IF_ERROR(
      detail::tune_op<typename Ffn::GluOp>(cache, s, channel_densities, stream, options, results, Lock::kTake));
  PROX_RETURN_IF_ERROR(
      detail::tune_op<typename Ffn::DownOp>(cache, s, channel_densities, stream, options, results, Lock::kTake));
  return detail::tune_op<typename Ffn::FusedStage2Op>(cache, s, channel_densities, stream, options, results,
                                                      Lock::kTake);
}

}  // namespace tuning
PROX_NAMESPACE_END

//! tune_op<Op> for one op type (parenthesized: the type may hold commas).
#define PROX_TUNING_INSTANTIATE_OP(...)                                                                \
  template ::prox::Status prox::tuning::detail::tune_op<__VA_ARGS__>(                                  \
      ::prox::tuning::Cache&, ::prox::tuning::detail::Shape, const std::vector<double>&, cudaStream_t, \
      const ::prox::tuning::TuneOptions&, std::vector<::prox::tuning::TuneResult>*,                    \
      ::prox::tuning::detail::Lock) noexcept;

//! Declares tune_op<Op> instantiated elsewhere (tune_ffn's down GEMV: in instances_<T>.cu).
#define PROX_TUNING_EXTERN_OP(...)                                                                     \
  extern template ::prox::Status prox::tuning::detail::tune_op<__VA_ARGS__>(                           \
      ::prox::tuning::Cache&, ::prox::tuning::detail::Shape, const std::vector<double>&, cudaStream_t, \
      const ::prox::tuning::TuneOptions&, std::vector<::prox::tuning::TuneResult>*,                    \
      ::prox::tuning::detail::Lock) noexcept;

#define PROX_TUNING_ARGS_ \
  const std::vector<double>&, cudaStream_t, const ::prox::tuning::TuneOptions&, std::vector<::prox::tuning::TuneResult>*

//! The ops of element type T without an activation: threshold and down GEMV.
#define PROX_TUNING_INSTANTIATE_TYPE(T)                                                                             \
  PROX_TUNING_INSTANTIATE_OP(::prox::ThresholdOp<T>)                                                                \
  PROX_TUNING_INSTANTIATE_OP(::prox::DownGemvOp<T>)                                                                 \
  template ::prox::Status prox::tuning::tune_threshold<T>(::prox::tuning::Cache&, int, PROX_TUNING_ARGS_) noexcept; \
  template ::prox::Status prox::tuning::tune_down_gemv<T>(::prox::tuning::Cache&, int, int, PROX_TUNING_ARGS_) noexcept;

//! The ops of layer type (T, Act): Stage 1 (INT4 and fp16/bf16 proxies), GLU, fused Stage 2, tune_ffn.
#define PROX_TUNING_INSTANTIATE_LAYER(T, Act)                                                                          \
  PROX_TUNING_EXTERN_OP(::prox::DownGemvOp<T>)                                                                         \
  PROX_TUNING_INSTANTIATE_OP(::prox::ProxyGemvOp<T, Act, ::prox::Int4Weights>)                                         \
  PROX_TUNING_INSTANTIATE_OP(::prox::ProxyGemvOp<T, Act, ::prox::DenseWeights<T>>)                                     \
  PROX_TUNING_INSTANTIATE_OP(::prox::GluGemvOp<T, Act>)                                                                \
  PROX_TUNING_INSTANTIATE_OP(::prox::GluDownGemvOp<T, Act>)                                                            \
  template ::prox::Status prox::tuning::tune_proxy_gemv<T, ::prox::Int4Weights, Act>(::prox::tuning::Cache&, int, int, \
                                                                                     PROX_TUNING_ARGS_) noexcept;      \
  template ::prox::Status prox::tuning::tune_proxy_gemv<T, ::prox::DenseWeights<T>, Act>(                              \
      ::prox::tuning::Cache&, int, int, PROX_TUNING_ARGS_) noexcept;                                                   \
  template ::prox::Status prox::tuning::tune_glu_gemv<T, Act>(::prox::tuning::Cache&, int, int,                        \
                                                              PROX_TUNING_ARGS_) noexcept;                             \
  template ::prox::Status prox::tuning::tune_glu_down_gemv<T, Act>(::prox::tuning::Cache&, int, int,                   \
                                                                   PROX_TUNING_ARGS_) noexcept;                        \
  template ::prox::Status prox::tuning::tune_ffn<::prox::SparseFfn<T, Act, ::prox::Int4Weights>>(                      \
      ::prox::tuning::Cache&, int, int, const std::vector<double>&, PROX_TUNING_ARGS_) noexcept;
