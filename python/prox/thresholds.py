# SPDX-License-Identifier: Apache-2.0
"""The thresholds file: calibrated (tau_x, tau_s) per layer for one or more sparsity targets, so a model is
calibrated once. JSON, human-readable, exact (floats are written with Python's round-trip repr; an infinite
threshold, which keeps nothing, is the string "inf").

    {"format": "prox-thresholds", "version": 4, "int4_layout": "...", "model": "...",
     "configs": [{"e": 0.5, "split": "paper", "allocation": "uniform", "alpha": 0.333..., "calibration": {...},
                  "layers": [{"name": "model.layers.0.mlp", "d_model": 576, "d_ff": 1536, "act": "silu",
                              "e": 0.5, "s1": 0.1, "s2": 0.7, "tau_x": ..., "tau_s": ...,
                              "realized_s1": ..., "realized_s2": ..., "output_error": ...,
                              "fingerprint": {"dtype": "float16", "gate": {...}, "up": {...},
                                              "down": {...}}, "format": "native"}, ...]}]}

A config is for one (e, split, allocation): e is the target effective sparsity, the cost-weighted mean of the
layers' own e (version 4: each layer records its e; "uniform" gives every layer the config's e, "greedy"
(prox.sparsify's allocation="greedy") gives each its own, and records the measured per-layer errors it chose them
by in "calibration"/"allocation"). Files before version 4 are uniform; their layers' e is computed from s1, s2 and
the config's alpha when read.

Several configs (targets, split rules, allocations) can live in one file: a server loads them all and switches a
model's sparsity per request with apply_thresholds() (a few device fills; no re-plan, no re-capture).

Thresholds are only valid for the weights they were calibrated on, so each layer records a fingerprint of
its weights (layer_fingerprint: for W_gate, W_up and W_down in nn.Linear layout, the sum and the absolute
sum in float64 and FINGERPRINT_SAMPLES values at fixed strided positions), and apply_thresholds() refuses a
file whose fingerprints, layer names, shapes, activations, INT4 layout or model name do not match the
model, unless told strict=False. Each layer also records its Stage-2 weight format ("native", "fp8_channel",
"fp8_block128"; version 3): thresholds calibrated on bf16 weights are not an FP8 model's, whose fingerprint is that
of its dequantized weights (dtype "float8_e4m3fn"). Version-1 and 2 files have no format: "native". Matching (fingerprint_mismatch): on the same dtype the samples must be
equal and the sums agree to 1e-9 of the absolute sum (the summation order differs between devices); across
dtypes (calibrated in float32, run in bfloat16) within the coarser dtype's rounding. Version-1 files (no
fingerprints) still load and apply, with a warning that their weights cannot be checked; re-save them
(save_thresholds after loading, fingerprints=model) to record fingerprints.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .allocation import ALPHA, effective_sparsity

FORMAT = "prox-thresholds"
VERSION = 4
#: version 1: no fingerprints; versions 1 and 2: no format (native); versions 1 to 3: uniform, no per-layer e
VERSIONS_READ = (1, 2, 3, 4)
ALLOCATIONS = ("uniform", "greedy")  #: how a config's layers got their e (prox.sparsify's allocation=)
INT4_LAYOUT = "prox-int4-kmajor-i8-v1"
FINGERPRINT_SAMPLES = 8
#: Unit roundoff of each weight dtype (fingerprints compared across dtypes agree within the coarser one's).
_UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float64": 2.0 ** -53,
                  "float8_e4m3fn": 2.0 ** -4}


def matrix_fingerprint(w, full: Optional[tuple] = None, at: tuple = (0, 0), as_tensor: bool = False):
    """Sum, absolute sum (float64) and FINGERPRINT_SAMPLES values at fixed strided positions of a 2-D weight
    (any layout, any device: one pass over it and one host read).

    A block of a larger matrix (a tensor-parallel shard: ``full`` the whole matrix's shape, ``at`` the block's
    first row and column) gives the whole matrix's sample positions, 0.0 for those outside the block, and the
    block's sums: summed over the blocks, these are the whole matrix's fingerprint (prox.distributed.
    fingerprints). as_tensor: the float64 [2 + FINGERPRINT_SAMPLES] values on w's device, not read."""
    rows, cols = (int(v) for v in (full or w.shape))
    n = rows * cols
    idx = torch.tensor([((2 * k + 1) * n) // (2 * FINGERPRINT_SAMPLES) for k in range(FINGERPRINT_SAMPLES)],
                       dtype=torch.int64, device=w.device)
    r, c = idx // cols - at[0], idx % cols - at[1]
    inside = (r >= 0) & (r < w.shape[0]) & (c >= 0) & (c < w.shape[1])
    vals = w[r.clamp(0, w.shape[0] - 1), c.clamp(0, w.shape[1] - 1)].to(torch.float64)
    vals = torch.where(inside, vals, torch.zeros_like(vals))
    sums = torch.stack([w.sum(dtype=torch.float64), torch.linalg.vector_norm(w, 1, dtype=torch.float64)])
    out = torch.cat([sums, vals])
    if as_tensor:
        return out
    out = out.tolist()
    return {"sum": out[0], "abs_sum": out[1], "samples": out[2:]}


def layer_fingerprint(w_gate, w_up, w_down) -> dict:
    """The fingerprint of a gated MLP's weights: w_gate, w_up [d_ff, d_model], w_down [d_model, d_ff]
    (nn.Linear layout; a transposed view of W_down^T serves)."""
    return {"dtype": str(w_gate.dtype).replace("torch.", ""), "gate": matrix_fingerprint(w_gate),
            "up": matrix_fingerprint(w_up), "down": matrix_fingerprint(w_down)}


def fingerprint_mismatch(saved: dict, current: dict) -> Optional[str]:
    """None when two layer fingerprints can be the same weights (the rule in the module docstring); else
    which matrix differs and how."""
    same = saved.get("dtype") == current.get("dtype")
    u = max(_UNIT_ROUNDOFF.get(saved.get("dtype"), 2.0 ** -8), _UNIT_ROUNDOFF.get(current.get("dtype"), 2.0 ** -8))
    for m in ("gate", "up", "down"):
        a, b = saved[m], current[m]
        if len(a["samples"]) != len(b["samples"]):
            return f"W_{m}: {len(a['samples'])} samples recorded, {len(b['samples'])} computed"
        scale = max(abs(a["abs_sum"]), abs(b["abs_sum"]), 1e-300)
        tol = 1e-9 * scale if same else 2.0 * u * scale
        for key in ("sum", "abs_sum"):
            if abs(a[key] - b[key]) > tol:
                return f"W_{m}: {key} {b[key]!r} against {a[key]!r} recorded"
        for k, (x, y) in enumerate(zip(a["samples"], b["samples"])):
            if (x != y) if same else abs(x - y) > 2.0 * u * max(abs(x), abs(y)) + 1e-30:
                return f"W_{m}: sample {k} is {y!r} against {x!r} recorded"
    return None


@dataclass
class LayerRecord:
    name: str
    d_model: int
    d_ff: int
    act: str
    s1: float
    s2: float
    tau_x: float
    tau_s: float
    realized_s1: Optional[float] = None
    realized_s2: Optional[float] = None
    output_error: Optional[float] = None  #: relative FFN output error ||y - y_dense||^2 / ||y_dense||^2 (calibration)
    fingerprint: Optional[dict] = None  #: layer_fingerprint of the weights calibrated on (None: a version-1 file)
    format: str = "native"  #: the layer's Stage-2 weight format (prox.FORMATS; versions 1 and 2: native)
    e: Optional[float] = None  #: the layer's target effective sparsity (read from versions 1 to 3: s1, s2's)


@dataclass
class ThresholdConfig:
    e: float
    split: str  #: "paper" (the allocation rule) or "search" (per-layer split chosen by output error)
    layers: list = field(default_factory=list)  #: LayerRecord
    alpha: float = ALPHA
    calibration: dict = field(default_factory=dict)  #: tokens, capacity, seed, source text, ...
    model: str = ""  #: the model the thresholds are for (the file's "model"; apply_thresholds can check it)
    int4_layout: str = INT4_LAYOUT  #: the INT4 proxy layout calibrated with (the file's)
    allocation: str = "uniform"  #: "uniform" (every layer at e) or "greedy" (per-layer e, mean e): ALLOCATIONS

    def key(self) -> tuple:
        """What identifies a config in a file: (e, split, allocation)."""
        return round(self.e, 9), self.split, self.allocation

    def by_name(self) -> dict:
        return {r.name: r for r in self.layers}


def _enc(v):
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def _dec(v):
    if v == "inf":
        return math.inf
    if v == "-inf":
        return -math.inf
    return v


def to_dict(configs: list, model: str = "") -> dict:
    layouts = {c.int4_layout for c in configs} or {INT4_LAYOUT}
    if len(layouts) > 1:
        raise ValueError(f"prox: configs of different INT4 layouts ({sorted(layouts)}) cannot share a file")
    names = {c.model for c in configs if c.model}
    if not model and len(names) == 1:
        model = names.pop()
    out = {"format": FORMAT, "version": VERSION, "int4_layout": layouts.pop(), "model": model, "configs": []}
    for c in configs:
        d = asdict(c)
        del d["model"], d["int4_layout"]  # file-level fields
        d["layers"] = [{k: _enc(v) for k, v in asdict(r).items()} for r in c.layers]
        out["configs"].append(d)
    return out


def from_dict(d: dict) -> list:
    if d.get("format") != FORMAT:
        raise ValueError(f"prox: not a thresholds file (format {d.get('format')!r}, expected {FORMAT!r})")
    if d.get("version") not in VERSIONS_READ:
        raise ValueError(f"prox: thresholds file version {d.get('version')} is not supported (this reads "
                         f"{', '.join(map(str, VERSIONS_READ))})")
    configs = []
    for c in d["configs"]:
        alpha = float(c.get("alpha", ALPHA))
        allocation = c.get("allocation", "uniform")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"prox: thresholds file config (e={c['e']}, {c['split']}): unknown allocation "
                             f"{allocation!r} (this reads {', '.join(ALLOCATIONS)})")
        layers = [LayerRecord(**{k: _dec(v) for k, v in r.items()}) for r in c["layers"]]
        if d["version"] < 4:  # uniform: every layer at the e of its split
            for r in layers:
                r.e = effective_sparsity(r.s1, r.s2, alpha)
        configs.append(ThresholdConfig(e=float(c["e"]), split=c["split"], layers=layers, alpha=alpha,
                                       calibration=c.get("calibration", {}), model=d.get("model", "") or "",
                                       int4_layout=d.get("int4_layout", INT4_LAYOUT), allocation=allocation))
    return configs


def save_thresholds(path: str | os.PathLike, configs, model: str = "", merge: bool = True,
                    fingerprints=None) -> None:
    """Write configs (a ThresholdConfig or a list). With merge, configs already in the file with another
    (e, split, allocation) are kept; a config with the same (e, split, allocation) is replaced, and the file's
    configs must be for the same model (the same fingerprints). ``fingerprints``: a model whose layers'
    fingerprint() (its SparseMLPs') fill the records that have none (upgrading a version-1 file). Written
    atomically."""
    if isinstance(configs, ThresholdConfig):
        configs = [configs]
    configs = list(configs)
    if fingerprints is not None:
        fps = {n: m.fingerprint() for n, m in fingerprints.named_modules() if callable(getattr(m, "fingerprint", None))}
        for c in configs:
            for r in c.layers:
                if r.fingerprint is None and r.name in fps:
                    r.fingerprint = fps[r.name]
    if merge and os.path.exists(path):
        old = load_thresholds(path)
        new_fp = {r.name: r.fingerprint for c in configs for r in c.layers if r.fingerprint is not None}
        for c in old:
            for r in c.layers:
                why = fingerprint_mismatch(r.fingerprint, new_fp[r.name]) \
                    if r.fingerprint is not None and r.name in new_fp else None
                if why:
                    raise ValueError(f"prox: {path} holds thresholds of other weights ({r.name}: {why}): save to "
                                     "another file, or pass merge=False to replace it")
        keys = {c.key() for c in configs}
        configs = [c for c in old if c.key() not in keys] + configs
    configs.sort(key=lambda c: (c.allocation, c.split, c.e))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(to_dict(configs, model), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_thresholds(path: str | os.PathLike) -> list:
    with open(path) as f:
        return from_dict(json.load(f))


class MissingThresholds(ValueError):
    """find_config(): the configs hold none for the (e, split, allocation) asked for."""


def describe(c: ThresholdConfig) -> str:
    """A config's key as messages write it: (e=0.5, paper), (e=0.5, paper, greedy)."""
    return f"(e={c.e}, {c.split}" + (f", {c.allocation})" if c.allocation != "uniform" else ")")


def find_config(configs: list, e: float, split: str = "paper", allocation: str = "uniform") -> ThresholdConfig:
    """The config of (e, split, allocation) among ``configs`` (load_thresholds()'s); a MissingThresholds (a
    ValueError) that says what they hold and what to do otherwise."""
    for c in configs:
        if abs(c.e - e) < 1e-9 and c.split == split and c.allocation == allocation:
            return c
    have = ", ".join(describe(c) for c in configs)
    how = f"split={split!r}" + (f", allocation={allocation!r}" if allocation != "uniform" else "")
    raise MissingThresholds(f"prox: the thresholds hold no config for e={e}, {how}; they hold "
                            f"{have or 'none'}. Ask for one of those, or calibrate this one (cfg = "
                            f"prox.sparsify(model, {e}, calibration_ids, {how})) and add it to the file "
                            "(prox.save_thresholds(path, cfg) keeps the file's other configs)")
