// SPDX-License-Identifier: Apache-2.0
//! @file catch.hpp  Catch2 2 or 3, whichever the distribution ships (Debian 12 and Ubuntu 22.04: 2.13;
//! Debian 13 and Ubuntu 24.04: 3.x). The tests include this header, never Catch2's own, and use the
//! subset common to both: TEST_CASE, TEMPLATE_TEST_CASE, SECTION, CHECK/REQUIRE, Approx,
//! Catch::Session, and CATCH_CONFIG_MAIN / CATCH_CONFIG_RUNNER in the two mains.
#pragma once

// tests/CMakeLists.txt passes the major version of the Catch2 it found, so a second Catch2 elsewhere
// on the include path cannot be picked up instead; __has_include covers a build without it.
#if defined(PROX_CATCH2_MAJOR)
#define PROX_CATCH2_V3 (PROX_CATCH2_MAJOR >= 3)
#elif __has_include(<catch2/catch_all.hpp>)
#define PROX_CATCH2_V3 1
#else
#define PROX_CATCH2_V3 0
#endif

#if PROX_CATCH2_V3
#include <catch2/catch_all.hpp>

// Catch2 2 puts Approx in the global namespace; 3 keeps it in Catch.
using Catch::Approx;

// Catch2 3 ignores CATCH_CONFIG_MAIN (its main lives in Catch2::Catch2WithMain); keep the 2.x
// meaning, so host_main.cpp stays one define and one include under both.
#if defined(CATCH_CONFIG_MAIN)
int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
#endif
#else
#include <catch2/catch.hpp>
#endif
