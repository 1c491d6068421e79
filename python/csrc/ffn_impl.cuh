// SPDX-License-Identifier: Apache-2.0
//! @file ffn_impl.cuh  FfnPlan for one layer type; included by the generated ffn_<name>.cu files
//! (setup.py's LAYER_TYPES), each of which compiles one layer type's kernels.
#pragma once

#include <prox/prox.cuh>

#include "ffn_api.h"
#include "ffn_type.cuh"

namespace prox_ext {

template <class T, class ActT, Format kFormat>
class FfnPlanImpl final : public FfnPlan {
 public:
  using Ffn = FfnType<T, ActT, kFormat>;

  prox::Status plan(const FfnDesc& d) noexcept {
    typename Ffn::Config cfg;
    cfg.d_model = d.d_model;
    cfg.d_ff = d.d_ff;
    cfg.tau_x = 0.0f;  // unused: every run reads d.thresholds
    cfg.tau_s = 0.0f;
    cfg.thresholds = d.thresholds;
    cfg.max_tokens = d.max_tokens;
    const typename Ffn::Weights w = FfnTypeOf<T, ActT, kFormat>::weights(d);
    typename Ffn::PlanOptions o;
#define PROX_EXT_APPLY(name, def) o.name = d.flags.name;
    PROX_EXT_PLAN_FLAGS(PROX_EXT_APPLY)
#undef PROX_EXT_APPLY
    o.choice.proxy = d.flags.proxy;
    o.choice.glu = d.flags.glu;
    o.choice.down = d.flags.down;
    o.choice.glu_down = d.flags.glu_down;
    return ffn_.plan(cfg, w, o);
  }

  prox::Status run(const void* x, void* y, void* workspace, std::size_t bytes, cudaStream_t stream,
                   const FfnOutputs& out) const noexcept override {
    typename Ffn::Outputs o;
    o.counters = static_cast<prox::SparsityCounters*>(out.counters);
    o.channel_mask = out.mask;
    o.s_proxy = out.s_proxy;
    o.s = out.s;
    return ffn_.run(static_cast<const T*>(x), static_cast<T*>(y), workspace, bytes, stream, o);
  }

  prox::Status run_batch(const void* x, void* y, int tokens, void* workspace, std::size_t bytes,
                         cudaStream_t stream, const FfnOutputs& out) const noexcept override {
    typename Ffn::BatchOutputs o;
    o.counters = static_cast<prox::SparsityCounters*>(out.counters);
    o.channel_mask = out.mask;
    o.s_proxy = out.s_proxy;
    o.s = out.s;
    return ffn_.run_batch(static_cast<const T*>(x), static_cast<T*>(y), tokens, workspace, bytes, stream, o);
  }

  prox::Status run_proxy_values(const void* x, float* s_proxy, void* workspace, std::size_t bytes,
                                cudaStream_t stream) const noexcept override {
    return ffn_.run_proxy_values(static_cast<const T*>(x), s_proxy, workspace, bytes, stream);
  }

  void policies(int out[4]) const noexcept override {
    const prox::PolicyChoice c = ffn_.choice();
    out[0] = c.proxy;
    out[1] = c.glu;
    out[2] = c.down;
    out[3] = c.glu_down;
  }

 private:
  Ffn ffn_;
};

/**
 * @brief The dense Stage 2 of one layer type (DensePlan, ffn_api.h): the fused Stage-2 op of its SparseFfn on an
 * all-ones channel mask, with the plan's options. The mask, the s scratch and the op's workspace are the plan's
 * own device memory.
 */
template <class T, class ActT, Format kFormat>
class DensePlanImpl final : public DensePlan {
 public:
  using Ffn = FfnType<T, ActT, kFormat>;
  using Op = typename Ffn::FusedStage2Op;

  ~DensePlanImpl() override {
    // The plans live in a cache that is never destroyed; a plan dropped on a planning error frees its buffers.
    if (mem_ != nullptr) static_cast<void>(cudaFree(mem_));
  }

  prox::Status plan(const FfnDesc& d) noexcept {
    const typename Ffn::Weights w = FfnTypeOf<T, ActT, kFormat>::weights(d);
    typename Op::Args a;
    a.d_model = d.d_model;
    a.d_ff = d.d_ff;
    a.w_gate = w.gate;
    a.w_up = w.up;
    a.w_down_t = w.down_t;
    typename Ffn::PlanOptions po;
#define PROX_EXT_APPLY(name, def) po.name = d.flags.name;
    PROX_EXT_PLAN_FLAGS(PROX_EXT_APPLY)
#undef PROX_EXT_APPLY
    // Stand-ins for can_implement (16-byte aligned, never read): the real buffers follow.
    alignas(16) static const unsigned char standin[16] = {};
    a.x = reinterpret_cast<const T*>(standin);
    a.y = reinterpret_cast<T*>(const_cast<unsigned char*>(standin));
    a.channel_mask = reinterpret_cast<const std::uint32_t*>(standin);
    a.s = reinterpret_cast<float*>(const_cast<unsigned char*>(standin));
    const std::size_t n = static_cast<std::size_t>(d.d_ff);
    const std::size_t mask_bytes = prox::round_up(sizeof(std::uint32_t) * (n / 32), std::size_t{256});
    const std::size_t s_bytes = prox::round_up(sizeof(float) * n, std::size_t{256});
    ws_bytes_ = prox::Operator<Op>::workspace_bytes(a);
    if (cudaMalloc(&mem_, mask_bytes + s_bytes + ws_bytes_ + 16) != cudaSuccess) {
      mem_ = nullptr;
      return prox::Status::kErrorCudaRuntime;
    }
    char* base = static_cast<char*>(mem_);
    a.channel_mask = reinterpret_cast<const std::uint32_t*>(base);
    a.s = reinterpret_cast<float*>(base + mask_bytes);
    ws_ = base + mask_bytes + s_bytes;
    PROX_RETURN_IF_ERROR(op_.initialize(a, Ffn::template op_options<Op>(po), d.flags.glu_down));
    const cudaStream_t s = cudaStreamPerThread;
    // The weights' values the plan can see (an FP8 layer's scales), as SparseFfn::plan checks them
    // (PlanOptions::check_scales): a dense FFN on an invalid scale would be a silent wrong answer.
    using Fmt = typename FfnTypeOf<T, ActT, kFormat>::Fmt;
    PROX_RETURN_IF_ERROR(Fmt::check_values(w.gate, d.d_ff, d.d_model, prox::WeightOrientation::kOutIn, s));
    PROX_RETURN_IF_ERROR(Fmt::check_values(w.up, d.d_ff, d.d_model, prox::WeightOrientation::kOutIn, s));
    PROX_RETURN_IF_ERROR(Fmt::check_values(w.down_t, d.d_ff, d.d_model, prox::WeightOrientation::kInOut, s));
    if (cudaMemsetAsync(base, 0xff, mask_bytes, s) != cudaSuccess) return prox::Status::kErrorCudaRuntime;
    if (ws_bytes_ > 0) PROX_RETURN_IF_ERROR(prox::initialize_workspace(ws_, ws_bytes_, s));
    return cudaStreamSynchronize(s) == cudaSuccess ? prox::Status::kSuccess : prox::Status::kErrorCudaRuntime;
  }

  prox::Status run(const void* x, void* y, cudaStream_t stream) const noexcept override {
    typename Op::Args a = op_.args();
    a.x = static_cast<const T*>(x);
    a.y = static_cast<T*>(y);
    return op_.run(a, ws_, ws_bytes_, stream);
  }

  int policy() const noexcept override { return op_.policy(); }

 private:
  prox::Operator<Op> op_;
  void* mem_ = nullptr;
  void* ws_ = nullptr;
  std::size_t ws_bytes_ = 0;
};

template <class T, class ActT, Format kFormat>
prox::Status make_dense_impl(const FfnDesc& d, std::unique_ptr<DensePlan>* out) {
  auto p = std::make_unique<DensePlanImpl<T, ActT, kFormat>>();
  const prox::Status st = p->plan(d);
  if (st == prox::Status::kSuccess) *out = std::move(p);
  return st;
}

template <class T, class ActT, Format kFormat>
prox::Status make_plan_impl(const FfnDesc& d, std::unique_ptr<FfnPlan>* out) {
  auto p = std::make_unique<FfnPlanImpl<T, ActT, kFormat>>();
  const prox::Status st = p->plan(d);
  if (st == prox::Status::kSuccess) *out = std::move(p);
  return st;
}

}  // namespace prox_ext

//! Defines the factories of one layer type (make_plan_<name>, make_dense_<name>) and instantiates its kernels in
//! this translation unit (a generated ffn_<name>.cu holds one line of it).
#define PROX_EXT_DEFINE_FACTORY(T, ActT, format, name)                                    \
  PROX_EXT_INSTANTIATE(T, ActT, format)                                                   \
  namespace prox_ext {                                                                    \
  prox::Status make_plan_##name(const FfnDesc& d, std::unique_ptr<FfnPlan>* out) {        \
    return make_plan_impl<T, ActT, Format::format>(d, out);                               \
  }                                                                                       \
  prox::Status make_dense_##name(const FfnDesc& d, std::unique_ptr<DensePlan>* out) {     \
    return make_dense_impl<T, ActT, Format::format>(d, out);                              \
  }                                                                                       \
  }
