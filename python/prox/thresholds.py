# SPDX-License-Identifier: Apache-2.0
"""The thresholds file: calibrated (tau_x, tau_s) per layer for one or more sparsity targets, so a model is
calibrated once. JSON, human-readable, exact (floats are written with Python's round-trip repr; an infinite
threshold, which keeps nothing, is the string "inf").

    {"format": "prox-thresholds", "version": 1, "int4_layout": "...", "model": "...",
     "configs": [{"e": 0.5, "split": "paper", "alpha": 0.333..., "calibration": {...},
                  "layers": [{"name": "model.layers.0.mlp", "d_model": 576, "d_ff": 1536, "act": "silu",
                              "s1": 0.1, "s2": 0.7, "tau_x": ..., "tau_s": ...,
                              "realized_s1": ..., "realized_s2": ...}, ...]}]}

Several configs (targets, split rules) can live in one file: a server loads them all and switches a
model's sparsity per request with apply_thresholds() (a few device fills; no re-plan, no re-capture).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .allocation import ALPHA

FORMAT = "prox-thresholds"
VERSION = 1
INT4_LAYOUT = "prox-int4-kmajor-i8-v1"


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


@dataclass
class ThresholdConfig:
    e: float
    split: str  #: "paper" (the allocation rule) or "search" (per-layer split chosen by output error)
    layers: list = field(default_factory=list)  #: LayerRecord
    alpha: float = ALPHA
    calibration: dict = field(default_factory=dict)  #: tokens, capacity, seed, source text, ...

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
    out = {"format": FORMAT, "version": VERSION, "int4_layout": INT4_LAYOUT, "model": model, "configs": []}
    for c in configs:
        d = asdict(c)
        d["layers"] = [{k: _enc(v) for k, v in asdict(r).items()} for r in c.layers]
        out["configs"].append(d)
    return out


def from_dict(d: dict) -> list:
    if d.get("format") != FORMAT:
        raise ValueError(f"prox: not a thresholds file (format {d.get('format')!r}, expected {FORMAT!r})")
    if d.get("version") != VERSION:
        raise ValueError(f"prox: thresholds file version {d.get('version')} is not supported (this is {VERSION})")
    configs = []
    for c in d["configs"]:
        layers = [LayerRecord(**{k: _dec(v) for k, v in r.items()}) for r in c["layers"]]
        configs.append(ThresholdConfig(e=float(c["e"]), split=c["split"], layers=layers,
                                       alpha=float(c.get("alpha", ALPHA)), calibration=c.get("calibration", {})))
    return configs


def save_thresholds(path: str | os.PathLike, configs, model: str = "", merge: bool = True) -> None:
    """Write configs (a ThresholdConfig or a list). With merge, configs already in the file with another
    (e, split) are kept; a config with the same (e, split) is replaced. Written atomically."""
    if isinstance(configs, ThresholdConfig):
        configs = [configs]
    configs = list(configs)
    if merge and os.path.exists(path):
        old = load_thresholds(path)
        keys = {(round(c.e, 9), c.split) for c in configs}
        configs = [c for c in old if (round(c.e, 9), c.split) not in keys] + configs
    configs.sort(key=lambda c: (c.split, c.e))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(to_dict(configs, model), f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_thresholds(path: str | os.PathLike) -> list:
    with open(path) as f:
        return from_dict(json.load(f))


def find_config(configs: list, e: float, split: str = "paper") -> ThresholdConfig:
    for c in configs:
        if abs(c.e - e) < 1e-9 and c.split == split:
            return c
    have = ", ".join(f"(e={c.e}, {c.split})" for c in configs)
    raise KeyError(f"prox: no thresholds for e={e}, split={split!r} (the file has {have or 'none'})")
