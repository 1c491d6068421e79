// SPDX-License-Identifier: Apache-2.0
//! @file layer_slots.h  The layer's tensors on the torch side: the ops' `Tensor?[] layer` list read by slot name
//! (PROX_EXT_LAYER_SLOTS, ffn_api.h) and checked by the Stage-2 weight format's FormatSlots, every error naming
//! the slot. bindings.cpp's describe() runs these checks on every op call, and the check_layer op runs them
//! where a layer is built (prox.check_layer). A new format's checks are one FormatSlots specialization here:
//! check_format() does not compile without it.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include "ffn_api.h"

namespace prox_ext {

//! The ops' `layer` argument: one entry per slot, in PROX_EXT_LAYER_SLOTS order.
using LayerList = c10::List<std::optional<at::Tensor>>;

// ---------------------------------------------------------------- names and tensor checks

//! torch's name of a dtype ("torch.float16"): the messages are read in Python.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    default: return std::string("torch.") + c10::toString(t);
  }
}

//! A shape as Python prints a tuple: (128, 64), (2,).
inline std::string shape_name(at::IntArrayRef s) {
  std::ostringstream o;
  o << '(';
  for (std::size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

inline bool aligned(const at::Tensor& t, std::uintptr_t a) {
  return t.is_meta() || reinterpret_cast<std::uintptr_t>(t.data_ptr()) % a == 0;  // meta: no address
}

//! Where a tensor the op reads is and what it holds: a CUDA tensor where the layer's are, of `dtype`.
inline void check_placement(const at::Tensor& t, const char* name, const at::Device& dev, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.defined(), "prox: ", name, " is undefined");
  TORCH_CHECK_VALUE(!dev.is_cuda() || t.is_cuda(), "prox: ", name, " must be a CUDA tensor (it is on ", t.device(),
                    ")");
  TORCH_CHECK_VALUE(t.device() == dev, "prox: ", name, " is on ", t.device(), ", the layer's tensors on ", dev);
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "prox: ", name, " must be ", dtype_name(dtype), " (it is ",
                   dtype_name(t.scalar_type()), ")");
}

//! How the kernels read it: contiguous, `alignment`-byte aligned.
inline void check_layout(const at::Tensor& t, const char* name, std::uintptr_t alignment) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "prox: ", name, " must be contiguous");
  TORCH_CHECK_VALUE(aligned(t, alignment), "prox: ", name, " must be ", alignment, "-byte aligned (data_ptr ",
                    t.data_ptr(), ")");
}

//! Device, dtype, contiguity and alignment of a tensor the op reads, named `name` in every error.
inline void check_tensor(const at::Tensor& t, const char* name, const at::Device& dev, at::ScalarType dtype,
                         std::uintptr_t alignment) {
  check_placement(t, name, dev, dtype);
  check_layout(t, name, alignment);
}

inline void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, "prox: ", name, " must have shape ", shape_name(shape), " (it has ",
                    shape_name(t.sizes()), ")");
}

// ---------------------------------------------------------------- the slots

inline const char* slot_name(Slot s) {
  static constexpr const char* kNames[] = {
#define PROX_EXT_SLOT_NAME(name) #name,
      PROX_EXT_LAYER_SLOTS(PROX_EXT_SLOT_NAME)
#undef PROX_EXT_SLOT_NAME
  };
  return kNames[static_cast<int>(s)];
}

inline std::string slot_names() {
  std::string out;
  for (int i = 0; i < kSlotCount; ++i) out += (i ? ", " : "") + std::string(slot_name(static_cast<Slot>(i)));
  return out;
}

inline const char* format_name(Format f) {
  switch (f) {
#define PROX_EXT_FORMAT(name, code) \
  case Format::code:                \
    return #name;
#include "generated/formats.inc"
#undef PROX_EXT_FORMAT
  }
  return "?";
}

constexpr int kFormatCount = 0
#define PROX_EXT_FORMAT(name, code) +1
#include "generated/formats.inc"
#undef PROX_EXT_FORMAT
    ;

inline Format format_of(int64_t code) {
  TORCH_CHECK_VALUE(code >= 0 && code < kFormatCount, "prox: format must be a code of torch.ops.prox.layer_format_names()"
                    " (0..", kFormatCount - 1, "), got ", code);
  return static_cast<Format>(code);
}

//! The layer's shape, read from w_gate ([d_ff, d_model] in every format).
struct LayerShape {
  int64_t d_model = 0;
  int64_t d_ff = 0;
};

//! The activation type a call asks for, and what named it (x for a call, dtype for plan_ffn / check_layer).
struct ActType {
  std::optional<at::ScalarType> type;
  const char* what = "dtype";
};

/**
 * @brief The ops' `layer` list read by slot name. A format's checks take each slot they read (need()); the
 * slots they leave must be None: a tensor the format would not read is refused, never ignored.
 */
class LayerSlots {
 public:
  explicit LayerSlots(const LayerList& layer) {
    TORCH_CHECK_VALUE(static_cast<int>(layer.size()) == kSlotCount, "prox: layer must have ", kSlotCount,
                      " entries, one per slot (", slot_names(), "), got ", layer.size(),
                      ": build it from a prox.LayerTensors (its tensors())");
    for (int i = 0; i < kSlotCount; ++i) {
      const std::optional<at::Tensor> t = layer.get(i);
      if (t.has_value()) t_[i] = *t;
    }
  }

  bool given(Slot s) const { return t_[idx(s)].defined(); }

  //! A slot's tensor, which must be there (not checked further).
  const at::Tensor& get(Slot s, Format f) const {
    TORCH_CHECK_VALUE(given(s), "prox: ", slot_name(s), " is missing (None): the ", format_name(f),
                      " format needs it");
    return t_[idx(s)];
  }

  //! A slot the format reads: there, on the layer's device, of `dtype` and `shape`, contiguous, `align`-byte
  //! aligned. Marks it read.
  const at::Tensor& need(Slot s, Format f, at::ScalarType dtype, at::IntArrayRef shape, std::uintptr_t align) {
    const at::Tensor& t = get(s, f);
    const char* name = slot_name(s);
    check_placement(t, name, dev_, dtype);
    check_shape(t, name, shape);
    check_layout(t, name, align);
    used_[idx(s)] = true;
    return t;
  }

  //! After the format's checks: every slot given is one the format read.
  void check_unused(Format f) const {
    for (int i = 0; i < kSlotCount; ++i) {
      TORCH_CHECK_VALUE(!t_[i].defined() || used_[i], "prox: ", slot_name(static_cast<Slot>(i)), " is given, but the ",
                        format_name(f), " format has no such tensor: pass None");
    }
  }

  //! The device pointer of a slot the format read (null for the others).
  const void* ptr(Slot s) const {
    const at::Tensor& t = t_[idx(s)];
    return used_[idx(s)] && !t.is_meta() ? t.data_ptr() : nullptr;
  }

  void set_device(const at::Device& dev) { dev_ = dev; }
  const at::Device& device() const { return dev_; }

 private:
  static int idx(Slot s) { return static_cast<int>(s); }
  std::array<at::Tensor, kSlotCount> t_;
  std::array<bool, kSlotCount> used_{};
  at::Device dev_{at::kCPU};
};

// ---------------------------------------------------------------- the formats' checks

//! Stage 1's INT4 proxies (every format: docs/int4-format.md): proxy_gate / proxy_up int32 [d_model, d_ff/8]
//! (uint32 words), 16-byte aligned; scale_gate / scale_up float32 [d_ff].
inline void need_int4_proxies(LayerSlots& l, const LayerShape& s, Format f) {
  l.need(Slot::proxy_gate, f, at::kInt, {s.d_model, s.d_ff / 8}, 16);
  l.need(Slot::scale_gate, f, at::kFloat, {s.d_ff}, 4);
  l.need(Slot::proxy_up, f, at::kInt, {s.d_model, s.d_ff / 8}, 16);
  l.need(Slot::scale_up, f, at::kFloat, {s.d_ff}, 4);
}

/**
 * @brief One Stage-2 weight format's slots: `check(l, shape, want)` needs (LayerSlots::need) every slot the
 * format reads, with its dtype, shape and alignment, and returns the activation type T (x, y). Slots it
 * leaves must be None. Declared only: a format of setup.py's FORMATS without a specialization does not compile.
 */
template <Format kFormat>
struct FormatSlots;

//! fp16/bf16 weights of the activation type (prox::SparseFfn<T, Act, Int4Weights>): W_gate, W_up and W_down^T
//! [d_ff, d_model] of T, 16-byte aligned, and the INT4 proxies. T is the weights' dtype.
template <>
struct FormatSlots<Format::kNative> {
  static at::ScalarType check(LayerSlots& l, const LayerShape& s, const ActType& want) {
    constexpr Format f = Format::kNative;
    const at::ScalarType t = l.get(Slot::w_gate, f).scalar_type();
    TORCH_CHECK_TYPE(t == at::kHalf || t == at::kBFloat16, "prox: w_gate must be torch.float16 or torch.bfloat16 "
                     "(it is ", dtype_name(t), ")", t == at::kFloat8_e4m3fn ? ": FP8 weights are the fp8_channel or "
                     "fp8_block128 format" : "");
    TORCH_CHECK_TYPE(!want.type || *want.type == t, "prox: ", want.what, " must be ", dtype_name(t),
                     ", the dtype of the native format's weights (it is ", dtype_name(want.type.value_or(t)), ")");
    l.need(Slot::w_gate, f, t, {s.d_ff, s.d_model}, 16);
    l.need(Slot::w_up, f, t, {s.d_ff, s.d_model}, 16);
    l.need(Slot::w_down_t, f, t, {s.d_ff, s.d_model}, 16);  // W_down transposed
    need_int4_proxies(l, s, f);
    return t;
  }
};

//! The activation type of a format whose weights do not give it (FP8): the call's (x) or the dtype asked for,
//! required, float16 or bfloat16.
inline at::ScalarType want_activation_type(const ActType& want, Format f) {
  TORCH_CHECK_TYPE(want.type.has_value(), "prox: the ", format_name(f), " format's weights are torch.float8_e4m3fn: "
                   "give the activation dtype (dtype=torch.float16 or torch.bfloat16)");
  const at::ScalarType t = *want.type;
  TORCH_CHECK_TYPE(t == at::kHalf || t == at::kBFloat16, "prox: ", want.what, " must be torch.float16 or "
                   "torch.bfloat16 for the ", format_name(f), " format (it is ", dtype_name(t), ")");
  return t;
}

/**
 * @brief FP8 e4m3 Stage-2 weights with fp32 scales (prox::Fp8Weights<L>, docs/fp8-format.md): W_gate, W_up and
 * W_down^T torch.float8_e4m3fn [d_ff, d_model], 16-byte aligned, with d_model a multiple of 16 (a 16-byte piece
 * holds 16 codes); their scales float32, 4-byte aligned: w_gate_scale and w_up_scale [d_ff] and w_down_t_scale
 * [d_model] (one per output column of W_down^T) per channel, all three [ceil(d_ff/128), ceil(d_model/128)] in
 * 128 x 128 blocks; the INT4 proxies. The activation type is the call's (required). The scales' values (finite,
 * > 0) are data: prox.fp8.check_scales checks them where a layer is built, and the plan checks them once on the
 * device (SparseFfn::PlanOptions::check_scales); a call reads no values.
 */
template <Format kFormat, bool kBlock>
struct Fp8FormatSlots {
  static at::ScalarType check(LayerSlots& l, const LayerShape& s, const ActType& want) {
    constexpr Format f = kFormat;
    const at::ScalarType t = want_activation_type(want, f);
    TORCH_CHECK_VALUE(s.d_model % 16 == 0, "prox: d_model must be a multiple of 16 for the ", format_name(f),
                      " format (a 16-byte piece holds 16 e4m3 weights), got ", s.d_model);
    const at::ScalarType e4m3 = at::kFloat8_e4m3fn;
    l.need(Slot::w_gate, f, e4m3, {s.d_ff, s.d_model}, 16);
    l.need(Slot::w_up, f, e4m3, {s.d_ff, s.d_model}, 16);
    l.need(Slot::w_down_t, f, e4m3, {s.d_ff, s.d_model}, 16);  // W_down transposed (prox.fp8.transpose_down)
    if (kBlock) {
      const int64_t blocks_ff = (s.d_ff + 127) / 128, blocks_model = (s.d_model + 127) / 128;
      l.need(Slot::w_gate_scale, f, at::kFloat, {blocks_ff, blocks_model}, 4);
      l.need(Slot::w_up_scale, f, at::kFloat, {blocks_ff, blocks_model}, 4);
      l.need(Slot::w_down_t_scale, f, at::kFloat, {blocks_ff, blocks_model}, 4);  // W_down's blocks, transposed
    } else {
      l.need(Slot::w_gate_scale, f, at::kFloat, {s.d_ff}, 4);
      l.need(Slot::w_up_scale, f, at::kFloat, {s.d_ff}, 4);
      l.need(Slot::w_down_t_scale, f, at::kFloat, {s.d_model}, 4);  // one per output d: per column of W_down^T
    }
    need_int4_proxies(l, s, f);
    return t;
  }
};

template <>
struct FormatSlots<Format::kFp8Channel> : Fp8FormatSlots<Format::kFp8Channel, false> {};
template <>
struct FormatSlots<Format::kFp8Block128> : Fp8FormatSlots<Format::kFp8Block128, true> {};

//! The format's checks (FormatSlots<format>::check), for every format of generated/formats.inc.
inline at::ScalarType check_format(Format f, LayerSlots& l, const LayerShape& s, const ActType& want) {
  switch (f) {
#define PROX_EXT_FORMAT(name, code) \
  case Format::code:                \
    return FormatSlots<Format::code>::check(l, s, want);
#include "generated/formats.inc"
#undef PROX_EXT_FORMAT
  }
  TORCH_CHECK_VALUE(false, "prox: unknown format ", static_cast<int>(f));
  return at::kHalf;  // unreachable
}

/**
 * @brief Checks a layer's tensors (the slots of its format, then the thresholds) and fills `d`'s type, shape
 * and pointers. `cuda`: the tensors must be CUDA tensors (the ops); check_layer checks on any device.
 */
inline void describe_layer(const LayerList& layer, int64_t format, const at::Tensor& thresholds, const ActType& want,
                           bool cuda, FfnDesc* d) {
  LayerSlots l(layer);
  const Format f = format_of(format);
  const at::Tensor& w_gate = l.get(Slot::w_gate, f);
  TORCH_CHECK_VALUE(w_gate.dim() == 2, "prox: w_gate must be a 2-D [d_ff, d_model] tensor (it has shape ",
                    shape_name(w_gate.sizes()), ")");
  const at::Device dev = w_gate.device();
  TORCH_CHECK_VALUE(!cuda || dev.is_cuda(), "prox: w_gate must be a CUDA tensor (it is on ", dev, ")");
  l.set_device(dev);
  const LayerShape s{w_gate.size(1), w_gate.size(0)};
  TORCH_CHECK_VALUE(s.d_model >= 8 && s.d_model % 8 == 0 && s.d_model <= (1 << 20),
                    "prox: d_model must be a multiple of 8 in [8, 2^20], got ", s.d_model);
  TORCH_CHECK_VALUE(s.d_ff >= 32 && s.d_ff % 32 == 0 && s.d_ff <= (1 << 20),
                    "prox: d_ff must be a multiple of 32 in [32, 2^20], got ", s.d_ff);
  const at::ScalarType t = check_format(f, l, s, want);
  l.check_unused(f);
  check_tensor(thresholds, "thresholds", dev, at::kFloat, 4);
  check_shape(thresholds, "thresholds", {2});
  TORCH_CHECK_TYPE(t == at::kHalf || t == at::kBFloat16, "prox: the activation type must be torch.float16 or "
                   "torch.bfloat16 (it is ", dtype_name(t), ")");
  d->dtype = t == at::kHalf ? DType::kHalf : DType::kBFloat16;
  d->format = f;
  d->d_model = static_cast<int>(s.d_model);
  d->d_ff = static_cast<int>(s.d_ff);
  for (int i = 0; i < kSlotCount; ++i) d->slots[i] = l.ptr(static_cast<Slot>(i));
  d->thresholds = thresholds.is_meta() ? nullptr : thresholds.data_ptr<float>();
}

}  // namespace prox_ext
