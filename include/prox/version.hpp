// SPDX-License-Identifier: Apache-2.0
//! @file version.hpp  Library version, and the inline namespace derived from it (prox::v0_1_0).
#pragma once

// CMakeLists.txt reads these three lines: they are the one place the version is written.
#define PROX_VERSION_MAJOR 0
#define PROX_VERSION_MINOR 1
#define PROX_VERSION_PATCH 0
#define PROX_VERSION_STRING "0.1.0"

#define PROX_PP_CAT_(a, b) a##b
#define PROX_PP_CAT(a, b) PROX_PP_CAT_(a, b)

//! The inline namespace: `v<major>_<minor>_<patch>`. The full version, not the major alone: prox is
//! header-only, so every release changes inline code, and two static archives built from different
//! releases and linked into one shared object would otherwise break the one-definition rule silently.
//! An engine that names it (it should not need to) writes `prox::PROX_ABI_NAMESPACE`.
#define PROX_ABI_NAMESPACE                                                                                   \
  PROX_PP_CAT(PROX_PP_CAT(PROX_PP_CAT(PROX_PP_CAT(PROX_PP_CAT(v, PROX_VERSION_MAJOR), _), PROX_VERSION_MINOR), _), \
              PROX_VERSION_PATCH)

//! Every prox entity (functions, function-local statics, static data members, types) has hidden
//! visibility on ELF: a shared object that uses prox exports none of it, so two extension modules
//! built from different prox versions, or from one version with different CUDA architecture lists,
//! each call their own launchers and keep their own caches (tests/package/ checks this). It follows
//! that prox's state (caches, the warning handler) is per shared object, and that the TUs using
//! PROX_SPARSE_FFN_EXTERN must sit in the shared object of the PROX_SPARSE_FFN_INSTANTIATE TU (across
//! two, the link fails: "hidden symbol ... isn't defined"). With GCC, a class of *default* visibility
//! that holds a prox type as a field or base draws "-Wattributes: declared with greater visibility
//! than the type of its field". Compile such code with -fvisibility=hidden (as pybind11 modules are),
//! or define PROX_DISABLE_HIDDEN_VISIBILITY in every TU of that shared object: prox's symbols are then
//! exported, still kept apart across versions by the namespace name, but not across architecture lists.
#if defined(__GNUC__) && !defined(_WIN32) && !defined(PROX_DISABLE_HIDDEN_VISIBILITY)
#define PROX_NAMESPACE_VISIBILITY __attribute__((visibility("hidden")))
#else
#define PROX_NAMESPACE_VISIBILITY
#endif

#define PROX_NAMESPACE_BEGIN \
  namespace prox {           \
  inline namespace PROX_ABI_NAMESPACE PROX_NAMESPACE_VISIBILITY {
#define PROX_NAMESPACE_END \
  }                        \
  }
