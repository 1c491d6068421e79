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

template <class T, class ActT, Format kFormat>
prox::Status make_plan_impl(const FfnDesc& d, std::unique_ptr<FfnPlan>* out) {
  auto p = std::make_unique<FfnPlanImpl<T, ActT, kFormat>>();
  const prox::Status st = p->plan(d);
  if (st == prox::Status::kSuccess) *out = std::move(p);
  return st;
}

}  // namespace prox_ext

//! Defines the factory of one layer type and instantiates its kernels in this translation unit (a
//! generated ffn_<name>.cu holds one line of it).
#define PROX_EXT_DEFINE_FACTORY(T, ActT, format, name)                                  \
  PROX_EXT_INSTANTIATE(T, ActT, format)                                                 \
  namespace prox_ext {                                                                  \
  prox::Status name(const FfnDesc& d, std::unique_ptr<FfnPlan>* out) {                  \
    return make_plan_impl<T, ActT, Format::format>(d, out);                             \
  }                                                                                     \
  }
