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
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _ops, reference
from ._ops import PlanOptions
from .planned import sparsity_report as counters_report

#: Buffers that stay float32 whatever dtype the module is converted to (model.half(), .to(bf16)).
_FLOAT32_BUFFERS = ("scale_gate", "scale_up", "thresholds")


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


def is_gated_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear) and getattr(m, n).bias is None
               for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(m, "act_fn")


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every gated MLP or SparseMLP in the model, in registration (depth) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMLP) or is_gated_mlp(m)]


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


_SHARED_WORKSPACES: dict = {}


def shared_workspace(d_model: int, d_ff: int, device: torch.device) -> torch.Tensor:
    """One initialized workspace per (device, d_model, d_ff), sized for batches of MAX_TOKENS tokens: prox lets
    every layer of a shape running on one stream share it, whatever each call's token count."""
    key = (str(device), d_model, d_ff)
    ws = _SHARED_WORKSPACES.get(key)
    if ws is None:
        ws = _SHARED_WORKSPACES[key] = _ops.new_workspace(d_model, d_ff, device, max_tokens=_ops.MAX_TOKENS)
    return ws


class SparseMLP(nn.Module):
    """Prox for one gated MLP.

    Args:
        gate_proj, up_proj: the nn.Linear modules (kept, and shared with the dense path).
        down_proj: the down projection's nn.Linear; its weight is transposed into ``down_t`` and dropped
            unless keep_down=True.
        act: "silu" or "gelu_tanh".
        backend: "op" (CUDA op), "torch" (reference implementation, any device) or "auto" (the op for
            fp16/bf16 CUDA tensors when the extension is loaded, else torch).
        prefill: "dense" or "sparse" (what several tokens at once run when they do not run as one batch).
        tau_x, tau_s: thresholds; they live in the device tensor ``thresholds`` (set_thresholds()).
        options: the op's PlanOptions.
        workspace: the op's workspace; default: the one shared by the layers of this shape on the device,
            sized for 8 tokens. A given one serves the batches it holds (prox.workspace_tokens()).
        track_sparsity: accumulate runtime sparsity counters (sparsity_report(); a batch counts each token).
        batched: 2..8 tokens on the op's path run as one batched op call, whatever ``prefill`` says; False:
            they follow ``prefill``, as more tokens do.
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act: str = "silu", *,
                 backend: str = "auto", prefill: str = "dense", keep_down: bool = False, tau_x: float = 0.0,
                 tau_s: float = 0.0, options: PlanOptions = PlanOptions(), workspace: Optional[torch.Tensor] = None,
                 track_sparsity: bool = False, batched: bool = True):
        super().__init__()
        if backend not in ("auto", "op", "torch"):
            raise ValueError(f"prox: backend must be 'auto', 'op' or 'torch', got {backend!r}")
        if prefill not in ("dense", "sparse"):
            raise ValueError(f"prox: prefill must be 'dense' or 'sparse', got {prefill!r}")
        _ops.act_code(act)
        w = gate_proj.weight
        self.d_ff, self.d_model = (int(v) for v in w.shape)
        if self.d_model % 8 or self.d_ff % 32:
            raise ValueError(f"prox: d_model must be a multiple of 8 and d_ff of 32, got ({self.d_model}, {self.d_ff})")
        if tuple(up_proj.weight.shape) != (self.d_ff, self.d_model) or \
                tuple(down_proj.weight.shape) != (self.d_model, self.d_ff):
            raise ValueError("prox: gate_proj, up_proj, down_proj shapes do not form a gated MLP")
        self.act = act
        self.backend = backend
        self.prefill = prefill
        self.batched = bool(batched)
        # Workspace bytes for 1..MAX_TOKENS tokens, read by forward() (a plain tuple: torch.compile traces it).
        self._ws_sizes = _ops._workspace_sizes(self.d_model, self.d_ff) if _ops.available() else None
        self.options = options
        self._options = options.encode()
        self.act_code = _ops.act_code(act)
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        with torch.no_grad():
            wd = down_proj.weight.detach()
            use_op = wd.is_cuda and _ops.available() and wd.dtype in (torch.float16, torch.bfloat16)
            down_t = _ops.transpose(wd.contiguous()) if use_op else wd.t().contiguous()
            pack = _ops.pack_int4 if (_ops.available() and w.dtype in (torch.float16, torch.bfloat16)) \
                else reference.pack_int4
            pg, sg = pack(gate_proj.weight.detach().contiguous())
            pu, su = pack(up_proj.weight.detach().contiguous())
        self.keep_down = keep_down
        self.down_proj = down_proj if keep_down else None
        self.register_buffer("down_t", down_t, persistent=False)
        self.register_buffer("proxy_gate", pg, persistent=False)
        self.register_buffer("scale_gate", sg, persistent=False)
        self.register_buffer("proxy_up", pu, persistent=False)
        self.register_buffer("scale_up", su, persistent=False)
        self.register_buffer("thresholds", torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32,
                                                        device=w.device), persistent=False)
        self.register_buffer("counters", torch.zeros(4, dtype=torch.int64, device=w.device) if track_sparsity
                             else None, persistent=False)
        if workspace is None and use_op:
            workspace = shared_workspace(self.d_model, self.d_ff, w.device)
        self.register_buffer("workspace", workspace, persistent=False)
        self._q_cache = None  # unpacked proxies for the torch backend

    @classmethod
    def from_mlp(cls, mlp: nn.Module, act: Optional[str] = None, **kw) -> "SparseMLP":
        """A SparseMLP around a model's gated MLP (its Linear modules are taken over, not copied)."""
        if not is_gated_mlp(mlp):
            raise TypeError(f"prox: {type(mlp).__name__} is not a gated MLP with gate_proj/up_proj/down_proj "
                            "(bias-free nn.Linear) and act_fn")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act or detect_act(mlp.act_fn), **kw)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, act={self.act}, backend={self.backend}, "
                f"prefill={self.prefill}, batched={self.batched}, keep_down={self.keep_down}")

    # ------------------------------------------------------------ state

    def _apply(self, fn, recurse=True):
        # model.half() / .to(torch.bfloat16) must not round the float32 scales and thresholds.
        keep = {k: self._buffers.pop(k) for k in _FLOAT32_BUFFERS}
        # The workspace is derived state, not a tensor to convert: fn(workspace) would give every layer its
        # own copy of a shared workspace (uninitialized on a new device), and a module built on the CPU has
        # none. After the move the layer keeps a workspace already on its device (a dtype change), else takes
        # the shared one of its shape there (initialized once), or none off CUDA.
        ws = self._buffers.pop("workspace")
        super()._apply(fn, recurse)
        for k, t in keep.items():
            moved = fn(t)
            self._buffers[k] = moved if moved.dtype == t.dtype else t.to(device=moved.device)
        device = self.down_t.device
        if ws is None or ws.device != device:
            ws = shared_workspace(self.d_model, self.d_ff, device) \
                if device.type == "cuda" and _ops.available() else None
        self._buffers["workspace"] = ws
        self._q_cache = None
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
        runs). Returns batch 1's policies."""
        if not self._use_op(self.gate_proj.weight):
            return None
        policies = list(torch.ops.prox.plan_ffn(*self._tensors(), self.act_code, self._options))
        m = _ops.workspace_tokens(self.d_model, self.d_ff, self.workspace.numel()) if self.workspace is not None else 0
        if self.batched and m >= 2:
            torch.ops.prox.plan_ffn(*self._tensors(), self.act_code, self._options, m)
        return policies

    def reset_counters(self) -> None:
        if self.counters is not None:
            self.counters.zero_()

    def sparsity_report(self) -> dict:
        if self.counters is None:
            raise RuntimeError("prox: build the SparseMLP with track_sparsity=True to count")
        return counters_report(self.counters, self.d_model, self.d_ff)

    def memory_bytes(self) -> dict:
        """Bytes of what this layer adds to the dense MLP (proxies, scales, W_down^T), and of what it keeps."""
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        extra = {"proxies": nb(self.proxy_gate) + nb(self.proxy_up), "scales": nb(self.scale_gate) + nb(self.scale_up),
                 "w_down_t": nb(self.down_t) if self.keep_down else 0}
        dense = nb(self.gate_proj.weight) + nb(self.up_proj.weight) + nb(self.down_t)
        return {**extra, "extra_total": sum(extra.values()), "dense_mlp": dense}

    # ------------------------------------------------------------ forward

    def _tensors(self):
        return (self.gate_proj.weight.detach(), self.up_proj.weight.detach(), self.down_t, self.proxy_gate,
                self.scale_gate, self.proxy_up, self.scale_up, self.thresholds)

    def _use_op(self, x: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        ok = x.is_cuda and _ops.available() and x.dtype in (torch.float16, torch.bfloat16)
        if self.backend == "op" and not ok:
            raise RuntimeError(f"prox: backend 'op' needs fp16/bf16 CUDA tensors and the extension "
                               f"(x is {x.dtype} on {x.device}, extension loaded: {_ops.available()})")
        return ok

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP on the same weights (prefill)."""
        h = reference.activation(self.act)(self.gate_proj(x)) * self.up_proj(x)
        if self.keep_down:
            return self.down_proj(h)
        return torch.matmul(h, self.down_t)

    def _q(self):
        if self._q_cache is None or self._q_cache[0].device != self.proxy_gate.device:
            self._q_cache = (reference.unpack_int4(self.proxy_gate), reference.unpack_int4(self.proxy_up))
        return self._q_cache

    def sparse_reference(self, x2: torch.Tensor) -> torch.Tensor:
        """Prox on every row of x2 [tokens, d_model] through the torch reference (fp32 math)."""
        qg, qu = self._q()
        tau_x, tau_s = self.thresholds[0], self.thresholds[1]
        y, _, mask, _ = reference.prox_ffn(x2, self.gate_proj.weight, self.up_proj.weight, self.down_t, qg,
                                           self.scale_gate, qu, self.scale_up, tau_x, tau_s, self.act,
                                           return_all=True)
        c = self.counters
        if c is not None:  # {calls, kept inputs, selected channels, 0}, as the op counts
            c[0] += x2.shape[0]
            c[1] += reference.input_mask(x2, tau_x).sum()
            c[2] += mask.sum()
        return y

    def _batches(self, x2: torch.Tensor) -> bool:
        """Whether x2's tokens run as one batched op call: 2..MAX_TOKENS of them, batched=True, the op's path,
        and a workspace that holds them."""
        n = x2.shape[0]
        return (self.batched and 2 <= n <= _ops.MAX_TOKENS and self.backend != "torch" and x2.is_cuda
                and x2.dtype in (torch.float16, torch.bfloat16) and self.workspace is not None
                and self._ws_sizes is not None and self.workspace.numel() >= self._ws_sizes[n - 1])

    def sparse_op(self, x2: torch.Tensor) -> torch.Tensor:
        """Prox on every row of x2 [tokens, d_model] through the CUDA op: one call for one token or a batch
        (_batches()), else one call per token."""
        tensors = self._tensors()
        if x2.shape[0] == 1 or self._batches(x2):
            return torch.ops.prox.sparse_ffn(x2, *tensors, self.workspace, self.act_code, self._options,
                                             False, False, False, self.counters)[0]
        rows = [torch.ops.prox.sparse_ffn(x2[t], *tensors, self.workspace, self.act_code, self._options,
                                          False, False, False, self.counters)[0] for t in range(x2.shape[0])]
        return torch.stack(rows)

    def proxy_values(self, x2: torch.Tensor, tau_x: float) -> torch.Tensor:
        """Stage 1's s~ (float32 [tokens, d_ff]) under tau_x: the op's values mode, or the torch reference."""
        if self._use_op(x2):
            saved = self.thresholds.clone()
            self.thresholds[0].fill_(float(tau_x))
            s = torch.ops.prox.proxy_values(x2.contiguous(), *self._tensors(), self.workspace, self.act_code,
                                            self._options)
            self.thresholds.copy_(saved)
            return s
        qg, qu = self._q()
        return reference.proxy_values(x2, qg, self.scale_gate, qu, self.scale_up, tau_x, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.d_model)
        if x2.shape[0] > 1 and self.prefill == "dense" and not self._batches(x2):
            return self.dense(x)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = self.sparse_op(x2) if self._use_op(x2) else self.sparse_reference(x2)
        return y.reshape(shape)


def memory_report(model: nn.Module) -> dict:
    """Extra memory of the model's SparseMLPs: bytes of proxies, scales and W_down^T copies, the workspaces
    (each counted once), and the dense MLP weights for scale."""
    tot = {"proxies": 0, "scales": 0, "w_down_t": 0, "dense_mlp": 0, "layers": 0}
    ws = {}
    for _, m in find_mlps(model):
        if isinstance(m, SparseMLP):
            r = m.memory_bytes()
            for k in ("proxies", "scales", "w_down_t", "dense_mlp"):
                tot[k] += r[k]
            tot["layers"] += 1
            if m.workspace is not None:
                ws[m.workspace.data_ptr()] = m.workspace.numel()
    tot["workspaces"] = sum(ws.values())
    tot["extra_total"] = tot["proxies"] + tot["scales"] + tot["w_down_t"] + tot["workspaces"]
    tot["extra_fraction_of_mlp"] = tot["extra_total"] / tot["dense_mlp"] if tot["dense_mlp"] else 0.0
    return tot


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
    """Replace every gated MLP by a SparseMLP (thresholds 0: every input and channel kept). Returns the names."""
    names = []
    for name, m in find_mlps(model):
        if not isinstance(m, SparseMLP):
            _set_submodule(model, name, SparseMLP.from_mlp(m, **kw))
            names.append(name)
    return names


def restore_mlps(model: nn.Module, mlp_factory=None, *, originals: Optional[dict] = None) -> None:
    """Put dense MLPs back. A SparseMLP whose name is in ``originals`` ({name: module}, e.g. find_mlps()'s
    modules kept from before the swap) gets that module back as it was; any other needs keep_down=True (so
    W_down is still there) and becomes a module with gate_proj, up_proj, down_proj and act_fn
    (mlp_factory(sparse) -> module, or a generic one)."""
    for name, m in list(sparse_mlps(model)):
        if originals is not None and name in originals:
            new = originals[name]
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
