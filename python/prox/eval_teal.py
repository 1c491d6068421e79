# SPDX-License-Identifier: Apache-2.0
"""TEAL-style input sparsity: prox.eval_ppl's baseline rows "teal-uniform" and "teal-greedy" (after TEAL, Liu et
al. 2024, training-free magnitude-based activation sparsity). A torch module on any device; no CUDA kernel.

The method. Each projection of a gated MLP skips the entries of its input whose magnitude is below a threshold:
x (the MLP's input) into gate_proj and up_proj, and s = act(g) u into down_proj (the paper's Figure 2(c)):

    x~ = x [|x| >= tau_x],   s = act(W_gate x~) (W_up x~),   y = W_down (s [|s| >= tau_s]).

Effective sparsity. e is the fraction of the dense FFN's weight bytes and FLOPs a token skips, Prox's e too
(prox.allocation): each projection costs d_model d_ff, and an input entry skipped skips its weight row, so e is the
mean of the three projections' input sparsities, e = (2 s_x + s_s) / 3 (s_x: the fraction of x's entries under
tau_x, the input of two projections; s_s: the fraction of s's under tau_s). A layer at e runs each projection at
e (s_x = s_s = e); the realized e of a model (teal_report) is the skipped work over the dense work, summed over the
layers and tokens of the runtime counters.

Calibration (calibrate): sequential, as prox.sparsify's: for l = 1..L the calibration tokens run through the
layers < l with their TEAL thresholds, layer l's MLP inputs x are collected with layer l dense, tau_x is the
quantile of |x| at s_x and tau_s the quantile at s_s of |s| computed from x~ under that tau_x
(prox.calibration.calibrate_layer's rule: TEAL's s is Prox's Stage-1 s~ computed with the exact weights, which TEAL
keeps as the value where Prox recomputes it; TealMLP.proxy_values gives it under the name calibrate_layer and
prox.layerwise ask a layer for).

Allocation: "uniform" (every layer at e) or "greedy" (each layer its own e, their cost-weighted mean e), chosen by
the machinery of prox.sparsify(allocation="greedy"): each layer's error at each e of a grid, that layer alone
TEAL-sparse, is the mean KL divergence of the model's next-token distributions from the dense model's on the
calibration tokens (prox.layerwise.layer_kl_errors, with a TealMLP where Prox's measurement puts a SparseMLP), and
prox.allocation.allocate_layers raises the layer of least error per unit of FFN cost saved until the mean is e.
TEAL's own greedy also splits a layer's e between its three projections by the block's output error; this one moves
e between layers only, as Prox's greedy does, so that the two methods are compared under one allocation rule.

Configs are prox.ThresholdConfig with split "teal" (tau_x, tau_s per layer; s1 = s2 = the layer's e; the weights'
fingerprints; a greedy config records its layer errors like Prox's): prox.save_thresholds / load_thresholds
write and read them, in a file of their own (eval_ppl's --teal-thresholds), never a Prox thresholds file.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.nn as nn

from prox import reference
from prox.allocation import LAYER_E_MAX, LAYER_GRID_STEP, LayerErrors, StageSparsity, layer_grid
from prox.calibration import DEFAULT_CAPACITY, DEFAULT_SEED, calibrate_layer
from prox.layerwise import LayerWalk, as_sequences, first_tokens, layer_kl_errors
from prox.nn import detect_act, find_mlps, set_submodule
from prox.thresholds import (LayerRecord, MissingThresholds, ThresholdConfig, describe, find_config,
                             fingerprint_mismatch, layer_fingerprint)

SPLIT = "teal"  #: a TEAL-style config's split (prox.ThresholdConfig.split)
ALLOCATIONS = ("uniform", "greedy")


class TealMLP(nn.Module):
    """A gated MLP (gate_proj, up_proj, down_proj, act: its modules shared, not copied) run with TEAL-style input
    sparsity at thresholds (tau_x, tau_s) (the module's docstring). prefill: "sparse" (every token sparse, what
    eval_ppl scores) or "dense" (calls of several tokens run the dense MLP). counters: int64 [3], the tokens run
    sparse, x's entries kept and s's entries kept (teal_report)."""

    def __init__(self, mlp: nn.Module, tau_x: float = 0.0, tau_s: float = 0.0, prefill: str = "sparse"):
        super().__init__()
        if prefill not in ("dense", "sparse"):
            raise ValueError(f"prox: TealMLP: prefill must be 'dense' or 'sparse', got {prefill!r}")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = detect_act(mlp.act_fn)
        self.d_ff, self.d_model = (int(v) for v in mlp.gate_proj.weight.shape)
        dev = mlp.gate_proj.weight.device
        self.register_buffer("thresholds", torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32,
                                                        device=dev), persistent=False)
        self.register_buffer("counters", torch.zeros(3, dtype=torch.int64, device=dev), persistent=False)
        self.prefill = prefill
        self.tp = None  # no tensor parallelism (prox.layerwise reads it)

    def set_thresholds(self, tau_x: float, tau_s: float) -> None:
        self.thresholds.copy_(torch.tensor([float(tau_x), float(tau_s)], dtype=torch.float32))

    def get_thresholds(self) -> tuple[float, float]:
        t = self.thresholds.tolist()
        return float(t[0]), float(t[1])

    def reset_counters(self) -> None:
        self.counters.zero_()

    def proxy_values(self, x: torch.Tensor, tau_x) -> torch.Tensor:
        """s = act(W_gate x~) (W_up x~), x~ = x [|x| >= tau_x] (compared in float32, as Prox's Stage 1): the input
        of down_proj, whose magnitudes tau_s thresholds."""
        xk = torch.where(reference.input_mask(x, tau_x), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return reference.activation(self.act)(self.gate_proj(xk)) * self.up_proj(xk)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(reference.activation(self.act)(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.d_model
        if tokens > 1 and self.prefill == "dense":
            return self.dense(x)
        kx = reference.input_mask(x, self.thresholds[0])
        s = self.proxy_values(x, self.thresholds[0])
        ks = reference.input_mask(s, self.thresholds[1])
        y = self.down_proj(torch.where(ks, s, torch.zeros((), dtype=s.dtype, device=s.device)))
        self.counters += torch.stack([torch.tensor(tokens, device=kx.device), kx.sum(), ks.sum()])
        return y


def teal_mlps(model: nn.Module) -> list:
    """(name, TealMLP) of every TealMLP in the model, in depth order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TealMLP)]


def teal_report(model: nn.Module) -> dict:
    """The realized sparsity of the model's TealMLPs since their counters' reset: s1 (x's entries skipped, the
    input of gate_proj and up_proj), s2 (s's, down_proj's input) and effective (the dense FFN work skipped over the
    dense work: (2 s_x + s_s) / 3 per layer, weighted by the layers' tokens and cost), as prox.sparsity_report
    names them."""
    layers = [m for _, m in teal_mlps(model)]
    if not layers:
        raise RuntimeError("prox: teal_report: the model has no TealMLP")
    counts = torch.stack([m.counters.to(layers[0].counters.device) for m in layers]).tolist()
    calls = inputs = kept_x = channels = kept_s = skipped = work = 0
    for (t, kx, ks), m in zip(counts, layers):
        calls += t
        inputs, kept_x = inputs + t * m.d_model, kept_x + kx
        channels, kept_s = channels + t * m.d_ff, kept_s + ks
        skipped += 2 * m.d_ff * (t * m.d_model - kx) + m.d_model * (t * m.d_ff - ks)
        work += 3 * t * m.d_model * m.d_ff
    if calls == 0:
        return {"calls": 0, "s1": 0.0, "s2": 0.0, "effective": 0.0}
    return {"calls": calls, "s1": 1.0 - kept_x / inputs, "s2": 1.0 - kept_s / channels, "effective": skipped / work}


def _dense_mlps(model: nn.Module) -> list:
    """(name, module) of the model's gated MLPs, which must all be dense (no TealMLP, no SparseMLP)."""
    if teal_mlps(model):
        raise ValueError("prox: the model already runs TealMLPs: put its dense MLPs back first")
    mlps = find_mlps(model)
    if not mlps:
        raise ValueError("prox: no gated MLP (gate_proj/up_proj/down_proj) found in the model")
    if any(not hasattr(m, "act_fn") for _, m in mlps):
        raise ValueError("prox: TEAL-style sparsity runs on the model's dense MLPs (it holds SparseMLPs)")
    return mlps


def _decoder_layers(model: nn.Module, mlps: list) -> list:
    layers = [model.get_submodule(n.rpartition(".")[0]) for n, _ in mlps]
    if len({id(layer) for layer in layers}) != len(layers) or any(layer is model for layer in layers):
        raise ValueError("prox: TEAL-style calibration needs one gated MLP per decoder layer")
    return layers


def _cost(m) -> float:
    """A layer's dense FFN cost, 3 d_model d_ff (LayerErrors' costs)."""
    return 3.0 * m.gate_proj.weight.shape[0] * m.gate_proj.weight.shape[1]


@torch.no_grad()
def measure_errors(model: nn.Module, calibration_inputs, *, tokens: int = 2048, step: float = LAYER_GRID_STEP,
                   layer_bounds: tuple = (0.0, LAYER_E_MAX), capacity: int = DEFAULT_CAPACITY,
                   seed: int = DEFAULT_SEED, progress: Optional[Callable[[str], None]] = None) -> LayerErrors:
    """Each layer's model-level error at each effective sparsity g of layer_grid(lo, hi, step): the mean KL
    divergence per token of the next-token distributions from the dense model's when that layer alone runs
    TEAL-style at g (x and s each at g, its thresholds calibrated on its dense inputs), on the first ``tokens``
    calibration tokens (prox.layerwise.layer_kl_errors, as prox.measure_layer_errors measures Prox's). The model's
    MLPs must be dense; it is left as it was."""
    mlps = _dense_mlps(model)
    lo, hi = (float(v) for v in layer_bounds)
    if not (0.0 <= lo < hi < 1.0):
        raise ValueError(f"prox: layer_bounds must be (lo, hi) with 0 <= lo < hi < 1, got {layer_bounds!r}")
    if not (isinstance(tokens, int) and tokens >= 1):
        raise ValueError(f"prox: tokens must be an int >= 1, got {tokens!r}")
    grid = layer_grid(lo, hi, step)
    say = progress or (lambda s: None)
    t0 = time.time()
    names = [n for n, _ in mlps]
    was_training = model.training
    model.eval()
    try:
        walk = LayerWalk(model, _decoder_layers(model, mlps), first_tokens(as_sequences(
            calibration_inputs, next(model.parameters()).device), tokens), keep_logprobs=True)
        say(f"TEAL-style: measuring the error of {len(mlps)} layers at {len(grid)} effective sparsities each "
            f"({grid[0]:g} .. {grid[-1]:g}) on {walk.tokens} tokens")
        rows = layer_kl_errors(walk, [n.rpartition(".")[0] for n in names], names, lambda li: TealMLP(mlps[li][1]),
                               [StageSparsity(g, g) for g in grid], capacity=capacity, seed=seed, say=say)
    finally:
        model.train(was_training)
    seconds = time.time() - t0
    say(f"TEAL-style: layer errors measured in {seconds:.1f} s")
    return LayerErrors(names, grid, rows, [_cost(m) for _, m in mlps], "kl", walk.tokens,
                       {"seconds": round(seconds, 3), "step": step, "split": SPLIT})


def layer_errors_of(config: ThresholdConfig) -> LayerErrors:
    """The layer errors a greedy TEAL-style config was allocated by (to allocate another e without measuring)."""
    rec = config.calibration.get("allocation")
    if config.split != SPLIT or config.allocation != "greedy" or not rec:
        raise ValueError(f"prox: the config {describe(config)} is no greedy TEAL-style config: it records no layer "
                         "errors")
    return LayerErrors.from_dict(rec)


@torch.no_grad()
def calibrate(model: nn.Module, e: float, calibration_inputs, *, allocation: str = "uniform",
              layer_errors: Optional[LayerErrors] = None, allocation_tokens: int = 2048,
              allocation_step: float = LAYER_GRID_STEP, capacity: int = DEFAULT_CAPACITY, seed: int = DEFAULT_SEED,
              model_name: str = "", progress: Optional[Callable[[str], None]] = None) -> ThresholdConfig:
    """Calibrate TEAL-style thresholds for effective sparsity e (the module's docstring) and swap the model's MLPs
    for TealMLPs (prefill "sparse"; their counters reset). allocation: "uniform" or "greedy" (layer_errors: the
    LayerErrors to allocate by, e.g. an earlier greedy config's, layer_errors_of(); else measured with
    measure_errors on the first allocation_tokens tokens, every allocation_step of e from 0 to 0.9). Returns the
    config (split "teal"; prox.save_thresholds writes it)."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"prox: allocation must be one of {', '.join(map(repr, ALLOCATIONS))}, got {allocation!r}")
    if allocation != "greedy" and layer_errors is not None:
        raise ValueError("prox: layer_errors are for allocation='greedy'")
    if not (isinstance(e, (int, float)) and 0.0 <= e < 1.0):
        raise ValueError(f"prox: the target effective sparsity must be in [0, 1), got {e!r}")
    mlps = _dense_mlps(model)
    say = progress or (lambda s: None)
    if allocation == "greedy":
        if layer_errors is None:
            layer_errors = measure_errors(model, calibration_inputs, tokens=allocation_tokens, step=allocation_step,
                                          capacity=capacity, seed=seed, progress=say)
        if list(layer_errors.names) != [n for n, _ in mlps]:
            raise ValueError(f"prox: the layer errors are for {len(layer_errors.names)} other layers "
                             f"({', '.join(layer_errors.names[:2])}, ...)")
        layer_e = layer_errors.allocate(e)  # raises where e lies outside the layers' bounds
    else:
        layer_e = [float(e)] * len(mlps)
    seqs = as_sequences(calibration_inputs, next(model.parameters()).device)
    was_training = model.training
    model.eval()
    walk = LayerWalk(model, _decoder_layers(model, mlps), seqs)
    hidden = list(walk.hidden0)
    cfg = ThresholdConfig(e=float(e), split=SPLIT, model=model_name, allocation=allocation,
                          calibration={"tokens": walk.tokens, "sequences": len(seqs), "capacity": capacity,
                                       "seed": seed, "method": "teal-style input sparsity (prox.eval_teal)"})
    if allocation == "greedy":
        cfg.calibration["allocation"] = layer_errors.to_dict()
    for li, (name, mlp) in enumerate(mlps):
        t1 = time.time()
        x, _ = walk.mlp_inputs(li, mlp, hidden)
        teal = TealMLP(mlp)
        lt = calibrate_layer(x, layer_e[li], layer_e[li], teal.proxy_values, capacity=capacity, seed=seed)
        teal.set_thresholds(lt.tau_x, lt.tau_s)
        y_dense = mlp(x).double()
        err = float((teal(x).double() - y_dense).pow(2).sum() / y_dense.pow(2).sum().clamp_min(1e-300))
        cfg.layers.append(LayerRecord(name, teal.d_model, teal.d_ff, teal.act, layer_e[li], layer_e[li], lt.tau_x,
                                      lt.tau_s, lt.realized_s1, lt.realized_s2, err,
                                      layer_fingerprint(mlp.gate_proj.weight, mlp.up_proj.weight,
                                                        mlp.down_proj.weight), "native", layer_e[li]))
        set_submodule(model, name, teal)
        hidden = walk.outputs(li, hidden)  # this layer's outputs with its TEAL thresholds: the next layer's inputs
        say(f"  {name}: e={layer_e[li]:.3f} tau_x={lt.tau_x:.4g} tau_s={lt.tau_s:.4g} (realized "
            f"{lt.realized_s1:.3f}/{lt.realized_s2:.3f}) ffn rel. error {err:.4f} [{time.time() - t1:.1f} s]")
    for _, m in teal_mlps(model):
        m.reset_counters()
    model.train(was_training)
    return cfg


def apply(model: nn.Module, configs, e: float, allocation: str = "uniform") -> ThresholdConfig:
    """Swap the model's dense MLPs for TealMLPs with the thresholds of the config (e, "teal", allocation) among
    ``configs`` (a MissingThresholds when there is none), after checking every layer's name, shape and weight
    fingerprint (all or nothing: a mismatch raises before any swap). Returns the config."""
    teal = [c for c in configs if c.split == SPLIT]
    try:
        cfg = find_config(teal, e, SPLIT, allocation)
    except MissingThresholds:
        raise MissingThresholds(f"prox: the TEAL-style thresholds hold no config for e={e}, allocation="
                                f"{allocation!r}; they hold {', '.join(describe(c) for c in teal) or 'none'}. "
                                "Calibrate it: prox.eval_teal.calibrate(model, e, calibration_ids, "
                                f"allocation={allocation!r})") from None
    mlps = _dense_mlps(model)
    recs = cfg.by_name()
    problems = []
    if sorted(recs) != sorted(n for n, _ in mlps):
        problems.append(f"its layers are {len(recs)} others than the model's {len(mlps)}")
    for name, m in mlps:
        r = recs.get(name)
        if r is None:
            continue
        if (r.d_model, r.d_ff) != (m.gate_proj.weight.shape[1], m.gate_proj.weight.shape[0]):
            problems.append(f"{name}: shape ({r.d_model}, {r.d_ff})")
            continue
        why = fingerprint_mismatch(r.fingerprint, layer_fingerprint(m.gate_proj.weight, m.up_proj.weight,
                                                                    m.down_proj.weight)) if r.fingerprint else None
        if why:
            problems.append(f"{name}: other weights ({why})")
    if problems:
        raise ValueError(f"prox: the TEAL-style thresholds {describe(cfg)} do not match this model: "
                         + "; ".join(problems[:4]))
    for name, m in mlps:
        r = recs[name]
        set_submodule(model, name, TealMLP(m, r.tau_x, r.tau_s))
    return cfg

