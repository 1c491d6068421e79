// SPDX-License-Identifier: Apache-2.0
//! @file ffn_type.cuh  The one place the extension names prox's layer type: a (T, activation, Stage-2 weight
//! format) of the layer-type list maps to its SparseFfn here, its Weights are made from the layer's slots
//! (ffn_api.h, PROX_EXT_LAYER_SLOTS) here, and it is instantiated (or declared extern) through the two macros
//! below. A new Stage-2 weight format is one specialization here, one entry of setup.py's FORMATS and
//! LAYER_TYPES, its slots (ffn_api.h) and their checks (layer_slots.h, FormatSlots): docs/python.md, "The
//! layer's tensors".
#pragma once

#include <prox/prox.cuh>

#include "ffn_api.h"

namespace prox_ext {

//! type: the layer type's SparseFfn; weights(d): its Weights from the slots of `d` (which bindings.cpp has
//! checked with the format's FormatSlots).
template <class T, class ActT, Format kFormat>
struct FfnTypeOf;

//! Today's Stage 2: fp16/bf16 weights of the activation type T (prox::NativeWeights<T>, stage2_weights.cuh);
//! Stage 1 reads the INT4 proxies.
template <class T, class ActT>
struct FfnTypeOf<T, ActT, Format::kNative> {
  using type = prox::SparseFfn<T, ActT, prox::Int4Weights, prox::NativeWeights<T>>;

  static typename type::Weights weights(const FfnDesc& d) noexcept {
    typename type::Weights w;
    w.gate = d.slot<T>(Slot::w_gate);
    w.up = d.slot<T>(Slot::w_up);
    w.down_t = d.slot<T>(Slot::w_down_t);
    w.proxy_gate = {d.slot<std::uint32_t>(Slot::proxy_gate), d.slot<float>(Slot::scale_gate)};
    w.proxy_up = {d.slot<std::uint32_t>(Slot::proxy_up), d.slot<float>(Slot::scale_up)};
    return w;
  }
};

template <class T, class ActT, Format kFormat>
using FfnType = typename FfnTypeOf<T, ActT, kFormat>::type;

}  // namespace prox_ext

//! Instantiates / declares extern the kernels of one layer type (prox's explicit-instantiation macros).
#define PROX_EXT_INSTANTIATE(T, ActT, format) PROX_EXT_INSTANTIATE_##format(T, ActT)
#define PROX_EXT_EXTERN(T, ActT, format) PROX_EXT_EXTERN_##format(T, ActT)
#define PROX_EXT_INSTANTIATE_kNative(T, ActT) \
  PROX_SPARSE_FFN_INSTANTIATE(T, ActT, ::prox::Int4Weights, ::prox::NativeWeights<T>)
#define PROX_EXT_EXTERN_kNative(T, ActT) PROX_SPARSE_FFN_EXTERN(T, ActT, ::prox::Int4Weights, ::prox::NativeWeights<T>)
