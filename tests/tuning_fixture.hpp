// SPDX-License-Identifier: Apache-2.0
//! @file tuning_fixture.hpp  What the tuning-cache tests share: a temporary directory, a capture of
//! the cache's warnings, and the signature, policy table, keys and entries of a made-up device.
//! Host-only (the standard library and <prox/tuning/cache.hpp>); used by test_tuning_cache.cpp,
//! test_tuning_library.cpp and test_tuning_gpu.cu.
#pragma once

#include <stdlib.h>  // mkdtemp

#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <prox/tuning/cache.hpp>

namespace prox_test {

//! A fresh temporary directory (/tmp/<prefix>-XXXXXX), removed with its contents at scope exit.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "prox-tuning-test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

//! Captures the cache's warnings (a process-wide handler, hence the lock) for the scope.
class WarningCapture {
 public:
  WarningCapture() {
    old_ = prox::tuning::set_warning_handler([this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_.push_back(m);
    });
  }
  ~WarningCapture() { prox::tuning::set_warning_handler(std::move(old_)); }
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;
  std::vector<std::string> messages() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
  prox::tuning::WarningHandler old_;
};

//! The signature of a made-up H100-like device.
inline prox::tuning::Signature test_signature() {
  prox::tuning::Signature s;
  s.gpu_name = "Test GPU 80GB";
  s.sm_count = 132;
  s.cc_major = 9;
  s.cc_minor = 0;
  s.l2_bytes = 52428800;
  s.mem_bus_bits = 5120;
  s.mem_clock_khz = 2619000;
  s.driver_version = 13000;
  return s;
}

inline prox::tuning::PolicyTable test_table() {
  return {{"glu_gemv", {"glu_a", "glu_b", "glu_c"}}, {"down_gemv", {"down_a", "down_b"}}, {"threshold", {"thr1024"}}};
}

inline prox::tuning::CacheOptions file_options(const std::string& path) {
  prox::tuning::CacheOptions o;
  o.path = path;
  return o;
}

//! A key from its fields as a cache file spells them (the tests state keys literally, not through OpKey).
inline prox::tuning::Key text_key(std::string op, std::string dtype, std::string weights, std::string act, int d_model,
                                  int d_ff, int bucket) {
  prox::tuning::Key k;
  k.op = std::move(op);
  k.dtype = std::move(dtype);
  k.weights = std::move(weights);
  k.act = std::move(act);
  k.d_model = d_model;
  k.d_ff = d_ff;
  k.density16 = bucket;
  return k;
}

inline prox::tuning::Key glu_key(int d_model, int d_ff, int bucket) {
  return text_key("glu_gemv", "f16", "f16", "silu", d_model, d_ff, bucket);
}

/**
 * @brief The keys of every op of the registry of tuned ops (prox/tuning/tuned_ops.cuh) over f16/bf16 x
 * silu/gelu_tanh at (d_model, d_ff) and `bucket`, as cache files hold them (docs/tuning.md, "Keys and
 * values"): 2 x 2 ops of an element type, 4 x 4 of a layer type. Changing one orphans its cached entries.
 */
inline std::vector<prox::tuning::Key> registry_keys(int d_model, int d_ff, int bucket) {
  std::vector<prox::tuning::Key> keys;
  const auto add = [&](const char* op, const char* dtype, const char* weights, const char* act, int n_ff) {
    keys.push_back(text_key(op, dtype, weights, act, d_model, n_ff, bucket));
  };
  for (const char* t : {"f16", "bf16"}) {
    add("threshold", t, "-", "-", 0);  // its length is d_model: no d_ff
    add("down_gemv", t, t, "-", d_ff);
    for (const char* act : {"silu", "gelu_tanh"}) {
      add("proxy_gemv", t, "int4v1", act, d_ff);
      add("proxy_gemv_dense", t, t, act, d_ff);
      add("glu_gemv", t, t, act, d_ff);
      add("glu_down_gemv", t, t, act, d_ff);
    }
  }
  return keys;
}

inline prox::tuning::Entry entry(const std::string& policy, double median) {
  return prox::tuning::Entry{policy, median, median * 0.98, median * 1.03, 25};
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

}  // namespace prox_test
