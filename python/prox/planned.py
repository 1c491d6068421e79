# SPDX-License-Identifier: Apache-2.0
"""PlannedFfn: one sparse FFN layer, planned once and run many times (FlashInfer's wrapper pattern).

It holds references to the exact weights, the derived forms prox reads (INT4 proxies, W_down^T), the
thresholds as a device tensor (so a server can change a layer's sparsity between requests, or between
replays of a captured graph, without re-planning or re-capturing), the workspace, and the plan
(cached by the extension under the layer's pointers, shape, dtype, activation, options and token
capacity, so a call does no planning). run() launches two kernels on the current stream (three for a
batch of 2 to 8 tokens) and can be captured in a CUDA graph or traced by torch.compile.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from . import _ops, formats, layer_ops
from .formats import FormatNamed
from ._ops import FfnOutputs, LayerTensors, PlanOptions
from .allocation import ALPHA, effective_sparsity


def _check_weight(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"prox: {name} must be a tensor")
    if t.dtype != dtype:
        raise TypeError(f"prox: {name} must be {dtype} like w_gate (it is {t.dtype})")
    if tuple(t.shape) != shape:
        raise ValueError(f"prox: {name} must have shape {shape} (it has {tuple(t.shape)})")
    if t.device != device:
        raise ValueError(f"prox: {name} is on {t.device}, w_gate on {device}")


class PlannedFfn(FormatNamed):
    """A planned Prox FFN layer.

    Args:
        w_gate, w_up: [d_ff, d_model] fp16/bf16 CUDA tensors (nn.Linear weights; referenced, not copied).
        w_down: [d_model, d_ff] nn.Linear weight of the down projection; or give ``w_down_t``
            ([d_ff, d_model], W_down^T) instead, which is then referenced as is.
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        tau_x, tau_s: initial thresholds (changeable later with set_thresholds()).
        thresholds: optional device float32 [2] tensor to read the thresholds from (shared with the caller).
        workspace: optional workspace (uint8, >= prox.workspace_bytes(d_model, d_ff, max_tokens)), shared by
            layers of the same shape running on one stream; a new one is made and initialized otherwise.
        proxies: optional ((packed_gate, scale_gate), (packed_up, scale_up)) already packed (pack_int4).
        options: PlanOptions.
        max_tokens: the most tokens one run() takes (1..8), what a new workspace is sized for. Batches run the
            plan of as many tokens as the workspace holds; plan() plans it along with the batch-1 plan.

    FP8 e4m3 weights (docs/fp8-format.md): w_gate, w_up and w_down torch.float8_e4m3fn with their float32 scales
    ``w_gate_scale``, ``w_up_scale`` and ``w_down_scale`` (the checkpoint's ``weight_scale`` / ``weight_scale_inv``:
    [d_ff] and [d_model] per channel, [ceil(rows/128), ceil(cols/128)] in 128 x 128 blocks; the layout is read
    from their shapes), or ``w_down_t`` with ``w_down_t_scale`` (prox.fp8.transpose_down), and ``dtype``, the
    activation dtype (torch.float16 or torch.bfloat16, required). The scales are checked (finite, > 0: a ValueError
    naming the tensor), W_down^T and its scales come from prox.fp8.transpose_down, the INT4 proxies from
    prox.fp8.pack_int4 (the dequantized weights); ``layer_tensors().format`` is "fp8_channel" or "fp8_block128".
    What differs between the formats is asked of the layer's format (``fmt``, prox.formats).

    Tensor parallelism over d_ff: prox.distributed.planned_ffn_from_shards builds a PlannedFfn on this rank's shard
    and gives it a ``tp`` (its TPState); run() then all-reduces y once.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: Optional[torch.Tensor] = None, *,
                 w_down_t: Optional[torch.Tensor] = None, act: str = "silu", tau_x: float = 0.0, tau_s: float = 0.0,
                 thresholds: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None,
                 proxies=None, options: PlanOptions = PlanOptions(), max_tokens: int = 1,
                 w_gate_scale: Optional[torch.Tensor] = None, w_up_scale: Optional[torch.Tensor] = None,
                 w_down_scale: Optional[torch.Tensor] = None, w_down_t_scale: Optional[torch.Tensor] = None,
                 dtype: Optional[torch.dtype] = None):
        self.tp = None  # a shard's TPState (prox.distributed.planned_ffn_from_shards sets it)
        _ops._require()
        if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 2:
            raise ValueError(f"prox: w_gate must be a [d_ff, d_model] tensor, got {getattr(w_gate, 'shape', w_gate)}")
        #: the Stage-2 weight format (prox.formats), read from w_gate and its scales
        self.fmt = formats.of_weights(w_gate, w_gate_scale)
        self._set_shape(w_gate, self.fmt.act_dtype(w_gate.dtype, dtype, op_only=True), act, max_tokens, options)
        shape, wdt = (self.d_ff, self.d_model), w_gate.dtype
        _check_weight("w_up", w_up, shape, wdt, self.device)
        with torch.no_grad():
            self.w_gate_scale = self.fmt.stage2_scale(w_gate_scale, *shape, "w_gate_scale")
            self.w_up_scale = self.fmt.stage2_scale(w_up_scale, *shape, "w_up_scale")
            if w_down_t is None:
                if w_down is None or w_down_t_scale is not None:
                    raise ValueError("prox: give w_down ([d_model, d_ff]; FP8: and w_down_scale) or w_down_t ([d_ff, "
                                     "d_model]; FP8: and w_down_t_scale, prox.fp8.transpose_down gives both)")
                _check_weight("w_down", w_down, (self.d_model, self.d_ff), wdt, self.device)
                w_down_t, w_down_t_scale = self.fmt.down_t(w_down, w_down_scale, "w_down", "w_down_scale")
            elif w_down_scale is not None:
                raise ValueError("prox: w_down_scale goes with w_down; w_down_t takes w_down_t_scale")
            _check_weight("w_down_t", w_down_t, shape, wdt, self.device)
            self.w_down_t_scale = self.fmt.stage2_scale(w_down_t_scale, *shape, "w_down_t_scale", transposed=True)
            self.w_gate = w_gate.detach()
            self.w_up = w_up.detach()
            self.w_down_t = w_down_t.detach()
            if proxies is None:
                (self.proxy_gate, self.scale_gate) = self.fmt.proxy(self.w_gate, self.w_gate_scale, "w_gate")
                (self.proxy_up, self.scale_up) = self.fmt.proxy(self.w_up, self.w_up_scale, "w_up")
            else:
                (self.proxy_gate, self.scale_gate), (self.proxy_up, self.scale_up) = proxies
        self._finish(thresholds, workspace, tau_x, tau_s, max_tokens)

    def _set_shape(self, w_gate, dtype, act, max_tokens, options) -> None:
        """The layer's device, shape, activation dtype, activation and options (both formats)."""
        if w_gate.device.type != "cuda":
            raise ValueError(f"prox: PlannedFfn needs CUDA weights (w_gate is on {w_gate.device})")
        self.d_ff, self.d_model = (int(v) for v in w_gate.shape)
        self.dtype, self.device = dtype, w_gate.device
        self.act = act
        self.act_code = _ops.act_code(act)
        if not 1 <= max_tokens <= _ops.MAX_TOKENS:
            raise ValueError(f"prox: max_tokens must be in [1, {_ops.MAX_TOKENS}], got {max_tokens}")
        self.options = options
        self._options = options.encode()

    def _finish(self, thresholds, workspace, tau_x, tau_s, max_tokens) -> None:
        """The thresholds, the workspace, the checks and the plans (both formats)."""
        if thresholds is None:
            thresholds = torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32, device=self.device)
        self.thresholds = thresholds
        if workspace is None:
            workspace = _ops.new_workspace(self.d_model, self.d_ff, self.device, max_tokens=max_tokens)
        self.workspace = workspace
        # Every tensor checked here, each named (the op checks again on every call, for raw-op callers).
        _ops.check_layer(self.layer_tensors(), self.thresholds, self.workspace, max_tokens=max_tokens,
                         dtype=self.dtype)
        # The plans stay pinned in the extension's plan cache while this object lives (a capture later can
        # always find them); the finalizer releases them.
        self._pins: list = []
        weakref.finalize(self, layer_ops.unpin, self._pins)
        self.policies = self.plan()

    # ------------------------------------------------------------ planning and thresholds

    def layer_tensors(self) -> LayerTensors:
        """The layer's tensors by name (the ops' ``layer`` list is its ``tensors()``), as they are now."""
        return LayerTensors(w_gate=self.w_gate, w_up=self.w_up, w_down_t=self.w_down_t, proxy_gate=self.proxy_gate,
                            scale_gate=self.scale_gate, proxy_up=self.proxy_up, scale_up=self.scale_up,
                            w_gate_scale=self.w_gate_scale, w_up_scale=self.w_up_scale,
                            w_down_t_scale=self.w_down_t_scale, format=self.format)

    @property
    def max_tokens(self) -> int:
        """The most tokens one run() takes with this layer's workspace (0: too small even for one)."""
        return _ops.workspace_tokens(self.d_model, self.d_ff, self.workspace.numel())

    def plan(self) -> list[int]:
        """Plan (or find the cached plans of) this layer: batch 1 and, when the workspace holds a batch, the
        batched plan that batches run. Returns the policies chosen [proxy, glu, down, glu_down] (batch 1's).
        Outside graph capture only; the constructor calls it. The plans are pinned while this object lives."""
        layer_ops.unpin(self._pins)
        return layer_ops.plan(self.layer_tensors(), self.thresholds, self.act_code, self._options, self.dtype,
                              self.max_tokens, self._pins)

    def exact_weights(self, dtype=torch.float32) -> tuple:
        """(W_gate, W_up, W_down^T) as Stage 2 computes with them, in ``dtype``: the weights, or FP8 weights
        dequantized (prox.fp8.dequantize; float64 is exact)."""
        return self.fmt.exact_weights(self.layer_tensors(), dtype)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense FFN of one token through this layer's own fused Stage-2 kernel, every channel selected and no
        Stage 1 (torch.ops.prox.dense_ffn): prox's dense baseline of the format (a benchmark's; its first call plans
        and allocates, later calls can be captured). x [d_model] or [1, d_model]."""
        layer, fmt = _ops.layer_args(self.layer_tensors())
        return torch.ops.prox.dense_ffn(x, layer, fmt, self.thresholds, self.act_code, self._options)

    def set_thresholds(self, tau_x: float, tau_s: float) -> None:
        """Write new thresholds into the device tensor every run reads (two fills on the current stream:
        no host sync, no re-plan, valid for graphs already captured)."""
        _ops.write_thresholds(self.thresholds, tau_x, tau_s)

    # ------------------------------------------------------------ running

    def __call__(self, x: torch.Tensor, **kw):
        return self.run(x, **kw)

    def run(self, x: torch.Tensor, *, return_mask: bool = False, return_s_proxy: bool = False,
            return_s: bool = False, counters: Optional[torch.Tensor] = None):
        """y = FFN(x): x is one token, [d_model] or [1, d_model] (batch-1 decoding), or a batch [B, d_model] of
        2 <= B <= max_tokens tokens (each token what batch 1 gives it, within rounding), y is shaped like x.
        With any return_* flag, returns FfnOutputs(y, mask, s_proxy, s) (None for what was not asked for;
        a batch's have a leading B). ``counters`` accumulates runtime sparsity statistics: prox.new_counters()
        (int64 [4]; a batch counts each token as a call), or for a batch of B an int64 [B + 1, 4] tensor
        that gets each token's counts, then their union's (the inputs any token kept, the channels any
        token selected)."""
        layer, fmt = _ops.layer_args(self.layer_tensors())
        y, mask, s_proxy, s = torch.ops.prox.sparse_ffn(x, layer, fmt, self.thresholds, self.workspace, self.act_code,
                                                         self._options, return_mask, return_s_proxy, return_s,
                                                         counters)
        if self.tp is not None:  # a shard's partial sum (mask, s~ and s stay this rank's channels)
            self.tp.all_reduce_(y)
        if not (return_mask or return_s_proxy or return_s):
            return y
        return FfnOutputs(y, mask if return_mask else None, s_proxy if return_s_proxy else None,
                          s if return_s else None)

    def proxy_values(self, x: torch.Tensor, tau_x: Optional[float] = None) -> torch.Tensor:
        """Stage 1 in values mode: s~ float32 [tokens, d_ff] for x [tokens, d_model] (one launch per token; for
        calibration), under the layer's current tau_x, or under ``tau_x`` when given (the thresholds are written
        for the call and restored after it: calibrate_layer's proxy_values(x, tau_x) callback, as SparseMLP's)."""
        return layer_ops.proxy_values(x, self.layer_tensors(), self.thresholds, self.workspace, self.act_code,
                                      self._options, tau_x)


def new_counters(device: torch.device | str = "cuda") -> torch.Tensor:
    """Device counters for run(counters=...): int64 [4] = {calls, kept inputs, selected channels, 0}."""
    return torch.zeros(4, dtype=torch.int64, device=device)


def sparsity_report(counters: torch.Tensor, d_model: int, d_ff: int, alpha: float = ALPHA) -> dict:
    """s1, s2 and the effective sparsity e^ measured by counters (prox::make_report). Reads the device."""
    return summed_report([(counters.tolist(), d_model, d_ff)], alpha)


def summed_report(rows, alpha: float = ALPHA) -> dict:
    """The report of counters summed over layers: rows of (counters as 4 ints, d_model, d_ff). s1 and s2
    are the fractions of every input and channel the layers' calls dropped."""
    calls = kept = selected = inputs = channels = 0
    for c, d_model, d_ff in rows:
        calls += int(c[0])
        kept += int(c[1])
        selected += int(c[2])
        inputs += int(c[0]) * d_model
        channels += int(c[0]) * d_ff
    if calls == 0:
        return {"calls": 0, "s1": 0.0, "s2": 0.0, "effective": 0.0}
    s1 = 1.0 - kept / inputs
    s2 = 1.0 - selected / channels
    return {"calls": calls, "s1": s1, "s2": s2, "effective": effective_sparsity(s1, s2, alpha)}
