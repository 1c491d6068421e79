# SPDX-License-Identifier: Apache-2.0
"""The paper's stage-wise sparsity allocation (include/prox/allocation.hpp), in Python.

e = s2 - 2 alpha (1 - s1) / 3: the dense FFN costs three projections, Prox 2 alpha (1 - s1) for the two
INT4 proxies plus 3 (1 - s2) for the exact part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
