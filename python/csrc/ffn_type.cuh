// SPDX-License-Identifier: Apache-2.0
//! @file ffn_type.cuh  The one place the extension names prox's layer type: a (T, activation, Stage-2 weight
//! format) of the layer-type list maps to its SparseFfn here, its Weights are made from the layer's slots
//! (ffn_api.h, PROX_EXT_LAYER_SLOTS) here, and it is instantiated (or declared extern) through the two macros
//! below. A new Stage-2 weight format is one specialization here, one entry of setup.py's FORMATS and
//! LAYER_TYPES, its slots (ffn_api.h) and their checks (layer_slots.h, FormatSlots): docs/python.md, "The
//! layer's tensors".
#pragma once

#include <prox/prox.cuh>
// FP8 is not in the umbrella header (its offline launchers would be compiled in every engine file that includes
// prox.cuh): the FP8 formats' types and candidate lists, and fp8.cuh's helpers offline.cu calls.
#include <prox/fp8_policies.cuh>

#include "ffn_api.h"

namespace prox_ext {

//! type: the layer type's SparseFfn; Fmt: its Stage-2 weight format; weights(d): its Weights from the slots of `d`
//! (which bindings.cpp has checked with the format's FormatSlots).
template <class T, class ActT, Format kFormat>
struct FfnTypeOf;

//! The native Stage 2: fp16/bf16 weights of the activation type T (prox::NativeWeights<T>, stage2_weights.cuh);
//! Stage 1 reads the INT4 proxies.
template <class T, class ActT>
struct FfnTypeOf<T, ActT, Format::kNative> {
  using Fmt = prox::NativeWeights<T>;  //!< Stage 2's weight format
  using type = prox::SparseFfn<T, ActT, prox::Int4Weights, Fmt>;

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

//! FP8 e4m3 Stage-2 weights with fp32 scales in layout L (prox::Fp8Weights<L>, fp8_weights.cuh): W_gate, W_up and
//! W_down^T are the e4m3 slots, their scales the w_*_scale slots (shapes checked by FormatSlots, layer_slots.h:
//! the Matrix's scale shape is the layout's own, fp8::scale_shape); Stage 1 reads the INT4 proxies packed from
//! the dequantized weights (fp8::pack_int4_device).
template <class T, class ActT, prox::fp8::ScaleLayout L>
struct Fp8FfnTypeOf {
  using Fmt = prox::Fp8Weights<L>;
  using type = prox::SparseFfn<T, ActT, prox::Int4Weights, Fmt>;

  static typename Fmt::Matrix matrix(const FfnDesc& d, Slot q, Slot s, prox::WeightOrientation o) noexcept {
    const prox::fp8::ScaleShape sh = prox::fp8::scale_shape(L, Fmt::orientation(o), d.d_ff, d.d_model);
    typename Fmt::Matrix m;
    m.w = d.slot<std::uint8_t>(q);
    m.scales = d.slot<float>(s);
    m.scale_rows = sh.rows;
    m.scale_cols = sh.cols;
    return m;
  }

  static typename type::Weights weights(const FfnDesc& d) noexcept {
    typename type::Weights w;
    w.gate = matrix(d, Slot::w_gate, Slot::w_gate_scale, prox::WeightOrientation::kOutIn);
    w.up = matrix(d, Slot::w_up, Slot::w_up_scale, prox::WeightOrientation::kOutIn);
    w.down_t = matrix(d, Slot::w_down_t, Slot::w_down_t_scale, prox::WeightOrientation::kInOut);
    w.proxy_gate = {d.slot<std::uint32_t>(Slot::proxy_gate), d.slot<float>(Slot::scale_gate)};
    w.proxy_up = {d.slot<std::uint32_t>(Slot::proxy_up), d.slot<float>(Slot::scale_up)};
    return w;
  }
};

template <class T, class ActT>
struct FfnTypeOf<T, ActT, Format::kFp8Channel> : Fp8FfnTypeOf<T, ActT, prox::fp8::ScaleLayout::kPerChannel> {};
template <class T, class ActT>
struct FfnTypeOf<T, ActT, Format::kFp8Block128> : Fp8FfnTypeOf<T, ActT, prox::fp8::ScaleLayout::kBlock128> {};

template <class T, class ActT, Format kFormat>
using FfnType = typename FfnTypeOf<T, ActT, kFormat>::type;

}  // namespace prox_ext

//! Instantiates / declares extern the kernels of one layer type (prox's explicit-instantiation macros).
#define PROX_EXT_INSTANTIATE(T, ActT, format) PROX_EXT_INSTANTIATE_##format(T, ActT)
#define PROX_EXT_EXTERN(T, ActT, format) PROX_EXT_EXTERN_##format(T, ActT)
#define PROX_EXT_INSTANTIATE_kNative(T, ActT) \
  PROX_SPARSE_FFN_INSTANTIATE(T, ActT, ::prox::Int4Weights, ::prox::NativeWeights<T>)
#define PROX_EXT_EXTERN_kNative(T, ActT) PROX_SPARSE_FFN_EXTERN(T, ActT, ::prox::Int4Weights, ::prox::NativeWeights<T>)
#define PROX_EXT_INSTANTIATE_kFp8Channel(T, ActT) \
  PROX_SPARSE_FFN_INSTANTIATE(T, ActT, ::prox::Int4Weights, ::prox::Fp8ChannelWeights)
#define PROX_EXT_EXTERN_kFp8Channel(T, ActT) \
  PROX_SPARSE_FFN_EXTERN(T, ActT, ::prox::Int4Weights, ::prox::Fp8ChannelWeights)
#define PROX_EXT_INSTANTIATE_kFp8Block128(T, ActT) \
  PROX_SPARSE_FFN_INSTANTIATE(T, ActT, ::prox::Int4Weights, ::prox::Fp8BlockWeights)
#define PROX_EXT_EXTERN_kFp8Block128(T, ActT) \
  PROX_SPARSE_FFN_EXTERN(T, ActT, ::prox::Int4Weights, ::prox::Fp8BlockWeights)
