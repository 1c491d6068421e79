# SPDX-License-Identifier: Apache-2.0
"""SparseMLP (``prox.SparseMLP``, ``prox.nn.SparseMLP``), a drop-in replacement for gated MLPs with gate_proj /
up_proj / down_proj (Llama, Qwen2/Qwen3, Mistral: SwiGLU; Gemma: GeGLU with tanh-GELU).

A decode step (one token) runs Prox: the CUDA op on fp16/bf16 activations on CUDA, or the torch reference of the
method elsewhere. A decode batch (x [..., 1, d_model]: one new token for each of several sequences) runs Prox on
every row: on the op's path in batched calls of at most the workspace's capacity (8 tokens for a pool's
workspace), each token what batch 1 gives it within rounding; 2 to 8 tokens of other shapes on the op's path (a
speculative verification) run as one batched call (``batched=True``, the default). Other multi-token calls
(prefill) run the dense MLP on the same weights (``prefill="dense"``, what a server does: the format's prefill,
prox.formats), or Prox on every token, one op call each (``prefill="sparse"``: how the paper scores perplexity,
and how calibration runs the layers it has finalized).

Memory: the INT4 proxies of W_gate and W_up (d_model d_ff / 2 bytes each, + d_ff float32 scales) and
W_down^T ([d_ff, d_model], the layout the sparse down GEMV reads). W_down itself is dropped unless
``keep_down=True``: the dense path computes h @ W_down^T from the transposed copy (cuBLAS reads it as a
transposed operand, no copy), so the only extra memory is the proxies (prox.nn.memory_report()).

What differs between weight formats (fp16/bf16, FP8 per channel or in 128 x 128 blocks) is asked of the layer's
format (``fmt``, prox.formats): recognizing the projections, the derived state, dequantization, the prefill.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _ops, formats, layer_ops, reference
from ._ops import PlanOptions
from .formats import OP_DTYPES
from .mlp_weights import MlpWeights
from .planned import sparsity_report as counters_report
from .workspace import DEFAULT_POOL, WorkspacePool, raw_stream

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


_WARNED: set = set()


def _warn_once(key, msg: str) -> None:
    """One RuntimeWarning per process and key (a slow path is worth one line, not one per layer)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def is_decode_batch(x: torch.Tensor) -> bool:
    """Whether x [..., tokens, d_model] is one new token for each of several sequences (a decode step's batch)."""
    return x.dim() >= 3 and x.shape[-2] == 1 and x.numel() > x.shape[-1]


def check_run_options(backend: str, prefill: str, options: PlanOptions) -> None:
    """SparseMLP's backend, prefill and options as it takes them (sparsify checks them before its dense pass)."""
    if backend not in ("auto", "op", "torch"):
        raise ValueError(f"prox: backend must be 'auto', 'op' or 'torch', got {backend!r}")
    if prefill not in ("dense", "sparse"):
        raise ValueError(f"prox: prefill must be 'dense' or 'sparse', got {prefill!r}")
    if not isinstance(options, PlanOptions):
        raise TypeError(f"prox: options must be a prox.PlanOptions, got {type(options).__name__}")


class SparseMLP(MlpWeights):
    """Prox for one gated MLP: an MlpWeights (the weights and their derived state, prox.mlp_weights) that runs.

    Args:
        gate_proj, up_proj: the linear modules (kept, and shared with the dense path): nn.Linear, or an FP8
            linear (prox.fp8.linear_info). Bias-free: a bias is refused (Prox computes u * act(g) W_down without one).
        down_proj: the down projection (bias-free); its weight is transposed into ``down_t`` and dropped unless
            keep_down=True.
        act: "silu" or "gelu_tanh".
        backend: "op" (CUDA op), "torch" (reference implementation, any device) or "auto" (the op for
            fp16/bf16 activations on CUDA when the extension is loaded, else torch; it warns once which path runs
            when the reference runs, and why).
        prefill: "dense" or "sparse" (what several tokens at once run when they do not run as a batch).
        tau_x, tau_s: thresholds; they live in the device tensor ``thresholds`` (set_thresholds()).
        options: the op's PlanOptions.
        workspace: the op's workspace, used as given for every call (one per stream that may run at the
            same time as another: prox.new_workspace()). Default: the workspace of ``workspace_pool`` for
            the current stream, sized for 8 tokens. A batch runs in calls of as many tokens as it holds.
        workspace_pool: a WorkspacePool (default: prox.nn.DEFAULT_POOL; swap_mlps() and sparsify() give each
            model its own).
        track_sparsity: accumulate runtime sparsity counters (sparsity_report(); a batch counts each token).
        batched: batches on the op's path (a decode batch of any size, or 2..8 tokens) run as batched op calls,
            whatever ``prefill`` says; False: they follow ``prefill``, as more tokens do.
        dtype: the activation dtype where the weights do not give it (FP8 projections): torch.float16 or
            torch.bfloat16 run the FP8 op, torch.float32 the torch reference; default torch.bfloat16 (the FP8
            checkpoints' models; swap_mlps() and sparsify() pass the model's). For fp16/bf16 weights, None or
            their dtype. model.half() / .to(dtype) changes it and keeps the FP8 weights as they are.
        prefill_gemm: the dense path's GEMMs: "auto" (the format's fastest: FP8 weights through torch._scaled_mm
            where torch takes their scale layout, the activations quantized per token or 1 x 128 group, as the FP8
            checkpoints' dynamic activation scheme) or "dequantized" (the weights as Stage 2 computes with them,
            one matrix at a time in the activation dtype). The same for fp16/bf16 weights.

    State: the proxies and W_down^T are derived from the weights (by the format). load_state_dict() re-derives
    them; after changing the weights in place otherwise, call refresh() (a call on weights changed since raises).
    The state dict is the dense MLP's ({gate,up,down}_proj.weight, and an FP8 MLP's scales), W_down included with
    keep_down=False.

    FP8 projections (prox.fp8.linear_info: torch.float8_e4m3fn weights with float32 ``weight_scale_inv`` or
    ``weight_scale``, per channel, per tensor or 128 x 128 blocks) make the layer's ``format`` "fp8_channel" or
    "fp8_block128": W_down^T and its scales by prox.fp8.transpose_down, the proxies packed from the dequantized
    weights, the op's FP8 Stage 2; the torch reference computes with the dequantized weights in float32.

    Tensor parallelism: prox.distributed (shard_mlp(s), sparse_mlp_from_shards) builds a SparseMLP on this rank's
    shard and gives it a ``tp`` (its TPState); forward() then all-reduces y once.
    """

    FLOAT32_BUFFERS = MlpWeights.FLOAT32_BUFFERS + ("thresholds",)
    RUNTIME_BUFFERS = ("workspace",)

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act: str = "silu", *,
                 backend: str = "auto", prefill: str = "dense", keep_down: bool = False, tau_x: float = 0.0,
                 tau_s: float = 0.0, options: PlanOptions = PlanOptions(), workspace: Optional[torch.Tensor] = None,
                 workspace_pool: Optional[WorkspacePool] = None, track_sparsity: bool = False,
                 batched: bool = True, dtype: Optional[torch.dtype] = None, prefill_gemm: str = "auto"):
        check_run_options(backend, prefill, options)
        _ops.act_code(act)
        super().__init__(gate_proj, up_proj, down_proj, act, keep_down=keep_down, dtype=dtype,
                         prefill_gemm=prefill_gemm)
        self.tp = None  # a shard's TPState (prox.distributed sets it)
        self.backend = backend
        self.prefill = prefill
        self.batched = bool(batched)
        # Workspace bytes for 1..MAX_TOKENS tokens (a plain tuple: torch.compile traces it).
        self._ws_sizes = _ops._workspace_sizes(self.d_model, self.d_ff) if _ops.available() else None
        if workspace is not None and _ops.available():
            _ops.check_workspace(workspace, need=self._ws_sizes[0],
                                 what=f"workspace (prox.workspace_bytes({self.d_model}, {self.d_ff}))")
        self.options = options
        self._options = options.encode()
        self.act_code = _ops.act_code(act)
        device = gate_proj.weight.device
        self.register_buffer("thresholds", torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32,
                                                        device=device), persistent=False)
        self.register_buffer("counters", torch.zeros(4, dtype=torch.int64, device=device) if track_sparsity
                             else None, persistent=False)
        # A given workspace is used as given; otherwise the pool's workspace of the current stream, re-taken
        # in forward() when the stream changes (_bind_workspace()).
        self._pool = None if workspace is not None else (workspace_pool if workspace_pool is not None else DEFAULT_POOL)
        self._ws_stream = None
        self.register_buffer("workspace", workspace, persistent=False)
        self._plan_pins: list = []  # plan-cache pins of plan()
        self._after_move()

    @classmethod
    def from_mlp(cls, mlp: nn.Module, act: Optional[str] = None, **kw) -> "SparseMLP":
        """A SparseMLP around a model's gated MLP (its linear modules are taken over, not copied)."""
        if not formats.is_gated_mlp(mlp):
            raise TypeError(f"prox: {type(mlp).__name__} is not a gated MLP with gate_proj/up_proj/down_proj "
                            "(bias-free nn.Linear or FP8 linears) and act_fn")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act or detect_act(mlp.act_fn), **kw)

    def extra_repr(self) -> str:
        tp = "" if self.tp is None else f", tp={self.tp.rank}/{self.tp.world_size} of d_ff={self.tp.d_ff}"
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, act={self.act}, backend={self.backend}, "
                f"prefill={self.prefill}, batched={self.batched}, keep_down={self.keep_down}, format={self.format}, "
                f"dtype={self.act_dtype}{tp}")

    @property
    def d_ff_full(self) -> int:
        """The full layer's d_ff (d_ff times the TP degree for a shard): what a thresholds file records."""
        return self.d_ff if self.tp is None else self.tp.d_ff

    # ------------------------------------------------------------ the op's readiness, thresholds, counters

    def fingerprint(self) -> dict:
        """The weights' fingerprint (prox.thresholds.layer_fingerprint), computed once per weight version. A
        tensor-parallel shard gives its full layer's (its TPState's: a collective)."""
        return self.local_fingerprint() if self.tp is None else self.tp.fingerprint(self)

    def _after_move(self) -> None:
        """After construction, a move or a refresh: whether the op can run these weights, the tensors checked
        where the user is (the op checks them again on every call), and one warning, the first time "auto" runs
        the torch reference for a reason, of which path runs and why."""
        w = self.gate_proj.weight
        self._op_ok = self._op_weights(w) and (self.workspace is not None or self._pool is not None)
        if self._op_ok:
            _ops.check_layer(self.layer_tensors(), self.thresholds, self.workspace if self._pool is None else None,
                             dtype=self.act_dtype)
            if self.workspace is None and not torch.cuda.is_current_stream_capturing():
                self._bind_workspace()
        elif self.backend == "auto" and w.device.type != "meta":
            reason = self._op_unavailable_reason(w)
            speed = "about 9x slower than the op" if w.is_cuda else "slower than the dense MLP on the CPU"
            _warn_once(("reference", reason), f"prox: SparseMLP on {w.device} ({self.format} weights, "
                       f"{self.act_dtype} activations) runs the torch reference of Prox, not the CUDA op ({speed}): "
                       f"{reason}")

    def _op_weights(self, w: torch.Tensor) -> bool:
        return w.is_cuda and self.act_dtype in OP_DTYPES and _ops.available()

    def _op_unavailable_reason(self, w: torch.Tensor) -> str:
        if not _ops.available():
            return _ops.import_error() or "the extension is not loaded"
        if not w.is_cuda:
            return f"the weights are on {w.device}"
        if self.act_dtype not in OP_DTYPES:
            return (f"the activation dtype is {self.act_dtype}; the op runs float16/bfloat16 activations "
                    f"({self.fmt.dtype_hint()})")
        return "no workspace"

    def _restore_runtime(self, runtime: dict, device: torch.device) -> None:
        # The workspace is derived state, not a tensor to convert: fn(workspace) would copy a shared workspace
        # (uninitialized on a new device). A given one is kept while it is on the module's device, dropped
        # otherwise; the pool's is re-taken at the next call.
        ws = runtime["workspace"]
        if self._pool is not None:
            ws = None
            self._ws_stream = None
        elif ws is not None and ws.device != device:
            ws = None
        self._buffers["workspace"] = ws

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
        layer_ops.unpin(self._plan_pins)
        return layer_ops.plan(self.layer_tensors(), self.thresholds, self.act_code, self._options, self.act_dtype,
                              self.capacity() if self.batched else 1, self._plan_pins)

    def __del__(self):
        try:
            layer_ops.unpin(self._plan_pins)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def reset_counters(self) -> None:
        if self.counters is not None:
            self.counters.zero_()

    def sparsity_report(self) -> dict:
        if self.counters is None:
            raise RuntimeError("prox: build the SparseMLP with track_sparsity=True to count")
        return counters_report(self.counters, self.d_model, self.d_ff, self.alpha)

    # ------------------------------------------------------------ forward

    def backend_in_use(self) -> str:
        """"op" or "torch": what a decode step of this layer runs now (its weights' dtype and device)."""
        return "op" if self.backend != "torch" and self._op_ok else "torch"

    def capacity(self) -> int:
        """The most tokens one op call of this layer takes: what its workspace holds (a pool's: MAX_TOKENS); 0 off
        the op's path."""
        if not (self.backend != "torch" and self._op_ok and self._ws_sizes is not None):
            return 0
        if self._pool is not None:
            return _ops.MAX_TOKENS
        return sum(1 for b in self._ws_sizes if b <= self.workspace.numel())

    def _use_op(self, x: torch.Tensor) -> bool:
        """Whether x runs the op. x must match the activation dtype and the weights' device where the op runs
        them (a mismatch is an error, as in nn.Linear, never a silent cast or a silent fallback)."""
        if self.backend == "torch":
            return False
        if self._op_ok:
            w = self.gate_proj.weight
            if x.dtype != self.act_dtype:
                if self.fmt.weights_set_dtype:
                    raise TypeError(f"prox: x is {x.dtype} but this layer's weights are {w.dtype}: run the model in "
                                    "one dtype (model.to(dtype)), or autocast to the weights' dtype")
                raise TypeError(f"prox: x is {x.dtype} but this {self.format} layer runs {self.act_dtype} "
                                f"activations: run the model in one dtype ({self.fmt.dtype_hint()})")
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
        s = raw_stream(device)
        if s != self._ws_stream and (self._buffers["workspace"] is None
                                     or not torch.cuda.is_current_stream_capturing()):
            self._buffers["workspace"] = self._pool.get(self.d_model, self.d_ff, device)
            self._ws_stream = s

    def dense_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The dense FFN of one token through the layer's own fused Stage-2 kernel, every channel selected, no
        Stage 1 (torch.ops.prox.dense_ffn; its first call plans and allocates outside capture): prox's dense
        baseline in this layer's format (bench_decode's dense FP8 (b)). CUDA op only."""
        if not self._use_op(x):
            raise RuntimeError(f"prox: dense_kernel runs the CUDA op: {self._op_unavailable_reason(self.gate_proj.weight)}")
        layer, fmt = _ops.layer_args(self.layer_tensors())
        return torch.ops.prox.dense_ffn(x.reshape(-1, self.d_model), layer, fmt, self.thresholds, self.act_code,
                                        self._options).reshape(x.shape)

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

    def sparse_op(self, x2: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """Prox on every row of x2 [tokens, d_model] through the CUDA op, in calls of at most ``rows`` tokens
        (at most capacity(); 1: each token as batch 1)."""
        self._bind_workspace()
        return layer_ops.sparse_rows(x2, self.layer_tensors(), self.thresholds, self.workspace, self.act_code,
                                     self._options, self.counters, rows)

    def proxy_values(self, x2: torch.Tensor, tau_x: float) -> torch.Tensor:
        """Stage 1's s~ (float32 [tokens, d_ff]) under tau_x: the op's values mode, or the torch reference."""
        if self._use_op(x2):
            self._bind_workspace()
            return layer_ops.proxy_values(x2.contiguous(), self.layer_tensors(), self.thresholds, self.workspace,
                                          self.act_code, self._options, tau_x)
        qg, qu = self._q()
        return reference.proxy_values(x2, qg, self.scale_gate, qu, self.scale_up, tau_x, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_local(x)
        return y if self.tp is None else self.tp.all_reduce_(y)  # a shard's partial sum: the one all-reduce

    def _batch_rows(self, x: torch.Tensor, n: int) -> int:
        """How many of x's n rows one op call takes when they run as a batch (0: they do not): with batched=True,
        a decode batch (any size, in calls of the capacity) or 2..capacity tokens of any shape."""
        cap = self.capacity()
        if not (self.batched and n >= 2 and cap >= 1 and (n <= cap or is_decode_batch(x))):
            return 0
        return cap

    def forward_local(self, x: torch.Tensor) -> torch.Tensor:
        """forward() without the all-reduce: a shard's partial y (the whole y when not sharded)."""
        if not torch.compiler.is_compiling():
            self._check_fresh()
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)
        n = x2.shape[0]
        rows = self._batch_rows(x, n)
        if n > 1 and not rows and self.prefill == "dense" and not (self.batched and is_decode_batch(x)):
            return self.dense(x)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = self.sparse_op(x2, max(rows, 1)) if self._use_op(x2) else self.sparse_reference(x2)
        return y.reshape(shape)
