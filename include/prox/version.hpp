// SPDX-License-Identifier: Apache-2.0
//! @file version.hpp  Library version and the versioned inline namespace (prox::v0).
#pragma once

#define PROX_VERSION_MAJOR 0
#define PROX_VERSION_MINOR 1
#define PROX_VERSION_PATCH 0
#define PROX_VERSION_STRING "0.1.0"

//! Everything public lives in prox::v0 (inline), so two engines built on different prox
//! versions can be linked into one process without ODR clashes.
#define PROX_NAMESPACE_BEGIN \
  namespace prox {           \
  inline namespace v0 {
#define PROX_NAMESPACE_END \
  }                        \
  }
