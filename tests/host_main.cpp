// SPDX-License-Identifier: Apache-2.0
//! @file host_main.cpp  Catch2 main of the host (no GPU) tests.
#define CATCH_CONFIG_MAIN
#include "catch.hpp"
