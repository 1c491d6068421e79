// SPDX-License-Identifier: Apache-2.0
//! @file test_tuning_cache.cpp  Host tests of the autotuning cache: file format round trip,
//! percent-encoding, corrupt / truncated / foreign files (ignored with exactly one warning),
//! location precedence, modes, the near-tie rule, and concurrency (lookups, records, saves; two
//! caches saving one file).
#include "catch.hpp"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <prox/tuning/cache.hpp>

namespace fs = std::filesystem;
namespace pt = prox::tuning;

namespace {

//! A fresh temporary directory, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "prox-tuning-test-XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

//! Saves and restores the environment variables the cache reads; clears them on entry.
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
      if (s.set) setenv(s.name, s.value.c_str(), 1);
      else unsetenv(s.name);
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

//! Captures the cache's warnings (process-wide handler) for the scope.
class WarningCapture {
 public:
  WarningCapture() {
    old_ = pt::set_warning_handler([this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex_);
      messages_.push_back(m);
    });
  }
  ~WarningCapture() { pt::set_warning_handler(std::move(old_)); }
  std::vector<std::string> messages() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
  pt::WarningHandler old_;
};

pt::Signature test_signature() {
  pt::Signature s;
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

pt::PolicyTable test_table() {
  return {{"glu_gemv", {"glu_a", "glu_b", "glu_c"}}, {"down_gemv", {"down_a", "down_b"}}, {"threshold", {"thr1024"}}};
}

pt::CacheOptions file_options(const std::string& path) {
  pt::CacheOptions o;
  o.path = path;
  o.use_environment = false;
  return o;
}

pt::Key glu_key(int d_model, int d_ff, int bucket) {
  pt::Key k;
  k.op = "glu_gemv";
  k.dtype = "f16";
  k.weights = "f16";
  k.act = "silu";
  k.d_model = d_model;
  k.d_ff = d_ff;
  k.density16 = bucket;
  return k;
}

pt::Entry entry(const std::string& policy, double median) {
  return pt::Entry{policy, median, median * 0.98, median * 1.03, 25};
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

//! A valid file with two entries, written by the cache itself.
std::string valid_file_text(const TempDir& dir) {
  const std::string p = dir.file("valid-source.tsv");
  pt::Cache c(test_signature(), test_table(), file_options(p));
  REQUIRE(c.record(glu_key(4096, 12288, 8), entry("glu_b", 21.5)) == prox::Status::kSuccess);
  REQUIRE(c.record(glu_key(2048, 6144, 5), entry("glu_a", 7.25)) == prox::Status::kSuccess);
  REQUIRE(c.save() == prox::Status::kSuccess);
  return read_text(p);
}

}  // namespace

// ---------------------------------------------------------------- pure helpers
TEST_CASE("tuning cache: density buckets round up to sixteenths", "[tuning]") {
  CHECK(pt::density_bucket(0.0) == 0);
  CHECK(pt::density_bucket(-0.5) == 0);
  CHECK(pt::density_bucket(1e-6) == 1);
  CHECK(pt::density_bucket(1.0 / 16) == 1);
  CHECK(pt::density_bucket(0.3) == 5);   // 4.8 -> 5
  CHECK(pt::density_bucket(0.5) == 8);   // exactly 8/16 stays 8
  CHECK(pt::density_bucket(0.51) == 9);
  CHECK(pt::density_bucket(0.9) == 15);
  CHECK(pt::density_bucket(1.0) == 16);
  CHECK(pt::density_bucket(7.0) == 16);
  CHECK(pt::density_bucket(std::nan("")) == 16);
  for (int b = 0; b <= 16; ++b) CHECK(pt::density_bucket(pt::bucket_density(b)) == b);
}

TEST_CASE("tuning cache: the near-tie rule picks the lowest index within 0.5% of the best", "[tuning]") {
  const double inf = HUGE_VAL;
  CHECK(pt::kTieTolerance == 0.005);
  CHECK(pt::choose_index({10.0, 9.96, 10.5}) == 0);     // 10.0 <= 9.96 * 1.005
  CHECK(pt::choose_index({10.1, 10.0, 10.04}) == 1);    // 10.1 > 10.05
  CHECK(pt::choose_index({12.0, 10.0, 10.049}) == 1);
  CHECK(pt::choose_index({12.0, 10.051, 10.0}) == 2);   // 10.051 > 10.05
  CHECK(pt::choose_index({10.15, 10.0, 10.1}) == 1);    // a near-tie under the former 2 %, not under 0.5 %
  CHECK(pt::choose_index({inf, 5.0, 5.02}) == 1);       // a failed candidate never wins
  CHECK(pt::choose_index({std::nan(""), 5.0}) == 1);
  CHECK(pt::choose_index({inf, inf}) == -1);
  CHECK(pt::choose_index({}) == -1);
  CHECK(pt::choose_index({10.0, 9.0}, 0.2) == 0);
  // Deterministic: the same input gives the same answer every time.
  for (int i = 0; i < 100; ++i) CHECK(pt::choose_index({3.01, 3.0, 3.0}) == 0);
}

TEST_CASE("tuning cache: percent-encoding round trips every byte", "[tuning]") {
  std::string all;
  for (int c = 1; c < 256; ++c) all += static_cast<char>(c);
  const std::string samples[] = {"", "plain", "tab\there", "new\nline", "cr\r", "100%", "%09", all};
  for (const auto& s : samples) {
    const std::string enc = pt::detail::percent_encode(s);
    CHECK(enc.find('\t') == std::string::npos);
    CHECK(enc.find('\n') == std::string::npos);
    CHECK(enc.find('\r') == std::string::npos);
    std::string dec;
    REQUIRE(pt::detail::percent_decode(enc, &dec));
    CHECK(dec == s);
  }
  CHECK(pt::detail::percent_encode("a\tb%") == "a%09b%25");
  std::string out;
  CHECK_FALSE(pt::detail::percent_decode("bad%", &out));
  CHECK_FALSE(pt::detail::percent_decode("bad%4", &out));
  CHECK_FALSE(pt::detail::percent_decode("bad%zz", &out));
  CHECK(pt::detail::percent_decode("%4a%4A", &out));
  CHECK(out == "JJ");
}

TEST_CASE("tuning cache: numbers are written and read locale-free", "[tuning]") {
  double v = 0;
  CHECK(pt::detail::format_fixed3(12.3456) == "12.346");
  CHECK(pt::detail::format_fixed3(0.0004) == "0.000");
  CHECK(pt::detail::format_fixed3(7.0) == "7.000");
  CHECK(pt::detail::parse_fixed("12.346", &v));
  CHECK(v == Approx(12.346));
  CHECK(pt::detail::parse_fixed("3", &v));
  CHECK(v == 3.0);
  for (const char* bad : {"", "-1", "1e3", "1.", ".5", "1.2.3", "nan", "inf", "1,5", " 1", "0x10"})
    CHECK_FALSE(pt::detail::parse_fixed(bad, &v));
  long long i = 0;
  CHECK(pt::detail::parse_int("4096", 1, 1 << 24, &i));
  CHECK(i == 4096);
  for (const char* bad : {"", "-3", "+3", "3.0", "99999999999999999999", "abc"})
    CHECK_FALSE(pt::detail::parse_int(bad, 0, 1 << 24, &i));
  CHECK_FALSE(pt::detail::parse_int("17", 0, 16, &i));
}

// ---------------------------------------------------------------- file format
TEST_CASE("tuning cache: file round trip", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("sub/dir/cache.tsv");  // save() creates missing directories
  pt::Key odd = glu_key(4096, 12288, 8);
  odd.act = "we\tird\nact%";  // free-form fields survive encoding
  {
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.path() == p);
    CHECK(c.mode() == pt::Mode::kReadOnly);
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.last_load().state == pt::FileState::kMissing);
    CHECK(c.record(glu_key(4096, 12288, 8), entry("glu_b", 21.5)) == prox::Status::kSuccess);
    CHECK(c.record(odd, entry("glu_c", 33.125)) == prox::Status::kSuccess);
    pt::Key dk = glu_key(4096, 12288, 5);
    dk.op = "down_gemv";
    dk.act = "-";
    CHECK(c.record(dk, entry("down_b", 18.0)) == prox::Status::kSuccess);
    pt::Key tk;
    tk.op = "threshold";
    tk.dtype = "bf16";
    tk.weights = "-";
    tk.act = "-";
    tk.d_model = 5120;
    tk.d_ff = 0;
    tk.density16 = 0;
    CHECK(c.record(tk, entry("thr1024", 2.5)) == prox::Status::kSuccess);
    CHECK(c.size() == 4);
    CHECK(c.save() == prox::Status::kSuccess);
    CHECK(c.warnings() == 0);
  }
  const std::string text = read_text(p);
  INFO(text);
  CHECK(text.rfind("# prox_autotune v1\n", 0) == 0);
  CHECK(text.find("# gpu\tTest GPU 80GB\n") != std::string::npos);
  CHECK(text.find("# sm_count\t132\n") != std::string::npos);
  CHECK(text.find("# cc\t9.0\n") != std::string::npos);
  CHECK(text.find("# prox\t" PROX_VERSION_STRING "\n") != std::string::npos);
  CHECK(text.find(
            "\nop\tdtype\tweights\tact\td_model\td_ff\tdensity16\tbatch\tpolicy\tmedian_us\tp20_us\tp80_us\treps\n") !=
        std::string::npos);
  CHECK(text.find("we%09ird%0Aact%25") != std::string::npos);
  CHECK(text.find("glu_gemv\tf16\tf16\tsilu\t4096\t12288\t8\t1\tglu_b\t21.500\t21.070\t22.145\t25\n") !=
        std::string::npos);
  CHECK(text.back() == '\n');
  CHECK_FALSE(fs::exists(p + ".corrupt"));

  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.last_load().state == pt::FileState::kLoaded);
  CHECK(r.last_load().loaded == 4);
  CHECK(r.size() == 4);
  const auto e = r.find(odd);
  REQUIRE(e.has_value());
  CHECK(e->policy == "glu_c");
  CHECK(e->median_us == Approx(33.125));
  CHECK(e->p20_us == Approx(33.125 * 0.98).margin(1e-3));
  CHECK(e->p80_us == Approx(33.125 * 1.03).margin(1e-3));
  CHECK(e->reps == 25);
  CHECK(r.index_of(odd) == 2);
  CHECK(r.index_of(glu_key(4096, 12288, 8)) == 1);
  CHECK(r.index_of(glu_key(4096, 12288, 9)) == -1);  // another bucket: a miss
  // Saving an unchanged cache rewrites the same bytes (deterministic row order).
  CHECK(r.save() == prox::Status::kSuccess);
  CHECK(read_text(p) == text);
  CHECK(warnings.messages().empty());
}

TEST_CASE("tuning cache: the device signature query never fails hard", "[tuning]") {
  pt::Signature s;
  CHECK(pt::query_signature(0, nullptr) == prox::Status::kErrorNullPointer);
  const prox::Status st = pt::query_signature(0, &s);  // no GPU here: kErrorNoDevice; with one: kSuccess
  CHECK((st == prox::Status::kSuccess || st == prox::Status::kErrorNoDevice));
  if (st == prox::Status::kSuccess) {
    CHECK_FALSE(s.gpu_name.empty());
    CHECK(s.sm_count > 0);
  }
  CHECK(pt::query_signature(-1, &s) != prox::Status::kSuccess);
}

TEST_CASE("tuning cache: the default file name carries the signature hash", "[tuning]") {
  EnvGuard env;
  TempDir dir;
  setenv("PROX_CACHE_DIR", dir.path().c_str(), 1);
  pt::Cache a(test_signature(), test_table());
  pt::Signature other = test_signature();
  other.sm_count = 114;  // another SKU / MIG slice
  pt::Cache b(other, test_table());
  pt::PolicyTable edited = test_table();
  edited["glu_gemv"].push_back("glu_d");  // a list edit
  pt::Cache c(test_signature(), edited);
  CHECK(a.path() == dir.file("prox-" + a.signature().hash_hex() + ".tsv"));
  CHECK(a.path() != b.path());
  CHECK(a.path() != c.path());
  pt::Signature driver = test_signature();
  driver.driver_version = 12040;  // recorded, not enforced
  pt::Cache d(driver, test_table());
  CHECK(a.path() == d.path());
  CHECK(a.signature().policy_hash == pt::policy_table_hash(test_table()));
}

// ---------------------------------------------------------------- corruption
namespace {
struct CorruptCase {
  const char* name;
  std::function<std::string(const std::string& valid)> make;
  std::size_t expect_loaded;  // rows still accepted
  pt::FileState expect_state;
};

std::string replace_first(std::string s, const std::string& from, const std::string& to) {
  const auto pos = s.find(from);
  REQUIRE(pos != std::string::npos);
  s.replace(pos, from.size(), to);
  return s;
}
}  // namespace

TEST_CASE("tuning cache: corrupt or mismatched files are ignored with exactly one warning", "[tuning]") {
  TempDir dir;
  const std::string valid = valid_file_text(dir);
  const std::string row_b = "glu_gemv\tf16\tf16\tsilu\t4096\t12288\t8\t1\tglu_b\t21.500\t21.070\t22.145\t25\n";
  REQUIRE(valid.find(row_b) != std::string::npos);
  using FS = pt::FileState;
  // An edit of row_b only (the row of key (4096, 12288, bucket 8)); the other row stays valid.
  const auto in_row_b = [&](const std::string& from, const std::string& to) {
    return [=](const std::string& v) { return replace_first(v, row_b, replace_first(row_b, from, to)); };
  };
  const std::vector<CorruptCase> cases = {
      {"garbage", [](const std::string&) { return std::string("\x7f" "ELF\x01\x02\x00\xff garbage\n\n\t\t\n", 20); },
       0, FS::kCorrupt},
      {"empty", [](const std::string&) { return std::string(); }, 0, FS::kCorrupt},
      {"json", [](const std::string&) { return std::string("{\"prox\": 1}\n"); }, 0, FS::kCorrupt},
      {"wrong header", [](const std::string& v) { return replace_first(v, "# prox_autotune v1", "# prox_autotune"); },
       0, FS::kCorrupt},
      {"other format version", [](const std::string& v) { return replace_first(v, "v1\n", "v2\n"); }, 0,
       FS::kVersionMismatch},
      {"signature mismatch: gpu", [](const std::string& v) { return replace_first(v, "Test GPU 80GB", "Other GPU"); },
       0, FS::kSignatureMismatch},
      {"signature mismatch: prox version",
       [](const std::string& v) { return replace_first(v, "# prox\t" PROX_VERSION_STRING, "# prox\t9.9.9"); }, 0,
       FS::kSignatureMismatch},
      {"signature mismatch: policy table",
       [](const std::string& v) {
         const auto pos = v.find("# policy_hash\t");
         std::string s = v;
         s[pos + 14] = s[pos + 14] == '0' ? '1' : '0';
         return s;
       },
       0, FS::kSignatureMismatch},
      {"signature field missing", [](const std::string& v) { return replace_first(v, "# sm_count\t132\n", ""); }, 0,
       FS::kSignatureMismatch},
      {"header row lacks a column", [](const std::string& v) { return replace_first(v, "\tp80_us", "\tp81_us"); }, 0,
       FS::kCorrupt},
      {"no header row", [](const std::string& v) { return v.substr(0, v.find("\nop\t") + 1); }, 0, FS::kCorrupt},
      {"bad number", in_row_b("\t21.500\t", "\t21.5x0\t"), 1, FS::kLoaded},
      {"negative number", in_row_b("\t4096\t12288", "\t-4096\t12288"), 1, FS::kLoaded},
      {"nan timing", in_row_b("\t21.500\t", "\tnan\t"), 1, FS::kLoaded},
      {"percentiles out of order", in_row_b("\t21.070\t", "\t99.000\t"), 1, FS::kLoaded},
      {"density bucket out of range", in_row_b("\t12288\t8\t", "\t12288\t17\t"), 1, FS::kLoaded},
      {"bad escape", in_row_b("\tglu_b\t", "\tglu%zb\t"), 1, FS::kLoaded},
      {"too few fields", in_row_b("\t25\n", "\n"), 1, FS::kLoaded},
      {"too many fields", in_row_b("\t25\n", "\t25\textra\n"), 1, FS::kLoaded},
      {"unknown policy name", in_row_b("\tglu_b\t", "\tglu_zz\t"), 1, FS::kLoaded},
      {"unknown op", [&](const std::string& v) { return replace_first(v, row_b, "fused_ffn" + row_b.substr(8)); }, 1,
       FS::kLoaded},
      {"duplicate keys",
       [&](const std::string& v) {
         std::string dup = row_b;
         dup = replace_first(dup, "\tglu_b\t", "\tglu_c\t");
         return v + dup;
       },
       2, FS::kLoaded},
      {"truncated last row", [&](const std::string& v) { return v.substr(0, v.size() - 4); }, 1, FS::kLoaded},
  };
  for (const auto& tc : cases) {
    DYNAMIC_SECTION(tc.name) {
      WarningCapture warnings;
      const std::string p = dir.file("case.tsv");
      const std::string text = tc.make(valid);
      write_text(p, text);
      pt::Cache c(test_signature(), test_table(), file_options(p));
      CHECK(c.load() == prox::Status::kSuccess);  // ignored, not an error
      CHECK(c.warnings() == 1);
      CHECK(warnings.messages().size() == 1);
      CHECK(c.last_load().state == tc.expect_state);
      CHECK(c.size() == tc.expect_loaded);
      INFO("warning: " << c.last_warning());
      CHECK(c.last_warning().find(p) != std::string::npos);
      // Loading again warns no more ("warn once"); the entries that were valid are still there.
      CHECK(c.load() == prox::Status::kSuccess);
      CHECK(c.warnings() == 1);
      CHECK(c.size() == tc.expect_loaded);
      if (tc.expect_loaded > 0) CHECK(c.index_of(glu_key(2048, 6144, 5)) == 0);
      CHECK(read_text(p) == text);  // load never writes
    }
  }
}

TEST_CASE("tuning cache: every truncation of a valid file loads without crashing", "[tuning]") {
  TempDir dir;
  const std::string valid = valid_file_text(dir);
  const std::string p = dir.file("cut.tsv");
  WarningCapture quiet;
  for (std::size_t n = 0; n < valid.size(); ++n) {
    write_text(p, valid.substr(0, n));
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.warnings() <= 1);
    const bool cut_mid_line = n > 0 && valid[n - 1] != '\n';
    if (n == 0 || cut_mid_line) CHECK(c.warnings() == 1);
    CHECK(c.size() <= 2);
  }
}

TEST_CASE("tuning cache: a foreign file is never overwritten; a corrupt one is moved aside", "[tuning]") {
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
    CHECK(c.save() == prox::Status::kErrorCacheIo);
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
    CHECK(c.save() == prox::Status::kErrorCacheIo);  // save without load: still refused
    CHECK(read_text(p) == v2);
    CHECK(c.warnings() == 1);
  }
  SECTION("garbage") {
    const std::string p = dir.file("garbage.tsv");
    write_text(p, "not a cache\n");
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(c.record(glu_key(64, 128, 3), entry("glu_a", 1.0)) == prox::Status::kSuccess);
    CHECK(c.save() == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(read_text(p + ".corrupt") == "not a cache\n");
    pt::Cache r(test_signature(), test_table(), file_options(p));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.warnings() == 0);
    CHECK(r.index_of(glu_key(64, 128, 3)) == 0);
  }
  SECTION("malformed rows are dropped on the next save, valid ones kept") {
    const std::string p = dir.file("rows.tsv");
    write_text(p, replace_first(valid, "\t21.500\t", "\tbad\t"));
    pt::Cache c(test_signature(), test_table(), file_options(p));
    CHECK(c.save() == prox::Status::kSuccess);
    CHECK(c.warnings() == 1);
    CHECK(c.size() == 1);  // the valid file row was adopted
    pt::Cache r(test_signature(), test_table(), file_options(p));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.warnings() == 0);
    CHECK(r.size() == 1);
  }
}

TEST_CASE("tuning cache: a table that gains an op (the fused glu_down_gemv) invalidates older files", "[tuning]") {
  // What happened when the fused Stage 2 became a tuned op: the policy table gained a list, so the
  // policy hash changed; a file written before is ignored with one warning and never overwritten
  // (regenerating it means removing it first); rows of the new op then round-trip by name.
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("before-fused.tsv");
  {
    pt::Cache old(test_signature(), test_table(), file_options(p));
    REQUIRE(old.record(glu_key(4096, 12288, 5), entry("glu_b", 17.5)) == prox::Status::kSuccess);
    pt::Key fused = glu_key(4096, 12288, 5);
    fused.op = "glu_down_gemv";
    CHECK(old.record(fused, entry("glud_a", 30.0)) == prox::Status::kErrorInvalidArgument);  // not in its table
    REQUIRE(old.save() == prox::Status::kSuccess);
  }
  const std::string before = read_text(p);
  pt::PolicyTable with_fused = test_table();
  with_fused["glu_down_gemv"] = {"glud_a", "glud_b"};
  CHECK(pt::policy_table_hash(with_fused) != pt::policy_table_hash(test_table()));
  CHECK(
      pt::Cache(test_signature(), with_fused, file_options("")).signature().hash_hex() !=
      pt::Cache(test_signature(), test_table(), file_options("")).signature().hash_hex());  // another default file name

  pt::Cache c(test_signature(), with_fused, file_options(p));
  CHECK(c.load() == prox::Status::kSuccess);
  CHECK(c.last_load().state == pt::FileState::kSignatureMismatch);
  CHECK(c.warnings() == 1);
  CHECK(warnings.messages().size() == 1);
  CHECK(c.size() == 0);
  CHECK(c.index_of(glu_key(4096, 12288, 5)) == -1);  // the old rows do not apply
  pt::Key fused = glu_key(4096, 12288, 5);
  fused.op = "glu_down_gemv";
  REQUIRE(c.record(fused, entry("glud_b", 30.0)) == prox::Status::kSuccess);
  CHECK(c.index_of(fused) == 1);
  CHECK(c.index_of(glu_key(4096, 12288, 5)) == -1);  // same shape and bucket, another op: a miss
  CHECK(c.save() == prox::Status::kErrorCacheIo);     // the older file is not clobbered
  CHECK(read_text(p) == before);
  CHECK(c.warnings() == 1);

  REQUIRE(fs::remove(p));
  CHECK(c.save() == prox::Status::kSuccess);
  pt::Cache r(test_signature(), with_fused, file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.last_load().state == pt::FileState::kLoaded);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == 1);
  CHECK(r.index_of(fused) == 1);
  CHECK(r.find(fused)->policy == "glud_b");
  CHECK(read_text(p).find("\nglu_down_gemv\tf16\tf16\tsilu\t4096\t12288\t5\t1\tglud_b\t") != std::string::npos);
}

TEST_CASE("tuning cache: the largest accepted timing survives save and load", "[tuning]") {
  TempDir dir;
  const std::string p = dir.file("big.tsv");
  const pt::Entry big{"glu_a", pt::detail::kMaxTimingUs / 2, pt::detail::kMaxTimingUs / 4, pt::detail::kMaxTimingUs,
                      25};
  {
    pt::Cache c(test_signature(), test_table(), file_options(p));
    REQUIRE(c.record(glu_key(64, 128, 4), big) == prox::Status::kSuccess);
    REQUIRE(c.save() == prox::Status::kSuccess);
  }
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.last_load().loaded == 1);
  const auto e = r.find(glu_key(64, 128, 4));
  REQUIRE(e.has_value());
  CHECK(e->p80_us == Approx(pt::detail::kMaxTimingUs));
  CHECK(e->median_us == Approx(pt::detail::kMaxTimingUs / 2));
}

TEST_CASE("tuning cache: record validates and the first entry of a key wins", "[tuning]") {
  pt::Cache c(test_signature(), test_table(), file_options(""));
  CHECK(c.path().empty());  // no location: in-memory only
  bool inserted = false;
  CHECK(c.record(glu_key(64, 128, 3), entry("glu_b", 2.0), &inserted) == prox::Status::kSuccess);
  CHECK(inserted);
  CHECK(c.record(glu_key(64, 128, 3), entry("glu_c", 1.0), &inserted) == prox::Status::kSuccess);
  CHECK_FALSE(inserted);
  CHECK(c.find(glu_key(64, 128, 3))->policy == "glu_b");
  CHECK(c.index_of(glu_key(64, 128, 3)) == 1);
  CHECK(c.record(glu_key(64, 128, 4), entry("no_such_policy", 1.0)) == prox::Status::kErrorInvalidArgument);
  pt::Key bad_op = glu_key(64, 128, 4);
  bad_op.op = "nope";
  CHECK(c.record(bad_op, entry("glu_a", 1.0)) == prox::Status::kErrorInvalidArgument);
  CHECK(c.record(glu_key(64, 128, 17), entry("glu_a", 1.0)) == prox::Status::kErrorInvalidArgument);
  CHECK(c.record(glu_key(0, 128, 4), entry("glu_a", 1.0)) == prox::Status::kErrorInvalidArgument);
  CHECK(c.record(glu_key(64, 128, 4), pt::Entry{"glu_a", HUGE_VAL, 1.0, HUGE_VAL, 25}) ==
        prox::Status::kErrorInvalidArgument);  // failed candidates are not persisted
  // A timing the file could not read back is refused (the largest accepted one round-trips: next test).
  CHECK(c.record(glu_key(64, 128, 4), pt::Entry{"glu_a", 1.0, 1.0, 2e12, 25}) == prox::Status::kErrorInvalidArgument);
  CHECK(c.size() == 1);
  CHECK(c.save() == prox::Status::kErrorCacheIo);  // nowhere to write
  CHECK(c.load() == prox::Status::kSuccess);
  CHECK(c.last_load().state == pt::FileState::kNoPath);

  // A file row never replaces an entry already in memory.
  TempDir dir;
  const std::string p = dir.file("first.tsv");
  {
    pt::Cache w(test_signature(), test_table(), file_options(p));
    CHECK(w.record(glu_key(64, 128, 3), entry("glu_c", 1.0)) == prox::Status::kSuccess);
    CHECK(w.save() == prox::Status::kSuccess);
  }
  pt::Cache m(test_signature(), test_table(), file_options(p));
  CHECK(m.record(glu_key(64, 128, 3), entry("glu_a", 5.0)) == prox::Status::kSuccess);
  CHECK(m.load() == prox::Status::kSuccess);
  CHECK(m.last_load().kept_in_memory == 1);
  CHECK(m.find(glu_key(64, 128, 3))->policy == "glu_a");
  CHECK(m.save() == prox::Status::kSuccess);  // memory wins in the file too
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.find(glu_key(64, 128, 3))->policy == "glu_a");
}

// ---------------------------------------------------------------- location and mode
TEST_CASE("tuning cache: location precedence API > PROX_AUTOTUNE_CACHE > PROX_CACHE_DIR > XDG > HOME", "[tuning]") {
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

  // Through the Cache: its own signature hash names the file.
  TempDir dir;
  setenv("PROX_CACHE_DIR", dir.path().c_str(), 1);
  pt::Cache c(test_signature(), test_table());
  CHECK(c.path() == dir.file("prox-" + c.signature().hash_hex() + ".tsv"));
  pt::CacheOptions o;
  o.path = dir.file("explicit.tsv");
  pt::Cache e(test_signature(), test_table(), o);
  CHECK(e.path() == o.path);
}

TEST_CASE("tuning cache: read-only by default; PROX_AUTOTUNE selects the mode", "[tuning]") {
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
  {
    pt::Cache c(test_signature(), test_table(), file_options(""));  // use_environment false: env ignored
    CHECK(c.mode() == pt::Mode::kReadOnly);
    CHECK(c.warnings() == 0);
  }
  {
    pt::Cache c(test_signature(), test_table());
    CHECK(c.mode() == pt::Mode::kReadOnly);
    CHECK(c.warnings() == 1);  // the bad value is reported once
  }
  setenv("PROX_AUTOTUNE", "2", 1);
  pt::CacheOptions o;
  o.mode = pt::Mode::kOff;  // the API beats the environment
  CHECK(pt::Cache(test_signature(), test_table(), o).mode() == pt::Mode::kOff);
  CHECK(pt::Cache(test_signature(), test_table()).mode() == pt::Mode::kTuneOnMiss);
  unsetenv("PROX_AUTOTUNE");

  // Read-only: loading, looking up and recording never touch the file; only save() writes.
  TempDir dir;
  const std::string valid = valid_file_text(dir);
  const std::string p = dir.file("ro.tsv");
  write_text(p, valid);
  const auto before = fs::last_write_time(p);
  {
    pt::CacheOptions ro;
    ro.path = p;
    pt::Cache c(test_signature(), test_table(), ro);
    CHECK(c.mode() == pt::Mode::kReadOnly);
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.index_of(glu_key(4096, 12288, 8)) == 1);
    CHECK(c.record(glu_key(1, 32, 1), entry("glu_a", 1.0)) == prox::Status::kSuccess);
  }
  CHECK(read_text(p) == valid);
  CHECK(fs::last_write_time(p) == before);
  CHECK_FALSE(fs::exists(p + ".lock"));
}

TEST_CASE("tuning cache: the warning handler is settable and restorable", "[tuning]") {
  std::vector<std::string> got;
  auto old = pt::set_warning_handler([&](const std::string& m) { got.push_back(m); });
  TempDir dir;
  const std::string p = dir.file("w.tsv");
  write_text(p, "junk");
  pt::Cache c(test_signature(), test_table(), file_options(p));
  c.load();
  REQUIRE(got.size() == 1);
  CHECK(got[0].find("not a valid prox_autotune file") != std::string::npos);
  CHECK(got[0].find('\n') == std::string::npos);  // one line
  pt::set_warning_handler([](const std::string&) { throw std::runtime_error("handler throws"); });
  pt::Cache t(test_signature(), test_table(), file_options(p));
  CHECK_NOTHROW(t.load());  // a throwing handler cannot take the caller down
  CHECK(t.warnings() == 1);
  pt::set_warning_handler(std::move(old));
}

// ---------------------------------------------------------------- concurrency
TEST_CASE("tuning cache: lookups and records race with saves safely", "[tuning]") {
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
    while (!stop.load()) {
      if (c.save() != prox::Status::kSuccess) ++save_errors;
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const pt::Key k = glu_key(64 * (t + 1), 32 * (i + 1), (i % 16) + 1);
        const std::string pol = (i % 3 == 0) ? "glu_a" : (i % 3 == 1 ? "glu_b" : "glu_c");
        if (c.record(k, entry(pol, 1.0 + i)) != prox::Status::kSuccess) ++bad;
        if (c.index_of(k) != i % 3) ++bad;  // our own record is visible at once
        // Lookups of other threads' keys: either a miss or the right index, never garbage.
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
  REQUIRE(c.save() == prox::Status::kSuccess);
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == static_cast<std::size_t>(kThreads * kPerThread));
  CHECK(warnings.messages().empty());
  // No temporary files left behind.
  for (const auto& e : fs::directory_iterator(dir.path()))
    CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
}

TEST_CASE("tuning cache: two caches saving one file concurrently produce a valid merged file", "[tuning]") {
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
      if (c.save() != prox::Status::kSuccess) ++errors;
      // Every save leaves a complete file: a reader never sees a partial one.
      pt::Cache reader(test_signature(), test_table(), file_options(p));
      if (reader.load() != prox::Status::kSuccess || reader.warnings() != 0) ++errors;
    }
  };
  std::thread ta(run, std::ref(a), 0);
  std::thread tb(run, std::ref(b), 1);
  ta.join();
  tb.join();
  CHECK(errors.load() == 0);
  pt::Cache r(test_signature(), test_table(), file_options(p));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.size() == 2 * kRounds);  // the union of both: nothing lost to a race
  for (int i = 0; i < kRounds; ++i) {
    CHECK(r.index_of(glu_key(1000, 32 * (i + 1), 4)) == 0);
    CHECK(r.index_of(glu_key(1001, 32 * (i + 1), 4)) == 2);
  }
  // Each writer adopted the other's rows from the file while merging.
  CHECK(a.size() >= static_cast<std::size_t>(kRounds));
  CHECK(b.size() >= static_cast<std::size_t>(kRounds));
  CHECK(warnings.messages().empty());
}
