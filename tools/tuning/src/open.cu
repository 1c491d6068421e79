// SPDX-License-Identifier: Apache-2.0
//! @file open.cu  Caches found from the environment (open_cache, default_cache) and mode 2: the miss
//! handler, which maps a missed key back to the op it belongs to and tunes it. Compiles no kernel:
//! tune_op<Op> is instantiated in instances_*.cu.
#include <map>
#include <memory>
#include <mutex>

#include <prox/tuning/choose.cuh>
#include <prox_tuning/tune.hpp>

#include "tune_op.hpp"

PROX_NAMESPACE_BEGIN
namespace tuning {
namespace {

//! Every op instances_*.cu compile tune_op for (a mismatch is a link error).
using InstantiatedOps =
    OpList<ThresholdOp<__half>, DownGemvOp<__half>, ThresholdOp<__nv_bfloat16>, DownGemvOp<__nv_bfloat16>,
           ProxyGemvOp<__half, SiLU, Int4Weights>, ProxyGemvOp<__half, SiLU, DenseWeights<__half>>,
           GluGemvOp<__half, SiLU>, GluDownGemvOp<__half, SiLU>, ProxyGemvOp<__half, GeluTanh, Int4Weights>,
           ProxyGemvOp<__half, GeluTanh, DenseWeights<__half>>, GluGemvOp<__half, GeluTanh>,
           GluDownGemvOp<__half, GeluTanh>, ProxyGemvOp<__nv_bfloat16, SiLU, Int4Weights>,
           ProxyGemvOp<__nv_bfloat16, SiLU, DenseWeights<__nv_bfloat16>>, GluGemvOp<__nv_bfloat16, SiLU>,
           GluDownGemvOp<__nv_bfloat16, SiLU>, ProxyGemvOp<__nv_bfloat16, GeluTanh, Int4Weights>,
           ProxyGemvOp<__nv_bfloat16, GeluTanh, DenseWeights<__nv_bfloat16>>, GluGemvOp<__nv_bfloat16, GeluTanh>,
           GluDownGemvOp<__nv_bfloat16, GeluTanh>>;

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

}  // namespace tuning
PROX_NAMESPACE_END
