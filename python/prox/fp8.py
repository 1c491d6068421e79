# SPDX-License-Identifier: Apache-2.0
"""FP8 e4m3 Stage-2 weights in Python (docs/fp8-format.md): the two scale layouts, the offline helpers as ops
(quantize, W_down's transpose with its scales, INT4 proxies packed from the dequantized weights, scale checks),
their torch equivalents where the extension is not loaded, and the FP8 linear modules SparseMLP accepts.

The dequantized weight is ``W[r][c] = e4m3(q[r][c]) * scale``; a checkpoint names the fp32 multiplier
``weight_scale`` (vLLM, compressed-tensors) or ``weight_scale_inv`` (DeepSeek-V3, the official Qwen3-*-FP8,
transformers' fine-grained FP8: despite its name, a multiplier too). Two layouts:

- ``"channel"``: one scale per output channel, ``[N]`` (or ``[N, 1]`` as compressed-tensors stores it);
- ``"block128"``: one scale per 128 x 128 block, ``[ceil(N/128), ceil(K/128)]`` (the last blocks partial).

A per-tensor scale (one value) is both: it is expanded to the layout of the MLP's other projections (per channel
when all three are per tensor), which dequantizes to the same weights.

Linear modules recognized (``linear_info``): any module whose ``weight`` is torch.float8_e4m3fn [N, K] with a
float32 ``weight_scale_inv`` or ``weight_scale`` in one of those shapes: transformers' ``FP8Linear``
(integrations/finegrained_fp8.py; its ``block_size`` must be (128, 128) or None, per tensor), this module's
``Fp8Linear`` (per channel or blocks), compressed-tensors / vLLM-style per-channel linears. Prox computes with the
activations unquantized (FP8 weights, fp16/bf16 activations): a module's activation scheme is not applied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _ops, reference

E4M3 = torch.float8_e4m3fn
#: Largest finite e4m3 value.
E4M3_MAX = 448.0
#: Side of a block-scale block.
BLOCK = 128
#: The scale layouts, code = position (prox::fp8::ScaleLayout: kPerChannel 0, kBlock128 1).
LAYOUTS = ("channel", "block128")
#: prox::fp8::kLayoutTag: the tag of prox-made FP8 tensors (W_down^T and its scales).
LAYOUT_TAG = "prox-fp8-e4m3-v1"
#: Rows dequantize() computes at once (a multiple of BLOCK): its float32 temporary holds 2048 rows of codes (32 MiB
#: on a Qwen3-8B-shaped [12288, 4096] matrix), never the whole matrix.
DEQUANT_ROWS = 16 * BLOCK
#: Smallest scale quantize writes (FLT_MIN: an all-zero row or block keeps a normal scale > 0).
MIN_SCALE = 1.17549435082228750797e-38


def layout_code(layout: str) -> int:
    try:
        return LAYOUTS.index(layout)
    except ValueError:
        raise ValueError(f"prox: an FP8 scale layout is one of {LAYOUTS}, got {layout!r}") from None


def blocks(n: int) -> int:
    """ceil(n / 128)."""
    return (int(n) + BLOCK - 1) // BLOCK


def scale_shape(layout: str, rows: int, cols: int, transposed: bool = False) -> tuple:
    """The scales' shape of a stored matrix [rows, cols]: nn.Linear's [out, in] (``transposed=False``: one scale
    per row) or W_down^T's [in, out] (``transposed=True``: one per column); blocks [ceil(rows/128),
    ceil(cols/128)] either way."""
    layout_code(layout)
    if layout == "block128":
        return (blocks(rows), blocks(cols))
    return (int(cols),) if transposed else (int(rows),)


def _expanded(scales: torch.Tensor, layout: str, rows: int, cols: int, transposed: bool, r0: int = 0,
              r1: Optional[int] = None) -> torch.Tensor:
    """Each element's scale, float32 [r1 - r0, cols] for the rows [r0, r1) of a [rows, cols] matrix (a broadcast
    view per channel; r0 a multiple of BLOCK for block scales)."""
    r1 = rows if r1 is None else min(r1, rows)
    if layout == "block128":
        return _block_row_scales(scales, rows, cols, r0, r1).repeat_interleave(BLOCK, 0)[:r1 - r0]
    s = scales.to(torch.float32).reshape(-1)
    return s[None, :].expand(r1 - r0, cols) if transposed else s[r0:r1, None].expand(r1 - r0, cols)


def _block_row_scales(scales: torch.Tensor, rows: int, cols: int, r0: int, r1: int) -> torch.Tensor:
    """The block scales of the block rows covering [r0, r1), expanded along the columns: float32 [blocks, cols]."""
    s = scales.to(torch.float32).reshape(blocks(rows), blocks(cols))[r0 // BLOCK:blocks(r1)]
    return s.repeat_interleave(BLOCK, 1)[:, :cols]


def dequantize(q: torch.Tensor, scales: torch.Tensor, layout: Optional[str] = None, dtype=torch.float32,
               transposed: bool = False) -> torch.Tensor:
    """The dequantized matrix e4m3(q) * scale in ``dtype`` (float32: the product rounded once, prox::fp8::
    dequant_value; float64: exact, the tests' reference; float16 / bfloat16: the float32 product rounded to
    ``dtype``), computed DEQUANT_ROWS rows at a time with the scales broadcast, so that its only large temporary is
    one chunk of the codes in float32, never the whole matrix. ``transposed``: q is W_down^T [d_ff, d_model] and
    the per-channel scales are per column. ``layout`` None: inferred from the scales' shape."""
    rows, cols = (int(v) for v in q.shape)
    layout = layout or infer_layout(scales, rows, cols, transposed=transposed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    for r in range(0, rows, DEQUANT_ROWS):
        r1 = min(r + DEQUANT_ROWS, rows)
        qc, oc = q[r:r1].to(work), out[r:r1]
        if layout == "block128" and (r1 - r) % BLOCK == 0:  # [blocks, 128, cols] x [blocks, 1, cols]
            nb = (r1 - r) // BLOCK
            s = _block_row_scales(scales, rows, cols, r, r1).to(work)[:, None, :]
            torch.mul(qc.view(nb, BLOCK, cols), s, out=oc.view(nb, BLOCK, cols))  # rounded once, to dtype
        else:
            torch.mul(qc, _expanded(scales, layout, rows, cols, transposed, r, r1).to(work), out=oc)
    return out


def infer_layout(scales: torch.Tensor, rows: int, cols: int, transposed: bool = False,
                 name: str = "scales") -> str:
    """The layout of a matrix's scales from their shape: [out] or [out, 1] per channel, [ceil(rows/128),
    ceil(cols/128)] blocks (a ValueError naming ``name`` otherwise)."""
    out = cols if transposed else rows
    shape = tuple(scales.shape)
    if shape in ((out,), (out, 1)):
        return "channel"
    if shape == (blocks(rows), blocks(cols)):
        return "block128"
    raise ValueError(f"prox: {name} has shape {shape}: FP8 scales are [{out}] (one per output channel) or "
                     f"[{blocks(rows)}, {blocks(cols)}] (128 x 128 blocks) for a [{rows}, {cols}] matrix")


# ---------------------------------------------------------------- the offline helpers (ops, torch fallbacks)


def _use_op(t: torch.Tensor) -> bool:
    return _ops.available() and t.device.type in ("cpu", "cuda")


def check_scales(scales: torch.Tensor, name: str = "scales") -> None:
    """Every scale finite and > 0 (prox::fp8::check_scales_device / _host through the op: offline, it synchronizes);
    else a ValueError naming ``name``, the first invalid element and its value."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"prox: {name} must be a float32 tensor (it is {type(scales).__name__})")
    if scales.dtype != torch.float32:
        raise TypeError(f"prox: {name} must be torch.float32 (it is {scales.dtype})")
    if scales.numel() == 0:
        raise ValueError(f"prox: {name} is empty")
    s = scales.contiguous()
    if _use_op(s):
        bad = int(torch.ops.prox.fp8_check_scales(s))
    else:
        flat = s.reshape(-1)
        idx = torch.nonzero(~(torch.isfinite(flat) & (flat > 0)))
        bad = int(idx[0]) if idx.numel() else -1
    if bad >= 0:
        v = float(s.reshape(-1)[bad])
        raise ValueError(f"prox: {name} holds an invalid scale: element {bad} (flattened) is {v!r}; FP8 scales must "
                         "be finite and > 0 (NaN, infinite, zero and negative scales are refused)")


def quantize_reference(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """prox::fp8::quantize_host in torch: per row or 128 x 128 block, scale = max(amax / 448, FLT_MIN) (one IEEE
    division), q = e4m3_rn_satfinite(w / scale). (q float8_e4m3fn [rows, cols], scales float32)."""
    layout_code(layout)
    wf = w.to(torch.float32)
    if not torch.isfinite(wf).all():
        raise ValueError("prox: fp8_quantize: the weight holds NaN or Inf")
    rows, cols = wf.shape
    if layout == "channel":
        amax = wf.abs().amax(dim=1)
    else:
        pad = F.pad(wf.abs(), (0, blocks(cols) * BLOCK - cols, 0, blocks(rows) * BLOCK - rows))
        amax = pad.reshape(blocks(rows), BLOCK, blocks(cols), BLOCK).amax(dim=(1, 3))
    scales = torch.clamp(amax / torch.full_like(amax, E4M3_MAX), min=MIN_SCALE)
    q = (wf / _expanded(scales, layout, rows, cols, False)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.contiguous(), scales.contiguous()


def quantize(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An nn.Linear weight [rows, cols] (float32, float16 or bfloat16) quantized to e4m3 with per-channel or
    128 x 128 block scales: prox::fp8::quantize_device on CUDA, quantize_host on the CPU (bit-identical), the torch
    equivalent without the extension. Offline: synchronizes. Returns (q float8_e4m3fn [rows, cols], scales)."""
    code = layout_code(layout)
    if _use_op(w):
        return tuple(torch.ops.prox.fp8_quantize(w.contiguous(), code))
    return quantize_reference(w, layout)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 codes, one float32 scale per row [M, 1]): the row-wise (per token) dynamic
    quantization torch._scaled_mm's row-wise scaling reads (scale = amax / 448, at least 1e-12)."""
    s = (x.float().abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] (K a multiple of 128) -> (e4m3 codes, float32 scales [M, K/128] per row and 128-column
    group, outer-dim-major as cuBLAS's blockwise FP8 GEMM reads them: BlockWise1x128)."""
    m, k = x.shape
    xf = x.float().view(m, k // BLOCK, BLOCK)
    s = (xf.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)
    q = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(m, k)
    return q, s.t().contiguous().t()


def transpose_down(q_down: torch.Tensor, scales: torch.Tensor, layout: Optional[str] = None,
                   name: str = "w_down") -> tuple[torch.Tensor, torch.Tensor]:
    """W_down^T and its scales from an FP8 W_down [d_model, d_ff] (nn.Linear): the codes transposed, the
    per-channel scales kept ([d_model], now one per column), the block scales transposed ([ceil(d_ff/128),
    ceil(d_model/128)]). prox::fp8::transpose_down_device / _host (the torch equivalent without the extension)."""
    d_model, d_ff = (int(v) for v in q_down.shape)
    layout = layout or infer_layout(scales, d_model, d_ff, name=f"{name}'s scales")
    s = normalize_scales(scales, layout, d_model, d_ff, name=f"{name}'s scales")
    if _use_op(q_down):
        return tuple(torch.ops.prox.fp8_transpose_down(q_down.contiguous(), s, layout_code(layout)))
    return q_down.t().contiguous(), (s.t().contiguous() if layout == "block128" else s.clone())


def pack_int4(q: torch.Tensor, scales: torch.Tensor, layout: Optional[str] = None,
              name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """The INT4 proxy (layout v1) of an FP8 W_gate or W_up [d_ff, d_model], packed from its dequantized weights
    (prox::fp8::pack_int4_device / _host; bit-identical to int4-packing the float32 dequantized weights, which is
    the torch equivalent without the extension). The scales are checked first (a ValueError naming ``name``).
    Returns (packed int32 [d_model, d_ff/8], scales float32 [d_ff])."""
    d_ff, d_model = (int(v) for v in q.shape)
    layout = layout or infer_layout(scales, d_ff, d_model, name=f"{name}'s scales")
    s = normalize_scales(scales, layout, d_ff, d_model, name=f"{name}'s scales")
    check_scales(s, f"{name}'s scales")
    if _use_op(q):
        return tuple(torch.ops.prox.fp8_pack_int4(q.contiguous(), s, layout_code(layout)))
    return reference.pack_int4(dequantize(q, s, layout))


def normalize_scales(scales: torch.Tensor, layout: str, rows: int, cols: int, transposed: bool = False,
                     name: str = "scales") -> torch.Tensor:
    """A matrix's scales in the shape the ops read, float32 and contiguous: [out] per channel (from [out], [out, 1]
    or one per-tensor value), [ceil(rows/128), ceil(cols/128)] blocks (from that shape or one per-tensor value).
    A view where the input already is so."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"prox: {name} must be a tensor (it is {type(scales).__name__})")
    if scales.dtype != torch.float32:
        raise TypeError(f"prox: {name} must be torch.float32 (it is {scales.dtype}): prox reads fp32 scales")
    want = scale_shape(layout, rows, cols, transposed)
    s = scales.detach()
    if s.numel() == 1 and tuple(s.shape) != want:  # per tensor: the same value everywhere
        return s.reshape(1).expand(math.prod(want)).reshape(want).contiguous()
    if layout == "channel" and tuple(s.shape) == (want[0], 1):
        s = s.reshape(want)
    if tuple(s.shape) != want:
        raise ValueError(f"prox: {name} has shape {tuple(scales.shape)}; the {layout} layout of a [{rows}, {cols}] "
                         f"matrix needs {list(want)}")
    return s.contiguous()


# ---------------------------------------------------------------- linear modules


class Fp8Linear(nn.Module):
    """A bias-free linear layer with FP8 e4m3 weights and fp32 scales: ``weight`` float8_e4m3fn [out, in] and
    ``weight_scale`` float32, [out] (one per output channel, as vLLM's per-channel FP8 and compressed-tensors'
    FP8_DYNAMIC hold it) or [ceil(out/128), ceil(in/128)] (128 x 128 blocks). The forward computes with the
    dequantized weights in float32 (activations unquantized) and returns the input's dtype: the dense layer exactly
    as the checkpoint means it. SparseMLP runs Prox on it through the FP8 op.

        lin = prox.Fp8Linear.from_linear(nn_linear, "channel")    # quantized with prox's rule (quantize())
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        super().__init__()
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise TypeError(f"prox: Fp8Linear's weight must be a 2-D torch.float8_e4m3fn tensor (it is "
                            f"{weight.dtype}, shape {tuple(weight.shape)})")
        self.out_features, self.in_features = (int(v) for v in weight.shape)
        self.layout = infer_layout(weight_scale, self.out_features, self.in_features, name="weight_scale")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.to(torch.float32), requires_grad=False)
        self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Module, layout: str = "channel") -> "Fp8Linear":
        """The FP8 copy of a bias-free linear layer, quantized with prox's rule (quantize(): amax / 448 per channel
        or block, round to nearest even, saturating)."""
        if getattr(linear, "bias", None) is not None:
            raise ValueError("prox: Fp8Linear has no bias; the layer given has one")
        with torch.no_grad():
            q, s = quantize(linear.weight.detach(), layout)
        return cls(q, s)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.layout, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.float32), self.dequantized()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}"


@dataclass
class Fp8Weight:
    """An FP8 linear's weight as Prox reads it (linear_info())."""

    q: torch.Tensor  #: float8_e4m3fn [out, in] (the module's weight, detached)
    scales: torch.Tensor  #: the module's own scale tensor (any of the accepted shapes)
    scale_name: str  #: "weight_scale_inv" or "weight_scale"
    layout: Optional[str]  #: "channel", "block128", or None for one per-tensor scale (either)

    def normalized(self, layout: Optional[str] = None, transposed: bool = False, name: str = "scales") -> torch.Tensor:
        """The scales in ``layout`` (this one's by default) as the ops read them (normalize_scales)."""
        rows, cols = (int(v) for v in self.q.shape)
        return normalize_scales(self.scales, layout or self.layout or "channel", rows, cols, transposed, name)


def linear_info(module: nn.Module, name: str = "linear") -> Optional[Fp8Weight]:
    """The FP8 weight of a linear module (None when its weight is not torch.float8_e4m3fn): transformers' FP8Linear
    (``weight_scale_inv``, block_size (128, 128) or None), prox.Fp8Linear and per-channel linears (``weight_scale``).
    Refused with a ValueError naming the module: no scale, a scale that is not float32 (UE8M0 exponents), another
    block size, a scale shape of no layout."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dtype != E4M3:
        return None
    if w.dim() != 2:
        raise ValueError(f"prox: {name}.weight must be 2-D [out, in] (it has shape {tuple(w.shape)})")
    scale_name = next((n for n in ("weight_scale_inv", "weight_scale") if isinstance(getattr(module, n, None),
                                                                                      torch.Tensor)), None)
    if scale_name is None:
        raise ValueError(f"prox: {name} has torch.float8_e4m3fn weights but no float32 weight_scale_inv or "
                         "weight_scale tensor (the dequantized weight is q * scale)")
    s = getattr(module, scale_name)
    if s.dtype != torch.float32:
        raise ValueError(f"prox: {name}.{scale_name} is {s.dtype}: prox reads float32 scales (UE8M0 exponent scales "
                         "are not supported)")
    rows, cols = (int(v) for v in w.shape)
    block_size = getattr(module, "block_size", None)
    if block_size is not None and tuple(int(b) for b in block_size) != (BLOCK, BLOCK):
        raise ValueError(f"prox: {name} has block_size {tuple(block_size)}; prox's FP8 format has 128 x 128 blocks "
                         "or one scale per output channel")
    if block_size is not None:
        layout = infer_layout(s, rows, cols, name=f"{name}.{scale_name}")
        if layout != "block128" and s.numel() != 1:
            raise ValueError(f"prox: {name} has block_size (128, 128) but {name}.{scale_name} has shape "
                             f"{tuple(s.shape)} (expected [{blocks(rows)}, {blocks(cols)}])")
        layout = "block128"
    elif s.numel() == 1 and rows > 1 and tuple(s.shape) != (blocks(rows), blocks(cols)):
        layout = None  # per tensor: expanded to the MLP's layout (a [1, 1] grid of one block stays a block)
    else:
        layout = infer_layout(s, rows, cols, name=f"{name}.{scale_name}")
    return Fp8Weight(w.detach(), s.detach(), scale_name, layout)


def default_module(layout: str) -> str:
    """quantize_linear()'s default ``module`` for a layout: "transformers" for block128 when transformers has its
    fine-grained FP8Linear (the official Qwen3-*-FP8 checkpoints' class), else "prox"."""
    layout_code(layout)
    if layout == "block128":
        try:
            import transformers.integrations.finegrained_fp8  # noqa: F401  (optional: the class exists)
            return "transformers"
        except ImportError:
            pass
    return "prox"


def quantize_linear(linear: nn.Module, layout: str, module: Optional[str] = "prox") -> nn.Module:
    """An FP8 copy of a bias-free linear layer (prox's quantization rule): ``module="prox"`` gives an Fp8Linear,
    ``"transformers"`` transformers' FP8Linear (block128 only: ``weight_scale_inv``, block_size (128, 128), the
    official Qwen3-*-FP8 checkpoints' class; its own forward needs transformers' FP8 kernels, SparseMLP does not),
    None the layout's default (default_module())."""
    module = default_module(layout) if module is None else module
    if module == "prox":
        return Fp8Linear.from_linear(linear, layout)
    if module != "transformers":
        raise ValueError(f"prox: module must be 'prox' or 'transformers', got {module!r}")
    if layout != "block128":
        raise ValueError("prox: transformers' FP8Linear holds 128 x 128 block scales (layout 'block128')")
    from transformers.integrations.finegrained_fp8 import FP8Linear
    w = linear.weight.detach()
    with torch.no_grad():
        q, s = quantize(w, layout)
    with torch.device("meta"):
        m = FP8Linear(w.shape[1], w.shape[0], block_size=(BLOCK, BLOCK))
    m.weight = nn.Parameter(q, requires_grad=False)
    m.weight_scale_inv = nn.Parameter(s, requires_grad=False)
    return m
