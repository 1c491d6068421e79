// SPDX-License-Identifier: Apache-2.0
//! @file operator.cuh  prox::Operator<Op>: the one way every op is planned and launched (modelled on
//! CUTLASS's device-level operators). SparseFfn, the tuner, the benchmarks and the tests all drive the
//! ops through it, so how an op is launched is known in one place: the op's own header.
//!
//! An op is a type (ThresholdOp, ProxyGemvOp, GluGemvOp, DownGemvOp, GluDownGemvOp) with
//!   Args                      data only: pointers, shape, thresholds
//!   Policies                  its candidate tile policies (a PolicyList; index 0 implements every shape)
//!   Options                   launch knobs (pdl and op-specific ones)
//!   can_implement(Args)       validation, no launch
//!   check_options(Options)    the options' own rules (checked before the device is asked anything)
//!   same_shape(Args, Args)    whether a plan made for one serves the other
//!   workspace_needs(Args)     sync and scratch bytes, the same for every policy (core/workspace.cuh)
//!   configure<P>(...)         plan time: grid, shared memory, launch attributes of policy P
//!   launch<P>(...)            run time: launches with the planned configuration, nothing else
//! and default_policy(Op, DeviceInfo, Args): the op's own rule beside it in its header, found by argument-
//! dependent lookup, else dispatch.cuh's fallback (policy 0). This header includes no op: driving one op
//! compiles that op.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/device.hpp"
#include "core/launch.cuh"
#include "core/math.hpp"
#include "core/policy.hpp"
#include "core/status.hpp"
#include "core/workspace.cuh"
#include "dispatch.cuh"

PROX_NAMESPACE_BEGIN

/**
 * @brief A planned op: initialize() validates once and fixes the policy, grid and launch options;
 * run() launches.
 * @tparam Op an op type (see the file comment).
 *
 * @code
 * prox::ProxyGemvArgs<__half> a;  // x, d_model, d_ff, tau_x, tau_s, gate / up proxies, channel_mask
 * prox::Operator<prox::ProxyGemvOp<__half, prox::SiLU>> op;
 * PROX_CHECK(op.initialize(a));                      // plan time: validates, reads the device once
 * std::size_t bytes = op.workspace_bytes(a);         // any policy, any device
 * prox::initialize_workspace(ws, bytes, stream);     // once
 * PROX_CHECK(op.run(ws, bytes, stream));             // per call; graph-capturable
 * @endcode
 */
template <class Op>
class Operator {
 public:
  using Args = typename Op::Args;
  using Options = typename Op::Options;
  using Policies = typename Op::Policies;

  //! Validate without planning or launching.
  static Status can_implement(const Args& a) noexcept { return Op::can_implement(a); }
  //! Bytes of a workspace for this op alone: a header (detail::kHeaderBytes), the sync words, the scratch (0 for an
  //! op that needs none: threshold, glu_gemv).
  static std::size_t workspace_bytes(const Args& a) noexcept {
    return detail::standalone_workspace_bytes(Op::workspace_needs(a));
  }

  //! The view of an op-only workspace (workspace_bytes(a) bytes at `workspace`) that run() launches on:
  //! its header checked (initialize_workspace()), nothing reset or stamped.
  static OpWorkspace workspace_view(void* workspace, const Args& a) noexcept {
    return detail::standalone_view(workspace, Op::workspace_needs(a));
  }

  /**
   * @brief The view of an op-only workspace that SparseFfn gives its Stage-2 kernels (down, GLU, fused):
   * the header not checked (in the FFN, Stage 1 has checked it) and, with `stamp`, stamped ready
   * ({magic, kTagAny}, as initialize_workspace() wrote it). A Stage-2 op launched on it costs what it
   * costs in the FFN (benches, the tuner); null for an op that needs no workspace.
   */
  static OpWorkspace stage2_view(void* workspace, const Args& a, bool stamp) noexcept {
    OpWorkspace v;
    if (workspace_bytes(a) > 0) v = workspace_view(workspace, a);
    v.guard = WorkspaceGuard{};
    if (stamp) {
      v.guard.stamp = static_cast<std::uint32_t*>(workspace);
      v.guard.tag = detail::kTagAny;
    }
    return v;
  }

  /**
   * @brief Plan: validate `a` and `o`, read the current device once, fix the policy (`policy` >= 0: that index
   * of Policies; -1: default_policy() for this device and shape) and its launch configuration.
   * Not capturable (it may query the driver); call it before capture. On failure the operator is
   * left uninitialized, and run() returns kErrorNotPlanned.
   */
  Status initialize(const Args& a, const Options& o = {}, int policy = -1) noexcept {
    ready_ = false;
    PROX_RETURN_IF_ERROR(validate(a, o, policy));  // before the device is asked anything
    DeviceInfo d;
    PROX_RETURN_IF_ERROR(query_device(&d));
    return configure(a, o, policy, d);
  }

  //! initialize() on a device the caller has read (query_device()): one read serves every op of a plan
  //! (SparseFfn).
  Status initialize(const Args& a, const Options& o, int policy, const DeviceInfo& d) noexcept {
    ready_ = false;
    PROX_RETURN_IF_ERROR(validate(a, o, policy));
    return configure(a, o, policy, d);
  }

  /**
   * @brief Launch the initialized arguments on `stream` with an op-only workspace (workspace_bytes()
   * bytes at `workspace`, initialized once with initialize_workspace()). Checks the workspace, then
   * launches: no device query, no allocation, no synchronization; graph-capturable.
   */
  Status run(void* workspace, std::size_t workspace_size, cudaStream_t stream) const noexcept {
    return run(args_, workspace, workspace_size, stream);
  }

  /**
   * @brief Launch with per-call arguments `a` (new pointers, same shape as initialized: weights,
   * activations and outputs may change from call to call, e.g. over rotated weight copies). `a` is
   * validated (host arithmetic only) before anything is launched.
   */
  Status run(const Args& a, void* workspace, std::size_t workspace_size, cudaStream_t stream) const noexcept {
    if (!ready_) return Status::kErrorNotPlanned;
    PROX_RETURN_IF_ERROR(Op::can_implement(a));
    if (!Op::same_shape(args_, a)) return Status::kErrorInvalidArgument;
    const std::size_t need = detail::standalone_workspace_bytes(needs_);  // 0: the op needs none
    if (need == 0) return launch(a, OpWorkspace{}, stream);
    PROX_RETURN_IF_ERROR(detail::check_workspace(workspace, workspace_size, need));
    return launch(a, detail::standalone_view(workspace, needs_), stream);
  }

  /**
   * @brief The driver path (SparseFfn): launch `a` with a workspace view the caller laid out, without
   * validating. The caller guarantees that `a` passed can_implement() with this plan's shape.
   */
  Status launch(const Args& a, const OpWorkspace& ws, cudaStream_t stream) const noexcept {
    return dispatch_policy<Policies>(policy_, [&](auto p) {
      return Op::template launch<decltype(p)>(a, launch_, ws, stream);
    });
  }

  //! The policy index initialize() fixed.
  int policy() const noexcept { return policy_; }
  const LaunchConfig& launch_config() const noexcept { return launch_; }
  //! The arguments initialize() validated (SparseFfn fills in the per-token pointers of a copy).
  const Args& args() const noexcept { return args_; }

 private:
  static Status validate(const Args& a, const Options& o, int policy) noexcept {
    PROX_RETURN_IF_ERROR(Op::can_implement(a));
    PROX_RETURN_IF_ERROR(Op::check_options(o));
    return policy >= Policies::kSize || policy < -1 ? Status::kErrorInvalidArgument : Status::kSuccess;
  }

  Status configure(const Args& a, const Options& o, int policy, const DeviceInfo& d) noexcept {
    const int index = policy >= 0 ? policy : default_policy(Op{}, d, a);
    LaunchConfig lc;
    PROX_RETURN_IF_ERROR(dispatch_policy<Policies>(index, [&](auto p) {
      return Op::template configure<decltype(p)>(a, o, d, &lc);
    }));
    lc.pdl = o.pdl && d.supports_pdl();
    args_ = a;
    needs_ = Op::workspace_needs(a);
    launch_ = lc;
    policy_ = index;
    ready_ = true;
    return Status::kSuccess;
  }

  Args args_{};
  WorkspaceNeeds needs_{};
  LaunchConfig launch_{};
  int policy_ = -1;
  bool ready_ = false;
};

PROX_NAMESPACE_END
