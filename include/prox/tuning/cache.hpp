// SPDX-License-Identifier: Apache-2.0
//! @file cache.hpp  The run-time half of the tuning cache: the Cache (a file's valid rows in memory,
//! lock-free lookups, the hook through which a tuner fills misses in mode 2) and its warnings.
//! Including it includes the whole run-time half: the vocabulary (keys, entries, policy table, the
//! device/build signature) of tuning/cache_key.hpp and the file format and its parser of
//! tuning/cache_file.hpp.
//!
//! Host-only C++17 (cuda_runtime.h only for the device signature and the capture check). The keys of
//! prox's ops and choose<Ffn>() are in tuning/choose.cuh. What an engine does not need at run time
//! lives in the compiled `prox_tuning` library (tools/tuning): the measuring harness, save() (file
//! locking, atomic replace) and the environment (PROX_AUTOTUNE, PROX_CACHE_DIR, XDG, HOME);
//! docs/tuning.md describes the design and the file.
//!
//! Guarantees
//!  - Lookups (find / index_of) never lock: they read an immutable snapshot
//!    (`std::shared_ptr<const Map>`, atomic load). Updates and loads swap the snapshot under one
//!    mutex; GPU tuning is serialized by tuning_mutex().
//!  - An entry, once in a Cache's memory, is never replaced for that Cache's lifetime (a later
//!    record or a file re-read keeps the first one), so a choice made is fixed for the process.
//!  - Nothing here throws (beyond std::bad_alloc from the constructor) or aborts. A corrupt,
//!    truncated, foreign-version or other-device file is ignored with ONE warning per file and
//!    problem, through the warning handler (set_warning_handler); malformed rows are skipped one
//!    by one and counted; rows naming an unknown op or policy are dropped.
//!  - Nothing here writes a file, reads the environment, or clears a pending CUDA error.
//!
//! Printing: prox prints nothing unless PROX_DEBUG is defined, with one documented exception:
//! the default warning handler of this cache writes one line ("prox: tuning cache: ...") to
//! stderr per warning. Install your own handler (or a no-op) with set_warning_handler().
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "../core/config.hpp"
#include "../core/status.hpp"
#include "cache_file.hpp"
#include "cache_key.hpp"

PROX_NAMESPACE_BEGIN

namespace tuning {

// ---------------------------------------------------------------- warnings
//! Receives one human-readable line per warning (no trailing newline).
using WarningHandler = std::function<void(const std::string&)>;

namespace detail {
struct WarningState {
  std::mutex mutex;
  WarningHandler handler;  // empty: default (stderr)
};
inline WarningState& warning_state() {
  static WarningState state;
  return state;
}
inline void emit_warning(const std::string& message) noexcept {
  try {
    WarningHandler h;
    {
      std::lock_guard<std::mutex> lock(warning_state().mutex);
      h = warning_state().handler;
    }
    if (h) {
      h(message);
    } else {
      std::fprintf(stderr, "prox: tuning cache: %s\n", message.c_str());
    }
  } catch (...) {
    // A throwing handler must not take the caller down.
  }
}
}  // namespace detail

/**
 * @brief Install the process-wide warning handler of the tuning cache; returns the previous one.
 * An empty handler restores the default (one line to stderr). To silence: `[](const std::string&) {}`.
 */
inline WarningHandler set_warning_handler(WarningHandler handler) {
  std::lock_guard<std::mutex> lock(detail::warning_state().mutex);
  WarningHandler old = std::move(detail::warning_state().handler);
  detail::warning_state().handler = std::move(handler);
  return old;
}

// ---------------------------------------------------------------- the snapshot of a Cache's entries
namespace detail {

//! Snapshot pointer with atomic load/store: the C++11 shared_ptr atomic free functions. (They are
//! deprecated in C++20 in favour of std::atomic<std::shared_ptr>, which libstdc++ 12 implements with
//! a pointer lock bit that ThreadSanitizer cannot see; the free functions use a mutex pool it can.)
template <class T>
class AtomicSharedPtr {
 public:
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
  std::shared_ptr<const T> load() const noexcept { return std::atomic_load_explicit(&p_, std::memory_order_acquire); }
  void store(std::shared_ptr<const T> v) noexcept {
    std::atomic_store_explicit(&p_, std::move(v), std::memory_order_release);
  }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

 private:
  std::shared_ptr<const T> p_ = std::make_shared<const T>();
};

}  // namespace detail

// ---------------------------------------------------------------- the cache
//! Where a Cache's file is and what choose() may do with it. The prox_tuning library's open_cache()
//! fills these from the environment; here they are explicit.
struct CacheOptions {
  std::string path;             //!< the file; "" = in memory only
  Mode mode = Mode::kReadOnly;  //!< what choose() does on a miss
};

class Cache;

/**
 * @brief Tunes the keys choose() missed (mode 2), called by choose() with the cache's tuning_mutex()
 * held and never while `stream` captures. The prox_tuning library installs one
 * (install_miss_handler(), and its open_cache() / default_cache()); without one a miss stays -1.
 * A key the handler cannot tune is left missing.
 */
using MissHandler = std::function<Status(Cache& cache, const std::vector<Key>& missing, cudaStream_t stream)>;

//! The prox_tuning library's access to a Cache's file state (its save() and environment handling).
class CacheWriter;

/**
 * @brief The tuning cache of one device and build: key -> chosen policy, read from a TSV file.
 * Writing the file (save()) and finding it from the environment are the prox_tuning library's.
 *
 * @code
 * prox::tuning::Signature sig;
 * prox::tuning::query_signature(device, &sig);
 * prox::tuning::Cache cache(sig, prox::tuning::policy_table(), {"/path/prox.tsv"});  // table: choose.cuh
 * cache.load();                                            // a missing file is fine
 * int idx = cache.index_of(key);                           // -1 on a miss
 * @endcode
 */
class Cache {
 public:
  /**
   * @param device  the device part of the signature (query_signature); policy_hash is replaced by
   *                the hash of `table`
   * @param table   current candidate names per op
   * @param options the file and the mode
   */
  Cache(const Signature& device, PolicyTable table, const CacheOptions& options = {})
      : table_(std::move(table)), sig_(device), path_(options.path), mode_(options.mode) {
    sig_.policy_hash = policy_table_hash(table_);
  }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  Mode mode() const noexcept { return mode_; }
  //! The file ("" = in-memory only).
  const std::string& path() const noexcept { return path_; }
  //! The full signature (policy_hash filled in).
  const Signature& signature() const noexcept { return sig_; }
  const PolicyTable& policies() const noexcept { return table_; }

  /**
   * @brief Read the file and merge its valid rows into memory (keys already in memory win).
   * A missing file or no path is success. A corrupt / foreign file is ignored with one warning and
   * still returns kSuccess (the cache simply stays as it was); see last_load() for details.
   * Returns kErrorCacheIo only if the file exists but cannot be read.
   */
  Status load() noexcept {
    try {
      LoadReport rep;
      detail::Map file_entries;
      const Status st = read_and_parse(&rep, &file_entries);
      merge_into_memory(file_entries, &rep);
      report_load_problems(rep);
      set_last_load(rep);
      return st;
    } catch (...) {
      return Status::kErrorCacheIo;
    }
  }

  //! The entry of `key`, if any (lock-free; never blocks on tuning or I/O).
  std::optional<Entry> find(const Key& key) const noexcept {
    try {
      const std::shared_ptr<const detail::Map> snap = snapshot_.load();
      const auto it = snap->find(detail::key_string(key));
      if (it == snap->end()) return std::nullopt;
      return it->second.entry;
    } catch (...) {
      return std::nullopt;
    }
  }

  //! Index of the cached policy of `key` in the op's list of this cache's table, or -1 on a miss
  //! (lock-free). The one name -> index mapping: choose() uses it with the compiled table.
  int index_of(const Key& key) const noexcept {
    const std::optional<Entry> e = find(key);
    if (!e) return -1;
    return policy_index(key.op, e->policy);
  }

  //! Index of policy `name` in `op`'s list of this cache's table, or -1.
  int policy_index(const std::string& op, const std::string& name) const noexcept {
    const auto it = table_.find(op);
    if (it == table_.end()) return -1;
    for (std::size_t i = 0; i < it->second.size(); ++i)
      if (it->second[i] == name) return static_cast<int>(i);
    return -1;
  }

  /**
   * @brief Insert an entry (memory only; the prox_tuning library's save() persists). If the key is
   * already present the existing entry is kept (choices are fixed for the Cache's lifetime) and
   * *inserted is false.
   * @return kErrorInvalidArgument for an unknown op/policy, a bad key or non-finite timings.
   */
  Status record(const Key& key, const Entry& entry, bool* inserted = nullptr) noexcept {
    try {
      if (inserted != nullptr) *inserted = false;
      bool unknown = false;
      if (!detail::check_entry(key, entry, table_, &unknown).empty()) return Status::kErrorInvalidArgument;
      std::lock_guard<std::mutex> lock(update_mutex_);
      const std::shared_ptr<const detail::Map> cur = snapshot_.load();
      const std::string ks = detail::key_string(key);
      if (cur->find(ks) != cur->end()) return Status::kSuccess;
      auto next = std::make_shared<detail::Map>(*cur);
      next->emplace(ks, detail::Stored{key, entry});
      snapshot_.store(std::move(next));
      if (inserted != nullptr) *inserted = true;
      return Status::kSuccess;
    } catch (...) {
      return Status::kErrorCacheIo;
    }
  }

  //! Number of entries in memory.
  std::size_t size() const noexcept { return snapshot_.load()->size(); }

  //! Every entry in memory, in key order.
  std::vector<std::pair<Key, Entry>> entries() const {
    std::vector<std::pair<Key, Entry>> out;
    const std::shared_ptr<const detail::Map> snap = snapshot_.load();
    out.reserve(snap->size());
    for (const auto& [k, v] : *snap) out.emplace_back(v.key, v.entry);
    return out;
  }

  //! Report of the last load() (or of the re-read inside the last save()).
  LoadReport last_load() const {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    return last_load_;
  }

  //! Number of warnings this Cache has emitted (each distinct problem at most once).
  int warnings() const noexcept { return warnings_.load(std::memory_order_relaxed); }
  //! Text of the last warning ("" if none).
  std::string last_warning() const {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    return last_warning_;
  }

  //! Serializes GPU timing (the tuner holds it while it measures; choose() while its handler runs).
  std::mutex& tuning_mutex() noexcept { return tuning_mutex_; }

  //! Install the handler choose() calls for misses in mode 2 (empty: misses stay -1). Thread-safe.
  void set_miss_handler(MissHandler handler) {
    std::lock_guard<std::mutex> lock(handler_mutex_);
    miss_handler_ = std::move(handler);
  }
  //! A copy of the installed miss handler (empty if none).
  MissHandler miss_handler() const {
    std::lock_guard<std::mutex> lock(handler_mutex_);
    return miss_handler_;
  }

  //! Count a miss that could not be tuned because the stream was capturing (mode 2).
  void count_capture_miss() noexcept { capture_misses_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t capture_misses() const noexcept { return capture_misses_.load(std::memory_order_relaxed); }

 private:
  friend class CacheWriter;

  //! Read + parse the file (no locks on memory). Fills *rep (state and counts) and *entries.
  Status read_and_parse(LoadReport* rep, detail::Map* entries) {
    *rep = LoadReport{};
    if (path_.empty()) {
      rep->state = FileState::kNoPath;
      return Status::kSuccess;
    }
    std::string text;
    std::string err;
    const detail::ReadResult r = detail::read_whole_file(path_, &text, &err);
    if (r == detail::ReadResult::kMissing) {
      rep->state = FileState::kMissing;
      return Status::kSuccess;
    }
    if (r == detail::ReadResult::kError) {
      rep->state = FileState::kUnreadable;
      rep->problem = err;
      warn("unreadable:" + path_, "cannot read " + path_ + ": " + err + " (ignored)");
      return Status::kErrorCacheIo;
    }
    if (text.size() > kMaxFileBytes) {
      rep->state = FileState::kCorrupt;
      rep->problem = "file larger than " + std::to_string(kMaxFileBytes) + " bytes";
      return Status::kSuccess;
    }
    detail::ParsedFile parsed = detail::parse_cache_text(text, sig_, table_);
    if (parsed.state == FileState::kLoaded) {
      *rep = parsed.report;
      *entries = std::move(parsed.entries);
    } else {
      rep->state = parsed.state;
      rep->problem = parsed.problem;
    }
    return Status::kSuccess;
  }

  //! Adopt file entries whose keys are not in memory yet; count the others in rep->kept_in_memory.
  void merge_into_memory(const detail::Map& file_entries, LoadReport* rep) {
    if (file_entries.empty()) return;
    std::lock_guard<std::mutex> lock(update_mutex_);
    const std::shared_ptr<const detail::Map> cur = snapshot_.load();
    auto next = std::make_shared<detail::Map>(*cur);
    std::size_t kept = 0;
    for (const auto& [k, v] : file_entries)
      if (!next->emplace(k, v).second) ++kept;
    rep->kept_in_memory = kept;
    snapshot_.store(std::move(next));
  }

  //! At most one warning per file and kind of problem.
  void report_load_problems(const LoadReport& rep) {
    switch (rep.state) {
      case FileState::kCorrupt:
        warn("corrupt:" + path_, "ignoring " + path_ + ": not a valid prox_autotune file (" + rep.problem + ")");
        break;
      case FileState::kVersionMismatch:
        warn("foreign:" + path_, "ignoring " + path_ + ": " + rep.problem + "; it will not be overwritten");
        break;
      case FileState::kSignatureMismatch:
        warn("foreign:" + path_, "ignoring " + path_ + ": " + rep.problem + "; it will not be overwritten");
        break;
      case FileState::kLoaded: {
        const std::size_t bad = rep.malformed + rep.unknown_policy + rep.duplicates;
        if (bad > 0) {
          warn("rows:" + path_, "skipped " + std::to_string(bad) + " of " + std::to_string(rep.rows) + " rows of " +
                                    path_ + " (malformed " + std::to_string(rep.malformed) + ", unknown policy " +
                                    std::to_string(rep.unknown_policy) + ", duplicate " +
                                    std::to_string(rep.duplicates) + "; first: " + rep.problem + ")");
        }
        break;
      }
      default: break;
    }
  }

  void set_last_load(const LoadReport& rep) {
    std::lock_guard<std::mutex> lock(warn_mutex_);
    last_load_ = rep;
  }

  //! Emit `message` unless a warning with this `tag` was emitted before.
  void warn(const std::string& tag, const std::string& message) noexcept {
    try {
      {
        std::lock_guard<std::mutex> lock(warn_mutex_);
        if (!warned_.insert(tag).second) return;
        last_warning_ = message;
      }
      warnings_.fetch_add(1, std::memory_order_relaxed);
      detail::emit_warning(message);
    } catch (...) {
    }
  }

  const PolicyTable table_;
  Signature sig_;
  const std::string path_;
  const Mode mode_;
  detail::AtomicSharedPtr<detail::Map> snapshot_;
  std::mutex update_mutex_;
  std::mutex tuning_mutex_;
  mutable std::mutex handler_mutex_;
  MissHandler miss_handler_;
  mutable std::mutex warn_mutex_;
  std::set<std::string> warned_;
  std::string last_warning_;
  LoadReport last_load_;
  std::atomic<int> warnings_{0};
  std::atomic<std::uint64_t> capture_misses_{0};
};

}  // namespace tuning

PROX_NAMESPACE_END
