// SPDX-License-Identifier: Apache-2.0
//! @file tune.hpp  The prox_tuning library (tools/tuning): measures every candidate policy of an op
//! on this GPU and records the fastest in a tuning Cache; writes cache files (save) and finds them
//! from the environment (open_cache, default_cache); serves mode 2 (tune on miss) as a Cache's miss
//! handler. `prox-tune` is its command line; engines that want online tuning link it too.
//!
//! Host-only declarations (C++17); the definitions are compiled into the library: tune<Op> for every
//! op of the registry of tuned ops (prox/tuning/tuned_ops.cuh) over T in {__half, __nv_bfloat16} and
//! Act in {SiLU, GeluTanh} (Stage 1 with Int4Weights and DenseWeights<T> proxies), the named functions
//! of the same ops (tune_threshold ... tune_glu_down_gemv), and tune_ffn for SparseFfn<T, Act, Int4Weights>.
//!
//! Measurement protocol (docs/tuning.md): synthetic random data at the bucket's density (its upper
//! edge, so every density of the bucket is covered); weights rotated over enough copies that more
//! than 2 x L2 of touched weight bytes pass between two uses of one copy (HBM-cold timings, as in
//! decoding); per candidate `warmup` untimed launches, then a delay kernel so the timed launches
//! queue up behind it, then >= 20 reps of `chain` (8) launches, each rep bracketed by CUDA events and
//! the launches chained with PDL as SparseFfn::run launches them; median, p20, p80 of the per-launch
//! mean of each rep. Policy 0 is checked against a float64 host reference and every other candidate
//! against policy 0, within per-element rounding bounds (prox_tuning/verify.hpp); a candidate that
//! fails, or fails to launch, gets an infinite time and is never chosen or persisted. Winner: the
//! lowest index within kTieTolerance (0.5 %) of the best.
//!
//! Tuning is never capturable: every entry point returns Status::kErrorCapturing when
//! cudaStreamIsCapturing says the stream captures (or cannot tell). It allocates and frees device
//! memory and synchronizes the stream; call it at start-up, before graph capture.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <prox/tuning/cache.hpp>

PROX_NAMESPACE_BEGIN
// The layer types the tuners are instantiated for (defined in the CUDA headers).
struct SiLU;
struct GeluTanh;
struct Int4Weights;
template <class W>
struct DenseWeights;
template <class W>
struct NativeWeights;
template <class T, class Act, class ProxyFmt, class WFmt>
class SparseFfn;
PROX_NAMESPACE_END

PROX_NAMESPACE_BEGIN

namespace tuning {

//! Minimum timed reps per candidate.
constexpr int kMinReps = 20;

//! How the tuner measures.
struct TuneOptions {
  int warmup = 3;  //!< untimed launches per candidate and round
  int reps = 25;   //!< timed reps per candidate (at least kMinReps), each `chain` launches
  int rounds = 2;  //!< the reps are split into rounds that visit candidates in turn (drift)
  //! Launches per timed rep, back to back between one pair of events and chained with PDL where the
  //! device has it (as SparseFfn::run launches): a rep's time is their mean, so each launch's ramp-up
  //! and tail overlap its neighbours' as in a decoding step's graph. 1 = each launch timed alone.
  int chain = 8;
  double tie_tolerance = kTieTolerance;                 //!< near-tie rule
  std::size_t rotate_bytes = 0;                         //!< touched weight bytes between two uses of a copy; 0: 2 x L2
  std::size_t max_rotate_bytes = std::size_t{4} << 30;  //!< cap on the copies (also <= half the free memory)
  bool verify = true;                                   //!< check every candidate's output against policy 0
  std::uint64_t seed = 0x9e3779b97f4a7c15ull;           //!< synthetic data seed
};

//! One candidate's outcome.
struct CandidateResult {
  std::string policy;                //!< policy name
  Status status = Status::kSuccess;  //!< plan/launch status (kSuccess if it launched)
  bool verified = false;             //!< output within the rounding bound (or verification was off)
  double median_us = HUGE_VAL;       //!< inf if it failed
  double p20_us = HUGE_VAL;
  double p80_us = HUGE_VAL;
  int reps = 0;
  std::string failure;  //!< why it was rejected ("" if fine)
};

//! What one tuning of one key found.
struct TuneResult {
  Key key;
  std::vector<CandidateResult> candidates;  //!< in list order
  int chosen = -1;                          //!< index of the winner (-1: every candidate failed)
  bool recorded = false;                    //!< the cache took the entry (false if the key was already there)
  int rotation_sets = 0;                    //!< weight copies rotated
  std::size_t rotation_bytes = 0;           //!< device bytes of those copies
};

/**
 * @brief Near-tie rule: the lowest index whose median is <= (1 + tolerance) * best median.
 * Non-finite or negative medians (failed candidates) never win. Returns -1 if none is valid.
 */
int choose_index(const std::vector<double>& medians, double tolerance = kTieTolerance) noexcept;

// ---------------------------------------------------------------- tuning one op
// Each tunes one op for a shape at several densities (deduplicated by 1/16 bucket; buffers
// allocated once), records the winners in `cache` (memory; save() persists) and appends one
// TuneResult per bucket to *results (optional). They lock cache.tuning_mutex() while they measure.
// Errors: kErrorCapturing if `stream` captures; kErrorInvalidShape for a shape the op refuses;
// kErrorCudaRuntime if allocation fails, or policy 0 fails to launch or to match the float64
// reference (the TuneResult says which).

/**
 * @brief Any tuned op: `Op` is an op of the registry (prox/tuning/tuned_ops.cuh) for a layer type the
 * library is compiled for, at input densities (Stage 1, threshold) or selected-channel densities
 * (Stage 2). An op keyed by d_model alone (the threshold op, of length d_model) ignores d_ff. The
 * named functions below are this for prox's first ops.
 * @code
 * std::vector<prox::tuning::TuneResult> r;
 * prox::tuning::tune<prox::GluGemvOp<__half, prox::SiLU>>(cache, 4096, 12288, {0.233, 0.3}, stream, {}, &r);
 * @endcode
 */
template <class Op>
Status tune(Cache& cache, int d_model, int d_ff, const std::vector<double>& densities, cudaStream_t stream,
            const TuneOptions& options = {}, std::vector<TuneResult>* results = nullptr) noexcept;

//! The threshold op on vectors of n elements of T, at input densities `densities`.
template <class T>
Status tune_threshold(Cache& cache, int n, const std::vector<double>& densities, cudaStream_t stream,
                      const TuneOptions& options = {}, std::vector<TuneResult>* results = nullptr) noexcept;

//! The Stage-1 proxy GEMV (Fmt = Int4Weights or DenseWeights<T>) at input densities.
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                       cudaStream_t stream, const TuneOptions& options = {},
                       std::vector<TuneResult>* results = nullptr) noexcept;

//! The masked GLU GEMV (unfused Stage 2) at selected-channel densities.
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                     cudaStream_t stream, const TuneOptions& options = {},
                     std::vector<TuneResult>* results = nullptr) noexcept;

//! The sparse down GEMV (unfused Stage 2) at selected-channel densities.
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                      cudaStream_t stream, const TuneOptions& options = {},
                      std::vector<TuneResult>* results = nullptr) noexcept;

/**
 * @brief The fused Stage 2 (what SparseFfn runs by default) at selected-channel densities, each
 * candidate on the grid and with the launch options SparseFfn::plan gives it.
 * @code
 * std::vector<prox::tuning::TuneResult> r;
 * prox::tuning::tune_glu_down_gemv<__half, prox::SiLU>(cache, 4096, 12288, {0.3}, stream, {}, &r);
 * @endcode
 */
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, const std::vector<double>& channel_densities,
                          cudaStream_t stream, const TuneOptions& options = {},
                          std::vector<TuneResult>* results = nullptr) noexcept;

/**
 * @brief The ops of a SparseFfn<T, Act, Int4Weights> layer shape, for both Stage-2 forms: the proxy
 * GEMV at every input density; the GLU and down GEMVs (PlanOptions::fuse_stage2 = false) and the fused
 * Stage 2 (true, the default) at every channel density. Results in the order proxy, GLU, down, fused.
 */
template <class Ffn>
Status tune_ffn(Cache& cache, int d_model, int d_ff, const std::vector<double>& input_densities,
                const std::vector<double>& channel_densities, cudaStream_t stream, const TuneOptions& options = {},
                std::vector<TuneResult>* results = nullptr) noexcept;

// Single-density forms: one key, its result (if any) in *result.
namespace detail {
template <class Fn>
Status tune_one(Fn&& fn, TuneResult* result) noexcept {
  try {
    std::vector<TuneResult> r;
    const Status st = fn(&r);
    if (result != nullptr && !r.empty()) *result = r.front();
    return st;
  } catch (...) {
    return Status::kErrorCudaRuntime;  // std::bad_alloc
  }
}
}  // namespace detail

template <class Op>
Status tune(Cache& cache, int d_model, int d_ff, double density, cudaStream_t stream, const TuneOptions& options = {},
            TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune<Op>(cache, d_model, d_ff, std::vector<double>{density}, stream, options, r);
      },
      result);
}
template <class T>
Status tune_threshold(Cache& cache, int n, double density, cudaStream_t stream, const TuneOptions& options = {},
                      TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune_threshold<T>(cache, n, std::vector<double>{density}, stream, options, r);
      },
      result);
}
template <class T, class Fmt, class Act>
Status tune_proxy_gemv(Cache& cache, int d_model, int d_ff, double input_density, cudaStream_t stream,
                       const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune_proxy_gemv<T, Fmt, Act>(cache, d_model, d_ff, std::vector<double>{input_density}, stream, options,
                                            r);
      },
      result);
}
template <class T, class Act>
Status tune_glu_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                     const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune_glu_gemv<T, Act>(cache, d_model, d_ff, std::vector<double>{channel_density}, stream, options, r);
      },
      result);
}
template <class T>
Status tune_down_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                      const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune_down_gemv<T>(cache, d_model, d_ff, std::vector<double>{channel_density}, stream, options, r);
      },
      result);
}
template <class T, class Act>
Status tune_glu_down_gemv(Cache& cache, int d_model, int d_ff, double channel_density, cudaStream_t stream,
                          const TuneOptions& options = {}, TuneResult* result = nullptr) noexcept {
  return detail::tune_one(
      [&](std::vector<TuneResult>* r) {
        return tune_glu_down_gemv<T, Act>(cache, d_model, d_ff, std::vector<double>{channel_density}, stream, options,
                                          r);
      },
      result);
}

// ---------------------------------------------------------------- mode 2
/**
 * @brief Tune one key now (any op and layer type this library is instantiated for), at its bucket's
 * density. The caller holds cache.tuning_mutex(). kErrorInvalidArgument for a key no instantiated op
 * produces.
 */
Status tune_key_locked(Cache& cache, const Key& key, cudaStream_t stream, const TuneOptions& options = {}) noexcept;

/**
 * @brief Make `cache` tune on miss (Mode::kTuneOnMiss): choose() hands its misses to a handler that
 * tunes them (tune_key_locked) and, when the cache has a file, saves it.
 */
void install_miss_handler(Cache& cache, const TuneOptions& options = {});

// ---------------------------------------------------------------- files and the environment
/**
 * @brief Persist: lock `<path>.lock`, re-read the file, merge (memory wins; the file's other valid
 * rows are kept and adopted into memory), write a new temporary file in the same directory
 * (created with O_EXCL), fsync, rename over the file, fsync the directory. A file with another
 * signature or format version is left alone (kErrorCacheIo, one warning); an unparsable one is
 * moved aside to `<path>.corrupt` (or `.corrupt.1`, `.corrupt.2`, ... when that exists) first.
 * No path: kErrorCacheIo (nothing to write to). Thread- and process-safe.
 */
Status save(Cache& cache) noexcept;

/**
 * @brief Where a cache file lives. Precedence: `explicit_path` > `PROX_AUTOTUNE_CACHE` (a file)
 * > `$PROX_CACHE_DIR/prox-<hash>.tsv` > `$XDG_CACHE_HOME/prox/prox-<hash>.tsv`
 * > `$HOME/.cache/prox/prox-<hash>.tsv`; empty variables count as unset. With use_environment
 * false only `explicit_path` counts. Returns "" (in-memory only) when nothing applies.
 * @param signature_hash Signature::hash_hex() of the device and build.
 */
std::string resolve_cache_path(const std::string& explicit_path, const std::string& signature_hash,
                               bool use_environment = true);

/**
 * @brief The mode from `PROX_AUTOTUNE`: "0" off, "1" read-only, "2" tune-on-miss; unset or empty:
 * read-only. Any other value: read-only, and *valid is set false.
 */
Mode mode_from_env(bool* valid = nullptr) noexcept;

//! How open_cache() / make_cache() find a cache: explicit values first, then the environment.
struct OpenOptions {
  std::string path;             //!< explicit file (highest precedence); "" = environment
  std::optional<Mode> mode;     //!< explicit mode; unset = PROX_AUTOTUNE (default read-only)
  bool use_environment = true;  //!< false: ignore PROX_AUTOTUNE* / PROX_CACHE_DIR / XDG / HOME
  TuneOptions tune;             //!< what mode 2's miss handler measures with
};

/**
 * @brief A Cache for signature `device` and `table` whose path and mode come from `options` and the
 * environment (an invalid PROX_AUTOTUNE is reported once, as a warning of the cache). Not loaded,
 * no miss handler. nullptr only if memory runs out.
 */
std::unique_ptr<Cache> make_cache(const Signature& device, PolicyTable table, const OpenOptions& options = {}) noexcept;

/**
 * @brief The cache of `device` (-1: the current one) with this build's policy table, located by
 * `options` and the environment, loaded, and with the miss handler installed (so PROX_AUTOTUNE=2
 * tunes misses). The cache is returned even if the file was unreadable (kErrorCacheIo); corrupt or
 * foreign files are ignored with one warning and give kSuccess.
 */
Status open_cache(std::unique_ptr<Cache>* out, const OpenOptions& options = {}, int device = -1) noexcept;

/**
 * @brief The process-wide cache of the current device (open_cache() with the environment), opened
 * on first use; one per device, never destroyed before exit; nullptr without a usable device.
 */
Cache* default_cache() noexcept;

// Exposed for the tests of the file format (not API).
namespace detail {
//! A finite non-negative microsecond value with 3 decimals (nanoseconds), locale-free.
std::string format_fixed3(double v);
//! The text of a cache file holding `entries` (rows in key order: deterministic files).
std::string format_cache_text(const Signature& sig, const Map& entries);
}  // namespace detail

}  // namespace tuning

PROX_NAMESPACE_END
