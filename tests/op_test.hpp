// SPDX-License-Identifier: Apache-2.0
//! @file op_test.hpp  Driving one op in the tests, the way an engine would: a prox::Operator planned with
//! an explicit policy index, on an op-only workspace initialized with prox::initialize_workspace.
#pragma once

#include <cstddef>

#include <prox/operator.cuh>

#include "common.hpp"

namespace prox_test {

//! An op-only workspace for `Op` at the shape of `a` (at least 16 bytes), initialized.
template <class Op>
DeviceBuffer<char> op_workspace(const typename Op::Args& a) {
  const std::size_t bytes = prox::Operator<Op>::workspace_bytes(a);
  DeviceBuffer<char> ws(bytes > 16 ? bytes : 16);
  if (bytes > 0) PROX_TEST_OK(prox::initialize_workspace(ws.get(), ws.bytes(), nullptr));
  return ws;
}

//! Plan `Op` with candidate `policy` and `options`, then launch `a` `reps` times on `ws` (synchronous
//! launches are the caller's business). The first failing Status is returned.
template <class Op>
prox::Status run_op(const typename Op::Args& a, int policy, const DeviceBuffer<char>& ws, int reps = 1,
                    const typename Op::Options& options = {}, cudaStream_t stream = nullptr) {
  prox::Operator<Op> op;
  PROX_RETURN_IF_ERROR(op.initialize(a, options, policy));
  for (int r = 0; r < reps; ++r) PROX_RETURN_IF_ERROR(op.run(a, ws.get(), ws.bytes(), stream));
  return prox::Status::kSuccess;
}

}  // namespace prox_test
