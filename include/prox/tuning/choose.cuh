// SPDX-License-Identifier: Apache-2.0
//! @file choose.cuh  The tuning cache as SparseFfn::plan() uses it: the cache key of a tuned op (OpKey,
//! from the fields the op's own header states), the policy table of this build (from the registry of
//! tuned ops, tuned_ops.cuh), opening a cache file by its path, and choose<Ffn>(), which fills a
//! PlanOptions' PolicyChoice by lookup (docs/tuning.md).
//!
//! Run-time only: no measuring, no file writing, no environment. The prox_tuning library (tools/tuning)
//! measures candidates, writes files and finds them from the environment; installed on a Cache as its
//! miss handler, it also serves mode 2 (tune on miss) through choose().
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/status.hpp"
#include "../core/tune_key.hpp"
#include "../core/types.cuh"
#include "../sparse_ffn.cuh"
#include "cache.hpp"
#include "tuned_ops.cuh"

PROX_NAMESPACE_BEGIN

namespace tuning {

// ---------------------------------------------------------------- the key of every tuned op
//! A key from its fields, the density rounded up to its 1/16 bucket.
inline Key make_key(const char* op, std::string dtype, std::string weights, std::string act, int d_model, int d_ff,
                    double density) {
  Key k;
  k.op = op;
  k.dtype = std::move(dtype);
  k.weights = std::move(weights);
  k.act = std::move(act);
  k.d_model = d_model;
  k.d_ff = d_ff;
  k.density16 = density_bucket(density);
  return k;
}

/**
 * @brief How a tuned op is keyed in the cache, from the fields its own header states (`Op::kTuneKey`,
 * core/tune_key.hpp): `kOp`, the name of its candidate list in the file, and `key(d_model, d_ff,
 * density)`. The density is the fraction of inputs kept for Stage 1 and the threshold op (whose length
 * is d_model; d_ff is ignored and keyed as 0), and the fraction of channels selected for the Stage-2
 * ops. An op without kTuneKey, or whose kTuneKey.op is null, cannot be tuned.
 */
template <class Op>
struct OpKey {
  static constexpr TuneKeyFields kFields = Op::kTuneKey;
  static_assert(kFields.op != nullptr, "this op has no tuning-cache key (a ProxyGemvOp with a list of its own?)");
  static constexpr const char* kOp = kFields.op;
  static Key key(int d_model, int d_ff, double density) {
    return make_key(kOp, kFields.dtype, kFields.weights, kFields.act, d_model, kFields.has_d_ff ? d_ff : 0, density);
  }
};

//! The cache key of op `Op` at (d_model, d_ff) and `density` (OpKey).
template <class Op>
Key op_key(int d_model, int d_ff, double density) {
  return OpKey<Op>::key(d_model, d_ff, density);
}

// ---------------------------------------------------------------- the policy table
/**
 * @brief One instance of every keyed candidate list: the registry (tuned_ops.cuh) for one element type and
 * activation, with every Stage-2 weight format (Stage2KeyedFormatsFor, tuned or not). A list depends on the op
 * and the weight format, not on the element type or the activation, so one instance stands for all of them
 * (NativeWeights<__half> and NativeWeights<__nv_bfloat16> share their lists and their names; a format may
 * share another's list and its name: consistent_lists).
 */
using TunedOps = typename ConcatOps<KeyedTypeOps<__half>, KeyedLayerOps<__half, SiLU>>::type;

namespace detail {
//! Whether two strings are equal (constexpr).
constexpr bool same_text(const char* a, const char* b) noexcept {
  while (*a != '\0' && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

//! Whether op A and every op of Ops that names A's candidate list have the same candidates.
template <class A, class... Ops>
constexpr bool same_name_same_list() noexcept {
  return ((!same_text(OpKey<A>::kOp, OpKey<Ops>::kOp) || std::is_same_v<typename A::Policies, typename Ops::Policies>) &&
          ...);
}

//! Whether the ops of a list that name one candidate list (the policy table has one row per name) have the
//! same candidates: two formats may share a list (and its row), never a name for two lists.
template <class... Ops>
constexpr bool consistent_lists(OpList<Ops...>) noexcept {
  return (same_name_same_list<Ops, Ops...>() && ...);
}

template <class... Ops>
PolicyTable make_policy_table(OpList<Ops...>) {
  PolicyTable t;
  ((t[OpKey<Ops>::kOp] = policy_names<typename Ops::Policies>()), ...);
  return t;
}
}  // namespace detail

static_assert(detail::consistent_lists(TunedOps{}),
              "two tuned ops name the same candidate list (kTuneKey.op) with different candidates");

/**
 * @brief The candidate names of every tuned op in this build: the table a Cache maps names with and
 * hashes into its file signature.
 */
inline PolicyTable policy_table() { return detail::make_policy_table(TunedOps{}); }

// ---------------------------------------------------------------- opening a file
/**
 * @brief A Cache of `device` (-1: the current one) with this build's policy table, reading the file
 * of `options` (explicit: no environment; the prox_tuning library's open_cache() also looks there).
 * The cache is returned even if the file was unreadable (status kErrorCacheIo); corrupt or foreign
 * files are ignored with one warning and give kSuccess.
 * @code
 * std::unique_ptr<prox::tuning::Cache> cache;
 * prox::tuning::CacheOptions o;
 * o.path = "/var/cache/engine/prox.tsv";
 * prox::tuning::open_cache(&cache, o);
 * @endcode
 */
inline Status open_cache(std::unique_ptr<Cache>* out, const CacheOptions& options, int device = -1) noexcept {
  if (out == nullptr) return Status::kErrorNullPointer;
  try {
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return Status::kErrorNoDevice;
    Signature sig;
    PROX_RETURN_IF_ERROR(query_signature(device, &sig));
    auto cache = std::make_unique<Cache>(sig, policy_table(), options);
    const Status st = cache->load();
    *out = std::move(cache);
    return st;
  } catch (...) {
    return Status::kErrorCacheIo;
  }
}

// ---------------------------------------------------------------- choose
/**
 * @brief The policies for a SparseFfn layer from the tuning cache: fills `opts->choice` for
 * SparseFfn::plan(cfg, weights, *opts).
 *
 * Reads `opts->fuse_stage2` and fills the fields of the kernels that plan will launch: `proxy`
 * always; `glu_down` for the fused Stage 2 (the default), `glu` and `down` otherwise. The other
 * fields, and every miss, are -1 (plan() uses the default for the shape).
 *
 * Mode kOff: every field -1. kReadOnly: cached choices. kTuneOnMiss: the misses go to the cache's
 * miss handler (under its tuning_mutex(), so concurrent calls tune a key once) and are looked up
 * again; without a handler, or while `stream` captures (the miss is then counted in
 * capture_misses()), they stay -1. Keys: the proxy GEMV at `input_density`, the Stage-2 op(s) at
 * `channel_density`, each rounded up to its 1/16 bucket; names map to indices of the compiled
 * candidate lists, so an entry naming a policy this build lacks is a miss.
 *
 * @tparam Ffn SparseFfn<T, Act, ProxyFmt>
 * @param input_density   expected fraction of x kept by tau_x (1 - s1)
 * @param channel_density expected fraction of channels selected by tau_s (1 - s2)
 * @param stream          where mode 2 measures (and what it checks for capture)
 * @return kSuccess, or (mode 2 only) the miss handler's error; opts->choice is valid either way.
 *
 * @code
 * using Ffn = prox::SparseFfn<__half>;
 * Ffn::PlanOptions opts;                          // fuse_stage2 = true: proxy + glu_down are chosen
 * prox::tuning::choose<Ffn>(cache, cfg, 0.30, 0.233, &opts);
 * ffn.plan(cfg, weights, opts);
 * @endcode
 */
template <class Ffn>
Status choose(Cache& cache, const typename Ffn::Config& cfg, double input_density, double channel_density,
              typename Ffn::PlanOptions* opts, cudaStream_t stream = nullptr) noexcept {
  if (opts == nullptr) return Status::kErrorNullPointer;
  PolicyChoice& c = opts->choice;
  c = PolicyChoice{};
  if (cache.mode() == Mode::kOff) return Status::kSuccess;
  try {
    const bool fused = opts->fuse_stage2;
    // The ops the plan launches, and the field each one's index goes to.
    const Key keys[3] = {op_key<typename Ffn::Stage1Op>(cfg.d_model, cfg.d_ff, input_density),
                         fused ? op_key<typename Ffn::FusedStage2Op>(cfg.d_model, cfg.d_ff, channel_density)
                               : op_key<typename Ffn::GluOp>(cfg.d_model, cfg.d_ff, channel_density),
                         op_key<typename Ffn::DownOp>(cfg.d_model, cfg.d_ff, channel_density)};
    int* const fields[3] = {&c.proxy, fused ? &c.glu_down : &c.glu, fused ? nullptr : &c.down};
    const auto look = [&](std::vector<Key>* missing) {
      for (int i = 0; i < 3; ++i) {
        if (fields[i] == nullptr) continue;
        *fields[i] = cache.index_of(keys[i]);
        if (*fields[i] < 0 && missing != nullptr) missing->push_back(keys[i]);
      }
    };
    std::vector<Key> missing;
    look(&missing);
    if (missing.empty() || cache.mode() != Mode::kTuneOnMiss) return Status::kSuccess;
    const MissHandler handler = cache.miss_handler();
    if (!handler) return Status::kSuccess;
    if (check_not_capturing(stream) != Status::kSuccess) {
      cache.count_capture_miss();
      return Status::kSuccess;
    }
    Status st = Status::kSuccess;
    {
      // Look again under the tuning mutex (another thread may have tuned meanwhile); hand on the rest.
      std::lock_guard<std::mutex> lock(cache.tuning_mutex());
      missing.clear();
      look(&missing);
      if (!missing.empty()) st = handler(cache, missing, stream);
    }
    look(nullptr);
    return st;
  } catch (...) {
    c = PolicyChoice{};
    return Status::kErrorCacheIo;
  }
}

}  // namespace tuning

PROX_NAMESPACE_END
