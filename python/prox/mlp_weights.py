# SPDX-License-Identifier: Apache-2.0
"""MlpWeights: the weights of one gated MLP and what Prox derives from them, asked of their format (prox.formats):
the INT4 proxies, W_down^T, the Stage-2 scales, the dequantized weights, the fingerprint, the dense path (prefill).
It keeps them in step with the weights: refresh() re-derives them, a call on weights changed in place since
raises, the state dict is the dense MLP's, and model.half() / .to() convert the weights (not FP8 codes or float32
scales) and re-derive. SparseMLP (prox.sparse_mlp) is an MlpWeights that runs Prox."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from . import formats, reference
from ._ops import LayerTensors
from .formats import OP_DTYPES, FormatNamed
from .thresholds import layer_fingerprint

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def keep_codes(fn, protected=frozenset()):
    """Module._apply's fn, except that weight codes (prox.formats.holds_codes: FP8), and the tensors whose id is in
    ``protected`` (their float32 scales), keep their dtype (model.half() / .to(bfloat16) would convert the codes and
    round the scales): they only follow the device."""
    def apply(t):
        if not formats.holds_codes(t) and id(t) not in protected:
            return fn(t)
        probe = fn(t.new_empty(0))
        return fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)
    return apply


class MlpWeights(FormatNamed, nn.Module):
    """A gated MLP's linear modules and Prox's derived state of them.

    Args:
        gate_proj, up_proj: the linear modules (kept, and shared with the dense path): nn.Linear, or an FP8
            linear (prox.fp8.linear_info). Bias-free: a bias is refused (Prox computes u * act(g) W_down without one).
        down_proj: the down projection (bias-free); its weight is transposed into ``down_t`` and dropped unless
            keep_down=True.
        act: "silu" or "gelu_tanh" (checked by the caller).
        keep_down, dtype, prefill_gemm: SparseMLP's.
    """

    #: Buffers that stay float32 whatever dtype the module is converted to (model.half(), .to(bf16)).
    FLOAT32_BUFFERS = ("scale_gate", "scale_up", "w_gate_scale", "w_up_scale", "w_down_t_scale", "down_scale")
    #: A subclass's buffers that are runtime state, not tensors to convert (_apply sets them aside).
    RUNTIME_BUFFERS = ()

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: str, *,
                 keep_down: bool = False, dtype: Optional[torch.dtype] = None, prefill_gemm: str = "auto"):
        super().__init__()
        if prefill_gemm not in ("auto", "dequantized"):
            raise ValueError(f"prox: prefill_gemm must be 'auto' or 'dequantized', got {prefill_gemm!r}")
        for name, lin in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(getattr(lin, "weight", None), torch.Tensor) or lin.weight.dim() != 2:
                raise TypeError(f"prox: {name} must be a linear layer with a 2-D weight (nn.Linear)")
            if getattr(lin, "bias", None) is not None:
                raise ValueError(f"prox: {name} has a bias; Prox computes bias-free gated MLPs (Llama, Qwen, "
                                 "Mistral, Gemma), and a bias would be left out of the result")
        #: the Stage-2 weight format (prox.formats): the one that reads all three projections
        self.fmt, lins = formats.of_mlp({"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj})
        self._scale_names = tuple(lins[n].scale_name for n in _PROJECTIONS)
        w = gate_proj.weight
        self._act_dtype = self.fmt.act_dtype(w.dtype, dtype, op_only=False)
        self.d_ff, self.d_model = (int(v) for v in w.shape)
        if self.d_model % 8 or self.d_ff % 32:
            raise ValueError(f"prox: d_model must be a multiple of 8 and d_ff of 32, got ({self.d_model}, {self.d_ff})")
        if tuple(up_proj.weight.shape) != (self.d_ff, self.d_model) or \
                tuple(down_proj.weight.shape) != (self.d_model, self.d_ff):
            raise ValueError(f"prox: gate_proj {tuple(w.shape)}, up_proj {tuple(up_proj.weight.shape)} and down_proj "
                             f"{tuple(down_proj.weight.shape)} do not form a gated MLP ([d_ff, d_model] twice, then "
                             "[d_model, d_ff])")
        if up_proj.weight.dtype != w.dtype or down_proj.weight.dtype != w.dtype or \
                up_proj.weight.device != w.device or down_proj.weight.device != w.device:
            raise ValueError("prox: gate_proj, up_proj and down_proj must share one dtype and device")
        self.act = act
        self.prefill_gemm = prefill_gemm
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.keep_down = keep_down
        # A module slot even when W_down is dropped: its state-dict key ("down_proj.weight") is ours to save
        # and load (from down_t), not an unexpected one.
        self.register_module("down_proj", down_proj if keep_down else None)
        # W_down dropped: its own scales (a format with scales) stay, the state dict saves them with W_down.
        self.register_buffer("down_scale", None if keep_down else lins["down_proj"].scales, persistent=False)
        with torch.no_grad():
            down_t, down_t_scale = self.fmt.down_t(down_proj.weight, lins["down_proj"].scales, "down_proj",
                                                   "down_proj's scales")
            pg, sg, pu, su = self._proxies()
            gs, us = self._stage2_scales()
        self.register_buffer("down_t", down_t, persistent=False)
        self.register_buffer("w_down_t_scale", down_t_scale, persistent=False)
        self.register_buffer("w_gate_scale", gs, persistent=False)
        self.register_buffer("w_up_scale", us, persistent=False)
        self.register_buffer("proxy_gate", pg, persistent=False)
        self.register_buffer("scale_gate", sg, persistent=False)
        self.register_buffer("proxy_up", pu, persistent=False)
        self.register_buffer("scale_up", su, persistent=False)
        self._q_cache = None  # unpacked proxies for the torch reference
        self._fingerprint = None  # (weight versions, thresholds.layer_fingerprint), computed when asked for
        self._derived_from = self._weight_versions()
        self.register_load_state_dict_post_hook(MlpWeights._after_load)

    @property
    def act_dtype(self) -> torch.dtype:
        """The activation dtype (x, y): the weights' for fp16/bf16 weights, the one given for FP8 projections."""
        return self.gate_proj.weight.dtype if self.fmt.weights_set_dtype else self._act_dtype

    @property
    def alpha(self) -> float:
        """The allocation's alpha for this layer's weight format (prox.formats)."""
        return self.fmt.alpha

    def _linear(self, name: str) -> formats.Linear:
        lin = self.fmt.linear(getattr(self, name), name)
        if lin is None:
            raise TypeError(f"prox: {name} no longer holds {self.format} weights (its weight is "
                            f"{getattr(getattr(self, name), 'weight', None).dtype}): build a new SparseMLP")
        return lin

    def _proxies(self) -> tuple:
        """(packed, scales) of W_gate's and W_up's INT4 proxies, from the current weights."""
        out = []
        for name in ("gate_proj", "up_proj"):
            lin = self._linear(name)
            out += self.fmt.proxy(lin.weight, lin.scales, name)
        return tuple(out)

    def _stage2_scales(self) -> tuple:
        """W_gate's and W_up's scales as the op reads them, each checked (None, None for a format without)."""
        return tuple(self.fmt.stage2_scale(self._linear(n).scales, self.d_ff, self.d_model, f"{n}'s scales")
                     for n in ("gate_proj", "up_proj"))

    def _scale_tensors(self) -> list:
        """The projections' own scale tensors (none for a format without scales): W_down's is down_scale when
        W_down is dropped."""
        out = []
        for name, attr in zip(_PROJECTIONS, self._scale_names):
            if attr is not None:
                mod = getattr(self, name) if name != "down_proj" or self.keep_down else None
                out.append(getattr(mod, attr) if mod is not None else self.down_scale)
        return out

    def _weight_versions(self) -> tuple:
        """The version counters of the weights the derived state comes from (bumped by in-place writes; None
        for inference tensors, which have none), their scales included."""
        ws = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight if self.keep_down else self.down_t]
        ws += self._scale_tensors()
        return tuple(None if w.is_inference() else w._version for w in ws)

    def exact_weights(self, dtype=None) -> tuple:
        """(W_gate, W_up, W_down^T) as Stage 2 computes with them: the fp16/bf16 weights (converted to ``dtype``
        when given), or an FP8 layer's dequantized weights (prox.fp8.dequantize, float32 by default)."""
        return self.fmt.exact_weights(self.layer_tensors(), dtype)

    def layer_tensors(self) -> LayerTensors:
        """The layer's tensors by name, as the op reads them (the ops' ``layer`` list is its ``tensors()``)."""
        return LayerTensors(w_gate=self.gate_proj.weight.detach(), w_up=self.up_proj.weight.detach(),
                            w_down_t=self.down_t, proxy_gate=self.proxy_gate, scale_gate=self.scale_gate,
                            proxy_up=self.proxy_up, scale_up=self.scale_up, w_gate_scale=self.w_gate_scale,
                            w_up_scale=self.w_up_scale, w_down_t_scale=self.w_down_t_scale, format=self.format)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-derive the proxies (and W_down^T with keep_down=True) from the current weights. In place where
        the shape, dtype and device are unchanged, so plans and CUDA graphs captured before see the new
        values; not during capture (packing synchronizes). load_state_dict() calls it; call it after any
        other in-place change of the weights (a LoRA merge, a weight update through .data)."""
        pg, sg, pu, su = self._proxies()
        fresh = {"proxy_gate": pg, "scale_gate": sg, "proxy_up": pu, "scale_up": su}
        if self.keep_down:
            lin = self._linear("down_proj")
            fresh["down_t"], fresh["w_down_t_scale"] = self.fmt.down_t(lin.weight, lin.scales, "down_proj",
                                                                       "down_proj's scales")
        else:
            fresh["w_down_t_scale"] = self.fmt.down_t_scale(self.down_scale, self.d_model, self.d_ff,
                                                            "down_proj's scales")
        fresh["w_gate_scale"], fresh["w_up_scale"] = self._stage2_scales()
        for k, t in fresh.items():
            old = self._buffers[k]
            if t is not None and old is not None and old.shape == t.shape and old.dtype == t.dtype and \
                    old.device == t.device and (torch.is_inference_mode_enabled() or not old.is_inference()):
                old.copy_(t)
            else:
                self._buffers[k] = t
        self._q_cache = None
        self._fingerprint = None
        self._derived_from = self._weight_versions()
        self._after_move()

    def _check_fresh(self) -> None:
        if self._weight_versions() != self._derived_from:
            raise RuntimeError("prox: this SparseMLP's weights changed in place after its proxies (and W_down^T) "
                               "were derived: call refresh() (prox.nn.refresh(model) for every layer) before "
                               "running it")

    @staticmethod
    def _after_load(module, incompatible_keys) -> None:
        module.refresh()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.keep_down:  # W_down lives only as down_t: save it as the dense MLP's down_proj.weight
            wd = self.down_t.t().contiguous()
            destination[prefix + "down_proj.weight"] = wd if keep_vars else wd.detach()
            if self.down_scale is not None:  # and its scales as they were given
                destination[prefix + "down_proj." + self._scale_names[2]] = self.down_scale

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.keep_down:
            return  # down_proj loads itself
        key = prefix + "down_proj.weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        v = state_dict[key]
        if tuple(v.shape) != (self.d_model, self.d_ff):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(v.shape)}, the "
                              f"parameter in current model is {(self.d_model, self.d_ff)}")
            return
        sv = None
        if self.down_scale is not None:  # codes with scales load as they are (a cast would change their meaning)
            if v.dtype != self.down_t.dtype:
                error_msgs.append(f"dtype mismatch for {key}: {v.dtype}, the layer's W_down is {self.down_t.dtype}")
                return
            skey = prefix + "down_proj." + self._scale_names[2]
            if skey not in state_dict:
                if strict:
                    missing_keys.append(skey)
                return
            sv = state_dict[skey]
            if tuple(sv.shape) != tuple(self.down_scale.shape):
                error_msgs.append(f"size mismatch for {skey}: copying a param with shape {tuple(sv.shape)}, the "
                                  f"parameter in current model is {tuple(self.down_scale.shape)}")
                return
        with torch.no_grad():
            if local_metadata.get("assign_to_params_buffers", False):
                self._buffers["down_t"] = v.t().contiguous()
                if sv is not None:
                    self._buffers["down_scale"] = sv
            else:
                self.down_t.copy_(v.t())
                if sv is not None:
                    self.down_scale.copy_(sv)

    def fingerprint_matrices(self) -> tuple:
        """(dtype name, W_gate, W_up, W_down in nn.Linear layout) as the format fingerprints them (an FP8 layer's
        dequantized weights)."""
        return self.fmt.fingerprint_matrices(self.layer_tensors(), self.down_proj.weight if self.keep_down else None)

    def local_fingerprint(self) -> dict:
        """The fingerprint (prox.thresholds.layer_fingerprint) of the weights this module holds, computed once per
        weight version."""
        v = self._weight_versions()
        if self._fingerprint is None or self._fingerprint[0] != v or self._fingerprint[2] != self.down_t.data_ptr():
            dtype, wg, wu, wd = self.fingerprint_matrices()
            fp = layer_fingerprint(wg, wu, wd)
            fp["dtype"] = dtype
            self._fingerprint = (v, fp, self.down_t.data_ptr())
        return self._fingerprint[1]

    def _apply(self, fn, recurse=True):
        protected = frozenset(id(s) for s in self._scale_tensors())  # the projections' scales keep their dtype
        # model.half() / .to(torch.bfloat16) must not round the float32 scales (and a subclass's FLOAT32_BUFFERS).
        keep = {k: self._buffers.pop(k) for k in self.FLOAT32_BUFFERS}
        # Runtime state that is not a tensor to convert (SparseMLP's workspace): set aside, then given back to
        # _restore_runtime() on the new device.
        runtime = {k: self._buffers.pop(k) for k in self.RUNTIME_BUFFERS}
        dtype = self.gate_proj.weight.dtype
        if not self.fmt.weights_set_dtype:  # the activation dtype follows a conversion, the weights stay
            act = fn(torch.empty(0, dtype=self._act_dtype)).dtype
            if act in OP_DTYPES + (torch.float32,):
                self._act_dtype = act
        fn = keep_codes(fn, protected)
        super()._apply(fn, recurse)
        for k, t in keep.items():
            if t is None:
                self._buffers[k] = None
                continue
            moved = fn(t)
            self._buffers[k] = moved if moved.dtype == t.dtype else t.to(device=moved.device)
        device = self.down_t.device
        self._restore_runtime(runtime, device)
        self._q_cache = None
        self._fingerprint = None
        if self.gate_proj.weight.dtype != dtype and device.type != "meta":
            self.refresh()  # proxies of the weights as converted (a rounding can move a scale)
        else:
            self._derived_from = self._weight_versions()
            if device.type != "meta":
                self._after_move()
        return self

    def _restore_runtime(self, runtime: dict, device: torch.device) -> None:
        """A subclass's RUNTIME_BUFFERS after a move to ``device`` (set aside by _apply)."""
        self._buffers.update(runtime)

    def _after_move(self) -> None:
        """After construction, a move or a refresh (a subclass checks what its runtime needs)."""

    def memory_bytes(self) -> dict:
        """Bytes of what this layer adds to the dense MLP (proxies, scales, W_down^T), and of what it keeps."""
        nb = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        extra = {"proxies": nb(self.proxy_gate) + nb(self.proxy_up), "scales": nb(self.scale_gate) + nb(self.scale_up),
                 "w_down_t": nb(self.down_t) + nb(self.w_down_t_scale) if self.keep_down else 0}
        # the dense MLP: its weights and their scales (W_down's as W_down^T's)
        dense = nb(self.gate_proj.weight) + nb(self.up_proj.weight) + nb(self.down_t)
        dense += nb(self.w_gate_scale) + nb(self.w_up_scale) + nb(self.w_down_t_scale)
        return {**extra, "extra_total": sum(extra.values()), "dense_mlp": dense}

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP on the same weights (prefill): the format's prefill (prox.formats; ``prefill_gemm``), in
        x's dtype, on the modules' own weight tensors."""
        down = None
        if self.keep_down:
            lin = self._linear("down_proj")
            down = (self.down_proj.weight, self.fmt.normalized_scale(lin.scales, self.d_model, self.d_ff,
                                                                     "down_proj's scales"))
        layer = self.layer_tensors()._replace(w_gate=self.gate_proj.weight, w_up=self.up_proj.weight)
        return self.fmt.prefill(x, layer, self.act, down, self.prefill_gemm)

    def _q(self):
        if self._q_cache is None or self._q_cache[0].device != self.proxy_gate.device:
            self._q_cache = (reference.unpack_int4(self.proxy_gate), reference.unpack_int4(self.proxy_up))
        return self._q_cache
