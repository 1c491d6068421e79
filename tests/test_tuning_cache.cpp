// SPDX-License-Identifier: Apache-2.0
//! @file test_tuning_cache.cpp  Host tests of the run-time half of the tuning cache (include/ only:
//! <prox/tuning/cache.hpp>, nothing of the prox_tuning library): buckets, encodings, reading a file
//! (hand-written here, as docs/tuning.md specifies it), corrupt / truncated / foreign files (ignored
//! with exactly one warning), validation of entries, and lookups racing with records and loads.
//! What the library adds (writing, the environment, the tie rule, verification) is tested in
//! test_tuning_library.cpp.
#include "catch.hpp"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <prox/tuning/cache.hpp>

#include "tuning_fixture.hpp"

namespace fs = std::filesystem;
namespace pt = prox::tuning;
using namespace prox_test;  // NOLINT(google-build-using-namespace): the shared tuning fixture

namespace {

const char* const kHeaderRow =
    "op\tdtype\tweights\tact\td_model\td_ff\tdensity16\tbatch\tpolicy\tmedian_us\tp20_us\tp80_us\treps\n";
const char* const kRowA = "glu_gemv\tf16\tf16\tsilu\t2048\t6144\t5\t1\tglu_a\t7.250\t7.105\t7.468\t25\n";
const char* const kRowB = "glu_gemv\tf16\tf16\tsilu\t4096\t12288\t8\t1\tglu_b\t21.500\t21.070\t22.145\t25\n";

//! A cache file as docs/tuning.md specifies it: magic, signature lines, header row, rows.
std::string file_text(const std::vector<std::string>& rows, const pt::PolicyTable& table = test_table()) {
  pt::Signature s = test_signature();
  s.policy_hash = pt::policy_table_hash(table);
  std::string t = "# prox_autotune v1\n";
  for (const auto& [k, v] : s.enforced_fields()) t += "# " + k + "\t" + v + "\n";
  t += "# driver\t13000\n";
  t += kHeaderRow;
  for (const auto& r : rows) t += r;
  return t;
}

//! A valid file with two entries.
std::string valid_file_text() { return file_text({kRowA, kRowB}); }

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

TEST_CASE("tuning cache: policy names and the table hash follow the lists", "[tuning]") {
  struct P3 {
    static std::string name() { return "p3"; }
  };
  struct P5 {
    static std::string name() { return "p5"; }
  };
  CHECK(pt::policy_names<prox::PolicyList<P3, P5>>() == std::vector<std::string>{"p3", "p5"});
  CHECK(pt::fnv1a64("p3;p5;p7") != pt::fnv1a64("p3;p5;p8"));
  CHECK(pt::fnv1a64("") == 1469598103934665603ull);  // the FNV-1a offset basis
  pt::PolicyTable edited = test_table();
  edited["glu_gemv"][1] = "glu_x";
  CHECK(pt::policy_table_hash(edited) != pt::policy_table_hash(test_table()));
  CHECK(pt::to_hex64(0xab4a7fa49a9a646dull) == "ab4a7fa49a9a646d");
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

TEST_CASE("tuning cache: numbers are read locale-free", "[tuning]") {
  double v = 0;
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

// ---------------------------------------------------------------- reading a file
TEST_CASE("tuning cache: a file as specified loads; reading never writes", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("cache.tsv");
  const std::string odd_row =
      "glu_gemv\tf16\tf16\twe%09ird%0Aact%25\t4096\t12288\t8\t1\tglu_c\t33.125\t32.463\t34.119\t25\n";
  const std::string down_row = "down_gemv\tf16\tf16\t-\t4096\t12288\t5\t1\tdown_b\t18.000\t17.640\t18.540\t25\n";
  const std::string thr_row = "threshold\tbf16\t-\t-\t5120\t0\t0\t1\tthr1024\t2.500\t2.450\t2.575\t25\n";
  // Columns are mapped by name: a reordered header and an unknown extra column are fine.
  std::string text = file_text({down_row, kRowB, odd_row, thr_row});
  text = text.substr(0, text.find(kHeaderRow)) + "# a comment line\n" + std::string(kHeaderRow) +
         text.substr(text.find(kHeaderRow) + std::string(kHeaderRow).size());
  write_text(p, text);
  pt::Cache c(test_signature(), test_table(), file_options(p));
  CHECK(c.path() == p);
  CHECK(c.mode() == pt::Mode::kReadOnly);
  CHECK(c.load() == prox::Status::kSuccess);
  CHECK(c.warnings() == 0);
  CHECK(c.last_load().state == pt::FileState::kLoaded);
  CHECK(c.last_load().loaded == 4);
  CHECK(c.size() == 4);
  pt::Key odd = glu_key(4096, 12288, 8);
  odd.act = "we\tird\nact%";  // free-form fields survive encoding
  const auto e = c.find(odd);
  REQUIRE(e.has_value());
  CHECK(e->policy == "glu_c");
  CHECK(e->median_us == Approx(33.125));
  CHECK(e->p20_us == Approx(32.463));
  CHECK(e->p80_us == Approx(34.119));
  CHECK(e->reps == 25);
  CHECK(c.index_of(odd) == 2);
  CHECK(c.index_of(glu_key(4096, 12288, 8)) == 1);
  CHECK(c.index_of(glu_key(4096, 12288, 9)) == -1);  // another bucket: a miss
  pt::Key dk = glu_key(4096, 12288, 5);
  dk.op = "down_gemv";
  dk.act = "-";
  CHECK(c.index_of(dk) == 1);
  const auto entries = c.entries();
  REQUIRE(entries.size() == 4);
  CHECK(entries.front().first.op == "down_gemv");  // key order
  // Loading never writes: the file is as it was, no lock or temporary file appears.
  CHECK(read_text(p) == text);
  CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
  CHECK(warnings.messages().empty());

  SECTION("columns in another order, and an extra one, are mapped by name") {
    const std::string q = dir.file("reordered.tsv");
    std::string t = file_text({});
    t = t.substr(0, t.find(kHeaderRow)) +
        "reps\tpolicy\textra\top\tdtype\tweights\tact\td_model\td_ff\tdensity16\tbatch\tmedian_us\tp20_us\tp80_us\n" +
        "25\tglu_b\twhatever\tglu_gemv\tf16\tf16\tsilu\t4096\t12288\t8\t1\t21.500\t21.070\t22.145\n";
    write_text(q, t);
    pt::Cache r(test_signature(), test_table(), file_options(q));
    CHECK(r.load() == prox::Status::kSuccess);
    CHECK(r.warnings() == 0);
    CHECK(r.index_of(glu_key(4096, 12288, 8)) == 1);
  }
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

TEST_CASE("tuning cache: a Cache reads no environment; its options say where and how", "[tuning]") {
  const char* saved = std::getenv("PROX_AUTOTUNE");
  const std::string saved_value = saved != nullptr ? saved : "";
  setenv("PROX_AUTOTUNE", "2", 1);
  {
    pt::Cache c(test_signature(), test_table());
    CHECK(c.mode() == pt::Mode::kReadOnly);  // the default, whatever PROX_AUTOTUNE says
    CHECK(c.path().empty());                 // in memory only
    CHECK(c.load() == prox::Status::kSuccess);
    CHECK(c.last_load().state == pt::FileState::kNoPath);
    pt::CacheOptions o;
    o.mode = pt::Mode::kTuneOnMiss;
    CHECK(pt::Cache(test_signature(), test_table(), o).mode() == pt::Mode::kTuneOnMiss);
    CHECK_FALSE(c.miss_handler());  // no tuner unless one is installed
    c.set_miss_handler([](pt::Cache&, const std::vector<pt::Key>&, cudaStream_t) { return prox::Status::kSuccess; });
    CHECK(static_cast<bool>(c.miss_handler()));
    CHECK(c.signature().policy_hash == pt::policy_table_hash(test_table()));
  }
  if (saved != nullptr) setenv("PROX_AUTOTUNE", saved_value.c_str(), 1);
  else unsetenv("PROX_AUTOTUNE");
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
  const std::string valid = valid_file_text();
  const std::string row_b = kRowB;
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
      {"duplicate column", [](const std::string& v) { return replace_first(v, "\tp80_us", "\tp20_us\tp80_us"); }, 0,
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
  const std::string valid = valid_file_text();
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

TEST_CASE("tuning cache: a directory or an unreadable path is an I/O error, reported once", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  pt::Cache c(test_signature(), test_table(), file_options(dir.path()));  // a directory
  CHECK(c.load() == prox::Status::kErrorCacheIo);
  CHECK(c.last_load().state == pt::FileState::kUnreadable);
  CHECK(c.load() == prox::Status::kErrorCacheIo);
  CHECK(c.warnings() == 1);
  pt::Cache m(test_signature(), test_table(), file_options(dir.file("missing.tsv")));
  CHECK(m.load() == prox::Status::kSuccess);
  CHECK(m.last_load().state == pt::FileState::kMissing);
  CHECK(m.warnings() == 0);
}

TEST_CASE("tuning cache: a table that gains an op (the fused glu_down_gemv) ignores older files", "[tuning]") {
  // What happened when the fused Stage 2 became a tuned op: the policy table gained a list, so the
  // policy hash changed, and a file written before is ignored with one warning (and, by the
  // library's save(), never overwritten); rows of the new op then map by name.
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("before-fused.tsv");
  const std::string before = file_text({kRowB});
  write_text(p, before);
  pt::PolicyTable with_fused = test_table();
  with_fused["glu_down_gemv"] = {"glud_a", "glud_b"};
  CHECK(pt::policy_table_hash(with_fused) != pt::policy_table_hash(test_table()));
  CHECK(pt::Cache(test_signature(), with_fused).signature().hash_hex() !=
        pt::Cache(test_signature(), test_table()).signature().hash_hex());  // another default file name

  pt::Cache c(test_signature(), with_fused, file_options(p));
  CHECK(c.load() == prox::Status::kSuccess);
  CHECK(c.last_load().state == pt::FileState::kSignatureMismatch);
  CHECK(c.warnings() == 1);
  CHECK(warnings.messages().size() == 1);
  CHECK(c.size() == 0);
  CHECK(c.index_of(glu_key(4096, 12288, 8)) == -1);  // the old rows do not apply
  pt::Key fused = glu_key(4096, 12288, 5);
  fused.op = "glu_down_gemv";
  REQUIRE(c.record(fused, entry("glud_b", 30.0)) == prox::Status::kSuccess);
  CHECK(c.index_of(fused) == 1);
  CHECK(c.index_of(glu_key(4096, 12288, 5)) == -1);  // same shape and bucket, another op: a miss
  pt::Cache old(test_signature(), test_table());
  CHECK(old.record(fused, entry("glud_a", 30.0)) == prox::Status::kErrorInvalidArgument);  // not in its table

  // A file of the new table reads its rows of the new op.
  const std::string q = dir.file("after-fused.tsv");
  write_text(q, file_text({"glu_down_gemv\tf16\tf16\tsilu\t4096\t12288\t5\t1\tglud_b\t30.000\t29.400\t30.900\t25\n"},
                          with_fused));
  pt::Cache r(test_signature(), with_fused, file_options(q));
  CHECK(r.load() == prox::Status::kSuccess);
  CHECK(r.warnings() == 0);
  CHECK(r.index_of(fused) == 1);
}

TEST_CASE("tuning cache: the largest accepted timing reads back", "[tuning]") {
  TempDir dir;
  const std::string p = dir.file("big.tsv");
  write_text(p, file_text({"glu_gemv\tf16\tf16\tsilu\t64\t128\t4\t1\tglu_a\t500000000000.000\t250000000000.000\t"
                           "1000000000000.000\t25\n"}));
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
  pt::Cache c(test_signature(), test_table());
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
        prox::Status::kErrorInvalidArgument);  // failed candidates are not recorded
  // A timing the file could not read back is refused (the largest accepted one reads back: above).
  CHECK(c.record(glu_key(64, 128, 4), pt::Entry{"glu_a", 1.0, 1.0, 2e12, 25}) == prox::Status::kErrorInvalidArgument);
  CHECK(c.size() == 1);

  // A file row never replaces an entry already in memory.
  TempDir dir;
  const std::string p = dir.file("first.tsv");
  write_text(p, file_text({"glu_gemv\tf16\tf16\tsilu\t64\t128\t3\t1\tglu_c\t1.000\t0.980\t1.030\t25\n"}));
  pt::Cache m(test_signature(), test_table(), file_options(p));
  CHECK(m.record(glu_key(64, 128, 3), entry("glu_a", 5.0)) == prox::Status::kSuccess);
  CHECK(m.load() == prox::Status::kSuccess);
  CHECK(m.last_load().kept_in_memory == 1);
  CHECK(m.find(glu_key(64, 128, 3))->policy == "glu_a");
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
TEST_CASE("tuning cache: lookups and records race with loads safely", "[tuning]") {
  WarningCapture warnings;
  TempDir dir;
  const std::string p = dir.file("race.tsv");
  write_text(p, valid_file_text());
  pt::Cache c(test_signature(), test_table(), file_options(p));
  constexpr int kThreads = 6;
  constexpr int kPerThread = 60;
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::thread loader([&] {
    while (!stop.load())
      if (c.load() != prox::Status::kSuccess) ++bad;
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
        if (c.index_of(glu_key(4096, 12288, 8)) != -1 && c.index_of(glu_key(4096, 12288, 8)) != 1) ++bad;
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  loader.join();
  CHECK(bad.load() == 0);
  CHECK(c.load() == prox::Status::kSuccess);
  CHECK(c.size() == static_cast<std::size_t>(kThreads * kPerThread) + 2);
  CHECK(c.index_of(glu_key(2048, 6144, 5)) == 0);
  CHECK(warnings.messages().empty());
}
