# SPDX-License-Identifier: Apache-2.0
"""prox.nn.SparseMLP, a drop-in replacement for gated MLPs with gate_proj / up_proj / down_proj (Llama,
Qwen2/Qwen3, Mistral: SwiGLU; Gemma: GeGLU with tanh-GELU), and the helpers that find, swap and
describe them in a model.

A decode step (one token) runs Prox: the CUDA op on fp16/bf16 CUDA tensors, or the torch reference of
the method elsewhere. 2 to 8 tokens on the op's path (a small decode batch, speculative verification) run
Prox as one batched call (``batched=True``, the default: each token what batch 1 gives it, within rounding,
with every weight row read once per call). Other multi-token calls (prefill) run the dense MLP through
torch on the same weights (``prefill="dense"``, what a server does), or Prox on every token, one op call
each (``prefill="sparse"``: how the paper scores perplexity, and how calibration runs the layers it has
finalized).

Memory: the INT4 proxies of W_gate and W_up (d_model d_ff / 2 bytes each, + d_ff float32 scales) and
W_down^T ([d_ff, d_model], the layout the sparse down GEMV reads). W_down itself is dropped unless
``keep_down=True``: the dense path computes h @ W_down^T from the transposed copy (cuBLAS reads it as a
transposed operand, no copy), so the only extra memory is the proxies (memory_report()).

FP8 e4m3 MLPs (prox.fp8: transformers' fine-grained FP8Linear, prox.Fp8Linear, per-channel linears with
``weight_scale``) run the FP8 formats: Prox through the FP8 op, the dense path and the torch reference on the
dequantized weights (float32 math), the proxies packed from the dequantized weights.
"""
from __future__ import annotations

import threading
import warnings
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _ops, fp8, reference
from ._ops import LayerTensors, PlanOptions
from .allocation import alpha_for
from .planned import sparsity_report as counters_report

#: Buffers that stay float32 whatever dtype the module is converted to (model.half(), .to(bf16)).
_FLOAT32_BUFFERS = ("scale_gate", "scale_up", "thresholds", "w_gate_scale", "w_up_scale", "w_down_t_scale",
                    "down_scale")
#: Activation dtypes the op runs.
_OP_DTYPES = (torch.float16, torch.bfloat16)


def detect_act(act_fn) -> str:
    """'silu' or 'gelu_tanh' for an MLP's activation module/function, by evaluating it (names differ
    across transformers versions: SiLU, SiLUActivation, GELUTanh, PytorchGELUTanh, ...)."""
    g = torch.linspace(-6.0, 6.0, 97, dtype=torch.float32)
    with torch.no_grad():
        try:
            v = act_fn(g).float()
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"prox: cannot evaluate the MLP's activation {act_fn!r}: {exc}") from exc
    if torch.allclose(v, F.silu(g), atol=1e-5, rtol=1e-4):
        return "silu"
    if torch.allclose(v, F.gelu(g, approximate="tanh"), atol=1e-5, rtol=1e-4):
        return "gelu_tanh"
    if torch.allclose(v, F.gelu(g), atol=1e-5, rtol=1e-4):
        raise ValueError("prox: the MLP uses exact (erf) GELU; prox implements SiLU and tanh-GELU only")
    raise ValueError(f"prox: unsupported MLP activation {act_fn!r} (prox implements SiLU and tanh-GELU)")


def _is_linear(m) -> bool:
    """A bias-free linear layer SparseMLP takes: nn.Linear, or an FP8 linear (prox.fp8.linear_info)."""
    return (isinstance(m, nn.Linear) or fp8.is_fp8_linear(m)) and getattr(m, "bias", None) is None


def is_gated_mlp(m: nn.Module) -> bool:
    return all(_is_linear(getattr(m, n, None)) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(m, "act_fn")


def is_fp8_mlp(m: nn.Module) -> bool:
    """Whether a gated MLP's projections hold FP8 e4m3 weights (a SparseMLP: whether it runs an FP8 format)."""
    if isinstance(m, SparseMLP):
        return m.format != "native"
    return any(fp8.is_fp8_linear(getattr(m, n, None)) for n in ("gate_proj", "up_proj", "down_proj"))


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations run in: that of its first floating-point parameter or buffer that is not
    FP8 (the embedding, the norms: an FP8 checkpoint's other layers), float32 when there is none."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and t.dtype != fp8.E4M3 and t.element_size() >= 2:
            return t.dtype
    return torch.float32


def _keep_fp8(fn, protected=frozenset()):
    """Module._apply's fn, except that FP8 tensors, and the tensors whose id is in ``protected`` (the FP8 linears'
    float32 scales), keep their dtype (model.half() / .to(bfloat16) would convert the codes and round the scales):
    they only follow the device."""
    def apply(t):
        if t.dtype != fp8.E4M3 and id(t) not in protected:
            return fn(t)
        probe = fn(t.new_empty(0))
        return fn(t) if probe.dtype == t.dtype else t.to(device=probe.device)
    return apply


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every gated MLP or SparseMLP in the model, in registration (depth) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMLP) or is_gated_mlp(m)]


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _raw_stream(device: torch.device) -> int:
    """The current stream's handle on a CUDA device (a plain int: cheap, no Stream object)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(get(idx)) if get is not None else int(torch.cuda.current_stream(idx).cuda_stream)


class WorkspacePool:
    """Workspaces for a set of layers that run one after another: one per (device, d_model, d_ff, stream),
    each sized for MAX_TOKENS tokens and initialized on its stream when first asked for.

    Why per stream: the fused Stage 2 keeps a grid barrier and split-K counters in the workspace, so two
    calls in flight at once on one workspace (two streams) can release the barrier early or hang. The
    layers of one stream run in order and share one safely. Why per model: swap_mlps() / sparsify() give
    each model its own pool, so two models never share a workspace, whatever streams or CUDA graphs run
    them. Thread-safe. clear() drops the pool's workspaces (layers take new ones at their next call)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ws: dict = {}

    def get(self, d_model: int, d_ff: int, device: torch.device) -> torch.Tensor:
        """The workspace of the current stream of ``device`` (made and initialized on it the first time;
        not during stream capture, where it cannot be allocated: warm up on the stream first)."""
        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        key = (device.index, d_model, d_ff, _raw_stream(device))
        ws = self._ws.get(key)
        if ws is None:
            with self._lock:
                ws = self._ws.get(key)
                if ws is None:
                    ws = self._ws[key] = _ops.new_workspace(d_model, d_ff, device, max_tokens=_ops.MAX_TOKENS)
        return ws

    def clear(self) -> None:
        with self._lock:
            self._ws.clear()

    def __len__(self) -> int:
        return len(self._ws)

    def __bool__(self) -> bool:
        # A pool is a pool even while it holds no workspace yet: without this, `pool or DEFAULT_POOL` (len 0
        # is false) silently gave every new model the process-wide pool (two models then shared workspaces).
        return True

    def nbytes(self) -> int:
        return sum(w.numel() for w in list(self._ws.values()))


#: The pool of SparseMLPs built on their own (not through swap_mlps() / sparsify()), unless given one.
DEFAULT_POOL = WorkspacePool()


def shared_workspace(d_model: int, d_ff: int, device: torch.device) -> torch.Tensor:
    """DEFAULT_POOL's workspace of (d_model, d_ff) for the current stream of ``device``."""
    return DEFAULT_POOL.get(d_model, d_ff, device)


def free_workspaces() -> None:
    """Drop DEFAULT_POOL's workspaces (a model's own pool: ``prox.nn.workspace_pool(model).clear()``)."""
    DEFAULT_POOL.clear()


_WARNED: set = set()


def _warn_once(key, msg: str) -> None:
    """One RuntimeWarning per process and key (a slow path is worth one line, not one per layer)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


class SparseMLP(nn.Module):
    """Prox for one gated MLP.

    Args:
        gate_proj, up_proj: the nn.Linear modules (kept, and shared with the dense path). Bias-free: a
            bias is refused (Prox computes u * act(g) W_down without one).
        down_proj: the down projection's nn.Linear (bias-free); its weight is transposed into ``down_t`` and
            dropped unless keep_down=True.
        act: "silu" or "gelu_tanh".
        backend: "op" (CUDA op), "torch" (reference implementation, any device) or "auto" (the op for
            fp16/bf16 CUDA weights when the extension is loaded, else torch; on CUDA it warns once that the
            reference runs, and why).
        prefill: "dense" or "sparse" (what several tokens at once run when they do not run as one batch).
        tau_x, tau_s: thresholds; they live in the device tensor ``thresholds`` (set_thresholds()).
        options: the op's PlanOptions.
        workspace: the op's workspace, used as given for every call (one per stream that may run at the
            same time as another: prox.new_workspace()). Default: the workspace of ``workspace_pool`` for
            the current stream, sized for 8 tokens.
        workspace_pool: a WorkspacePool (default: prox.nn.DEFAULT_POOL; swap_mlps() and sparsify() give each
            model its own).
        track_sparsity: accumulate runtime sparsity counters (sparsity_report(); a batch counts each token).
        batched: 2..8 tokens on the op's path run as one batched op call, whatever ``prefill`` says; False:
            they follow ``prefill``, as more tokens do.
        dtype: the activation dtype of FP8 projections (their weights do not give it): torch.float16 or
            torch.bfloat16 run the FP8 op, torch.float32 the torch reference; default torch.bfloat16 (the FP8
            checkpoints' models; swap_mlps() and sparsify() pass the model's). For fp16/bf16 weights, None or
            their dtype. model.half() / .to(dtype) changes it and keeps the FP8 weights as they are.
        tp, d_ff_full: tensor parallelism over d_ff (prox.distributed): the Linear modules hold this rank's
            shard (gate/up [d_ff_full / TP, d_model], down [d_model, d_ff_full / TP]), tp is the process group or
            a communicator (all_reduce_(tensor)); forward() all-reduces y once. Every rank constructs it; bad
            input raises on every rank. prox.distributed.shard_mlp / sparse_mlp_from_shards build it.

    State: the proxies and W_down^T are derived from the weights. load_state_dict() re-derives them; after
    changing the weights in place otherwise, call refresh() (a call on weights changed since raises). The
    state dict is the dense MLP's ({gate,up,down}_proj.weight, and an FP8 MLP's scales), W_down included with
    keep_down=False.

    FP8 projections (prox.fp8.linear_info: torch.float8_e4m3fn weights with float32 ``weight_scale_inv`` or
    ``weight_scale``, per channel, per tensor or 128 x 128 blocks) make the layer's ``format`` "fp8_channel" or
    "fp8_block128": W_down^T and its scales by prox.fp8.transpose_down, the proxies packed from the dequantized
    weights, the op's FP8 Stage 2; the dense path and the torch reference compute with the dequantized weights in
    float32. Tensor parallelism over FP8 MLPs is not supported.
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act: str = "silu", *,
                 backend: str = "auto", prefill: str = "dense", keep_down: bool = False, tau_x: float = 0.0,
                 tau_s: float = 0.0, options: PlanOptions = PlanOptions(), workspace: Optional[torch.Tensor] = None,
                 workspace_pool: Optional[WorkspacePool] = None, track_sparsity: bool = False,
                 batched: bool = True, dtype: Optional[torch.dtype] = None, tp=None, d_ff_full: Optional[int] = None):
        super().__init__()
        self.tp = None  # prox.distributed.TPState of a sharded layer
        local = (gate_proj, up_proj, down_proj, act, backend, prefill, keep_down, tau_x, tau_s, options, workspace,
                 workspace_pool, track_sparsity, batched, dtype)
        if tp is not None and any(fp8.is_fp8_linear(m) for m in (gate_proj, up_proj, down_proj)):
            raise ValueError("prox: tensor parallelism over FP8 MLPs is not supported (tp= with FP8 projections)")
        if tp is None:
            self._init_local(*local)
        else:  # every rank agrees on errors before the communicator is made (prox.distributed)
            from .distributed import init_sharded
            init_sharded(self, tp, d_ff_full, getattr(gate_proj, "weight", None), lambda: self._init_local(*local))

    @property
    def d_ff_full(self) -> int:
        """The full layer's d_ff (d_ff times the TP degree for a shard): what a thresholds file records."""
        return self.d_ff if self.tp is None else self.tp.d_ff

    def _init_local(self, gate_proj, up_proj, down_proj, act, backend, prefill, keep_down, tau_x, tau_s, options,
                    workspace, workspace_pool, track_sparsity, batched, dtype):
        if backend not in ("auto", "op", "torch"):
            raise ValueError(f"prox: backend must be 'auto', 'op' or 'torch', got {backend!r}")
        if prefill not in ("dense", "sparse"):
            raise ValueError(f"prox: prefill must be 'dense' or 'sparse', got {prefill!r}")
        if not isinstance(options, PlanOptions):
            raise TypeError(f"prox: options must be a prox.PlanOptions, got {type(options).__name__}")
        _ops.act_code(act)
        for name, lin in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(getattr(lin, "weight", None), torch.Tensor) or lin.weight.dim() != 2:
                raise TypeError(f"prox: {name} must be a linear layer with a 2-D weight (nn.Linear)")
            if getattr(lin, "bias", None) is not None:
                raise ValueError(f"prox: {name} has a bias; Prox computes bias-free gated MLPs (Llama, Qwen, "
                                 "Mistral, Gemma), and a bias would be left out of the result")
        infos = {n: fp8.linear_info(m, n) for n, m in (("gate_proj", gate_proj), ("up_proj", up_proj),
                                                          ("down_proj", down_proj))}
        n8 = sum(i is not None for i in infos.values())
        if 0 < n8 < 3:
            raise ValueError("prox: " + ", ".join(f"{n} is {'FP8' if i is not None else 'not FP8'}" for n, i in
                                                  infos.items()) + ": an MLP's three projections must all be FP8 or none")
        #: FP8 scale layout ("channel", "block128"), None for fp16/bf16 weights
        self.layout = fp8.mlp_layout(infos) if n8 else None
        #: the Stage-2 weight format the op runs (prox.FORMATS)
        self.format = fp8.FORMAT_OF[self.layout] if n8 else "native"
        self._scale_names = tuple(i.scale_name for i in infos.values()) if n8 else None
        w = gate_proj.weight
        if self.format == "native":
            if dtype is not None and dtype != w.dtype:
                raise TypeError(f"prox: dtype {dtype} given for {w.dtype} weights: the native format's activation dtype "
                                "is its weights' (dtype= is for FP8 projections)")
            self._act_dtype = None
        else:
            dtype = torch.bfloat16 if dtype is None else dtype
            if dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise TypeError(f"prox: dtype must be torch.float16, torch.bfloat16 or torch.float32 for FP8 projections "
                                f"(the activation dtype), got {dtype}")
            self._act_dtype = dtype
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
        self.backend = backend
        self.prefill = prefill
        self.batched = bool(batched)
        # Workspace bytes for 1..MAX_TOKENS tokens, read by forward() (a plain tuple: torch.compile traces it).
        self._ws_sizes = _ops._workspace_sizes(self.d_model, self.d_ff) if _ops.available() else None
        if workspace is not None and _ops.available():
            _ops.check_workspace(workspace, need=self._ws_sizes[0],
                                 what=f"workspace (prox.workspace_bytes({self.d_model}, {self.d_ff}))")
        self.options = options
        self._options = options.encode()
        self.act_code = _ops.act_code(act)
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.keep_down = keep_down
        # A module slot even when W_down is dropped: its state-dict key ("down_proj.weight") is ours to save
        # and load (from down_t), not an unexpected one.
        self.register_module("down_proj", down_proj if keep_down else None)
        # FP8 with keep_down=False: W_down's own scales stay (the state dict saves them with W_down).
        self.register_buffer("down_scale", infos["down_proj"].scales if n8 and not keep_down else None,
                             persistent=False)
        with torch.no_grad():
            down_t, down_t_scale = self._down_t_of(down_proj)
            pg, sg, pu, su = self._pack()
            gs, us = self._fp8_scales()
        self.register_buffer("down_t", down_t, persistent=False)
        self.register_buffer("w_down_t_scale", down_t_scale, persistent=False)
        self.register_buffer("w_gate_scale", gs, persistent=False)
        self.register_buffer("w_up_scale", us, persistent=False)
        self.register_buffer("proxy_gate", pg, persistent=False)
        self.register_buffer("scale_gate", sg, persistent=False)
        self.register_buffer("proxy_up", pu, persistent=False)
        self.register_buffer("scale_up", su, persistent=False)
        self.register_buffer("thresholds", torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32,
                                                        device=w.device), persistent=False)
        self.register_buffer("counters", torch.zeros(4, dtype=torch.int64, device=w.device) if track_sparsity
                             else None, persistent=False)
        # A given workspace is used as given; otherwise the pool's workspace of the current stream, re-taken
        # in forward() when the stream changes (_bind_workspace()).
        self._pool = None if workspace is not None else (workspace_pool if workspace_pool is not None else DEFAULT_POOL)
        self._ws_stream = None
        self.register_buffer("workspace", workspace, persistent=False)
        self._q_cache = None  # unpacked proxies for the torch backend
        self._fingerprint = None  # (weight versions, thresholds.layer_fingerprint), computed when asked for
        self._plan_pins: list = []  # plan-cache pins of plan()
        self._derived_from = self._weight_versions()
        self._after_move()
        self.register_load_state_dict_post_hook(SparseMLP._after_load)

    @classmethod
    def from_mlp(cls, mlp: nn.Module, act: Optional[str] = None, **kw) -> "SparseMLP":
        """A SparseMLP around a model's gated MLP (its Linear modules are taken over, not copied)."""
        if not is_gated_mlp(mlp):
            raise TypeError(f"prox: {type(mlp).__name__} is not a gated MLP with gate_proj/up_proj/down_proj "
                            "(bias-free nn.Linear or FP8 linears) and act_fn")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act or detect_act(mlp.act_fn), **kw)

    def extra_repr(self) -> str:
        tp = "" if self.tp is None else f", tp={self.tp.rank}/{self.tp.world_size} of d_ff={self.tp.d_ff}"
        f8 = "" if self.format == "native" else f", format={self.format}, dtype={self.act_dtype}"
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, act={self.act}, backend={self.backend}, "
                f"prefill={self.prefill}, batched={self.batched}, keep_down={self.keep_down}{f8}{tp}")

    @property
    def act_dtype(self) -> torch.dtype:
        """The activation dtype (x, y): the weights' for fp16/bf16 weights, the one given for FP8 projections."""
        return self._act_dtype if self._act_dtype is not None else self.gate_proj.weight.dtype

    @property
    def alpha(self) -> float:
        """The allocation's alpha for this layer's weight format (prox.allocation.alpha_for)."""
        return alpha_for(self.format)

    # ------------------------------------------------------------ derived state

    def _op_weights(self, w: torch.Tensor) -> bool:
        if self.format != "native":
            return w.is_cuda and self.act_dtype in _OP_DTYPES and _ops.available()
        return w.is_cuda and w.dtype in _OP_DTYPES and _ops.available()

    def _transpose(self, wd: torch.Tensor) -> torch.Tensor:
        """W_down^T [d_ff, d_model], contiguous (the op's transpose on CUDA, bit-identical to torch's)."""
        return _ops.transpose(wd.contiguous()) if self._op_weights(wd) else wd.t().contiguous()

    def _down_t_of(self, down: nn.Module) -> tuple:
        """(W_down^T, its FP8 scales or None) from a down projection module."""
        if self.format == "native":
            return self._transpose(down.weight.detach()), None
        info = fp8.linear_info(down, "down_proj")
        s = info.normalized(self.layout, name="down_proj's scales")
        fp8.check_scales(s, "down_proj's scales")
        return fp8.transpose_down(info.q, s, self.layout, name="down_proj")

    def _down_t_scale_from(self, raw: torch.Tensor) -> torch.Tensor:
        """W_down^T's scales from W_down's own (keep_down=False: the down_scale buffer)."""
        s = fp8.normalize_scales(raw, self.layout, self.d_model, self.d_ff, name="down_proj's scales")
        return s.t().contiguous() if self.layout == "block128" else s.contiguous()

    def _fp8_info(self, name: str):
        return fp8.linear_info(getattr(self, name), name)

    def _fp8_scales(self) -> tuple:
        """W_gate's and W_up's scales as the op reads them (None, None for fp16/bf16 weights), each checked."""
        if self.format == "native":
            return None, None
        out = []
        for name in ("gate_proj", "up_proj"):
            s = self._fp8_info(name).normalized(self.layout, name=f"{name}'s scales")
            fp8.check_scales(s, f"{name}'s scales")
            out.append(s)
        return tuple(out)

    def _pack(self):
        if self.format != "native":
            out = []
            for name in ("gate_proj", "up_proj"):
                info = self._fp8_info(name)
                out += fp8.pack_int4(info.q, info.normalized(self.layout, name=f"{name}'s scales"), self.layout,
                                     name=name)
            return tuple(out)
        pack = _ops.pack_int4 if (_ops.available() and self.gate_proj.weight.dtype in _OP_DTYPES) \
            else reference.pack_int4
        pg, sg = pack(self.gate_proj.weight.detach().contiguous())
        pu, su = pack(self.up_proj.weight.detach().contiguous())
        return pg, sg, pu, su

    def _weight_versions(self) -> tuple:
        """The version counters of the weights the derived state comes from (bumped by in-place writes; None
        for inference tensors, which have none); an FP8 MLP's scales included."""
        ws = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight if self.keep_down else self.down_t]
        if self.format != "native":
            ws += [getattr(self.gate_proj, self._scale_names[0]), getattr(self.up_proj, self._scale_names[1]),
                   getattr(self.down_proj, self._scale_names[2]) if self.keep_down else self.down_scale]
        return tuple(None if w.is_inference() else w._version for w in ws)

    def exact_weights(self, dtype=None) -> tuple:
        """(W_gate, W_up, W_down^T) as Stage 2 computes with them: the fp16/bf16 weights (converted to ``dtype``
        when given), or an FP8 layer's dequantized weights (prox.fp8.dequantize, float32 by default)."""
        if self.format == "native":
            ws = (self.gate_proj.weight, self.up_proj.weight, self.down_t)
            return ws if dtype is None else tuple(w.to(dtype) for w in ws)
        dtype = dtype or torch.float32
        return (fp8.dequantize(self.gate_proj.weight.detach(), self.w_gate_scale, self.layout, dtype),
                fp8.dequantize(self.up_proj.weight.detach(), self.w_up_scale, self.layout, dtype),
                fp8.dequantize(self.down_t, self.w_down_t_scale, self.layout, dtype, transposed=True))

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-derive the proxies (and W_down^T with keep_down=True) from the current weights. In place where
        the shape, dtype and device are unchanged, so plans and CUDA graphs captured before see the new
        values; not during capture (packing synchronizes). load_state_dict() calls it; call it after any
        other in-place change of the weights (a LoRA merge, a weight update through .data)."""
        pg, sg, pu, su = self._pack()
        fresh = {"proxy_gate": pg, "scale_gate": sg, "proxy_up": pu, "scale_up": su}
        if self.keep_down:
            fresh["down_t"], down_t_scale = self._down_t_of(self.down_proj)
            if down_t_scale is not None:
                fresh["w_down_t_scale"] = down_t_scale
        elif self.format != "native":
            fresh["w_down_t_scale"] = self._down_t_scale_from(self.down_scale)
            fp8.check_scales(fresh["w_down_t_scale"], "down_proj's scales")
        if self.format != "native":
            fresh["w_gate_scale"], fresh["w_up_scale"] = self._fp8_scales()
        for k, t in fresh.items():
            old = self._buffers[k]
            if old is not None and old.shape == t.shape and old.dtype == t.dtype and old.device == t.device and \
                    (torch.is_inference_mode_enabled() or not old.is_inference()):
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
            if self.format != "native":  # and its FP8 scales as they were given
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
        if self.format != "native":  # FP8 codes load as they are (a cast would change their meaning)
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
                if self.format != "native":
                    self._buffers["down_scale"] = sv
            else:
                self.down_t.copy_(v.t())
                if self.format != "native":
                    self.down_scale.copy_(sv)

    def fingerprint(self) -> dict:
        """The weights' fingerprint (prox.thresholds.layer_fingerprint), computed once per weight version. A
        tensor-parallel shard gives its full layer's (prox.distributed.fingerprints: collective)."""
        if self.tp is not None:
            from .distributed import fingerprints
            return fingerprints([self])[0]
        from .thresholds import layer_fingerprint
        v = self._weight_versions()
        if self._fingerprint is None or self._fingerprint[0] != v or self._fingerprint[2] != self.down_t.data_ptr():
            if self.format != "native":  # the dequantized weights (the codes and their scales)
                wg, wu, wdt = self.exact_weights(torch.float32)
                fp = layer_fingerprint(wg, wu, wdt.t())
                fp["dtype"] = str(fp8.E4M3).replace("torch.", "")
            else:
                wd = self.down_proj.weight if self.keep_down else self.down_t.t()
                fp = layer_fingerprint(self.gate_proj.weight.detach(), self.up_proj.weight.detach(), wd.detach())
            self._fingerprint = (v, fp, self.down_t.data_ptr())
        return self._fingerprint[1]

    def _after_move(self) -> None:
        """After construction, a move or a refresh: whether the op can run these weights, the tensors checked
        where the user is (the op checks them again on every call), and one warning when "auto" will run the
        torch reference on CUDA weights."""
        w = self.gate_proj.weight
        self._op_ok = self._op_weights(w) and (self.workspace is not None or self._pool is not None)
        if self._op_ok:
            _ops.check_layer(self.layer_tensors(), self.thresholds,
                             self.workspace if self._pool is None else None,
                             dtype=self.act_dtype if self.format != "native" else None)
            if self.workspace is None and not torch.cuda.is_current_stream_capturing():
                self._bind_workspace()
        elif self.backend == "auto" and w.is_cuda:
            reason = self._op_unavailable_reason(w)
            _warn_once(("reference", reason), f"prox: SparseMLP on {w.device} ({w.dtype}) runs the torch reference "
                       f"of Prox, not the CUDA op (about 9x slower): {reason}")

    def _op_unavailable_reason(self, w: torch.Tensor) -> str:
        if not _ops.available():
            return _ops.import_error() or "the extension is not loaded"
        if self.format != "native" and self.act_dtype not in _OP_DTYPES:
            return (f"the activation dtype is {self.act_dtype}; the FP8 op runs float16/bfloat16 activations "
                    "(SparseMLP(dtype=...), or model.to(dtype))")
        if self.format == "native" and w.dtype not in _OP_DTYPES:
            return (f"the weights are {w.dtype}; the op runs float16/bfloat16 weights (convert the model with "
                    ".half() or .to(torch.bfloat16); autocast does not convert weights)")
        if not w.is_cuda:
            return f"the weights are on {w.device}"
        return "no workspace"

    # ------------------------------------------------------------ state

    def _apply(self, fn, recurse=True):
        # model.half() / .to(torch.bfloat16) must not round the float32 scales and thresholds.
        keep = {k: self._buffers.pop(k) for k in _FLOAT32_BUFFERS}
        # The workspace is derived state, not a tensor to convert: fn(workspace) would copy a shared
        # workspace (uninitialized on a new device). A given one is kept while it is on the module's device,
        # dropped otherwise; the pool's is re-taken at the next call.
        ws = self._buffers.pop("workspace")
        dtype = self.gate_proj.weight.dtype
        if self.format != "native":  # FP8 weights keep their codes; the activation dtype follows a conversion
            act = fn(torch.empty(0, dtype=self._act_dtype)).dtype
            if act in (torch.float16, torch.bfloat16, torch.float32):
                self._act_dtype = act
            mods = (self.gate_proj, self.up_proj) + ((self.down_proj,) if self.keep_down else ())
            fn = _keep_fp8(fn, frozenset(id(getattr(m, n)) for m, n in zip(mods, self._scale_names)))
        super()._apply(fn, recurse)
        for k, t in keep.items():
            if t is None:
                self._buffers[k] = None
                continue
            moved = fn(t)
            self._buffers[k] = moved if moved.dtype == t.dtype else t.to(device=moved.device)
        device = self.down_t.device
        if self._pool is not None:
            ws = None
            self._ws_stream = None
        elif ws is not None and ws.device != device:
            ws = None
        self._buffers["workspace"] = ws
        self._q_cache = None
        self._fingerprint = None
        if self.gate_proj.weight.dtype != dtype and device.type != "meta":
            self.refresh()  # proxies of the weights as converted (a rounding can move a scale)
        else:
            self._derived_from = self._weight_versions()
            if device.type != "meta":
                self._after_move()
        return self

    def set_thresholds(self, tau_x: float, tau_s: float) -> None:
        """New thresholds, written into the device tensor every run reads (no re-plan, no re-capture)."""
        _ops.write_thresholds(self.thresholds, tau_x, tau_s)

    def get_thresholds(self) -> tuple[float, float]:
        t = self.thresholds.tolist()
        return float(t[0]), float(t[1])

    def plan(self) -> Optional[list[int]]:
        """Plan the op for the current tensors (outside graph capture; the first op call also plans): batch 1
        and, with batched=True, the batched plan of as many tokens as the workspace holds (what every batch
        runs). The plans stay pinned in the plan cache while this layer lives. Returns batch 1's policies."""
        if not (self.backend != "torch" and self._op_ok):
            if self.backend == "op":
                w = self.gate_proj.weight
                raise RuntimeError(f"prox: backend 'op' cannot run this layer ({w.dtype} weights on {w.device}): "
                                   f"{self._op_unavailable_reason(w)}")
            return None
        self._bind_workspace()
        self._unpin()
        layer, fmt = _ops.layer_args(self.layer_tensors())
        dt = self.act_dtype if self.format != "native" else None
        res = list(torch.ops.prox.plan_ffn(layer, fmt, self.thresholds, self.act_code, self._options, 1, True, dt))
        self._plan_pins.append(res[4])
        m = _ops.workspace_tokens(self.d_model, self.d_ff, self.workspace.numel())
        if self.batched and m >= 2:
            self._plan_pins.append(torch.ops.prox.plan_ffn(layer, fmt, self.thresholds, self.act_code, self._options,
                                                           m, True, dt)[4])
        return res[:4]

    def _unpin(self) -> None:
        for h in self._plan_pins:
            _ops.unpin_plan(h)
        self._plan_pins = []

    def __del__(self):
        try:
            self._unpin()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def reset_counters(self) -> None:
        if self.counters is not None:
            self.counters.zero_()

    def sparsity_report(self) -> dict:
        if self.counters is None:
            raise RuntimeError("prox: build the SparseMLP with track_sparsity=True to count")
        return counters_report(self.counters, self.d_model, self.d_ff)

    def memory_bytes(self) -> dict:
        """Bytes of what this layer adds to the dense MLP (proxies, scales, W_down^T), and of what it keeps."""
        nb = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        extra = {"proxies": nb(self.proxy_gate) + nb(self.proxy_up), "scales": nb(self.scale_gate) + nb(self.scale_up),
                 "w_down_t": nb(self.down_t) + nb(self.w_down_t_scale) if self.keep_down else 0}
        dense = nb(self.gate_proj.weight) + nb(self.up_proj.weight) + nb(self.down_t)
        if self.format != "native":  # the FP8 weights' scales (W_down's as W_down^T's)
            dense += nb(self.w_gate_scale) + nb(self.w_up_scale) + nb(self.w_down_t_scale)
        return {**extra, "extra_total": sum(extra.values()), "dense_mlp": dense}

    # ------------------------------------------------------------ forward

    def layer_tensors(self) -> LayerTensors:
        """The layer's tensors by name, as the op reads them (the ops' ``layer`` list is its ``tensors()``)."""
        return LayerTensors(w_gate=self.gate_proj.weight.detach(), w_up=self.up_proj.weight.detach(),
                            w_down_t=self.down_t, proxy_gate=self.proxy_gate, scale_gate=self.scale_gate,
                            proxy_up=self.proxy_up, scale_up=self.scale_up, w_gate_scale=self.w_gate_scale,
                            w_up_scale=self.w_up_scale, w_down_t_scale=self.w_down_t_scale, format=self.format)

    def backend_in_use(self) -> str:
        """"op" or "torch": what a decode step of this layer runs now (its weights' dtype and device)."""
        return "op" if self.backend != "torch" and self._op_ok else "torch"

    def _use_op(self, x: torch.Tensor) -> bool:
        """Whether x runs the op. x must match the weights' dtype and device where the op runs them (a
        mismatch is an error, as in nn.Linear, never a silent cast or a silent fallback)."""
        if self.backend == "torch":
            return False
        if self._op_ok:
            w = self.gate_proj.weight
            if x.dtype != self.act_dtype:
                if self.format != "native":
                    raise TypeError(f"prox: x is {x.dtype} but this FP8 layer runs {self.act_dtype} activations: "
                                    "run the model in one dtype (model.to(dtype) sets it, the FP8 weights stay)")
                raise TypeError(f"prox: x is {x.dtype} but this layer's weights are {w.dtype}: run the model in "
                                "one dtype (model.to(dtype)), or autocast to the weights' dtype")
            if x.device != w.device:
                raise ValueError(f"prox: x is on {x.device} but this layer's weights are on {w.device}")
            return True
        if self.backend == "op":
            w = self.gate_proj.weight
            raise RuntimeError(f"prox: backend 'op' cannot run this layer ({w.dtype} weights on {w.device}): "
                               f"{self._op_unavailable_reason(w)}")
        return False

    def _bind_workspace(self) -> None:
        """The pool's workspace of the current stream (eager calls; a compiled or captured call keeps the
        one bound when it was warmed up: capture cannot allocate)."""
        if self._pool is None or torch.compiler.is_compiling():
            return
        device = self.gate_proj.weight.device
        s = _raw_stream(device)
        if s != self._ws_stream and (self._buffers["workspace"] is None
                                     or not torch.cuda.is_current_stream_capturing()):
            self._buffers["workspace"] = self._pool.get(self.d_model, self.d_ff, device)
            self._ws_stream = s

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP on the same weights (prefill). FP8: with the dequantized weights in float32 (the dense
        FFN exactly as the checkpoint means it), returned in x's dtype."""
        if self.format != "native":
            wg, wu, wdt = self.exact_weights(torch.float32)
            xf = x.to(torch.float32)
            h = reference.activation(self.act)(F.linear(xf, wg)) * F.linear(xf, wu)
            return torch.matmul(h, wdt).to(x.dtype)
        h = reference.activation(self.act)(self.gate_proj(x)) * self.up_proj(x)
        if self.keep_down:
            return self.down_proj(h)
        return torch.matmul(h, self.down_t)

    def dense_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The dense FFN of one token through the layer's own fused Stage-2 kernel, every channel selected, no
        Stage 1 (torch.ops.prox.dense_ffn; its first call plans and allocates outside capture): prox's dense
        baseline in this layer's format (bench_decode's dense FP8 (b)). CUDA op only."""
        if not self._use_op(x):
            raise RuntimeError(f"prox: dense_kernel runs the CUDA op: {self._op_unavailable_reason(self.gate_proj.weight)}")
        layer, fmt = _ops.layer_args(self.layer_tensors())
        return torch.ops.prox.dense_ffn(x.reshape(-1, self.d_model), layer, fmt, self.thresholds, self.act_code,
                                        self._options).reshape(x.shape)

    def _q(self):
        if self._q_cache is None or self._q_cache[0].device != self.proxy_gate.device:
            self._q_cache = (reference.unpack_int4(self.proxy_gate), reference.unpack_int4(self.proxy_up))
        return self._q_cache

    def sparse_reference(self, x2: torch.Tensor) -> torch.Tensor:
        """Prox on every row of x2 [tokens, d_model] through the torch reference (fp32 math)."""
        qg, qu = self._q()
        tau_x, tau_s = self.thresholds[0], self.thresholds[1]
        wg, wu, wdt = self.exact_weights()
        y, _, mask, _ = reference.prox_ffn(x2, wg, wu, wdt, qg, self.scale_gate, qu, self.scale_up, tau_x, tau_s,
                                           self.act, return_all=True)
        c = self.counters
        if c is not None:  # {calls, kept inputs, selected channels, 0}, as the op counts
            c[0] += x2.shape[0]
            c[1] += reference.input_mask(x2, tau_x).sum()
            c[2] += mask.sum()
        return y

    def _batches(self, x2: torch.Tensor) -> bool:
        """Whether x2's tokens run as one batched op call: 2..MAX_TOKENS of them, batched=True, the op's path,
        and a workspace that holds them (the pool's hold MAX_TOKENS)."""
        n = x2.shape[0]
        if not (self.batched and 2 <= n <= _ops.MAX_TOKENS and self.backend != "torch" and self._op_ok
                and x2.is_cuda and x2.dtype == self.act_dtype and self._ws_sizes is not None):
            return False
        return self._pool is not None or self.workspace.numel() >= self._ws_sizes[n - 1]

    def sparse_op(self, x2: torch.Tensor) -> torch.Tensor:
        """Prox on every row of x2 [tokens, d_model] through the CUDA op: one call for one token or a batch
        (_batches()), else one call per token."""
        self._bind_workspace()
        layer, fmt = _ops.layer_args(self.layer_tensors())
        if x2.shape[0] == 1 or self._batches(x2):
            return torch.ops.prox.sparse_ffn(x2, layer, fmt, self.thresholds, self.workspace, self.act_code,
                                             self._options, False, False, False, self.counters)[0]
        rows = [torch.ops.prox.sparse_ffn(x2[t], layer, fmt, self.thresholds, self.workspace, self.act_code,
                                          self._options, False, False, False, self.counters)[0]
                for t in range(x2.shape[0])]
        return torch.stack(rows)

    def proxy_values(self, x2: torch.Tensor, tau_x: float) -> torch.Tensor:
        """Stage 1's s~ (float32 [tokens, d_ff]) under tau_x: the op's values mode, or the torch reference."""
        if self._use_op(x2):
            self._bind_workspace()
            saved = self.thresholds.clone()
            self.thresholds[0].fill_(float(tau_x))
            layer, fmt = _ops.layer_args(self.layer_tensors())
            s = torch.ops.prox.proxy_values(x2.contiguous(), layer, fmt, self.thresholds, self.workspace,
                                            self.act_code, self._options)
            self.thresholds.copy_(saved)
            return s
        qg, qu = self._q()
        return reference.proxy_values(x2, qg, self.scale_gate, qu, self.scale_up, tau_x, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_local(x)
        return y if self.tp is None else self.tp.all_reduce_(y)  # a shard's partial sum: the one all-reduce

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """forward() without the all-reduce: a shard's partial y (the whole y when not sharded)."""
        if not torch.compiler.is_compiling():
            self._check_fresh()
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)
        if x2.shape[0] > 1 and self.prefill == "dense" and not self._batches(x2):
            return self.dense(x)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = self.sparse_op(x2) if self._use_op(x2) else self.sparse_reference(x2)
        return y.reshape(shape)


def refresh(model: nn.Module) -> None:
    """SparseMLP.refresh() on every SparseMLP of the model (after changing its weights in place)."""
    for _, m in sparse_mlps(model):
        m.refresh()


def memory_report(model: nn.Module) -> dict:
    """Extra memory of the model's SparseMLPs: bytes of proxies, scales and W_down^T copies, the workspaces
    (given ones and those of the layers' pools, each counted once), and the dense MLP weights for scale."""
    tot = {"proxies": 0, "scales": 0, "w_down_t": 0, "dense_mlp": 0, "layers": 0}
    ws, pools = {}, {}
    for _, m in find_mlps(model):
        if isinstance(m, SparseMLP):
            r = m.memory_bytes()
            for k in ("proxies", "scales", "w_down_t", "dense_mlp"):
                tot[k] += r[k]
            tot["layers"] += 1
            if m._pool is not None:
                pools[id(m._pool)] = m._pool
            elif m.workspace is not None:
                ws[m.workspace.data_ptr()] = m.workspace.numel()
    tot["workspaces"] = sum(ws.values()) + sum(p.nbytes() for p in pools.values())
    tot["extra_total"] = tot["proxies"] + tot["scales"] + tot["w_down_t"] + tot["workspaces"]
    tot["extra_fraction_of_mlp"] = tot["extra_total"] / tot["dense_mlp"] if tot["dense_mlp"] else 0.0
    return tot


def _model_pool(model: nn.Module) -> WorkspacePool:
    """The model's own pool: the one its SparseMLPs already use, else a new one."""
    pool = workspace_pool(model)
    return pool if pool is not None else WorkspacePool()


def workspace_pool(model: nn.Module) -> Optional[WorkspacePool]:
    """The WorkspacePool of the model's SparseMLPs (the first one's; None where none uses a pool)."""
    for _, m in sparse_mlps(model):
        if m._pool is not None:
            return m._pool
    return None


def sparse_mlps(model: nn.Module) -> Iterator[tuple[str, SparseMLP]]:
    for n, m in model.named_modules():
        if isinstance(m, SparseMLP):
            yield n, m


def set_mode(model: nn.Module, *, prefill: Optional[str] = None, backend: Optional[str] = None,
             batched: Optional[bool] = None) -> None:
    """Set every SparseMLP's prefill mode, backend and/or batched flag."""
    for _, m in sparse_mlps(model):
        if batched is not None:
            m.batched = bool(batched)
        if prefill is not None:
            if prefill not in ("dense", "sparse"):
                raise ValueError(f"prox: prefill must be 'dense' or 'sparse', got {prefill!r}")
            m.prefill = prefill
        if backend is not None:
            if backend not in ("auto", "op", "torch"):
                raise ValueError(f"prox: backend must be 'auto', 'op' or 'torch', got {backend!r}")
            m.backend = backend


def swap_mlps(model: nn.Module, **kw) -> list[str]:
    """Replace every gated MLP by a SparseMLP (thresholds 0: every input and channel kept). Returns the names.
    The new layers share one WorkspacePool of their own (the model's: not shared with other models) unless
    ``workspace`` or ``workspace_pool`` is given."""
    if kw.get("workspace") is None and kw.get("workspace_pool") is None:
        kw["workspace_pool"] = _model_pool(model)
    names = []
    act = activation_dtype(model)
    for name, m in find_mlps(model):
        if not isinstance(m, SparseMLP):
            _set_submodule(model, name, SparseMLP.from_mlp(m, **mlp_kwargs(m, kw, act)))
            names.append(name)
    return names


def mlp_kwargs(mlp: nn.Module, kw: dict, act: torch.dtype) -> dict:
    """SparseMLP's arguments for one of a model's MLPs: an FP8 MLP takes the model's activation dtype (``act``)
    unless ``kw`` gives one; another MLP takes no dtype."""
    if is_fp8_mlp(mlp):
        return kw if kw.get("dtype") is not None else {**kw, "dtype": act}
    return {k: v for k, v in kw.items() if k != "dtype"}


def restore_mlps(model: nn.Module, mlp_factory=None, *, originals: Optional[dict] = None) -> None:
    """Put dense MLPs back. A SparseMLP whose name is in ``originals`` ({name: module}, e.g. find_mlps()'s
    modules kept from before the swap) gets that module back as it was; any other needs keep_down=True (so
    W_down is still there) and becomes a module with gate_proj, up_proj, down_proj and act_fn
    (mlp_factory(sparse) -> module, or a generic one)."""
    for name, m in list(sparse_mlps(model)):
        if originals is not None and name in originals:
            new = originals[name]
        elif m.tp is not None:  # a shard: a dense module of it would miss the all-reduce
            raise RuntimeError(f"prox: {name} is a tensor-parallel shard: restore it from originals=")
        elif not m.keep_down:
            raise RuntimeError(f"prox: {name} dropped W_down (keep_down=False): cannot restore the dense MLP")
        else:
            new = mlp_factory(m) if mlp_factory else DenseMLP(m.gate_proj, m.up_proj, m.down_proj, m.act)
        _set_submodule(model, name, new)


class DenseMLP(nn.Module):
    """A plain gated MLP (what restore_mlps() puts back when no factory is given)."""

    def __init__(self, gate_proj, up_proj, down_proj, act: str = "silu"):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act = act
        self.act_fn = reference.activation(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
