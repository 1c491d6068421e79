// SPDX-License-Identifier: Apache-2.0
//! @file tuned_ops.cuh  The registry of tuned ops: the one list a tunable op is added to
//! (docs/tuning.md, "Adding a tuned op"). Everything else is derived from it: the policy table and
//! OpKey (choose.cuh), and in the prox_tuning library the tune<Op> instances (instances_*.cu) and the
//! ops mode 2's miss handler maps a missed key back to (open.cu).
//!
//! An op goes in the list that matches its template parameters: TunedTypeOps<T> for an op of the
//! element type alone, TunedLayerOps<T, Act> for an op of a layer type. Its header states its cache
//! key (`static constexpr TuneKeyFields kTuneKey`, core/tune_key.hpp) and is included by prox.cuh;
//! its measurement is a TuneIO adapter, tools/tuning/src/io_<op>.cuh.
#pragma once

#include "../prox.cuh"

PROX_NAMESPACE_BEGIN

namespace tuning {

//! A list of op types.
template <class... Ops>
struct OpList {};

//! A list of element types or activations.
template <class... Ts>
struct TypeList {};

// ---------------------------------------------------------------- the registry
//! The tuned ops of element type T that take no activation.
template <class T>
using TunedTypeOps = OpList<ThresholdOp<T>, DownGemvOp<T>>;

//! The tuned ops of layer type (T, Act): Stage 1 with INT4 and with T proxies, the GLU GEMV, the fused Stage 2.
template <class T, class Act>
using TunedLayerOps = OpList<ProxyGemvOp<T, Act, Int4Weights>, ProxyGemvOp<T, Act, DenseWeights<T>>,
                             GluGemvOp<T, Act>, GluDownGemvOp<T, Act>>;

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
