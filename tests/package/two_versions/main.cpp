// SPDX-License-Identifier: Apache-2.0
//! @file main.cpp  The two-version test's process: links three modules (module.cpp) built from
//! different prox versions (mod_a, mod_b) or from one version with different code (mod_a, mod_c),
//! and checks that each module calls its own prox code and keeps its own statics.
#include <cstdio>
#include <cstring>

#define PROX_TEST_DECLARE(m)                   \
  extern "C" const char* m##_version();        \
  extern "C" const void* m##_static_cache();   \
  extern "C" const void* m##_typed_cache();    \
  extern "C" const char* m##_status();
PROX_TEST_DECLARE(mod_a)
PROX_TEST_DECLARE(mod_b)
PROX_TEST_DECLARE(mod_c)

namespace {
int failures = 0;

void expect_string(const char* what, const char* got, const char* want) {
  const bool ok = std::strcmp(got, want) == 0;
  std::printf("%s %s: \"%s\" (want \"%s\")\n", ok ? "ok  " : "FAIL", what, got, want);
  failures += !ok;
}
void expect_distinct(const char* what, const void* a, const void* b) {
  const bool ok = a != b;
  std::printf("%s %s: %p vs %p\n", ok ? "ok  " : "FAIL", what, a, b);
  failures += !ok;
}
}  // namespace

int main() {
  // Both the process-wide lookup order (mod_a before mod_b and mod_c on the link line) and a module's
  // own calls would make the later modules use mod_a's copies if prox's symbols were exported.
  expect_string("mod_a version", mod_a_version(), PROX_TEST_VERSION_A);
  expect_string("mod_b version", mod_b_version(), PROX_TEST_VERSION_B);
  expect_string("mod_c version", mod_c_version(), PROX_TEST_VERSION_A "+flavor-c");
  expect_distinct("mod_a/mod_b static cache", mod_a_static_cache(), mod_b_static_cache());
  expect_distinct("mod_a/mod_c static cache", mod_a_static_cache(), mod_c_static_cache());
  expect_distinct("mod_a/mod_b template static", mod_a_typed_cache(), mod_b_typed_cache());
  expect_distinct("mod_a/mod_c template static", mod_a_typed_cache(), mod_c_typed_cache());
  expect_string("mod_b prox::to_string", mod_b_status(), "not planned");
  if (failures) std::printf("%d check(s) failed: prox entities are shared between the modules\n", failures);
  return failures ? 1 : 0;
}
