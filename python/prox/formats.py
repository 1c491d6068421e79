# SPDX-License-Identifier: Apache-2.0
"""The Stage-2 weight formats, one object each (the registry): ``NATIVE`` (fp16/bf16 weights), ``FP8_CHANNEL`` and
``FP8_BLOCK128`` (FP8 e4m3 weights with one float32 scale per output channel or per 128 x 128 block, prox.fp8).

A format owns everything in Python that differs between weight formats, and the layers ask it instead of
branching on a name or a dtype:

- recognizing its linear layers (``Format.linear``; ``of_mlp``: the one format that reads all three projections
  of an MLP; ``of_weights``: the format of raw weight tensors, for PlannedFfn);
- the activation dtype (``act_dtype``: the weights' for NATIVE, given for the FP8 formats);
- the derived state: the INT4 proxies (``proxy``), the Stage-2 scales, checked (``stage2_scale``), W_down^T and
  its scales (``down_t``);
- dequantization (``exact_weights``) and the matrices a thresholds file fingerprints (``fingerprint_matrices``);
- the op's format code (``code``) and the allocation's alpha (``alpha``, alpha_for());
- the dense path of several tokens, prefill (``prefill``): FP8 through an FP8 GEMM where torch takes the scale
  layout, else one matrix at a time dequantized to the activation dtype;
- tensor-parallel cuts of its linears (``cut``: FP8 block scales are cut on block boundaries, or refused).

Adding a format: one Format subclass and its object in REGISTRY here, and its C++ instantiation (the kernels'
weight reader, the extension's format list in setup.py, csrc's dispatch); nothing else in python/prox names a
format.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _ops, fp8, reference
from ._ops import LayerTensors
from .allocation import ALPHA

#: Activation dtypes the op runs.
OP_DTYPES = (torch.float16, torch.bfloat16)
#: alpha for FP8 e4m3 Stage-2 weights: the cost of an INT4 proxy projection relative to an FP8 one. An INT4 proxy
#: reads half an FP8 projection's bytes (0.5 is the byte ratio), and prox_alpha --fp8=1 measured 0.531-0.594 on
#: Qwen3-8B and 0.462-0.553 on 14B at input sparsity 0-70 % (H100, commit 3b84009, --quick;
#: docs/data/alpha-fp8-h100.json): 0.5 lies inside that range.
FP8_ALPHA = 0.5
#: Token rows torch._scaled_mm is given a multiple of (cuBLAS's FP8 GEMM wants 16-row multiples).
SCALED_MM_ROWS = 16


@dataclass(frozen=True)
class Linear:
    """A linear layer's weight as a format reads it (Format.linear)."""

    weight: torch.Tensor  #: [out, in] (nn.Linear layout), detached
    scales: Optional[torch.Tensor] = None  #: the module's own scale tensor (any shape its format accepts), or None
    scale_name: Optional[str] = None  #: the module attribute that holds ``scales``
    layout: Optional[str] = None  #: FP8: "channel", "block128", or None for one per-tensor scale


def linear_module(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear around ``weight`` [out, in] (shared, not copied)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


def _cut_range(lo: int, hi: int, n: int) -> tuple[int, int]:
    if not 0 <= lo < hi <= n:
        raise ValueError(f"prox: cannot cut [{lo}, {hi}) out of {n}")
    return lo, hi


class Format:
    """One Stage-2 weight format. Subclasses: NativeFormat, Fp8Format."""

    name: str
    alpha: float
    #: FP8: the scale layout ("channel", "block128"); None for a format without scales.
    layout: Optional[str] = None
    #: Whether the weights' dtype is the activation dtype (NATIVE); else a layer is given one (dtype=).
    weights_set_dtype: bool = True
    #: Whether a model's own MLP module computes this format's dense MLP (what calibration's dense passes need):
    #: nn.Linear does; an FP8 checkpoint's linears may need kernels that are not installed and quantize the
    #: activations, so calibration runs their dense passes through SparseMLP's dense path.
    module_forward_is_dense: bool = True
    #: The dtypes of the codes this format's weights hold: kept as they are when a model is converted
    #: (model.half() must not cast FP8 codes).
    code_dtypes: tuple = ()

    def __repr__(self) -> str:
        return f"prox.formats.{self.name.upper()}"

    @property
    def code(self) -> int:
        """The ops' ``format`` argument (the format's code in the loaded extension)."""
        return _ops.format_code(self.name)

    # ------------------------------------------------------------ recognizing weights

    def recognizes(self, module) -> bool:
        """Whether ``module`` is a linear layer of this format's weights (a cheap test: Format.linear reads it, and
        raises where it is malformed)."""
        raise NotImplementedError

    def linear(self, module, name: str) -> Optional[Linear]:
        """The module's weight as this format reads it; None when it is no linear layer of this format."""
        raise NotImplementedError

    def reads_weights(self, w_gate: torch.Tensor, w_gate_scale: Optional[torch.Tensor]) -> bool:
        """Whether a layer given as tensors (PlannedFfn's w_gate and w_gate_scale) has this format."""
        raise NotImplementedError

    def act_dtype(self, weight_dtype: torch.dtype, given: Optional[torch.dtype], *, op_only: bool) -> torch.dtype:
        """The activation dtype of a layer with weights of ``weight_dtype`` and ``dtype=given``; ``op_only``: for a
        layer that only runs the op (PlannedFfn), else also the torch reference (SparseMLP)."""
        raise NotImplementedError

    def dtype_hint(self) -> str:
        """How a user sets this format's activation dtype (for the messages that refuse one)."""
        raise NotImplementedError

    # ------------------------------------------------------------ derived state

    def normalized_scale(self, scales: Optional[torch.Tensor], rows: int, cols: int, name: str,
                         transposed: bool = False) -> Optional[torch.Tensor]:
        """A matrix's scales in the shape the op reads (not checked: stage2_scale checks); None without scales."""
        raise NotImplementedError

    def stage2_scale(self, scales: Optional[torch.Tensor], rows: int, cols: int, name: str,
                     transposed: bool = False) -> Optional[torch.Tensor]:
        """A Stage-2 matrix's scales as the op reads them, checked (a ValueError naming ``name``); None for a
        format without scales."""
        raise NotImplementedError

    def proxy(self, weight: torch.Tensor, scales: Optional[torch.Tensor], name: str) -> tuple:
        """The INT4 proxy (packed int32 [d_model, d_ff/8], float32 scales [d_ff]) of W_gate or W_up."""
        raise NotImplementedError

    def down_t(self, weight: torch.Tensor, scales: Optional[torch.Tensor], name: str, scales_name: str) -> tuple:
        """(W_down^T [d_ff, d_model], its scales as the op reads them or None) from W_down [d_model, d_ff]."""
        raise NotImplementedError

    def down_t_scale(self, scales: Optional[torch.Tensor], d_model: int, d_ff: int,
                     name: str) -> Optional[torch.Tensor]:
        """W_down^T's scales from W_down's own (a layer that keeps only W_down^T and W_down's scales)."""
        raise NotImplementedError

    def exact_weights(self, layer: LayerTensors, dtype: Optional[torch.dtype] = None) -> tuple:
        """(W_gate, W_up, W_down^T) as Stage 2 computes with them, in ``dtype`` (float64: exact)."""
        raise NotImplementedError

    def fingerprint_matrices(self, layer: LayerTensors, w_down: Optional[torch.Tensor] = None) -> tuple:
        """(dtype name, W_gate, W_up, W_down in nn.Linear layout): what a thresholds file fingerprints
        (prox.thresholds.layer_fingerprint). ``w_down``: W_down itself where the layer keeps it."""
        raise NotImplementedError

    # ------------------------------------------------------------ running

    def prefill(self, x: torch.Tensor, layer: LayerTensors, act: str, down: Optional[tuple] = None,
                gemm: str = "auto") -> torch.Tensor:
        """The dense FFN of x [..., d_model] on the layer's weights, in x's dtype: what several tokens run when they
        do not run Prox. ``down``: (W_down [d_model, d_ff], its scales in this format's layout or None) where the
        layer keeps W_down. ``gemm``: "auto" (the format's fastest path) or "dequantized" (the weights as Stage 2
        computes with them, one matrix at a time in x's dtype)."""
        raise NotImplementedError

    # ------------------------------------------------------------ tensor parallelism

    def cut(self, lin: Linear, name: str, rows: Optional[tuple] = None, cols: Optional[tuple] = None) -> nn.Module:
        """A linear module holding rows [lo, hi) (W_gate, W_up: a rank's channels) or columns [lo, hi) (W_down) of
        ``lin`` (copied, so the whole can be freed), with its scales cut to match. A cut the format cannot make
        raises a ValueError naming ``name``, its shape and the cut."""
        raise NotImplementedError


class FormatNamed:
    """The format's name and layout as a layer reports them (PlannedFfn, SparseMLP's weights: their ``fmt``)."""

    fmt: Format

    @property
    def format(self) -> str:
        """The Stage-2 weight format's name (prox.FORMATS)."""
        return self.fmt.name

    @property
    def layout(self) -> Optional[str]:
        """FP8: the scale layout ("channel", "block128"); None for the native format."""
        return self.fmt.layout


class NativeFormat(Format):
    """fp16/bf16 weights: Stage 2 reads them as they are; the INT4 proxies are packed from them."""

    name = "native"
    alpha = ALPHA

    def recognizes(self, module) -> bool:
        return isinstance(module, nn.Linear) and self.linear(module, "linear") is not None

    def linear(self, module, name: str) -> Optional[Linear]:
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or holds_codes(w):
            return None
        return Linear(w.detach())

    def reads_weights(self, w_gate, w_gate_scale):
        return not holds_codes(w_gate)

    def act_dtype(self, weight_dtype, given, *, op_only):
        if given is not None and given != weight_dtype:
            raise TypeError(f"prox: dtype {given} given for {weight_dtype} weights: the native format's activation "
                            "dtype is its weights' (dtype= is for FP8 projections)")
        if op_only and weight_dtype not in OP_DTYPES:
            raise TypeError(f"prox: weights must be float16 or bfloat16, got {weight_dtype}")
        return weight_dtype

    def dtype_hint(self) -> str:
        return ("convert the model with .half() or .to(torch.bfloat16); autocast does not convert weights")

    def normalized_scale(self, scales, rows, cols, name, transposed=False):
        return self.stage2_scale(scales, rows, cols, name, transposed)

    def stage2_scale(self, scales, rows, cols, name, transposed=False):
        if scales is not None:
            raise ValueError(f"prox: {name} was given for float16/bfloat16 weights: the native format has no scales "
                             "(FP8 weights are torch.float8_e4m3fn)")
        return None

    def proxy(self, weight, scales, name):
        self.stage2_scale(scales, 0, 0, f"{name}'s scales")
        w = weight.detach().contiguous()
        pack = _ops.pack_int4 if _ops.available() and w.dtype in OP_DTYPES else reference.pack_int4
        return pack(w)

    def down_t(self, weight, scales, name, scales_name):
        self.stage2_scale(scales, 0, 0, scales_name)
        w = weight.detach()
        if _ops.available() and w.is_cuda and w.dtype in OP_DTYPES:
            return _ops.transpose(w.contiguous()), None  # bit-identical to torch's, on the device
        return w.t().contiguous(), None

    def down_t_scale(self, scales, d_model, d_ff, name):
        return self.stage2_scale(scales, d_model, d_ff, name)

    def exact_weights(self, layer, dtype=None):
        ws = (layer.w_gate, layer.w_up, layer.w_down_t)
        return ws if dtype is None else tuple(w.to(dtype) for w in ws)

    def fingerprint_matrices(self, layer, w_down=None):
        wd = w_down if w_down is not None else layer.w_down_t.t()
        return (str(layer.w_gate.dtype).replace("torch.", ""), layer.w_gate.detach(), layer.w_up.detach(),
                wd.detach())

    def prefill(self, x, layer, act, down=None, gemm="auto"):
        h = reference.activation(act)(F.linear(x, layer.w_gate)) * F.linear(x, layer.w_up)
        if down is not None:
            return F.linear(h, down[0])
        return torch.matmul(h, layer.w_down_t)  # W_down^T as a transposed operand: no copy

    def cut(self, lin, name, rows=None, cols=None):
        w = lin.weight
        if rows is not None:
            lo, hi = _cut_range(*rows, w.shape[0])
            return linear_module(w[lo:hi].clone())
        lo, hi = _cut_range(*cols, w.shape[1])
        return linear_module(w[:, lo:hi].contiguous())


class Fp8Format(Format):
    """FP8 e4m3 weights with float32 scales in one layout (docs/fp8-format.md, prox.fp8): Stage 2 reads the codes and
    scales; the INT4 proxies are packed from the dequantized weights; W_down^T's scales follow its transpose."""

    alpha = FP8_ALPHA
    weights_set_dtype = False
    module_forward_is_dense = False
    code_dtypes = (fp8.E4M3,)

    def __init__(self, layout: str):
        fp8.layout_code(layout)
        self.layout = layout
        self.name = f"fp8_{layout}"

    def recognizes(self, module) -> bool:
        w = getattr(module, "weight", None)
        return isinstance(w, torch.Tensor) and w.dtype in self.code_dtypes

    def reads_weights(self, w_gate, w_gate_scale):
        if w_gate.dtype not in self.code_dtypes or w_gate_scale is None:
            return False
        rows, cols = (int(v) for v in w_gate.shape)
        return fp8.infer_layout(w_gate_scale, rows, cols, name="w_gate_scale") == self.layout

    def linear(self, module, name):
        info = fp8.linear_info(module, name)  # None for other weights; malformed FP8 linears raise, named
        if info is None or info.layout not in (None, self.layout):
            return None
        return Linear(info.q, info.scales, info.scale_name, info.layout)

    def act_dtype(self, weight_dtype, given, *, op_only):
        if op_only:
            if given not in OP_DTYPES:
                raise TypeError(f"prox: FP8 weights need dtype=torch.float16 or torch.bfloat16 (the activation "
                                f"dtype), got {given}")
            return given
        given = torch.bfloat16 if given is None else given
        if given not in OP_DTYPES + (torch.float32,):
            raise TypeError(f"prox: dtype must be torch.float16, torch.bfloat16 or torch.float32 for FP8 projections "
                            f"(the activation dtype), got {given}")
        return given

    def dtype_hint(self) -> str:
        return "SparseMLP(dtype=...), or model.to(dtype): the FP8 weights stay as they are"

    def normalized_scale(self, scales, rows, cols, name, transposed=False):
        return fp8.normalize_scales(scales, self.layout, rows, cols, transposed, name)

    def stage2_scale(self, scales, rows, cols, name, transposed=False):
        if scales is None:
            raise ValueError(f"prox: {name} is missing: the {self.name} format's dequantized weight is q * scale")
        s = self.normalized_scale(scales, rows, cols, name, transposed)
        fp8.check_scales(s, name)
        return s

    def proxy(self, weight, scales, name):
        if scales is None:
            raise ValueError(f"prox: {name}'s scales are missing: the {self.name} format's dequantized weight is "
                             "q * scale")
        return fp8.pack_int4(weight.detach(), scales, self.layout, name=name)  # normalized and checked there

    def down_t(self, weight, scales, name, scales_name):
        d_model, d_ff = (int(v) for v in weight.shape)
        s = self.stage2_scale(scales, d_model, d_ff, scales_name)
        return fp8.transpose_down(weight.detach(), s, self.layout, name=name)

    def down_t_scale(self, scales, d_model, d_ff, name):
        s = self.normalized_scale(scales, d_model, d_ff, name)
        s = s.t().contiguous() if self.layout == "block128" else s.contiguous()
        fp8.check_scales(s, name)
        return s

    def exact_weights(self, layer, dtype=None):
        dtype = dtype or torch.float32
        return (fp8.dequantize(layer.w_gate.detach(), layer.w_gate_scale, self.layout, dtype),
                fp8.dequantize(layer.w_up.detach(), layer.w_up_scale, self.layout, dtype),
                fp8.dequantize(layer.w_down_t, layer.w_down_t_scale, self.layout, dtype, transposed=True))

    def fingerprint_matrices(self, layer, w_down=None):
        wg, wu, wdt = self.exact_weights(layer, torch.float32)  # the codes and their scales, as one matrix each
        return str(fp8.E4M3).replace("torch.", ""), wg, wu, wdt.t()

    # ------------------------------------------------------------ prefill

    def scaled_mm_ok(self, x: torch.Tensor, n: int, k: int) -> bool:
        """Whether the prefill runs x [M, k] against a [n, k] weight of this layout through torch._scaled_mm:
        per-channel (row-wise) scales, bfloat16 activations on CUDA sm_89 and newer, k and n multiples of 16.
        Not the 128 x 128 block layout: torch._scaled_mm's blockwise scaling (1 x 128 activation groups against
        128 x 128 weight blocks) gave wrong results in test_fp8_prefill_gemm on an H200 (torch 2.11, 512 tokens,
        d_model 256: relative errors from 0.3 to 1e27 against the float64 W8A8 reference, where the row-wise
        path matched), so block-scaled layers take the dequantized path."""
        if self.layout != "channel" or not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")):
            return False
        return torch.cuda.get_device_capability(x.device) >= (8, 9) and k % 16 == 0 and n % 16 == 0

    def scaled_mm(self, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x [M, k] @ w^T for FP8 w [n, k] (nn.Linear layout, row-major) with its per-channel scales (normalized):
        the activations quantized to e4m3 per token (row-wise), then torch._scaled_mm (cuBLAS's FP8 GEMM, float32
        accumulation), in x's dtype. Check scaled_mm_ok first."""
        m = x.shape[0]
        pad = -m % SCALED_MM_ROWS
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        xq, xs = fp8.quantize_rows(xp)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales.reshape(1, -1), out_dtype=x.dtype)
        return y[:m] if pad else y

    def _linear(self, x, w, scales, gemm):
        """x @ w^T for FP8 w [n, k] (normalized scales): the FP8 GEMM where it runs, else w dequantized to x's
        dtype (one matrix: freed when the GEMM returns)."""
        if gemm == "auto" and self.scaled_mm_ok(x, *w.shape):
            return self.scaled_mm(x, w, scales)
        return F.linear(x, fp8.dequantize(w, scales, self.layout, x.dtype))

    def prefill(self, x, layer, act, down=None, gemm="auto"):
        if gemm not in ("auto", "dequantized"):
            raise ValueError(f"prox: prefill_gemm must be 'auto' or 'dequantized', got {gemm!r}")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        h = reference.activation(act)(self._linear(x2, layer.w_gate, layer.w_gate_scale, gemm))
        h = h * self._linear(x2, layer.w_up, layer.w_up_scale, gemm)
        if down is not None:
            y = self._linear(h, down[0], down[1], gemm)
        else:  # W_down^T alone: the FP8 GEMM needs W_down row-major, so W_down^T is dequantized
            y = torch.matmul(h, fp8.dequantize(layer.w_down_t, layer.w_down_t_scale, self.layout, x.dtype,
                                               transposed=True))
        return y.reshape(shape)

    # ------------------------------------------------------------ tensor parallelism

    def _cut_blocks(self, lo: int, hi: int, n: int, name: str, shape: tuple, what: str) -> tuple[int, int]:
        """The block range of [lo, hi) along a dimension of n: block scales cut on block boundaries only."""
        if lo % fp8.BLOCK or (hi % fp8.BLOCK and hi != n):
            raise ValueError(f"prox: {name} {list(shape)} has 128 x 128 block scales: its {what} [{lo}, {hi}) do not "
                             f"start and end on a block boundary (multiples of 128), so the shard cannot be cut "
                             f"(give tensor parallelism a d_ff whose shards hold a multiple of 128 channels)")
        return lo // fp8.BLOCK, fp8.blocks(hi)

    def cut(self, lin, name, rows=None, cols=None):
        w = lin.weight
        shape = tuple(w.shape)
        s = self.normalized_scale(lin.scales, *shape, f"{name}'s scales")
        if rows is not None:
            lo, hi = _cut_range(*rows, shape[0])
            if self.layout == "block128":
                b0, b1 = self._cut_blocks(lo, hi, shape[0], name, shape, "rows")
                s = s[b0:b1]
            else:
                s = s[lo:hi]
            return fp8.Fp8Linear(w[lo:hi].clone(), s.clone())
        lo, hi = _cut_range(*cols, shape[1])
        if self.layout == "block128":
            b0, b1 = self._cut_blocks(lo, hi, shape[1], name, shape, "columns")
            s = s[:, b0:b1]
        return fp8.Fp8Linear(w[:, lo:hi].contiguous(), s.contiguous().clone())


NATIVE = NativeFormat()
FP8_CHANNEL = Fp8Format("channel")
FP8_BLOCK128 = Fp8Format("block128")
#: Every format, in the order of_mlp() tries them (an MLP of per-tensor FP8 scales, which both FP8 formats read,
#: runs FP8_CHANNEL).
REGISTRY = (NATIVE, FP8_CHANNEL, FP8_BLOCK128)
_CODE_DTYPES = tuple(d for f in REGISTRY for d in f.code_dtypes)
_BY_NAME = {f.name: f for f in REGISTRY}


def get(name) -> Format:
    """The format of a name (prox.FORMATS), or a Format itself; a ValueError for an unknown one."""
    if isinstance(name, Format):
        return name
    f = _BY_NAME.get(name)
    if f is None:
        raise ValueError(f"prox: unknown weight format {name!r} (prox knows {', '.join(_BY_NAME)})")
    return f


def fp8_format(layout: str) -> Format:
    """The FP8 format of a scale layout ("channel", "block128")."""
    fp8.layout_code(layout)
    return get(f"fp8_{layout}")


def alpha_for(fmt) -> float:
    """The allocation's alpha for a Stage-2 weight format (a name or a Format): the format's own (ALPHA for the native
    format, FP8_ALPHA for the FP8 ones), so that e stays the fraction of the dense FFN's cost, in that format, that
    Prox saves. An unknown format raises."""
    return get(fmt).alpha


def holds_codes(t: torch.Tensor) -> bool:
    """Whether a tensor holds a format's weight codes (FP8 e4m3), which keep their dtype through model.half() /
    .to(dtype), rather than values in the model's dtype."""
    return t.dtype in _CODE_DTYPES


def is_linear(m) -> bool:
    """A bias-free linear layer some format reads (nn.Linear, an FP8 linear: prox.fp8.linear_info)."""
    return getattr(m, "bias", None) is None and any(f.recognizes(m) for f in REGISTRY)


def is_gated_mlp(m: nn.Module) -> bool:
    """A gated MLP SparseMLP takes: bias-free linear gate_proj, up_proj and down_proj, and act_fn."""
    return all(is_linear(getattr(m, n, None)) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(m, "act_fn")


def of_mlp(projections: dict) -> tuple[Format, dict]:
    """The format of an MLP's projections ({"gate_proj": module, ...}): the first of REGISTRY that reads all of
    them, with each one's Linear. A ValueError naming each projection's formats when none reads all three."""
    for f in REGISTRY:
        lins = {n: f.linear(m, n) for n, m in projections.items()}
        if all(v is not None for v in lins.values()):
            return f, lins

    def formats_of(n, m):
        names = [f.name for f in REGISTRY if f.linear(m, n) is not None]
        return " or ".join(names) if names else "of no format"
    raise ValueError("prox: " + ", ".join(f"{n} is {formats_of(n, m)}" for n, m in projections.items())
                     + ": an MLP's three projections must share one weight format (native fp16/bf16 weights, or FP8 "
                     "with one scale layout)")


def of_module(mlp: nn.Module) -> Format:
    """The format of a gated MLP (a SparseMLP's own, or that of a model's MLP's projections)."""
    fmt = getattr(mlp, "fmt", None)
    if isinstance(fmt, Format):
        return fmt
    return of_mlp({n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")})[0]


def of_weights(w_gate: torch.Tensor, w_gate_scale: Optional[torch.Tensor]) -> Format:
    """The format of a layer given as tensors (PlannedFfn): the first of REGISTRY that reads w_gate with
    w_gate_scale (FP8 codes: by their scales' layout)."""
    for f in REGISTRY:
        if f.reads_weights(w_gate, w_gate_scale):
            return f
    shape = None if w_gate_scale is None else tuple(w_gate_scale.shape)
    raise ValueError(f"prox: no weight format reads w_gate ({w_gate.dtype}) with w_gate_scale {shape}: FP8 weights "
                     "need w_gate_scale and w_up_scale (and w_down_scale or w_down_t_scale): the dequantized weight "
                     "is q * scale")
