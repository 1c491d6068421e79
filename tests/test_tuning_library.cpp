// SPDX-License-Identifier: Apache-2.0
//! @file test_tuning_library.cpp  Host tests of the prox_tuning library (tools/tuning): save()
//! (round trip, merge, foreign and corrupt files, no symlink followed, concurrent savers), where a
//! cache file lives and which mode a cache gets from the environment, the near-tie rule, and the
//! verification rule of prox_tuning/verify.hpp (a corrupted small output is caught, rounding is not).
#include "catch.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <prox/tuning/cache.hpp>
#include <prox_tuning/tune.hpp>
#include <prox_tuning/verify.hpp>

#include "tuning_fixture.hpp"

namespace fs = std::filesystem;
namespace pt = prox::tuning;
namespace pv = prox::tuning::verify;
using namespace prox_test;  // NOLINT(google-build-using-namespace): the shared tuning fixture

namespace {

//! Saves and restores the environment variables the library reads; clears them on entry.
class EnvGuard {
 public:
  EnvGuard() {
    for (const char* n : kNames) {
      const char* v = std::getenv(n);
      saved_.push_back({n, v != nullptr, v != nullptr ? std::string(v) : std::string()});
      unsetenv(n);
    }
  }
  ~EnvGuard() {
    for (const auto& s : saved_) {
      if (s.set)
        setenv(s.name, s.value.c_str(), 1);
      else
        unsetenv(s.name);
    }
  }

 private:
  static constexpr const char* kNames[] = {"PROX_AUTOTUNE", "PROX_AUTOTUNE_CACHE", "PROX_CACHE_DIR", "XDG_CACHE_HOME",
                                           "HOME"};
  struct Saved {
    const char* name;
    bool set;
    std::string value;
  };
  std::vector<Saved> saved_;
};

//! A valid file with two entries, written by save().
std::string valid_file_text(const TempDir& dir) {
  const std::string p = dir.file("valid-source.tsv");
  pt::Cache c(test_signature(), test_table(), file_options(p));
  REQUIRE(c.record(glu_key(4096, 12288, 8), entry("glu_b", 21.5)) == prox::Status::kSuccess);
  REQUIRE(c.record(glu_key(2048, 6144, 5), entry("glu_a", 7.25)) == prox::Status::kSuccess);
  REQUIRE(pt::save(c) == prox::Status::kSuccess);
  return read_text(p);
}

std::string replace_first(std::string s, const std::string& from, const std::string& to) {
  const auto pos = s.find(from);
  REQUIRE(pos != std::string::npos);
  s.replace(pos, from.size(), to);
  return s;
}

//! No temporary file of save() is left in `dir`.
void check_no_temporaries(const TempDir& dir) {
  for (const auto& e : fs::directory_iterator(dir.path()))
    CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
}

}  // namespace

// ---------------------------------------------------------------- the ops the library is compiled for
TEST_CASE("tuning library: mode 2 maps the key of every registry op and layer type to its op, no other", "[tuning]") {
  // d_model 0: each op is found and refuses the shape (or, without a GPU, the stream) before measuring.
  // kErrorInvalidArgument means no op of the library makes the key.
  pt::Cache cache(test_signature(), test_table());
  std::lock_guard<std::mutex> lock(cache.tuning_mutex());
  const std::vector<pt::Key> keys = registry_keys(0, 0, 5);
  for (const pt::Key& k : keys) {
    INFO(k.op << " " << k.dtype << " " << k.weights << " " << k.act);
    CHECK(pt::tune_key_locked(cache, k, nullptr) != prox::Status::kErrorInvalidArgument);
  }
  const auto changed = [](pt::Key k, std::string pt::Key::*field, const char* value) {
    k.*field = value;
    return k;
  };
  const auto first = [&](const char* op) {
    const auto it = std::find_if(keys.begin(), keys.end(), [&](const pt::Key& k) { return k.op == op; });
    REQUIRE(it != keys.end());
    return *it;
  };
  const pt::Key glu = first("glu_gemv");
  CHECK(pt::tune_key_locked(cache, changed(glu, &pt::Key::dtype, "f32"), nullptr) ==
        prox::Status::kErrorInvalidArgument);
  CHECK(pt::tune_key_locked(cache, changed(glu, &pt::Key::weights, "bf16"), nullptr) ==
        prox::Status::kErrorInvalidArgument);  // GLU weights are T
  CHECK(pt::tune_key_locked(cache, changed(glu, &pt::Key::act, "relu"), nullptr) ==
        prox::Status::kErrorInvalidArgument);
  CHECK(pt::tune_key_locked(cache, changed(glu, &pt::Key::op, "glu_gemv_int4"), nullptr) ==
        prox::Status::kErrorInvalidArgument);
  pt::Key threshold = first("threshold");
  threshold.d_ff = 128;  // the threshold op's key has no d_ff
  CHECK(pt::tune_key_locked(cache, threshold, nullptr) == prox::Status::kErrorInvalidArgument);
}

// ---------------------------------------------------------------- the near-tie rule
TEST_CASE("tuning library: the near-tie rule picks the lowest index within 0.5% of the best", "[tuning]") {
  const double inf = HUGE_VAL;
  CHECK(pt::kTieTolerance == 0.005);
  CHECK(pt::choose_index({10.0, 9.96, 10.5}) == 0);   // 10.0 <= 9.96 * 1.005
  CHECK(pt::choose_index({10.1, 10.0, 10.04}) == 1);  // 10.1 > 10.05
  CHECK(pt::choose_index({12.0, 10.0, 10.049}) == 1);
  CHECK(pt::choose_index({12.0, 10.051, 10.0}) == 2);  // 10.051 > 10.05
  CHECK(pt::choose_index({10.15, 10.0, 10.1}) == 1);   // a near-tie under the former 2 %, not under 0.5 %
  CHECK(pt::choose_index({inf, 5.0, 5.02}) == 1);      // a failed candidate never wins
  CHECK(pt::choose_index({std::nan(""), 5.0}) == 1);
  CHECK(pt::choose_index({inf, inf}) == -1);
  CHECK(pt::choose_index({}) == -1);
  CHECK(pt::choose_index({10.0, 9.0}, 0.2) == 0);
  for (int i = 0; i < 100; ++i) CHECK(pt::choose_index({3.01, 3.0, 3.0}) == 0);  // deterministic
}

// ---------------------------------------------------------------- the verification rule
namespace {
//! n products x_k w_k summed in fp32 in the given order (a candidate's summation order).
float sum_fp32(const std::vector<float>& x, const std::vector<float>& w, const std::vector<int>& order) {
  float s = 0.0f;
  for (int k : order) s = std::fmaf(x[static_cast<std::size_t>(k)], w[static_cast<std::size_t>(k)], s);
  return s;
}
}  // namespace

TEST_CASE("tuning library: verification catches a corrupted small output, not rounding", "[tuning]") {
  // Outputs y_j = sum_k x_k w_jk with rows of very different magnitude (the tuner's synthetic weights
  // span 8 octaves per row). Policy 0 sums in order, the candidate in another order: both are fp32
  // sums, within the per-element bound gamma(K) sum|x w| of the exact value.
  constexpr int K = 4096;
  constexpr int N = 64;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(K);
  for (auto& v : x) v = u(rng);
  std::vector<int> forward(K), backward(K), strided;
  for (int k = 0; k < K; ++k)
    forward[static_cast<std::size_t>(k)] = k, backward[static_cast<std::size_t>(k)] = K - 1 - k;
  for (int s = 0; s < 32; ++s)
    for (int k = s; k < K; k += 32) strided.push_back(k);  // a split-K-like order
  std::vector<pv::Bounded> exact(N);
  std::vector<double> policy0(N), candidate(N);
  for (int j = 0; j < N; ++j) {
    std::vector<float> w(K);
    const float row_scale = std::ldexp(0.05f, -(j % 8));
    for (auto& v : w) v = u(rng) * row_scale;
    double e = 0.0, a = 0.0;
    for (int k = 0; k < K; ++k) {
      e += static_cast<double>(x[static_cast<std::size_t>(k)]) * w[static_cast<std::size_t>(k)];
      a += std::fabs(static_cast<double>(x[static_cast<std::size_t>(k)]) * w[static_cast<std::size_t>(k)]);
    }
    exact[static_cast<std::size_t>(j)] = {e, pv::gamma(K) * a};
    policy0[static_cast<std::size_t>(j)] = sum_fp32(x, w, forward);
    candidate[static_cast<std::size_t>(j)] = sum_fp32(x, w, j % 2 ? backward : strided);
  }
  std::vector<double> want(N);
  for (int j = 0; j < N; ++j) want[static_cast<std::size_t>(j)] = exact[static_cast<std::size_t>(j)].v;
  // Rounding-level differences pass: policy 0 against the exact values, the candidate against policy 0.
  CHECK(pv::check_within("y", policy0, want, exact, {}, pv::Against::kExact).empty());
  CHECK(pv::check_within("y", candidate, policy0, exact, {}, pv::Against::kPolicy0).empty());

  // The smallest output of the rows scaled by 2^-7, corrupted by 1.5x its bound: rejected, although the
  // former tolerance 4e-3 |ref| + 1e-3 max|ref| would have let it through.
  std::size_t small = 7;
  double max_ref = 0.0;
  for (std::size_t j = 0; j < want.size(); ++j) {
    if (j % 8 == 7 && std::fabs(want[j]) < std::fabs(want[small])) small = j;
    max_ref = std::max(max_ref, std::fabs(want[j]));
  }
  const double bound = pv::tolerance(exact[small], {}, pv::Against::kPolicy0);
  std::vector<double> corrupted = candidate;
  corrupted[small] += 1.5 * bound;
  const std::string why = pv::check_within("y", corrupted, policy0, exact, {}, pv::Against::kPolicy0);
  CHECK(why.find("y[" + std::to_string(small) + "]") != std::string::npos);
  CHECK(1.5 * bound < 4e-3 * std::fabs(policy0[small]) + 1e-3 * max_ref);  // the old rule missed it
  // Within the bound it passes; a NaN never does.
  corrupted[small] = candidate[small] + 0.25 * bound;
  CHECK(pv::check_within("y", corrupted, policy0, exact, {}, pv::Against::kPolicy0).empty());
  corrupted[small] = std::nan("");
  CHECK_FALSE(pv::check_within("y", corrupted, policy0, exact, {}, pv::Against::kPolicy0).empty());
  // Only selected elements are checked where a selection is given.
  std::vector<std::uint8_t> selected(N, 1);
  selected[small] = 0;
  CHECK(pv::check_within("y", corrupted, policy0, exact, {}, pv::Against::kPolicy0, &selected).empty());
}

TEST_CASE("tuning library: stored outputs get half an ulp of their type on top", "[tuning]") {
  const pv::Bounded b{1.0, 1e-6};
  const pv::Storage f16{pv::kStoreRelF16, pv::kStoreAbsF16};
  CHECK(pv::tolerance(b, {}, pv::Against::kExact) == b.err);
  CHECK(pv::tolerance(b, f16, pv::Against::kExact) ==
        Approx(1e-6 + pv::kStoreRelF16 * (1.0 + 1e-6) + pv::kStoreAbsF16));
  CHECK(pv::tolerance(b, f16, pv::Against::kPolicy0) == Approx(2.0 * pv::tolerance(b, f16, pv::Against::kExact)));
  // 1 + 2^-11 rounds to 1 or 1 + 2^-10 in fp16: both within the fp16 tolerance of each other.
  CHECK(std::fabs((1.0 + 0.0009765625) - 1.0) <= pv::tolerance(pv::Bounded{1.0, 0.0}, f16, pv::Against::kPolicy0));
}

TEST_CASE("tuning library: channel bits may differ only near tau_s", "[tuning]") {
  const std::vector<pv::Bounded> exact = {{1.0, 1e-3}, {0.5, 1e-3}, {0.5004, 1e-3}, {0.2, 1e-3}};
  const double tau = 0.5;
  const std::vector<std::uint32_t> want = {0b0111u};
  const std::vector<double> want_s = {1.0, 0.5, 0.5004, 0.2};
  CHECK(pv::check_mask({0b0111u}, want, want_s, exact, tau, pv::Against::kExact).empty());
  CHECK(pv::check_mask({0b0001u}, want, want_s, exact, tau, pv::Against::kExact).empty());        // 1, 2: at tau
  CHECK_FALSE(pv::check_mask({0b0110u}, want, want_s, exact, tau, pv::Against::kExact).empty());  // 0 is not
  CHECK_FALSE(pv::check_mask({0b1111u}, want, want_s, exact, tau, pv::Against::kExact).empty());  // nor 3
}

// ---------------------------------------------------------------- writing a file
TEST_CASE("tuning library: numbers are written locale-free and read back", "[tuning]") {
  CHECK(pt::detail::format_fixed3(12.3456) == "12.346");
  CHECK(pt::detail::format_fixed3(0.0004) == "0.000");
  CHECK(pt::detail::format_fixed3(7.0) == "7.000");
  CHECK(pt::detail::format_fixed3(-1.0) == "0.000");
  double v = 0.0;
  for (double x : {0.001, 1.5, 123.456, 99999.999}) {
    CHECK(pt::detail::parse_fixed(pt::detail::format_fixed3(x), &v));
    CHECK(v == Approx(x).margin(1e-9));
  }
}

TEST_CASE("tuning library: save writes the documented format and reads back", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("sub/dir/cache.tsv");  // save() creates missing directories
  pt::Key odd = glu_key(4096, 12288, 8);
  odd.act = "we\tird\nact%";  // free-form fields survive encoding
  {
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.record(glu_key(4096, 12288, 8), entry("glu_b", 21.5)) == prox::Status::kSuccess);
    CHECK(c.record(odd, entry("glu_c", 33.125)) == prox::Status::kSuccess);
    CHECK(c.size() == 2);
    CHECK(pt::save(c) == prox::Status::kSuccess);
    CHECK(c.warnings() == 0);
  }
  const std::string text = read_text(p);
  INFO(text);
  CHECK(text.rfind("# prox_autotune v1\n", 0) == 0);
  CHECK(text.find("# gpu\tTest GPU 80GB\n") != std::string::npos);
  CHECK(text.find("# cc\t9.0\n") != std::string::npos);
  CHECK(text.find("# prox\t" PROX_VERSION_STRING "\n") != std::string::npos);
  CHECK(text.find("# driver\t13000\n") != std::string::npos);
  CHECK(text.find(
            "\nop\tdtype\tweights\tact\td_model\td_ff\tdensity16\tbatch\tpolicy\tmedian_us\tp20_us\tp80_us\treps\n") !=
        std::string::npos);
  CHECK(text.find("we%09ird%0Aact%25") != std::string::npos);
  CHECK(text.find("glu_gemv\tf16\tf16\tsilu\t4096\t12288\t8\t1\tglu_b\t21.500\t21.070\t22.145\t25\n") !=
        std::string::npos);
  CHECK(text.back() == '\n');
  CHECK_FALSE(fs::exists(p + ".corrupt"));
  check_no_temporaries(dir);

  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == 2);
  CHECK(r.index_of(odd) == 2);
  // Saving an unchanged cache rewrites the same bytes (deterministic row order).
  CHECK(pt::save(r) == prox::Status::kSuccess);
  CHECK(read_text(p) == text);
  CHECK(warnings.messages().empty());
  pt::Cache nowhere(test_signature(), test_table());
  CHECK(pt::save(nowhere) == prox::Status::kErrorCacheIo);  // no location
}

TEST_CASE("tuning library: save merges with the file, memory winning", "[tuning]") {
  TempDir dir;
  const std::string p = dir.file("merge.tsv");
  {
    pt::Cache w(test_signature(), test_table(), file_options(p));
    CHECK(w.record(glu_key(64, 128, 3), entry("glu_c", 1.0)) == prox::Status::kSuccess);
    CHECK(w.record(glu_key(64, 128, 4), entry("glu_b", 1.0)) == prox::Status::kSuccess);
    CHECK(pt::save(w) == prox::Status::kSuccess);
  }
  pt::Cache m(test_signature(), test_table(), file_options(p));
  CHECK(m.record(glu_key(64, 128, 3), entry("glu_a", 5.0)) == prox::Status::kSuccess);  // not loaded first
  CHECK(pt::save(m) == prox::Status::kSuccess);
  CHECK(m.size() == 2);  // the file's other row was adopted
  CHECK(m.last_load().kept_in_memory == 1);
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.find(glu_key(64, 128, 3))->policy == "glu_a");  // memory won in the file too
  CHECK(r.index_of(glu_key(64, 128, 4)) == 1);
}

TEST_CASE("tuning library: a foreign file is never overwritten; a corrupt one is moved aside", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string valid = valid_file_text(dir);
  SECTION("signature mismatch") {
    const std::string p = dir.file("foreign.tsv");
    const std::string foreign = replace_first(valid, "Test GPU 80GB", "Other GPU");
    write_text(p, foreign);
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.record(glu_key(64, 128, 3), entry("glu_a", 1.0)) == prox::Status::kSuccess);
    CHECK(pt::save(c) == prox::Status::kErrorCacheIo);
    CHECK(read_text(p) == foreign);
    CHECK(c.warnings() == 1);  // the same problem is not reported twice
    CHECK(c.last_load().state == pt::FileState::kSignatureMismatch);
  }
  SECTION("other format version") {
    const std::string p = dir.file("v2.tsv");
    const std::string v2 = replace_first(valid, "v1\n", "v2\n");
    write_text(p, v2);
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.record(glu_key(64, 128, 3), entry("glu_a", 1.0)) == prox::Status::kSuccess);
    CHECK(pt::save(c) == prox::Status::kErrorCacheIo);  // save without load: still refused
    CHECK(read_text(p) == v2);
    CHECK(c.warnings() == 1);
  }
  SECTION("garbage, twice: each corrupt file keeps its own slot") {
    const std::string p = dir.file("garbage.tsv");
    write_text(p, "not a cache\n");
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(c.record(glu_key(64, 128, 3), entry("glu_a", 1.0)) == prox::Status::kSuccess);
    CHECK(pt::save(c) == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(read_text(p + ".corrupt") == "not a cache\n");
    pt::Cache r(test_signature(), test_table(), file_options(p));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.warnings() == 0);
    CHECK(r.index_of(glu_key(64, 128, 3)) == 0);
    write_text(p, "garbage again\n");
    pt::Cache d(test_signature(), test_table(), file_options(p));
    CHECK(pt::save(d) == prox::Status::kSuccess);
    CHECK(read_text(p + ".corrupt") == "not a cache\n");  // the first one is not replaced
    CHECK(read_text(p + ".corrupt.1") == "garbage again\n");
  }
  SECTION("malformed rows are dropped on the next save, valid ones kept") {
    const std::string p = dir.file("rows.tsv");
    write_text(p, replace_first(valid, "\t21.500\t", "\tbad\t"));
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(pt::save(c) == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(c.size() == 1);  // the valid file row was adopted
    pt::Cache r(test_signature(), test_table(), file_options(p));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.warnings() == 0);
    CHECK(r.size() == 1);
  }
  SECTION("a table that gains an op: the older file is not clobbered until removed") {
    const std::string p = dir.file("before-fused.tsv");
    write_text(p, valid);
    pt::PolicyTable with_fused = test_table();
    with_fused["glu_down_gemv"] = {"glud_a", "glud_b"};
    pt::Cache c(test_signature(), with_fused, file_options(p));
    pt::Key fused = glu_key(4096, 12288, 5);
    fused.op = "glu_down_gemv";
    REQUIRE(c.record(fused, entry("glud_b", 30.0)) == prox::Status::kSuccess);
    CHECK(pt::save(c) == prox::Status::kErrorCacheIo);
    CHECK(read_text(p) == valid);
    REQUIRE(fs::remove(p));
    CHECK(pt::save(c) == prox::Status::kSuccess);
    pt::Cache r(test_signature(), with_fused, file_options(p));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.index_of(fused) == 1);
  }
  check_no_temporaries(dir);
}

TEST_CASE("tuning library: save follows no symbolic link it creates or locks", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("cache.tsv");
  const std::string target = dir.file("victim");
  REQUIRE(symlink(target.c_str(), (p + ".lock").c_str()) == 0);
  pt::Cache c(test_signature(), test_table(), file_options(p));
  CHECK(c.record(glu_key(64, 128, 3), entry("glu_a", 1.0)) == prox::Status::kSuccess);
  CHECK(pt::save(c) == prox::Status::kErrorCacheIo);
  CHECK_FALSE(fs::exists(target));  // not created through the link
  CHECK_FALSE(fs::exists(p));
  CHECK(c.warnings() == 1);
}

TEST_CASE("tuning library: the largest accepted timing survives save and load", "[tuning]") {
  TempDir dir;
  const std::string p = dir.file("big.tsv");
  const pt::Entry big{"glu_a", pt::detail::kMaxTimingUs / 2, pt::detail::kMaxTimingUs / 4, pt::detail::kMaxTimingUs,
                      25};
  {
    pt::Cache c(test_signature(), test_table(), file_options(p));
    REQUIRE(c.record(glu_key(64, 128, 4), big) == prox::Status::kSuccess);
    REQUIRE(pt::save(c) == prox::Status::kSuccess);
  }
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.find(glu_key(64, 128, 4))->p80_us == Approx(pt::detail::kMaxTimingUs));
}

// ---------------------------------------------------------------- location and mode
TEST_CASE("tuning library: location precedence API > PROX_AUTOTUNE_CACHE > PROX_CACHE_DIR > XDG > HOME", "[tuning]") {
  EnvGuard env;
  const std::string h = "0123456789abcdef";
  const std::string file = "prox-" + h + ".tsv";
  CHECK(pt::resolve_cache_path("", h).empty());  // nothing set (HOME cleared too)
  setenv("HOME", "/home/u", 1);
  CHECK(pt::resolve_cache_path("", h) == "/home/u/.cache/prox/" + file);
  setenv("XDG_CACHE_HOME", "/xdg", 1);
  CHECK(pt::resolve_cache_path("", h) == "/xdg/prox/" + file);
  setenv("PROX_CACHE_DIR", "/pcd", 1);
  CHECK(pt::resolve_cache_path("", h) == "/pcd/" + file);
  setenv("PROX_AUTOTUNE_CACHE", "/exact/file.tsv", 1);
  CHECK(pt::resolve_cache_path("", h) == "/exact/file.tsv");
  CHECK(pt::resolve_cache_path("/api/path.tsv", h) == "/api/path.tsv");
  CHECK(pt::resolve_cache_path("", h, /*use_environment=*/false).empty());
  setenv("PROX_AUTOTUNE_CACHE", "", 1);  // empty counts as unset
  CHECK(pt::resolve_cache_path("", h) == "/pcd/" + file);
  unsetenv("PROX_CACHE_DIR");
  CHECK(pt::resolve_cache_path("", h) == "/xdg/prox/" + file);
  unsetenv("XDG_CACHE_HOME");
  CHECK(pt::resolve_cache_path("", h) == "/home/u/.cache/prox/" + file);

  // make_cache: the cache's own signature hash names the file.
  TempDir dir;
  setenv("PROX_CACHE_DIR", dir.path().c_str(), 1);
  auto c = pt::make_cache(test_signature(), test_table());
  REQUIRE(c != nullptr);
  CHECK(c->path() == dir.file("prox-" + c->signature().hash_hex() + ".tsv"));
  pt::OpenOptions o;
  o.path = dir.file("explicit.tsv");
  CHECK(pt::make_cache(test_signature(), test_table(), o)->path() == o.path);
  o.path.clear();
  o.use_environment = false;
  CHECK(pt::make_cache(test_signature(), test_table(), o)->path().empty());
}

TEST_CASE("tuning library: the default file name carries the signature hash", "[tuning]") {
  EnvGuard env;
  TempDir dir;
  setenv("PROX_CACHE_DIR", dir.path().c_str(), 1);
  auto a = pt::make_cache(test_signature(), test_table());
  pt::Signature other = test_signature();
  other.sm_count = 114;  // another SKU / MIG slice
  auto b = pt::make_cache(other, test_table());
  pt::PolicyTable edited = test_table();
  edited["glu_gemv"].push_back("glu_d");  // a list edit
  auto c = pt::make_cache(test_signature(), edited);
  CHECK(a->path() != b->path());
  CHECK(a->path() != c->path());
  pt::Signature driver = test_signature();
  driver.driver_version = 12040;  // recorded, not enforced
  CHECK(a->path() == pt::make_cache(driver, test_table())->path());
  CHECK(a->signature().policy_hash == pt::policy_table_hash(test_table()));
}

TEST_CASE("tuning library: read-only by default; PROX_AUTOTUNE selects the mode", "[tuning]") {
  EnvGuard env;
  WarningCapture warnings;
  CHECK(pt::mode_from_env() == pt::Mode::kReadOnly);
  setenv("PROX_AUTOTUNE", "0", 1);
  CHECK(pt::mode_from_env() == pt::Mode::kOff);
  setenv("PROX_AUTOTUNE", "2", 1);
  CHECK(pt::mode_from_env() == pt::Mode::kTuneOnMiss);
  setenv("PROX_AUTOTUNE", "1", 1);
  CHECK(pt::mode_from_env() == pt::Mode::kReadOnly);
  setenv("PROX_AUTOTUNE", "yes", 1);
  bool env_valid = true;
  CHECK(pt::mode_from_env(&env_valid) == pt::Mode::kReadOnly);
  CHECK_FALSE(env_valid);
  pt::OpenOptions quiet;
  quiet.use_environment = false;  // the environment ignored
  CHECK(pt::make_cache(test_signature(), test_table(), quiet)->mode() == pt::Mode::kReadOnly);
  CHECK(pt::make_cache(test_signature(), test_table(), quiet)->warnings() == 0);
  {
    auto c = pt::make_cache(test_signature(), test_table());
    CHECK(c->mode() == pt::Mode::kReadOnly);
    CHECK(c->warnings() == 1);  // the bad value is reported once
  }
  setenv("PROX_AUTOTUNE", "2", 1);
  pt::OpenOptions o;
  o.mode = pt::Mode::kOff;  // the API beats the environment
  CHECK(pt::make_cache(test_signature(), test_table(), o)->mode() == pt::Mode::kOff);
  CHECK(pt::make_cache(test_signature(), test_table())->mode() == pt::Mode::kTuneOnMiss);
  unsetenv("PROX_AUTOTUNE");

  // Read-only: loading, looking up and recording never touch the file; only save() writes.
  TempDir dir;
  const std::string valid = valid_file_text(dir);
  const std::string p = dir.file("ro.tsv");
  write_text(p, valid);
  const auto before = fs::last_write_time(p);
  {
    pt::OpenOptions ro;
    ro.path = p;
    auto c = pt::make_cache(test_signature(), test_table(), ro);
    CHECK(c->mode() == pt::Mode::kReadOnly);
    CHECK(c->load() == prox::Status::kSuccess);
    CHECK(c->index_of(glu_key(4096, 12288, 8)) == 1);
    CHECK(c->record(glu_key(1, 32, 1), entry("glu_a", 1.0)) == prox::Status::kSuccess);
  }
  CHECK(read_text(p) == valid);
  CHECK(fs::last_write_time(p) == before);
  CHECK_FALSE(fs::exists(p + ".lock"));
}

// ---------------------------------------------------------------- concurrency
TEST_CASE("tuning library: lookups and records race with saves safely", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("race.tsv");
  pt::Cache c(test_signature(), test_table(), file_options(p));
  constexpr int kThreads = 6;
  constexpr int kPerThread = 60;
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::atomic<int> save_errors{0};
  std::thread saver([&] {
    while (!stop.load())
      if (pt::save(c) != prox::Status::kSuccess) ++save_errors;
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const pt::Key k = glu_key(64 * (t + 1), 32 * (i + 1), (i % 16) + 1);
        const std::string pol = (i % 3 == 0) ? "glu_a" : (i % 3 == 1 ? "glu_b" : "glu_c");
        if (c.record(k, entry(pol, 1.0 + i)) != prox::Status::kSuccess) ++bad;
        if (c.index_of(k) != i % 3) ++bad;
        const int j = (i * 7) % kPerThread;
        const int other = c.index_of(glu_key(64 * (((t + 1) % kThreads) + 1), 32 * (j + 1), (j % 16) + 1));
        if (other != -1 && other != j % 3) ++bad;
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  saver.join();
  CHECK(bad.load() == 0);
  CHECK(save_errors.load() == 0);
  CHECK(c.size() == static_cast<std::size_t>(kThreads * kPerThread));
  REQUIRE(pt::save(c) == prox::Status::kSuccess);
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == static_cast<std::size_t>(kThreads * kPerThread));
  CHECK(warnings.messages().empty());
  check_no_temporaries(dir);
}

TEST_CASE("tuning library: savers of one file, in threads and processes, lose nothing", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("shared.tsv");
  constexpr int kRounds = 40;
  pt::Cache a(test_signature(), test_table(), file_options(p));
  pt::Cache b(test_signature(), test_table(), file_options(p));
  std::atomic<int> errors{0};
  auto run = [&](pt::Cache& c, int id) {
    for (int i = 0; i < kRounds; ++i) {
      if (c.record(glu_key(1000 + id, 32 * (i + 1), 4), entry(id == 0 ? "glu_a" : "glu_c", 1.0 + i)) !=
          prox::Status::kSuccess)
        ++errors;
      if (pt::save(c) != prox::Status::kSuccess) ++errors;
      // Every save leaves a complete file: a reader never sees a partial one.
      pt::Cache reader(test_signature(), test_table(), file_options(p));
      if (reader.load() != prox::Status::kSuccess || reader.warnings() != 0) ++errors;
    }
  };
  // Another process saves its own keys meanwhile (fork: the same code, another flock owner).
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    pt::Cache c(test_signature(), test_table(), file_options(p));
    for (int i = 0; i < kRounds; ++i) {
      if (c.record(glu_key(2000, 32 * (i + 1), 4), entry("glu_b", 1.0)) != prox::Status::kSuccess ||
          pt::save(c) != prox::Status::kSuccess)
        _exit(1);
    }
    _exit(0);
  }
  std::thread ta(run, std::ref(a), 0);
  std::thread tb(run, std::ref(b), 1);
  ta.join();
  tb.join();
  int child_status = -1;
  REQUIRE(waitpid(child, &child_status, 0) == child);
  CHECK(WIFEXITED(child_status));
  CHECK(WEXITSTATUS(child_status) == 0);
  CHECK(errors.load() == 0);
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == 3 * kRounds);  // the union of all three: nothing lost to a race
  for (int i = 0; i < kRounds; ++i) {
    CHECK(r.index_of(glu_key(1000, 32 * (i + 1), 4)) == 0);
    CHECK(r.index_of(glu_key(1001, 32 * (i + 1), 4)) == 2);
    CHECK(r.index_of(glu_key(2000, 32 * (i + 1), 4)) == 1);
  }
  CHECK(warnings.messages().empty());
  check_no_temporaries(dir);
}
