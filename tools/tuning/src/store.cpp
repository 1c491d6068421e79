// SPDX-License-Identifier: Apache-2.0
//! @file store.cpp  The tuning cache's file writer and its environment: save() (flock, re-read,
//! merge, a new temporary file, fsync, rename), where a cache file lives and which mode a cache
//! gets (PROX_AUTOTUNE*, PROX_CACHE_DIR, XDG_CACHE_HOME, HOME). Host-only; POSIX file calls.
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#if !defined(_WIN32)
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include <prox/tuning/cache.hpp>
#include <prox_tuning/tune.hpp>

PROX_NAMESPACE_BEGIN
namespace tuning {

namespace detail {

std::string format_fixed3(double v) {
  if (!(v >= 0.0) || !std::isfinite(v)) v = 0.0;
  const long long ns = std::llround(v * 1000.0);
  std::string frac = std::to_string(ns % 1000);
  while (frac.size() < 3) frac.insert(frac.begin(), '0');
  return std::to_string(ns / 1000) + "." + frac;
}

std::string format_cache_text(const Signature& sig, const Map& entries) {
  std::string s = std::string(kMagic) + "\n";
  for (const auto& [k, v] : sig.enforced_fields()) s += "# " + k + "\t" + percent_encode(v) + "\n";
  s += "# driver\t" + std::to_string(sig.driver_version) + "\n";
  const auto& cols = columns();
  for (std::size_t c = 0; c < cols.size(); ++c) s += (c ? "\t" : "") + cols[c];
  s += "\n";
  for (const auto& [ks, st] : entries) {
    const Entry& e = st.entry;
    s += ks + '\t' + percent_encode(e.policy) + '\t' + format_fixed3(e.median_us) + '\t' + format_fixed3(e.p20_us) +
         '\t' + format_fixed3(e.p80_us) + '\t' + std::to_string(e.reps) + '\n';
  }
  return s;
}

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

#if !defined(_WIN32)
//! Directory part of a path ("" for a bare file name).
std::string parent_dir(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return std::string();
  return slash == 0 ? std::string("/") : path.substr(0, slash);
}

//! mkdir -p; true if the directory exists afterwards.
bool make_dirs(const std::string& dir) {
  if (dir.empty()) return true;
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
  const std::string up = parent_dir(dir);
  if (!up.empty() && up != dir && !make_dirs(up)) return false;
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return false;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

//! Where a corrupt file goes: <path>.corrupt, or the first free <path>.corrupt.N (N < kCorruptSlots;
//! when all are taken, <path>.corrupt again), so one corrupt file does not replace another.
constexpr int kCorruptSlots = 100;
std::string corrupt_slot(const std::string& path) {
  const std::string base = path + ".corrupt";
  if (!exists(base)) return base;
  for (int n = 1; n < kCorruptSlots; ++n) {
    const std::string p = base + "." + std::to_string(n);
    if (!exists(p)) return p;
  }
  return base;
}

//! Attempts at a fresh temporary name before giving up (each O_EXCL: never an existing file or link).
constexpr int kTempAttempts = 16;

//! A random 64-bit value for temporary names (not guessable in advance).
std::uint64_t name_entropy() {
  try {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  } catch (...) {
    return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
}

/**
 * @brief Write `text` to a new file next to `path` and rename it over `path`: created with O_EXCL
 * (a name that exists, file or symbolic link, is never opened), written, fsync'ed, renamed. The
 * rename is made durable by an fsync of the directory (best effort). Returns "" or the error.
 */
std::string replace_file(const std::string& path, const std::string& dir, const std::string& text) {
  int fd = -1;
  std::string tmp;
  for (int attempt = 0; attempt < kTempAttempts && fd < 0; ++attempt) {
    tmp = path + ".tmp." + std::to_string(static_cast<long long>(::getpid())) + "." + to_hex64(name_entropy());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) return "cannot create " + tmp + ": " + std::strerror(errno);
  }
  if (fd < 0) return "cannot create a temporary file next to " + path;
  bool ok = true;
  std::size_t done = 0;
  while (ok && done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      ok = false;
    else
      done += static_cast<std::size_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  ok = (::close(fd) == 0) && ok;
  ok = ok && ::rename(tmp.c_str(), path.c_str()) == 0;
  if (!ok) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return "cannot write " + path + ": " + std::strerror(e);
  }
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return std::string();
}
#endif

}  // namespace
}  // namespace detail

//! The library's access to a Cache's file state (a friend of Cache).
class CacheWriter {
 public:
  static void warn(Cache& c, const std::string& tag, const std::string& message) noexcept { c.warn(tag, message); }

  static Status save(Cache& c) noexcept {
#if defined(_WIN32)
    (void)c;
    return Status::kErrorCacheIo;
#else
    try {
      const std::string& path = c.path_;
      if (path.empty()) return Status::kErrorCacheIo;
      const std::string dir = detail::parent_dir(path);
      if (!detail::make_dirs(dir)) {
        c.warn("io:" + path, "cannot create directory '" + dir + "' for " + path + ": " + std::strerror(errno));
        return Status::kErrorCacheIo;
      }
      // The lock file is never deleted (deleting it would let two writers lock different files).
      const std::string lock_path = path + ".lock";
      const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
      if (lock_fd < 0) {
        c.warn("io:" + path, "cannot open lock file " + lock_path + ": " + std::strerror(errno));
        return Status::kErrorCacheIo;
      }
      struct FdCloser {
        int fd;
        ~FdCloser() {
          ::flock(fd, LOCK_UN);
          ::close(fd);
        }
      } closer{lock_fd};
      while (::flock(lock_fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
          c.warn("io:" + path, "cannot lock " + lock_path + ": " + std::strerror(errno));
          return Status::kErrorCacheIo;
        }
      }
      LoadReport rep;
      detail::Map file_entries;
      const Status read_st = c.read_and_parse(&rep, &file_entries);
      if (read_st != Status::kSuccess) return read_st;  // unreadable: do not clobber what we cannot read
      c.report_load_problems(rep);                      // at most once per file and problem
      if (rep.state == FileState::kSignatureMismatch || rep.state == FileState::kVersionMismatch) {
        c.set_last_load(rep);
        return Status::kErrorCacheIo;
      }
      if (rep.state == FileState::kCorrupt) {
        const std::string aside = detail::corrupt_slot(path);
        if (::rename(path.c_str(), aside.c_str()) != 0) {
          c.warn("io:" + path, "cannot move corrupt " + path + " aside: " + std::strerror(errno));
          return Status::kErrorCacheIo;
        }
      }
      // Merge: file rows first, then memory on top (memory wins).
      const std::shared_ptr<const detail::Map> memory = c.snapshot_.load();  // held through the loop
      detail::Map merged = file_entries;
      for (const auto& [k, v] : *memory) merged[k] = v;
      const std::string error = detail::replace_file(path, dir, detail::format_cache_text(c.sig_, merged));
      if (!error.empty()) {
        c.warn("io:" + path, error);
        return Status::kErrorCacheIo;
      }
      c.merge_into_memory(file_entries, &rep);
      c.set_last_load(rep);
      return Status::kSuccess;
    } catch (...) {
      return Status::kErrorCacheIo;
    }
#endif
  }
};

Status save(Cache& cache) noexcept { return CacheWriter::save(cache); }

std::string resolve_cache_path(const std::string& explicit_path, const std::string& signature_hash,
                               bool use_environment) {
  if (!explicit_path.empty()) return explicit_path;
  if (!use_environment) return std::string();
  const std::string file = "prox-" + signature_hash + ".tsv";
  const std::string f = detail::env_or_empty("PROX_AUTOTUNE_CACHE");
  if (!f.empty()) return f;
  const std::string dir = detail::env_or_empty("PROX_CACHE_DIR");
  if (!dir.empty()) return dir + "/" + file;
  const std::string xdg = detail::env_or_empty("XDG_CACHE_HOME");
  if (!xdg.empty()) return xdg + "/prox/" + file;
  const std::string home = detail::env_or_empty("HOME");
  if (!home.empty()) return home + "/.cache/prox/" + file;
  return std::string();
}

Mode mode_from_env(bool* valid) noexcept {
  if (valid != nullptr) *valid = true;
  const char* v = std::getenv("PROX_AUTOTUNE");
  if (v == nullptr || v[0] == '\0') return Mode::kReadOnly;
  if (std::strcmp(v, "0") == 0) return Mode::kOff;
  if (std::strcmp(v, "1") == 0) return Mode::kReadOnly;
  if (std::strcmp(v, "2") == 0) return Mode::kTuneOnMiss;
  if (valid != nullptr) *valid = false;
  return Mode::kReadOnly;
}

std::unique_ptr<Cache> make_cache(const Signature& device, PolicyTable table, const OpenOptions& options) noexcept {
  try {
    bool valid = true;
    CacheOptions co;
    co.mode =
        options.mode.has_value() ? *options.mode : (options.use_environment ? mode_from_env(&valid) : Mode::kReadOnly);
    Signature sig = device;
    sig.policy_hash = policy_table_hash(table);
    co.path = resolve_cache_path(options.path, sig.hash_hex(), options.use_environment);
    auto cache = std::make_unique<Cache>(device, std::move(table), co);
    if (!valid)
      CacheWriter::warn(
          *cache, "env:PROX_AUTOTUNE",
          "PROX_AUTOTUNE='" + detail::env_or_empty("PROX_AUTOTUNE") + "' is not 0, 1 or 2; using read-only mode");
    return cache;
  } catch (...) {
    return nullptr;
  }
}

}  // namespace tuning
PROX_NAMESPACE_END
