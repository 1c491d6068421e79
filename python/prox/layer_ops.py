# SPDX-License-Identifier: Apache-2.0
"""The op calls of one layer, shared by PlannedFfn and SparseMLP: planning (with the plans pinned), Prox on a batch
of rows in calls of at most the workspace's capacity, and Stage 1's values under a given tau_x."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _ops
from ._ops import LayerTensors


def plan(layer: LayerTensors, thresholds: torch.Tensor, act_code: int, options: list, dtype: torch.dtype,
         capacity: int, pins: list) -> list[int]:
    """Plan (or find the cached plans of) a layer: batch 1 and, when ``capacity`` (the tokens its workspace holds)
    is 2 or more, the batched plan every batch runs. The plans are pinned (their handles appended to ``pins``; the
    owner releases them with unpin()). Outside graph capture. Returns batch 1's policies [proxy, glu, down,
    glu_down]."""
    args, fmt = _ops.layer_args(layer)
    res = list(torch.ops.prox.plan_ffn(args, fmt, thresholds, act_code, options, 1, True, dtype))
    pins.append(res[4])
    if capacity >= 2:
        pins.append(torch.ops.prox.plan_ffn(args, fmt, thresholds, act_code, options, capacity, True, dtype)[4])
    return res[:4]


def unpin(pins: list) -> None:
    """Release the plans plan() pinned (the list is emptied)."""
    for h in pins:
        _ops.unpin_plan(h)
    pins.clear()


def in_chunks(x2: torch.Tensor, rows: int, call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """call() on x2 [tokens, d_model] in consecutive chunks of at most ``rows`` rows (one call when x2 has no more),
    the results concatenated: a batch larger than a workspace holds, in batches it holds. A chunk of one row is
    given as [1, d_model] (batch 1)."""
    if rows < 1:
        raise ValueError(f"prox: a call takes at least one row (got a capacity of {rows} rows)")
    n = x2.shape[0]
    if n <= rows:
        return call(x2)
    return torch.cat([call(x2[i:i + rows]) for i in range(0, n, rows)])


def sparse_rows(x2: torch.Tensor, layer: LayerTensors, thresholds: torch.Tensor, workspace: torch.Tensor,
                act_code: int, options: list, counters: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """Prox on every row of x2 [tokens, d_model] through the op, in calls of at most ``rows`` rows (batched calls:
    each token what batch 1 gives it, within rounding; ``rows`` 1: each token as batch 1, exactly)."""
    args, fmt = _ops.layer_args(layer)

    def call(part):
        return torch.ops.prox.sparse_ffn(part, args, fmt, thresholds, workspace, act_code, options, False, False,
                                         False, counters)[0]
    return in_chunks(x2, rows, call)


def proxy_values(x: torch.Tensor, layer: LayerTensors, thresholds: torch.Tensor, workspace: torch.Tensor,
                 act_code: int, options: list, tau_x: Optional[float] = None) -> torch.Tensor:
    """Stage 1 in values mode (the op, one launch per token): s~ float32 [tokens, d_ff] for x [tokens, d_model],
    under the layer's tau_x, or under ``tau_x`` when given (written into the thresholds for the call, restored
    after it: calibration's proxy_values(x, tau_x) callback)."""
    args, fmt = _ops.layer_args(layer)
    if tau_x is None:
        return torch.ops.prox.proxy_values(x, args, fmt, thresholds, workspace, act_code, options)
    if not float(tau_x) >= 0.0:
        raise ValueError(f"prox: tau_x must be >= 0, got {tau_x}")
    saved = thresholds.clone()
    thresholds[0].fill_(float(tau_x))
    try:
        return torch.ops.prox.proxy_values(x, args, fmt, thresholds, workspace, act_code, options)
    finally:
        thresholds.copy_(saved)
