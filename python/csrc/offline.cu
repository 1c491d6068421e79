// SPDX-License-Identifier: Apache-2.0
//! @file offline.cu  The offline helpers (INT4 packing, transpose, the FP8 e4m3 helpers), the workspace calls
//! and the dispatch of make_plan() / make_dense_plan() to the layer types (generated/layer_types.inc). No
//! SparseFfn kernel is compiled here.
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

prox::Status make_dense_plan(const FfnDesc& d, std::unique_ptr<DensePlan>* out) {
  if (out == nullptr) return prox::Status::kErrorNullPointer;
#define PROX_EXT_LAYER(name, T, ActT, dt_, act_, fmt_)                                          \
  if (d.dtype == DType::dt_ && d.act == Act::act_ && d.format == Format::fmt_) return make_dense_##name(d, out);
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

// ---------------------------------------------------------------- FP8 e4m3

namespace {
prox::fp8::ScaleLayout layout_of(int layout) noexcept { return static_cast<prox::fp8::ScaleLayout>(layout); }
}  // namespace

prox::Status fp8_quantize(SrcType t, const void* w, int rows, int cols, int layout, std::uint8_t* q, float* scales,
                          cudaStream_t stream) {
  const prox::fp8::ScaleLayout l = layout_of(layout);
  switch (t) {
    case SrcType::kFloat:
      return prox::fp8::quantize_device(static_cast<const float*>(w), rows, cols, l, q, scales, stream);
    case SrcType::kHalf:
      return prox::fp8::quantize_device(static_cast<const __half*>(w), rows, cols, l, q, scales, stream);
    case SrcType::kBFloat16:
      return prox::fp8::quantize_device(static_cast<const __nv_bfloat16*>(w), rows, cols, l, q, scales, stream);
  }
  return prox::Status::kErrorInvalidArgument;
}

prox::Status fp8_quantize_host(SrcType t, const void* w, int rows, int cols, int layout, std::uint8_t* q,
                               float* scales) {
  const prox::fp8::ScaleLayout l = layout_of(layout);
  switch (t) {
    case SrcType::kFloat:
      return prox::fp8::quantize_host(static_cast<const float*>(w), rows, cols, l, q, scales);
    case SrcType::kHalf:
      return prox::fp8::quantize_host(static_cast<const __half*>(w), rows, cols, l, q, scales);
    case SrcType::kBFloat16:
      return prox::fp8::quantize_host(static_cast<const __nv_bfloat16*>(w), rows, cols, l, q, scales);
  }
  return prox::Status::kErrorInvalidArgument;
}

prox::Status fp8_transpose_down(const std::uint8_t* q, const float* scales, int d_model, int d_ff, int layout,
                                std::uint8_t* q_t, float* scales_t, cudaStream_t stream) {
  return prox::fp8::transpose_down_device(q, scales, d_model, d_ff, layout_of(layout), q_t, scales_t, stream);
}

prox::Status fp8_transpose_down_host(const std::uint8_t* q, const float* scales, int d_model, int d_ff, int layout,
                                     std::uint8_t* q_t, float* scales_t) {
  return prox::fp8::transpose_down_host(q, scales, d_model, d_ff, layout_of(layout), q_t, scales_t);
}

prox::Status fp8_pack_int4(const std::uint8_t* q, const float* scales, int layout, int d_model, int d_ff,
                           std::uint32_t* packed, float* int4_scales, cudaStream_t stream) {
  return prox::fp8::pack_int4_device(q, scales, layout_of(layout), d_model, d_ff, packed, int4_scales, stream);
}

prox::Status fp8_pack_int4_host(const std::uint8_t* q, const float* scales, int layout, int d_model, int d_ff,
                                std::uint32_t* packed, float* int4_scales) {
  return prox::fp8::pack_int4_host(q, scales, layout_of(layout), d_model, d_ff, packed, int4_scales);
}

prox::Status fp8_check_scales(const float* scales, std::size_t count, cudaStream_t stream, std::size_t* first_bad) {
  return prox::fp8::check_scales_device(scales, count, stream, first_bad);
}

prox::Status fp8_check_scales_host(const float* scales, std::size_t count, std::size_t* first_bad) {
  return prox::fp8::check_scales_host(scales, count, first_bad);
}

const char* fp8_layout_tag() noexcept { return prox::fp8::kLayoutTag; }

std::size_t fp8_scale_count(Format f, Slot s, int d_model, int d_ff) noexcept {
  using prox::fp8::Orientation;
  using prox::fp8::ScaleLayout;
  if (f != Format::kFp8Channel && f != Format::kFp8Block128) return 0;
  const ScaleLayout l = f == Format::kFp8Block128 ? ScaleLayout::kBlock128 : ScaleLayout::kPerChannel;
  switch (s) {
    case Slot::w_gate_scale:
    case Slot::w_up_scale:
      return prox::fp8::scale_count(l, Orientation::kOutIn, d_ff, d_model);
    case Slot::w_down_t_scale:
      return prox::fp8::scale_count(l, Orientation::kInOut, d_ff, d_model);
    default:
      return 0;
  }
}

}  // namespace prox_ext
