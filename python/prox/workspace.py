# SPDX-License-Identifier: Apache-2.0
"""Workspaces of layers that run one after another: one per (device, shape, stream), from a pool (WorkspacePool;
DEFAULT_POOL for SparseMLPs built on their own, a pool per model for swap_mlps() / sparsify())."""
from __future__ import annotations

import threading

import torch

from . import _ops


def raw_stream(device: torch.device) -> int:
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
        key = (device.index, d_model, d_ff, raw_stream(device))
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


def free_workspaces() -> None:
    """Drop DEFAULT_POOL's workspaces (a model's own pool: ``prox.nn.workspace_pool(model).clear()``)."""
    DEFAULT_POOL.clear()
