# SPDX-License-Identifier: Apache-2.0
"""The model walkers around SparseMLP (prox.sparse_mlp): find a model's gated MLPs, swap them for SparseMLPs and
back, set their modes, refresh them, report their memory, quantize them to FP8. ``prox.nn.SparseMLP``,
``WorkspacePool``, ``DEFAULT_POOL``, ``free_workspaces``, ``detect_act`` and ``is_gated_mlp`` are the modules
below's, named here too.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn

from . import formats, fp8, reference
from .formats import is_gated_mlp
from .sparse_mlp import SparseMLP, detect_act
from .workspace import DEFAULT_POOL, WorkspacePool, free_workspaces

__all__ = ["DEFAULT_POOL", "DenseMLP", "SparseMLP", "WorkspacePool", "activation_dtype", "detect_act", "find_mlps",
           "free_workspaces", "is_gated_mlp", "memory_report", "mlp_kwargs", "quantize_mlps", "refresh",
           "restore_mlps", "set_mode", "sparse_mlps", "swap_mlps", "workspace_pool"]


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's activations run in: that of its first floating-point parameter or buffer that holds no
    weight codes (the embedding, the norms: an FP8 checkpoint's other layers), float32 when there is none."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point() and not formats.holds_codes(t) and t.element_size() >= 2:
            return t.dtype
    return torch.float32


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every gated MLP or SparseMLP in the model, in registration (depth) order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SparseMLP) or is_gated_mlp(m)]


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in the model under the qualified name ``name``."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


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


def model_pool(model: nn.Module) -> WorkspacePool:
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
             batched: Optional[bool] = None, prefill_gemm: Optional[str] = None) -> None:
    """Set every SparseMLP's prefill mode, backend, batched flag and/or prefill GEMMs (SparseMLP's arguments)."""
    if prefill_gemm not in (None, "auto", "dequantized"):
        raise ValueError(f"prox: prefill_gemm must be 'auto' or 'dequantized', got {prefill_gemm!r}")
    for _, m in sparse_mlps(model):
        if prefill_gemm is not None:
            m.prefill_gemm = prefill_gemm
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
        kw["workspace_pool"] = model_pool(model)
    names = []
    act = activation_dtype(model)
    for name, m in find_mlps(model):
        if not isinstance(m, SparseMLP):
            set_submodule(model, name, SparseMLP.from_mlp(m, **mlp_kwargs(m, kw, act)))
            names.append(name)
    return names


def mlp_kwargs(mlp: nn.Module, kw: dict, act: torch.dtype) -> dict:
    """SparseMLP's arguments for one of a model's MLPs: an MLP whose format takes an activation dtype (FP8) takes
    the model's (``act``) unless ``kw`` gives one; another MLP takes no dtype (its weights give it)."""
    if not formats.of_module(mlp).weights_set_dtype:
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
        set_submodule(model, name, new)


class DenseMLP(nn.Module):
    """A plain gated MLP (what restore_mlps() puts back when no factory is given)."""

    def __init__(self, gate_proj, up_proj, down_proj, act: str = "silu"):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act = act
        self.act_fn = reference.activation(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def quantize_mlps(model: nn.Module, layout: str, module: Optional[str] = None) -> list:
    """Replace every gated MLP's gate_proj, up_proj and down_proj (bias-free nn.Linear) by its FP8 copy in
    ``layout`` (prox.fp8.quantize_linear: prox.Fp8Linear, or for block128 by default transformers' FP8Linear when
    transformers is installed). The other layers stay as they are. Returns the MLPs' names."""
    names = []
    for name, mlp in find_mlps(model):
        for p in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, p)
            if not formats.holds_codes(lin.weight):
                setattr(mlp, p, fp8.quantize_linear(lin, layout, module))
        names.append(name)
    return names
