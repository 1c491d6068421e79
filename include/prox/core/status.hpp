// SPDX-License-Identifier: Apache-2.0
//! @file status.hpp  prox::Status, the error type every launcher and planner returns.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "config.hpp"

PROX_NAMESPACE_BEGIN

/**
 * @brief Result of every host-side prox call. Launchers validate their arguments and return an
 * error *before* anything is launched; device code never traps.
 */
enum class Status : int {
  kSuccess = 0,
  kErrorNullPointer,          //!< a required pointer is null
  kErrorMisalignedPointer,    //!< a pointer is not aligned as the op requires (16 bytes for vectors)
  kErrorInvalidShape,         //!< a size is zero, negative, too large, or not a multiple the op needs
  kErrorInvalidThreshold,     //!< a threshold is NaN or negative
  kErrorWorkspaceTooSmall,    //!< the caller's workspace is smaller than workspace_bytes()
  kErrorInvalidArgument,      //!< any other argument out of its documented range
  kErrorNonFiniteWeight,      //!< a weight to be quantized is NaN or infinite
  kErrorInvalidTarget,        //!< a sparsity target outside its valid range (or NaN)
  kErrorEmptySamples,         //!< calibration got no finite sample
  kErrorUnreachableTarget,    //!< calibration samples cannot realize the requested sparsity
  kErrorNotPlanned,           //!< run() called on an object whose plan() did not succeed
  kErrorNoDevice,             //!< no CUDA device is visible
  kErrorUnsupportedDevice,    //!< the device is older than sm_80
  kErrorCacheIo,              //!< the tuning cache file could not be read or written
  kErrorCudaRuntime,          //!< a CUDA runtime call or kernel launch failed
  kErrorCapturing,            //!< the call is not allowed while the stream is being captured
  kErrorDirtyWorkspace,       //!< a kernel found the workspace not initialized (or last used at another shape)
  kErrorInvalidScale,         //!< a quantization scale is NaN, infinite, zero or negative
};

//! Human-readable name of a Status (never null).
constexpr const char* to_string(Status s) noexcept {
  switch (s) {
    case Status::kSuccess: return "success";
    case Status::kErrorNullPointer: return "null pointer";
    case Status::kErrorMisalignedPointer: return "misaligned pointer";
    case Status::kErrorInvalidShape: return "unsupported or invalid shape";
    case Status::kErrorInvalidThreshold: return "invalid threshold (NaN or negative)";
    case Status::kErrorWorkspaceTooSmall: return "workspace too small";
    case Status::kErrorInvalidArgument: return "invalid argument";
    case Status::kErrorNonFiniteWeight: return "non-finite weight";
    case Status::kErrorInvalidTarget: return "invalid sparsity target";
    case Status::kErrorEmptySamples: return "no finite calibration sample";
    case Status::kErrorUnreachableTarget: return "sparsity target unreachable on these samples";
    case Status::kErrorNotPlanned: return "not planned";
    case Status::kErrorNoDevice: return "no CUDA device";
    case Status::kErrorUnsupportedDevice: return "unsupported device (needs sm_80 or newer)";
    case Status::kErrorCacheIo: return "tuning cache I/O error";
    case Status::kErrorCudaRuntime: return "CUDA runtime error";
    case Status::kErrorCapturing: return "not allowed during stream capture";
    case Status::kErrorDirtyWorkspace: return "workspace not initialized (or last used at another shape)";
    case Status::kErrorInvalidScale: return "invalid quantization scale (NaN, infinite, zero or negative)";
  }
  return "unknown status";
}

constexpr bool ok(Status s) noexcept { return s == Status::kSuccess; }

namespace detail {
//! PROX_CHECK's failure path: one line on stderr, then std::abort().
[[noreturn]] inline void check_failed(Status s, const char* expr, const char* file, int line) noexcept {
  std::fprintf(stderr, "%s:%d: PROX_CHECK(%s) failed: %s\n", file, line, expr, to_string(s));
  std::fflush(stderr);
  std::abort();
}
}  // namespace detail

PROX_NAMESPACE_END

/**
 * @brief For user code (examples, tools, an engine's start-up): evaluate an expression that yields a
 * prox::Status and, unless it is kSuccess, print `file:line: PROX_CHECK(expr) failed: <status>` to
 * stderr and abort. prox itself never aborts: its calls return the Status, and an engine that
 * handles errors its own way tests that value instead. Variadic, so an expression whose template
 * arguments hold commas (`launch<PolicyAt<0, Policies>>(...)`) needs no extra parentheses.
 */
#define PROX_CHECK(...)                                                                   \
  do {                                                                                    \
    const ::prox::Status prox_check_status_ = (__VA_ARGS__);                              \
    if (prox_check_status_ != ::prox::Status::kSuccess) {                                 \
      ::prox::detail::check_failed(prox_check_status_, #__VA_ARGS__, __FILE__, __LINE__); \
    }                                                                                     \
  } while (0)

//! Propagate a non-success Status from the enclosing function (variadic, as PROX_CHECK).
#define PROX_RETURN_IF_ERROR(...)                      \
  do {                                                 \
    const ::prox::Status prox_status_ = (__VA_ARGS__); \
    if (prox_status_ != ::prox::Status::kSuccess) {    \
      return prox_status_;                             \
    }                                                  \
  } while (0)
