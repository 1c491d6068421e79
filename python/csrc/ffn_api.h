// SPDX-License-Identifier: Apache-2.0
//! @file ffn_api.h  The extension's torch-free interface to prox: what bindings.cpp (g++, torch
//! headers) calls and the .cu files (nvcc, prox headers) define. Keeping torch out of the .cu files
//! and the kernels out of bindings.cpp lets each be compiled by the compiler it needs, in parallel:
//! one .cu file per layer type (prox's explicit-instantiation pattern), one file for the offline
//! helpers.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include <prox/core/status.hpp>

namespace prox_ext {

enum class DType : int { kHalf = 0, kBFloat16 = 1 };

//! Most tokens one batched call runs (prox::kMaxBatchTokens; offline.cu checks that they agree).
constexpr int kMaxTokens = 8;
enum class Act : int { kSiLU = 0, kGeluTanh = 1 };

//! The plan options' flags, written once: X(name, default) in bit order (bit i of the options' flags word
//! is the i-th entry). Each name is a bool of SparseFfn::PlanOptions; bindings.cpp decodes the word with this
//! list, ffn_impl.cuh copies each into SparseFfn::PlanOptions, and Python's PlanOptions encodes by the names
//! the extension reports (torch.ops.prox.plan_flag_names()).
#define PROX_EXT_PLAN_FLAGS(X) \
  X(pdl, true)                 \
  X(cluster, false)            \
  X(fuse_stage2, true)         \
  X(spread, true)              \
  X(cooperative, true)         \
  X(check_workspace, true)     \
  X(fuse_batch_stage2, false)

//! SparseFfn::PlanOptions, flattened: the flags above, their word, and the four policy indices (-1 = default).
struct PlanFlags {
#define PROX_EXT_FLAG_FIELD(name, def) bool name = def;
  PROX_EXT_PLAN_FLAGS(PROX_EXT_FLAG_FIELD)
#undef PROX_EXT_FLAG_FIELD
  unsigned word = 0;  //!< the flags as encoded (bit i = the i-th flag): the plan cache's key
  int proxy = -1, glu = -1, down = -1, glu_down = -1;
};

//! The Stage-2 weight formats, from setup.py's FORMATS (generated/formats.inc: PROX_EXT_FORMAT(name, code), in
//! list order): the layer-type list's third field. Python names a format by its name (prox.LayerTensors.format)
//! and passes its position in torch.ops.prox.layer_format_names() as the ops' `format`.
enum class Format : int {
#define PROX_EXT_FORMAT(name, code) code,
#include "generated/formats.inc"
#undef PROX_EXT_FORMAT
};

//! The layer's tensors, written once: X(name) in slot order. The ops take them as one list, `Tensor?[] layer`,
//! entry i holding the i-th slot (None where the layer's format has no such tensor). bindings.cpp reads each by
//! its name and checks it (layer_slots.h: every error names the slot), the plan cache keys every slot's
//! pointer, ffn_type.cuh maps the slots to SparseFfn::Weights, and Python's prox.LayerTensors builds the list by
//! the names the extension reports (torch.ops.prox.layer_slot_names()). A format's own tensors (FP8's weight
//! scales) are new entries at the end, checked by that format's FormatSlots (layer_slots.h) and None for the
//! other formats. The enumerators are the names (Slot::w_gate). The FP8 formats' weight scales (the
//! multipliers checkpoints call `weight_scale` or `weight_scale_inv`; docs/fp8-format.md) are the last three:
//! w_gate_scale, w_up_scale ([d_ff] per channel) and w_down_t_scale ([d_model] per channel, one per output
//! column of W_down^T), or all three [ceil(d_ff/128), ceil(d_model/128)] in 128 x 128 blocks.
#define PROX_EXT_LAYER_SLOTS(X) \
  X(w_gate)                     \
  X(w_up)                       \
  X(w_down_t)                   \
  X(proxy_gate)                 \
  X(scale_gate)                 \
  X(proxy_up)                   \
  X(scale_up)                   \
  X(w_gate_scale)               \
  X(w_up_scale)                 \
  X(w_down_t_scale)

enum class Slot : int {
#define PROX_EXT_SLOT_ENUM(name) name,
  PROX_EXT_LAYER_SLOTS(PROX_EXT_SLOT_ENUM)
#undef PROX_EXT_SLOT_ENUM
};

//! Entries of the ops' `layer` list (one per PROX_EXT_LAYER_SLOTS entry).
constexpr int kSlotCount = 0
#define PROX_EXT_SLOT_COUNT(name) +1
    PROX_EXT_LAYER_SLOTS(PROX_EXT_SLOT_COUNT)
#undef PROX_EXT_SLOT_COUNT
    ;

//! One layer as SparseFfn::plan() sees it: activation type, activation, weight format, shape, every slot's
//! device pointer, options and token capacity. Thresholds are always read from the device
//! (Config::thresholds), so one plan serves every sparsity target.
struct FfnDesc {
  DType dtype = DType::kHalf;  //!< the activation type T (x, y)
  Act act = Act::kSiLU;
  Format format = Format{};  //!< Stage 2's weight format
  int d_model = 0;
  int d_ff = 0;
  //! Each slot's device pointer, indexed by Slot (null where the format has no such tensor).
  std::array<const void*, kSlotCount> slots{};
  const float* thresholds = nullptr;  //!< device float[2] {tau_x, tau_s}
  PlanFlags flags{};
  //! Config::max_tokens, 1..kMaxTokens: a plan of capacity m runs every batch of up to m tokens, and
  //! every call needs workspace_bytes(d_model, d_ff, m) (its layout has room for m tokens).
  int max_tokens = 1;

  //! Slot `s`'s pointer as a `const P*`.
  template <class P>
  const P* slot(Slot s) const noexcept {
    return static_cast<const P*>(slots[static_cast<int>(s)]);
  }
};

//! SparseFfn::Outputs / BatchOutputs (device pointers, null = not wanted). For a batch of B tokens
//! every array is token-major ([B][d_ff/32], [B][d_ff]) and counters holds B + 1 entries.
struct FfnOutputs {
  void* counters = nullptr;  //!< prox::SparsityCounters (4 x uint64) per entry
  std::uint32_t* mask = nullptr;
  float* s_proxy = nullptr;
  float* s = nullptr;
};

//! A planned layer of any of the layer types (generated/layer_types.inc).
class FfnPlan {
 public:
  virtual ~FfnPlan() = default;
  virtual prox::Status run(const void* x, void* y, void* workspace, std::size_t bytes, cudaStream_t stream,
                           const FfnOutputs& out) const noexcept = 0;
  //! SparseFfn::run_batch: x, y [tokens][d_model], tokens in [1, max_tokens].
  virtual prox::Status run_batch(const void* x, void* y, int tokens, void* workspace, std::size_t bytes,
                                 cudaStream_t stream, const FfnOutputs& out) const noexcept = 0;
  virtual prox::Status run_proxy_values(const void* x, float* s_proxy, void* workspace, std::size_t bytes,
                                        cudaStream_t stream) const noexcept = 0;
  //! The policies plan() fixed: proxy, glu, down, glu_down (-1 where that Stage 2 is not planned).
  virtual void policies(int out[4]) const noexcept = 0;
};

/**
 * @brief A layer's dense FFN through its own fused Stage-2 kernel (SparseFfn::FusedStage2Op) with every channel
 * selected and no Stage 1: the dense baseline of prox's own kernels (issue 40's baseline (b) for FP8 weights).
 * SparseFfn has no such entry point, so the extension drives the op itself (prox::Operator, as prox_bench's
 * fp8_dense does): the plan owns an all-ones channel mask, the s scratch and the op's own workspace (device
 * memory allocated at plan time, never freed: the dense plans live as long as the process). One call in
 * flight per plan: its workspace is not per stream.
 */
class DensePlan {
 public:
  virtual ~DensePlan() = default;
  //! y = the dense FFN of x (one token, [d_model]); graph-capturable, no allocation, no synchronization.
  virtual prox::Status run(const void* x, void* y, cudaStream_t stream) const noexcept = 0;
  virtual int policy() const noexcept = 0;
};

//! Plan a layer (reads the current device's attributes; not capturable).
prox::Status make_plan(const FfnDesc& d, std::unique_ptr<FfnPlan>* out);
//! Plan a layer's dense Stage 2 (DensePlan; allocates device memory and synchronizes: not capturable).
prox::Status make_dense_plan(const FfnDesc& d, std::unique_ptr<DensePlan>* out);

// Two factories per layer type, each pair in its generated translation unit (generated/ffn_<name>.cu). setup.py
// writes the list (generated/layer_types.inc) from LAYER_TYPES: PROX_EXT_LAYER(name, T, Act, dtype, act,
// format), with the DType / Act / Format codes above.
#define PROX_EXT_LAYER(name, T, ActT, dtype, act, format)                                   \
  prox::Status make_plan_##name(const FfnDesc& d, std::unique_ptr<FfnPlan>* out); \
  prox::Status make_dense_##name(const FfnDesc& d, std::unique_ptr<DensePlan>* out);
#include "generated/layer_types.inc"
#undef PROX_EXT_LAYER

// Offline helpers and workspace (offline.cu).
//! SparseFfn::workspace_bytes(d_model, d_ff, max_tokens); max_tokens = 1 is the batch-1 size.
std::size_t workspace_bytes(int d_model, int d_ff, int max_tokens = 1) noexcept;
prox::Status pack_int4(DType t, const void* w, int d_model, int d_ff, std::uint32_t* packed, float* scales,
                       cudaStream_t stream);
prox::Status transpose(DType t, const void* in, int rows, int cols, void* out, cudaStream_t stream) noexcept;
//! The host versions (int4::pack_host, transpose_host): CPU tensors, bit-identical to the device ones.
prox::Status pack_int4_host(DType t, const void* w, int d_model, int d_ff, std::uint32_t* packed, float* scales);
prox::Status transpose_host(DType t, const void* in, int rows, int cols, void* out);
prox::Status initialize_workspace(void* ws, std::size_t bytes, cudaStream_t stream) noexcept;
//! Bytes of a workspace's header (prox::detail::kHeaderBytes): the least any workspace holds; its status
//! word, which workspace_dirty() reads, is at the header's end.
std::size_t workspace_header_bytes() noexcept;
//! *dirty = whether a kernel found the workspace not ready since its initialization (synchronizes).
prox::Status workspace_dirty(const void* ws, cudaStream_t stream, bool* dirty) noexcept;
//! prox::allocate_sparsity with the paper's rule.
prox::Status allocate_sparsity(double e, double* s1, double* s2) noexcept;
//! The INT4 layout tag and version (int4_format.hpp).
const char* int4_layout_tag() noexcept;
int int4_layout_version() noexcept;

// FP8 e4m3 offline helpers (fp8.cuh, fp8_format.hpp; docs/fp8-format.md). `layout`: prox::fp8::ScaleLayout's
// value (0 per output channel, 1 128 x 128 blocks). Each has a device version (CUDA tensors, on `stream`) and a
// host version (CPU tensors), bit-identical.
//! The element type of a matrix fp8_quantize reads.
enum class SrcType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };
//! fp8::quantize_device / quantize_host: w [rows][cols] -> q [rows][cols] e4m3, scales [rows] or blocks.
prox::Status fp8_quantize(SrcType t, const void* w, int rows, int cols, int layout, std::uint8_t* q, float* scales,
                          cudaStream_t stream);
prox::Status fp8_quantize_host(SrcType t, const void* w, int rows, int cols, int layout, std::uint8_t* q,
                               float* scales);
//! fp8::transpose_down_device / _host: W_down [d_model][d_ff] and its scales -> W_down^T and its scales.
prox::Status fp8_transpose_down(const std::uint8_t* q, const float* scales, int d_model, int d_ff, int layout,
                                std::uint8_t* q_t, float* scales_t, cudaStream_t stream);
prox::Status fp8_transpose_down_host(const std::uint8_t* q, const float* scales, int d_model, int d_ff, int layout,
                                     std::uint8_t* q_t, float* scales_t);
//! fp8::pack_int4_device / _host: the INT4 proxy of an FP8 W_gate or W_up [d_ff][d_model].
prox::Status fp8_pack_int4(const std::uint8_t* q, const float* scales, int layout, int d_model, int d_ff,
                           std::uint32_t* packed, float* int4_scales, cudaStream_t stream);
prox::Status fp8_pack_int4_host(const std::uint8_t* q, const float* scales, int layout, int d_model, int d_ff,
                                std::uint32_t* packed, float* int4_scales);
//! fp8::check_scales_device (synchronizes `stream`) / _host: kErrorInvalidScale and *first_bad for a NaN, +-inf,
//! +-0 or negative scale.
prox::Status fp8_check_scales(const float* scales, std::size_t count, cudaStream_t stream, std::size_t* first_bad);
prox::Status fp8_check_scales_host(const float* scales, std::size_t count, std::size_t* first_bad);
//! The FP8 layout tag (fp8::kLayoutTag).
const char* fp8_layout_tag() noexcept;
//! The number of scales of a layer's FP8 slot (w_gate_scale, w_up_scale, w_down_t_scale) in its format (0 for
//! another slot or format).
std::size_t fp8_scale_count(Format f, Slot s, int d_model, int d_ff) noexcept;

}  // namespace prox_ext
