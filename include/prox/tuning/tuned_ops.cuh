// SPDX-License-Identifier: Apache-2.0
//! @file tuned_ops.cuh  The registry of tuned ops: the one list a tunable op is added to
//! (docs/tuning.md, "Adding a tuned op"). Everything else is derived from it: the policy table and
//! OpKey (choose.cuh), and in the prox_tuning library the tune<Op> instances (instances_*.cu) and the
//! ops mode 2's miss handler maps a missed key back to (open.cu).
//!
//! An op goes in the list that matches its template parameters: TunedTypeOps<T> for an op of the
//! element type alone, TunedLayerOps<T, Act> for an op of a layer type. Its header states its cache
//! key (`static constexpr TuneKeyFields kTuneKey`, core/tune_key.hpp) and is included here (this header
//! includes the tuned ops' headers, not the umbrella prox.cuh); its measurement is a TuneIO adapter,
//! tools/tuning/src/io_<op>.cuh. The Stage-2 ops are listed once per Stage-2 weight format of
//! Stage2FormatsFor<T> (stage2_weights.cuh): a new format is one entry there.
#pragma once

#include "../activation.cuh"
#include "../dense_weights.cuh"
#include "../down_gemv.cuh"
#include "../fp8_policies.cuh"
#include "../fp8_weights.cuh"
#include "../glu_down_gemv.cuh"
#include "../glu_gemv.cuh"
#include "../int4.cuh"
#include "../proxy_gemv.cuh"
#include "../stage2_weights.cuh"
#include "../threshold.cuh"

PROX_NAMESPACE_BEGIN

namespace tuning {

//! A list of op types.
template <class... Ops>
struct OpList {};

//! A list of element types or activations.
template <class... Ts>
struct TypeList {};

// ---------------------------------------------------------------- the registry
//! The Stage-2 weight formats whose ops prox-tune measures (each op has a TuneIO adapter), for activations of T.
template <class T>
using Stage2FormatsFor = TypeList<NativeWeights<T>>;

//! Every Stage-2 weight format, tuned or not: their ops' keys are valid in a cache file, and their candidate
//! lists are part of the policy table (choose.cuh, and so of its hash). The FP8 formats' ops have no TuneIO
//! adapter yet: prox-tune does not measure them, and choose() falls back to the default rules on their keys.
template <class T>
using Stage2KeyedFormatsFor = TypeList<NativeWeights<T>, Fp8ChannelWeights, Fp8BlockWeights>;

namespace detail {
template <class T, class Formats>
struct TypeOpsOf;
template <class T, class... Fmts>
struct TypeOpsOf<T, TypeList<Fmts...>> {
  using type = OpList<ThresholdOp<T>, DownGemvOp<T, Fmts>...>;
};
template <class T, class Act, class Formats>
struct LayerOpsOf;
template <class T, class Act, class... Fmts>
struct LayerOpsOf<T, Act, TypeList<Fmts...>> {
  using type = OpList<ProxyGemvOp<T, Act, Int4Weights>, ProxyGemvOp<T, Act, DenseWeights<T>>, GluGemvOp<T, Act, Fmts>...,
                      GluDownGemvOp<T, Act, Fmts>...>;
};
}  // namespace detail

//! The tuned ops of element type T that take no activation: the threshold op, the down GEMV of every tuned format.
template <class T>
using TunedTypeOps = typename detail::TypeOpsOf<T, Stage2FormatsFor<T>>::type;

//! The tuned ops of layer type (T, Act): Stage 1 with INT4 and with T proxies, the GLU GEMV and the fused Stage 2
//! of every tuned format.
template <class T, class Act>
using TunedLayerOps = typename detail::LayerOpsOf<T, Act, Stage2FormatsFor<T>>::type;

//! The keyed ops (the tuned ones and those of the other Stage-2 formats), as TunedTypeOps / TunedLayerOps.
template <class T>
using KeyedTypeOps = typename detail::TypeOpsOf<T, Stage2KeyedFormatsFor<T>>::type;
template <class T, class Act>
using KeyedLayerOps = typename detail::LayerOpsOf<T, Act, Stage2KeyedFormatsFor<T>>::type;

// ---------------------------------------------------------------- derived lists
//! The ops of several OpLists, in order (::type).
template <class... Lists>
struct ConcatOps;
template <>
struct ConcatOps<> {
  using type = OpList<>;
};
template <class... A>
struct ConcatOps<OpList<A...>> {
  using type = OpList<A...>;
};
template <class... A, class... B, class... Rest>
struct ConcatOps<OpList<A...>, OpList<B...>, Rest...> : ConcatOps<OpList<A..., B...>, Rest...> {};

namespace detail {
template <class Types, class Acts>
struct ExpandTunedOps;
template <class... Ts, class... Acts>
struct ExpandTunedOps<TypeList<Ts...>, TypeList<Acts...>> {
  template <class T>
  using Layers = typename ConcatOps<TunedLayerOps<T, Acts>...>::type;
  using type = typename ConcatOps<TunedTypeOps<Ts>..., Layers<Ts>...>::type;
};
}  // namespace detail

/**
 * @brief The registry expanded over element types `Types` and activations `Acts` (TypeLists):
 * TunedTypeOps<T> for every T, then TunedLayerOps<T, Act> for every T and Act.
 */
template <class Types, class Acts>
using TunedOpsFor = typename detail::ExpandTunedOps<Types, Acts>::type;

//! The number of ops of an OpList.
template <class... Ops>
constexpr int op_count(OpList<Ops...>) noexcept {
  return static_cast<int>(sizeof...(Ops));
}

}  // namespace tuning

PROX_NAMESPACE_END
