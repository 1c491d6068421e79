# SPDX-License-Identifier: Apache-2.0
"""Sparsity allocation, in two parts:

- between the stages of one layer: the paper's rule (include/prox/allocation.hpp), e = s2 - 2 alpha (1 - s1) / 3
  (the dense FFN costs three projections, Prox 2 alpha (1 - s1) for the two INT4 proxies plus 3 (1 - s2) for the
  exact part): allocate_sparsity, and the per-layer split search's candidates (split_candidates);
- between layers (prox.sparsify's allocation="greedy", beyond the paper): each layer's e from its measured
  error curve at a given cost-weighted mean e (allocate_layers, LayerErrors).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence
from dataclasses import asdict, dataclass, field

ALPHA = 1.0 / 3.0  #: cost of an INT4 proxy projection relative to a dense one (the paper's alpha)
#: (Each Stage-2 weight format has its own alpha: prox.formats, alpha_for.)
S_REF = 0.7  #: Stage-2 anchor sparsity
S1_MIN = 0.0
S1_MAX = 0.7


@dataclass(frozen=True)
class StageSparsity:
    s1: float  #: fraction of the d_model inputs Stage 1 drops
    s2: float  #: fraction of the d_ff channels Stage 2 skips


def effective_sparsity(s1: float, s2: float, alpha: float = ALPHA) -> float:
    """Effective FFN sparsity of a (s1, s2) pair."""
    return s2 - 2.0 * alpha * (1.0 - s1) / 3.0


def max_effective_sparsity(alpha: float = ALPHA, s1_max: float = S1_MAX) -> float:
    return 1.0 - 2.0 * alpha * (1.0 - s1_max) / 3.0


def allocate_sparsity(e: float, alpha: float = ALPHA, s_ref: float = S_REF, s1_min: float = S1_MIN,
                      s1_max: float = S1_MAX) -> StageSparsity:
    """Split a target effective sparsity e between the stages (paper, Sec. 4.2; prox::allocate_sparsity):
    s2 = s_ref and solve for s1; if s1 leaves [s1_min, s1_max], clamp it and re-solve s2.

    >>> allocate_sparsity(0.5)
    StageSparsity(s1=0.1..., s2=0.7)
    """
    if not (alpha > 0.0 and s1_min >= 0.0 and s1_max >= s1_min and s1_max < 1.0 and 0.0 <= s_ref <= 1.0):
        raise ValueError("prox: malformed allocation rule")
    top = max_effective_sparsity(alpha, s1_max)
    if not (isinstance(e, (int, float)) and not math.isnan(e) and 0.0 <= e <= top):
        raise ValueError(f"prox: target effective sparsity must be in [0, {top:.4f}], got {e}")
    k = 2.0 * alpha / 3.0
    s1 = 1.0 - (s_ref - e) / k
    s2 = s_ref
    if s1 < s1_min or s1 > s1_max:
        s1 = s1_min if s1 < s1_min else s1_max
        s2 = e + k * (1.0 - s1)
    s2 = min(s2, 1.0)
    return StageSparsity(s1, s2)


def split_candidates(e: float, alpha: float = ALPHA, s1_grid=None) -> list[StageSparsity]:
    """(s1, s2) pairs on the line of equal effective sparsity e, for the per-layer split search: s1 over
    a grid (default 0, 0.1, ..., 0.8) where s2 = e + 2 alpha (1 - s1) / 3 stays in [0, 1]. The paper's
    rule's own pair is added, so the search can always keep it."""
    grid = [i / 10 for i in range(9)] if s1_grid is None else list(s1_grid)
    k = 2.0 * alpha / 3.0
    out = []
    for s1 in grid:
        s2 = e + k * (1.0 - s1)
        if 0.0 <= s1 < 1.0 and 0.0 <= s2 <= 1.0:
            out.append(StageSparsity(float(s1), float(s2)))
    paper = allocate_sparsity(e, alpha)
    if all(abs(c.s1 - paper.s1) > 1e-9 for c in out):
        out.append(paper)
    return sorted(out, key=lambda c: c.s1)


#: Default grid of per-layer effective sparsities on which allocation="greedy" measures each layer's error.
LAYER_GRID_STEP = 0.05
LAYER_E_MAX = 0.9  #: default upper bound of a layer's effective sparsity (below max_effective_sparsity())


def layer_grid(lo: float, hi: float, step: float = LAYER_GRID_STEP) -> list[float]:
    """The effective sparsities a layer's error is measured at: lo, hi and the multiples of step between them."""
    k0, k1 = math.floor(lo / step + 1e-9) + 1, math.ceil(hi / step - 1e-9)
    inner = [round(k * step, 12) for k in range(k0, k1)]
    return [float(lo)] + [g for g in inner if lo < g < hi] + ([float(hi)] if hi > lo else [])


def lower_hull(xs: Sequence[float], ys: Sequence[float]) -> list[int]:
    """Indices of the lower convex hull of the points (xs[i], ys[i]) (xs increasing), first and last included;
    collinear points are dropped, so the hull's slopes strictly increase."""
    hull: list[int] = []
    for i in range(len(xs)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the chord a -> i: drop it
            if (ys[b] - ys[a]) * (xs[i] - xs[a]) >= (ys[i] - ys[a]) * (xs[b] - xs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def allocate_layers(e: float, grid: Sequence[float], errors: Sequence[Sequence[float]],
                    costs: Optional[Sequence[float]] = None) -> list[float]:
    """Per-layer effective sparsities whose cost-weighted mean is e, at the least summed error (prox.sparsify's
    allocation="greedy").

    errors[l][i] is layer l's error (model-level, measured with only that layer sparse) at effective sparsity
    grid[i]; costs[l] is the layer's dense FFN cost (3 d_model d_ff; default equal). Every layer starts at grid[0];
    the greedy step raises the layer whose next step costs the least error per unit of FFN cost saved, until
    sum_l costs[l] e_l = e sum_l costs[l]. The steps are those of each layer's lower convex hull of its errors,
    so a step that costs much but opens cheap ones is weighed with them, and the greedy walk is the exact
    minimizer of the summed, piecewise-linear errors (the Lagrangian solution). The last step is taken in part
    (the errors interpolated linearly), so the mean is e exactly (to rounding). A larger e takes a superset
    of the steps: no layer's e decreases when e grows. The bounds of every layer are grid[0] and grid[-1]."""
    grid = [float(g) for g in grid]
    n = len(errors)
    if n == 0:
        raise ValueError("prox: allocate_layers: no layer")
    if len(grid) < 2 or any(not (b > a) for a, b in zip(grid, grid[1:])):
        raise ValueError(f"prox: allocate_layers: the grid must hold at least two increasing values, got {grid}")
    costs = [1.0] * n if costs is None else [float(c) for c in costs]
    if len(costs) != n or not all(c > 0 and math.isfinite(c) for c in costs):
        raise ValueError(f"prox: allocate_layers: costs must be {n} positive numbers, got {costs}")
    for l, row in enumerate(errors):
        if len(row) != len(grid) or not all(math.isfinite(float(v)) for v in row):
            raise ValueError(f"prox: allocate_layers: errors[{l}] must hold {len(grid)} finite values (one per grid "
                             f"point), got {list(row)}")
    lo, hi = grid[0], grid[-1]
    if not (isinstance(e, (int, float)) and lo - 1e-12 <= e <= hi + 1e-12):
        raise ValueError(f"prox: the target effective sparsity e={e} cannot be reached with every layer in "
                         f"[{lo:g}, {hi:g}] (the per-layer bounds)")
    total = sum(costs)
    steps = []  # (error per unit cost saved, layer, step): each layer's hull steps in order
    for l, row in enumerate(errors):
        ys = [float(v) for v in row]
        h = lower_hull(grid, ys)
        for k, (a, b) in enumerate(zip(h, h[1:])):
            steps.append(((ys[b] - ys[a]) / ((grid[b] - grid[a]) * costs[l]), l, k, grid[a], grid[b]))
    steps.sort(key=lambda s: s[:3])
    out = [lo] * n
    left = (e - lo) * total  # the cost still to save
    for _, l, _, a, b in steps:
        if left <= 0.0:
            break
        gain = (b - a) * costs[l]
        if gain <= left:
            out[l] = b
            left -= gain
        else:
            out[l] = a + left / costs[l]
            left = 0.0
    return [min(max(v, lo), hi) for v in out]


def weighted_mean(values: Sequence[float], costs: Optional[Sequence[float]] = None) -> float:
    """The cost-weighted mean of per-layer values (equal weights by default)."""
    costs = [1.0] * len(values) if costs is None else list(costs)
    return sum(c * v for c, v in zip(costs, values)) / sum(costs)


@dataclass
class LayerErrors:
    """Each layer's model-level error at each effective sparsity of a grid, with only that layer sparse
    (prox.measure_layer_errors): what allocation="greedy" allocates by. Recorded in a greedy config's
    calibration["allocation"] (to_dict), from which it is read back (from_dict) to allocate another e without
    measuring again."""
    names: list  #: the layers' qualified names (their MLPs'), in depth order
    grid: list  #: effective sparsities, increasing; the first and last are every layer's bounds
    errors: list  #: errors[l][i]: layer l's error at grid[i]
    costs: list  #: each layer's dense FFN cost, 3 d_model d_ff
    signal: str = "kl"  #: what the errors are (measure_layer_errors: mean KL(dense || sparse) of the logits)
    tokens: int = 0  #: the tokens they were measured on
    info: dict = field(default_factory=dict)  #: how they were measured (seconds, step, ...)

    def __post_init__(self):
        n = len(self.names)
        if len(self.errors) != n or len(self.costs) != n:
            raise ValueError(f"prox: LayerErrors: {n} names, {len(self.errors)} error rows, {len(self.costs)} costs")

    def within(self, lo: float, hi: float) -> "LayerErrors":
        """The curves on the grid points in [lo, hi]; lo and hi must be grid points (the layers' bounds)."""
        idx = [i for i, g in enumerate(self.grid) if lo - 1e-9 <= g <= hi + 1e-9]
        if not idx or abs(self.grid[idx[0]] - lo) > 1e-9 or abs(self.grid[idx[-1]] - hi) > 1e-9:
            raise ValueError(f"prox: layer_bounds ({lo:g}, {hi:g}) are not points of the grid the layer errors were "
                             f"measured on ({', '.join(f'{g:g}' for g in self.grid)}): measure them again with "
                             "these bounds, or choose bounds on the grid")
        return LayerErrors(list(self.names), [self.grid[i] for i in idx], [[r[i] for i in idx] for r in self.errors],
                           list(self.costs), self.signal, self.tokens, dict(self.info))

    def allocate(self, e: float) -> list:
        """Each layer's e at cost-weighted mean e (allocate_layers on these curves)."""
        return allocate_layers(e, self.grid, self.errors, self.costs)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerErrors":
        return cls(**d)
