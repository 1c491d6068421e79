// SPDX-License-Identifier: Apache-2.0
//! @file open.cu  Caches found from the environment (open_cache, default_cache); mode 2: the miss
//! handler, which maps a missed key back to the op it belongs to and tunes it; and the named tuning
//! functions (tune_threshold ... tune_glu_down_gemv, tune_ffn). Compiles no kernel: everything here
//! reaches tune<Op> and tune_op<Op> by their declarations; they are compiled in instances_*.cu for
//! every op of the registry (prox/tuning/tuned_ops.cuh).
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <prox/tuning/choose.cuh>
#include <prox/tuning/tuned_ops.cuh>
#include <prox_tuning/tune.hpp>

#include "tune_op.hpp"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace {

//! Every op instances_*.cu compile tune<Op> and tune_op<Op> for: the registry over the element types
//! and activations of the library, one TU per TunedTypeOps<T> and per TunedLayerOps<T, Act> (an op
//! missing there is a link error).
using InstantiatedOps = TunedOpsFor<TypeList<__half, __nv_bfloat16>, TypeList<SiLU, GeluTanh>>;
static_assert(op_count(InstantiatedOps{}) ==
                  2 * op_count(TunedTypeOps<__half>{}) + 4 * op_count(TunedLayerOps<__half, SiLU>{}),
              "the registry over 2 element types and 2 x 2 layer types");

//! Tune `key` with the op whose key builder produces it; false if no instantiated op does.
template <class... Ops>
bool tune_matching(OpList<Ops...>, Cache& cache, const Key& key, cudaStream_t stream, const TuneOptions& o,
                   Status* st) {
  const double d = bucket_density(key.density16);
  const auto try_op = [&](auto op) {
    using Op = decltype(op);
    if (op_key<Op>(key.d_model, key.d_ff, d) != key) return false;
    *st = detail::tune_op<Op>(cache, {key.d_model, key.d_ff}, {d}, stream, o, nullptr, detail::Lock::kHeld);
    return true;
  };
  return (try_op(Ops{}) || ...);
}

}  // namespace

Status tune_key_locked(Cache& cache, const Key& key, cudaStream_t stream, const TuneOptions& options) noexcept {
  try {
    Status st = Status::kSuccess;
    return tune_matching(InstantiatedOps{}, cache, key, stream, options, &st) ? st : Status::kErrorInvalidArgument;
  } catch (...) {
    return Status::kErrorCudaRuntime;
  }
}

void install_miss_handler(Cache& cache, const TuneOptions& options) {
  cache.set_miss_handler([options](Cache& c, const std::vector<Key>& missing, cudaStream_t stream) {
    const std::size_t before = c.size();
    for (const Key& k : missing) {
      if (c.find(k)) continue;  // tuned meanwhile, or an entry this table cannot use: left as it is
      const Status st = tune_key_locked(c, k, stream, options);
      if (st == Status::kErrorInvalidArgument) continue;  // no op of this library makes this key
      PROX_RETURN_IF_ERROR(st);
    }
    if (c.size() != before && !c.path().empty()) (void)save(c);  // a failure warns once
    return Status::kSuccess;
  });
}

Status open_cache(std::unique_ptr<Cache>* out, const OpenOptions& options, int device) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  try {
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return Status::kErrorNoDevice;
    Signature sig;
    PROX_RETURN_IF_ERROR(query_signature(device, &sig));
    std::unique_ptr<Cache> cache = make_cache(sig, policy_table(), options);
    if (cache == nullptr) return Status::kErrorCacheIo;
    install_miss_handler(*cache, options.tune);
    const Status st = cache->load();
    *out = std::move(cache);
    return st;
  } catch (...) {
    return Status::kErrorCacheIo;
  }
}

Cache* default_cache() noexcept {
  try {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return nullptr;
    static std::mutex mutex;
    static std::map<int, std::unique_ptr<Cache>> caches;
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = caches.find(device);
    if (it != caches.end()) return it->second.get();
    std::unique_ptr<Cache> cache;
    (void)open_cache(&cache, OpenOptions{}, device);  // an unreadable file still gives a cache
    if (cache == nullptr) return nullptr;
    Cache* p = cache.get();
    caches.emplace(device, std::move(cache));
    return p;
  } catch (...) {
    return nullptr;
  }
}

// ---------------------------------------------------------------- the named functions
// tune<Op> under the names of the ops prox started with (a new op is tuned through tune<Op> alone),
// and tune_ffn, which tunes a layer's ops one after another (each takes the tuning mutex).

template <class T>
Status tune_threshold(Cache& cache, int n, const std::vector<double>& densities, cudaStream_t stream,
                      const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return tune<ThresholdOp<T>>(cache, n, 0, densities, stream, options, results);
}
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                       cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return tune<ProxyGemvOp<T, Act, Fmt>>(cache, d_model, d_ff, input_densities, stream, options, results);
}
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                     cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return tune<GluGemvOp<T, Act>>(cache, d_model, d_ff, channel_densities, stream, options, results);
}
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                      cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return tune<DownGemvOp<T>>(cache, d_model, d_ff, channel_densities, stream, options, results);
}
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                          cudaStream_t stream, const TuneOptions& options, std::vector<TuneResult>* results) noexcept {
  return tune<GluDownGemvOp<T, Act>>(cache, d_model, d_ff, channel_densities, stream, options, results);
}
template <class Ffn>
Status tune_ffn(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                const std::vector<double>& channel_densities, cudaStream_t stream, const TuneOptions& options,
                std::vector<TuneResult>* results) noexcept {
  PROX_RETURN_IF_ERROR(
      tune<typename Ffn::Stage1Op>(cache, d_model, d_ff, input_densities, stream, options, results));
  PROX_RETURN_IF_ERROR(tune<typename Ffn::GluOp>(cache, d_model, d_ff, channel_densities, stream, options, results));
  PROX_RETURN_IF_ERROR(tune<typename Ffn::DownOp>(cache, d_model, d_ff, channel_densities, stream, options, results));
  return tune<typename Ffn::FusedStage2Op>(cache, d_model, d_ff, channel_densities, stream, options, results);
}

}  // namespace tuning
PROX_NAMESPACE_END

#define PROX_TUNING_ARGS_ \
  const std::vector<double>&, cudaStream_t, const ::prox::tuning::TuneOptions&, std::vector<::prox::tuning::TuneResult>*

//! The named functions of element type T: the threshold op and the down GEMV.
#define PROX_TUNING_NAMED_TYPE(T)                                                                                   \
  template ::prox::Status prox::tuning::tune_threshold<T>(::prox::tuning::Cache&, int, PROX_TUNING_ARGS_) noexcept; \
  template ::prox::Status prox::tuning::tune_down_gemv<T>(::prox::tuning::Cache&, int, int, PROX_TUNING_ARGS_) noexcept;

//! The named functions of layer type (T, Act): Stage 1 (INT4 and T proxies), GLU, fused Stage 2, tune_ffn.
#define PROX_TUNING_NAMED_LAYER(T, Act)                                                                                \
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

// The layer types of InstantiatedOps.
PROX_TUNING_NAMED_TYPE(__half)
PROX_TUNING_NAMED_TYPE(__nv_bfloat16)
PROX_TUNING_NAMED_LAYER(__half, ::prox::SiLU)
PROX_TUNING_NAMED_LAYER(__half, ::prox::GeluTanh)
PROX_TUNING_NAMED_LAYER(__nv_bfloat16, ::prox::SiLU)
PROX_TUNING_NAMED_LAYER(__nv_bfloat16, ::prox::GeluTanh)
