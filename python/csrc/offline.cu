// SPDX-License-Identifier: Apache-2.0
//! @file offline.cu  The offline helpers (INT4 packing, transpose), the workspace calls and the
//! dispatch of make_plan() to the layer types (generated/layer_types.inc). No SparseFfn kernel is compiled
//! here.
#include <prox/prox.cuh>

#include "ffn_api.h"
#include "ffn_type.cuh"

PROX_EXT_EXTERN(__half, prox::SiLU, kNative)

static_assert(prox_ext::kMaxTokens == prox::kMaxBatchTokens, "ffn_api.h's kMaxTokens is prox's batch limit");

namespace prox_ext {

prox::Status make_plan(const FfnDesc& d, std::unique_ptr<FfnPlan>* out) {
  if (out == nullptr) return prox::Status::kErrorNullPointer;
#define PROX_EXT_LAYER(name, T, ActT, dt_, act_, fmt_)                                          \
  if (d.dtype == DType::dt_ && d.act == Act::act_ && d.format == Format::fmt_) return make_plan_##name(d, out);
#include "generated/layer_types.inc"
#undef PROX_EXT_LAYER
  return prox::Status::kErrorInvalidArgument;
}

std::size_t workspace_bytes(int d_model, int d_ff, int max_tokens) noexcept {
  // The same for every T, activation, policy and device (sparse_ffn.cuh).
  return FfnType<__half, prox::SiLU, Format::kNative>::workspace_bytes(d_model, d_ff, max_tokens);
}

prox::Status pack_int4(DType t, const void* w, int d_model, int d_ff, std::uint32_t* packed, float* scales,
                       cudaStream_t stream) {
  if (t == DType::kHalf)
    return prox::int4::pack_device(static_cast<const __half*>(w), d_model, d_ff, packed, scales, stream);
  return prox::int4::pack_device(static_cast<const __nv_bfloat16*>(w), d_model, d_ff, packed, scales, stream);
}

prox::Status transpose(DType t, const void* in, int rows, int cols, void* out, cudaStream_t stream) noexcept {
  if (t == DType::kHalf)
    return prox::transpose_device(static_cast<const __half*>(in), rows, cols, static_cast<__half*>(out), stream);
  return prox::transpose_device(static_cast<const __nv_bfloat16*>(in), rows, cols,
                                static_cast<__nv_bfloat16*>(out), stream);
}

prox::Status pack_int4_host(DType t, const void* w, int d_model, int d_ff, std::uint32_t* packed, float* scales) {
  if (t == DType::kHalf)
    return prox::int4::pack_host(static_cast<const __half*>(w), d_model, d_ff, packed, scales);
  return prox::int4::pack_host(static_cast<const __nv_bfloat16*>(w), d_model, d_ff, packed, scales);
}

prox::Status transpose_host(DType t, const void* in, int rows, int cols, void* out) {
  if (t == DType::kHalf)
    return prox::transpose_host(static_cast<const __half*>(in), rows, cols, static_cast<__half*>(out));
  return prox::transpose_host(static_cast<const __nv_bfloat16*>(in), rows, cols, static_cast<__nv_bfloat16*>(out));
}

prox::Status initialize_workspace(void* ws, std::size_t bytes, cudaStream_t stream) noexcept {
  return prox::initialize_workspace(ws, bytes, stream);
}

std::size_t workspace_header_bytes() noexcept { return prox::detail::kHeaderBytes; }

prox::Status workspace_dirty(const void* ws, cudaStream_t stream, bool* dirty) noexcept {
  prox::Status s = prox::Status::kSuccess;
  const prox::Status st = prox::read_workspace_status(ws, stream, &s);
  if (st != prox::Status::kSuccess) return st;
  *dirty = s == prox::Status::kErrorDirtyWorkspace;
  return prox::Status::kSuccess;
}

prox::Status allocate_sparsity(double e, double* s1, double* s2) noexcept {
  prox::StageSparsity split;
  const prox::Status st = prox::allocate_sparsity(e, &split);
  if (st == prox::Status::kSuccess) {
    *s1 = split.s1;
    *s2 = split.s2;
  }
  return st;
}

const char* int4_layout_tag() noexcept { return prox::int4::kLayoutTag; }
int int4_layout_version() noexcept { return prox::int4::kLayoutVersion; }

}  // namespace prox_ext
