# SPDX-License-Identifier: Apache-2.0
"""Threshold calibration in torch, with the rule of prox::calib (include/prox/calibrate.cuh,
docs/calibration.md), on any device:

- a reservoir of at most ``capacity`` (200,000) finite samples of |v|: the samples with the smallest
  priorities sample_priority(seed, position), position counting every sample since the reset (NaN/Inf
  included, never kept). The priorities are the C++ calibrator's (splitmix64 of the position), so for the
  same stream of samples the reservoir, and the threshold, are the same as prox::calib's;
- tau = a[floor(s n)] over the sorted reservoir magnitudes a (+inf when that index is n); a value is kept
  iff |v| >= tau. When ties at a[m] make the realized sparsity miss s by more than max(1/n, 0.01), the
  nearer of a[m] and the next distinct magnitude is taken (the lower sparsity when equally far).

calibrate_layer() is the paper's per-layer order: tau_x from the layer's inputs at s1, then tau_s from
Stage 1's s~ computed under that tau_x, at s2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

DEFAULT_CAPACITY = 200_000
DEFAULT_SEED = 0x70726F7863616C69  # "proxcali", prox::calib::kDefaultSeed
_CHUNK = 1 << 22

_M64 = (1 << 64) - 1


def _to_i64(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= (1 << 63) else v


def mix64_int(z: int) -> int:
    """splitmix64's finalizer on a Python int (prox::detail::mix64)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """mix64 on int64 tensors holding uint64 bit patterns (two's-complement wrap-around products)."""
    z = (z ^ _srl(z, 30)) * _to_i64(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _to_i64(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def sample_priority(seed: int, index: torch.Tensor) -> torch.Tensor:
    """prox::calib::sample_priority as int64 bit patterns: mix64(index ^ mix64(seed)), ~0 mapped to ~0 - 1."""
    p = mix64(index ^ _to_i64(mix64_int(seed)))
    return torch.where(p == -1, torch.full_like(p, -2), p)


def _ordered(p: torch.Tensor) -> torch.Tensor:
    """int64 keys whose signed order is the unsigned order of the bit patterns."""
    return p ^ _to_i64(1 << 63)


@dataclass
class ThresholdResult:
    tau: float  #: kept iff |v| >= tau
    target: float
    realized: float  #: fraction of reservoir samples with |v| < tau
    reservoir: int
    seen: int
    finite: int
    nan: int
    inf: int
    reachable: bool  #: realized within max(1/n, 0.01) of target


class Calibrator:
    """Streams samples and returns the threshold of a target sparsity (prox::calib::ThresholdCalibrator's
    rule). The reservoir lives on the samples' device."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, seed: int = DEFAULT_SEED):
        if capacity < 1:
            raise ValueError("prox: capacity must be >= 1")
        self.capacity = int(capacity)
        self.seed = int(seed)
        self.reset()

    def reset(self) -> None:
        self._keys = None  # ordered priorities of the reservoir, int64
        self._vals = None  # |v| float32
        self.seen = self.finite = self.nan = self.inf = 0

    def add(self, samples: torch.Tensor, positions: Optional[torch.Tensor] = None) -> None:
        """Add samples (any shape, flattened in row-major order, any float dtype). ``positions`` (int64, one per
        sample, same order) are the samples' positions in the stream, which set their priorities; by default the
        next ones after the samples seen so far. A shard of a wider stream gives the positions its samples have
        in the whole stream (tensor parallelism: a rank's channels of each token, TPState.positions), so that
        merging the shards' calibrators (merge) gives the whole stream's reservoir."""
        flat = samples.detach().reshape(-1)
        n = flat.numel()
        if positions is not None and positions.numel() != n:
            raise ValueError(f"prox: {positions.numel()} positions for {n} samples")
        pos = None if positions is None else positions.reshape(-1)
        for start in range(0, n, _CHUNK):
            v = flat[start:start + _CHUNK].float()
            m = v.numel()
            finite = torch.isfinite(v)
            nf = int(finite.sum())
            nn_ = int(torch.isnan(v).sum())
            self.finite += nf
            self.nan += nn_
            self.inf += m - nf - nn_
            idx = torch.arange(self.seen, self.seen + m, dtype=torch.int64, device=v.device) if pos is None else \
                pos[start:start + _CHUNK].to(device=v.device, dtype=torch.int64)
            self.seen += m
            keys = _ordered(sample_priority(self.seed, idx))[finite]
            vals = v[finite].abs()
            if self._keys is not None:
                keys = torch.cat([self._keys.to(keys.device), keys])
                vals = torch.cat([self._vals.to(vals.device), vals])
            if keys.numel() > self.capacity:
                keys, order = torch.topk(keys, self.capacity, largest=False, sorted=False)
                vals = vals[order]
            self._keys, self._vals = keys, vals

    def merge(self, others) -> None:
        """Take other calibrators' samples in (same capacity and seed; samples at positions disjoint from this
        one's): the reservoir becomes the one a single calibrator fed every sample would hold, the samples of
        smallest priority among all (the cross-rank merge of tensor-parallel calibration,
        prox.distributed.all_merge); the counts add up."""
        keys = [] if self._keys is None else [self._keys]
        vals = [] if self._vals is None else [self._vals]
        for o in others:
            if (o.capacity, o.seed) != (self.capacity, self.seed):
                raise ValueError(f"prox: cannot merge calibrators of capacity/seed {(o.capacity, o.seed)} and "
                                 f"{(self.capacity, self.seed)}")
            if o._keys is not None:
                dev = keys[0].device if keys else o._keys.device
                keys.append(o._keys.to(dev))
                vals.append(o._vals.to(dev))
            self.seen += o.seen
            self.finite += o.finite
            self.nan += o.nan
            self.inf += o.inf
        if not keys:
            return
        k, v = torch.cat(keys), torch.cat(vals)
        if k.numel() > self.capacity:
            k, order = torch.topk(k, self.capacity, largest=False, sorted=False)
            v = v[order]
        self._keys, self._vals = k, v

    def magnitudes(self) -> torch.Tensor:
        """The reservoir's |v|, sorted ascending."""
        if self._vals is None:
            return torch.empty(0)
        return torch.sort(self._vals).values

    def finalize(self, target: float) -> ThresholdResult:
        if not (0.0 <= target <= 1.0):
            raise ValueError(f"prox: target sparsity must be in [0, 1], got {target}")
        if self.finite == 0:
            raise ValueError("prox: no finite calibration sample")
        a = self.magnitudes()
        tau, realized, reachable = quantile_threshold(a, target)
        return ThresholdResult(tau, target, realized, a.numel(), self.seen, self.finite, self.nan, self.inf, reachable)


def quantile_threshold(a: torch.Tensor, target: float) -> tuple[float, float, bool]:
    """(tau, realized, reachable) for sorted magnitudes a and target sparsity (the rule above)."""
    n = a.numel()
    m = min(max(int(math.floor(target * float(n))), 0), n)
    if m == n:
        return math.inf, 1.0, True if n else False
    t = a[m]
    lo = int(torch.searchsorted(a, t, right=False))
    hi = int(torch.searchsorted(a, t, right=True))
    tau, realized = float(t), lo / n
    tol = max(1.0 / n, 0.01)
    if abs(realized - target) > tol:
        alt = hi / n
        if abs(alt - target) < abs(realized - target):
            tau, realized = (float(a[hi]) if hi < n else math.inf), alt
    return tau, realized, abs(realized - target) <= tol


@dataclass
class LayerThresholds:
    tau_x: float
    tau_s: float
    s1: float  #: target Stage-1 sparsity
    s2: float  #: target Stage-2 sparsity
    realized_s1: float  #: on the calibration samples
    realized_s2: float
    tokens: int
    reachable: bool


def calibrate_layer(x: torch.Tensor, s1: float, s2: float,
                    proxy_values: Callable[[torch.Tensor, float], torch.Tensor], *, capacity: int = DEFAULT_CAPACITY,
                    seed: int = DEFAULT_SEED, token_chunk: int = 1024, tp=None) -> LayerThresholds:
    """The paper's per-layer calibration (prox::calib::calibrate_layer): tau_x = quantile of |x| at s1 over
    every input sample; then s~ = proxy_values(x_chunk, tau_x) (Stage 1 in values mode: the CUDA op or
    prox.reference.proxy_values) and tau_s = quantile of |s~| at s2.

    tp: a sharded layer's TPState (SparseMLP.tp, prox.distributed): x is the replicated input (tau_x is computed
    on every rank and checked equal across ranks: tp.check_replicated), proxy_values gives this rank's channels,
    and tau_s is the quantile over all d_ff channels (proxy_threshold): TP=1's thresholds, exactly. Every rank
    calls it."""
    x2 = x.reshape(-1, x.shape[-1])
    cal = Calibrator(capacity, seed)
    cal.add(x2)
    rx = cal.finalize(s1)
    if tp is not None:
        tp.check_replicated(rx.tau, "tau_x (the quantile of |x|)")
    rs = proxy_threshold(x2, rx.tau, s2, proxy_values, capacity=capacity, seed=seed, token_chunk=token_chunk,
                         tp=tp)
    return LayerThresholds(rx.tau, rs.tau, s1, s2, rx.realized, rs.realized, x2.shape[0], rx.reachable and rs.reachable)


def proxy_threshold(x2: torch.Tensor, tau_x: float, s2: float,
                    proxy_values: Callable[[torch.Tensor, float], torch.Tensor], *, capacity: int = DEFAULT_CAPACITY,
                    seed: int = DEFAULT_SEED, token_chunk: int = 1024, tp=None) -> ThresholdResult:
    """calibrate_layer's second step: tau_s = quantile at s2 of |s~| over Stage 1's values under tau_x for the
    tokens x2 [tokens, d_model], computed token_chunk tokens at a time (proxy_calibrator(...).finalize(s2))."""
    return proxy_calibrator(x2, tau_x, proxy_values, capacity=capacity, seed=seed, token_chunk=token_chunk,
                            tp=tp).finalize(s2)


def proxy_calibrator(x2: torch.Tensor, tau_x: float, proxy_values: Callable[[torch.Tensor, float], torch.Tensor], *,
                     capacity: int = DEFAULT_CAPACITY, seed: int = DEFAULT_SEED, token_chunk: int = 1024,
                     tp=None) -> Calibrator:
    """The calibrator of |s~| over Stage 1's values under tau_x for the tokens x2 [tokens, d_model]: finalize(s2)
    gives tau_s for any s2 (one pass of Stage 1 serves every s2 of one tau_x).

    With tp (a sharded layer's TPState), proxy_values gives this rank's channels [tokens, d_ff / TP]: each
    rank's calibrator takes its values at the positions they hold in the full layer's stream (token t, channel
    j at t d_ff + j: tp.positions), and the calibrators are merged across ranks (tp.merge, prox.distributed.
    all_merge: one all-gather of at most ``capacity`` samples per rank). The merged reservoir is the one TP=1 holds
    for the same s~ values, so tau_s is TP=1's exactly (given s~ bit-identical per channel, as a shard computes
    it)."""
    cal = Calibrator(capacity, seed)
    if tp is None:
        for t0 in range(0, x2.shape[0], token_chunk):
            cal.add(proxy_values(x2[t0:t0 + token_chunk], tau_x))
        return cal
    with tp.agreed():  # a rank whose Stage 1 fails must not leave the others in the merge
        for t0 in range(0, x2.shape[0], token_chunk):
            s = proxy_values(x2[t0:t0 + token_chunk], tau_x)
            if s.dim() != 2 or s.shape[1] != tp.local_d_ff:
                raise ValueError(f"prox: proxy_values gave {tuple(s.shape)}, expected [tokens, {tp.local_d_ff}]")
            cal.add(s, positions=tp.positions(t0, s.shape[0], s.device))
    tp.merge(cal)
    return cal
