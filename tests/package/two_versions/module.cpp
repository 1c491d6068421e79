// SPDX-License-Identifier: Apache-2.0
//! @file module.cpp  One "extension module" of the two-version test: a shared library built from one
//! copy of prox's headers (tests/package/two_versions.cmake patches each copy's version.hpp). It
//! defines prox entities the way every prox header does (inside PROX_NAMESPACE_BEGIN/END) and exports
//! only extern "C" entry points, named by PROX_TEST_MODULE.
#include <prox/core/status.hpp>
#include <prox/version.hpp>

PROX_NAMESPACE_BEGIN
namespace package_test {

// noinline: the calls below must go through a symbol, as a launcher or a SparseFfn member does in an
// engine, since a call through a symbol is what the dynamic linker can redirect to another module.
// PROX_TEST_FLAVOR stands for what differs between two builds of one prox version (e.g. the CUDA
// architecture list): the same names, different code.
__attribute__((noinline)) inline const char* version_string() { return PROX_VERSION_STRING PROX_TEST_FLAVOR; }

// A function-local static, as the library's caches (device info, warnings handler) are.
__attribute__((noinline)) inline int* static_cache() {
  static int cache = 0;
  return &cache;
}

// The same through a template, as launch<Policy> and SparseFfn<T> are.
template <class T>
__attribute__((noinline)) T* typed_cache() {
  static T cache{};
  return &cache;
}

}  // namespace package_test
PROX_NAMESPACE_END

#define PROX_TEST_CAT_(a, b) a##b
#define PROX_TEST_CAT(a, b) PROX_TEST_CAT_(a, b)
#define PROX_TEST_ENTRY(name) PROX_TEST_CAT(PROX_TEST_MODULE, name)

extern "C" __attribute__((visibility("default"))) const char* PROX_TEST_ENTRY(_version)() {
  return prox::package_test::version_string();
}
extern "C" __attribute__((visibility("default"))) const void* PROX_TEST_ENTRY(_static_cache)() {
  return prox::package_test::static_cache();
}
extern "C" __attribute__((visibility("default"))) const void* PROX_TEST_ENTRY(_typed_cache)() {
  return prox::package_test::typed_cache<long>();
}
extern "C" __attribute__((visibility("default"))) const char* PROX_TEST_ENTRY(_status)() {
  return prox::to_string(prox::Status::kErrorNotPlanned);
}
