// SPDX-License-Identifier: Apache-2.0
//! @file op_test.hpp  Driving one op in the tests, the way an engine would: a prox::Operator planned with
//! an explicit policy index, on an op-only workspace initialized with prox::initialize_workspace.
#pragma once

#include <cstddef>
#include <cstdint>

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

//! What a fused Stage 2 (GluDownGemvOp, BatchedGluDownGemvOp) leaves in its op-only workspace for the next
//! launch: the grid barrier's arrival count, how many of its first `tiles` down tile counters are not zero,
//! and the header's status. Ready: 0, 0, kSuccess.
struct FusedWorkspaceState {
  std::uint32_t arrivals = 0;
  int counters_not_zero = 0;
  prox::Status status = prox::Status::kSuccess;
};
inline FusedWorkspaceState fused_workspace_state(const DeviceBuffer<char>& ws, int tiles) {
  const auto bytes = ws.download();
  const auto* words = reinterpret_cast<const std::uint32_t*>(bytes.data() + prox::detail::kHeaderBytes);
  FusedWorkspaceState st;
  st.arrivals = words[0];
  for (int t = 0; t < tiles; ++t) st.counters_not_zero += words[prox::detail::kBarrierWords + t] != 0u;
  PROX_TEST_OK(prox::read_workspace_status(ws.get(), nullptr, &st.status));
  return st;
}

}  // namespace prox_test
