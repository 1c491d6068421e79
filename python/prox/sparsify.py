# SPDX-License-Identifier: Apache-2.0
"""prox.sparsify: calibrate a model's gated MLPs layer by layer in the paper's sequential order and swap
them for SparseMLPs in place.

Order (paper, appendix "Sequential threshold calibration"): for l = 1..L, run the calibration tokens
through layers < l with their finalized sparse rules (Prox on every token), collect layer l's MLP inputs
x_l with layer l dense, choose tau_x at s1 on |x_l|, compute s~ by Stage 1 under that tau_x and choose
tau_s at s2 on |s~|. The decoder layers are run one at a time on cached hidden states (prox.layerwise.LayerWalk:
each layer's call arguments, such as masks and position embeddings, are captured from one dense forward), so
calibration costs about three passes of the model, not L.

allocation="uniform" gives every layer the target e (the paper's). allocation="greedy" (beyond the paper) gives
each layer its own e, their mean (weighted by the layers' dense FFN cost) the target: measure_layer_errors
measures each layer's model-level error (the KL divergence of the next-token distributions from the dense
model's, that layer alone sparse) at each e of a grid, and prox.allocation.allocate_layers raises, from the
bottom of the grid, the layer whose next step costs the least error per unit of FFN cost saved until the mean is
the target. The thresholds are then calibrated in the sequential order above at each layer's e.

split="paper" takes a layer's (s1, s2) from the allocation rule at its e. split="search" (beyond the paper)
chooses each layer's (s1, s2) on the line of its effective sparsity e by the relative error of the FFN's output
on the calibration tokens, then calibrates the chosen pair like the paper's rule.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from . import _ops, formats, reference
from ._ops import PlanOptions
from .allocation import (LAYER_E_MAX, LAYER_GRID_STEP, LayerErrors, StageSparsity, allocate_sparsity, layer_grid,
                         max_effective_sparsity, split_candidates)
from .calibration import (DEFAULT_CAPACITY, DEFAULT_SEED, Calibrator, calibrate_layer, proxy_threshold,
                          quantile_threshold)
from .distributed import agreed, all_reduce_float64, check_same_thresholds, fingerprints as tp_fingerprints
from .layerwise import LayerWalk, as_sequences, first_tokens, layer_kl_errors
from .sparse_mlp import check_run_options
from .nn import (SparseMLP, activation_dtype, find_mlps, mlp_kwargs, model_pool, set_mode, set_submodule,
                 sparse_mlps)
from .planned import summed_report
from .thresholds import (ALLOCATIONS, INT4_LAYOUT, LayerRecord, ThresholdConfig, describe, find_config,
                         fingerprint_mismatch, load_thresholds)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    d = (y.double() - ref.double()).pow(2).sum()
    return float(d / ref.double().pow(2).sum().clamp_min(1e-300))


def _whole(sp: SparseMLP, y: torch.Tensor) -> torch.Tensor:
    """A sharded layer's partial output summed over the ranks (float64, through its group); y itself otherwise.
    The output error needs the whole y: ||sum_r (y_r - y_dense_r)||^2 is not the sum of the ranks' own."""
    return y if sp.tp is None else all_reduce_float64(y, sp.tp.group)


def _layer_error(sp: SparseMLP, x: torch.Tensor, tau_x: float, tau_s: float, y_dense: torch.Tensor) -> float:
    qg, qu = sp._q()
    wg, wu, wdt = sp.exact_weights()  # an FP8 layer's dequantized weights
    y = reference.prox_ffn(x, wg, wu, wdt, qg, sp.scale_gate, qu, sp.scale_up, tau_x, tau_s, sp.act)
    return _relative_error(_whole(sp, y), y_dense)


def _search_split(sp: SparseMLP, xs: torch.Tensor, y_dense: torch.Tensor, cands: Sequence[StageSparsity],
                  capacity: int, seed: int):
    """(best candidate, [(s1, s2, error)]) by the FFN output error on the tokens xs (y_dense: their dense
    output). Each candidate is calibrated on xs by calibrate_layer's rule; |xs| is sampled and sorted once for
    all of them."""
    cal = Calibrator(capacity, seed)
    cal.add(xs)
    ax = cal.magnitudes()
    qg, qu = sp._q()

    def proxy_values(x2, tau_x):  # the proxies: no dequantized weights needed
        return reference.proxy_values(x2, qg, sp.scale_gate, qu, sp.scale_up, tau_x, sp.act)
    rows = []
    for c in cands:
        tau_x = quantile_threshold(ax, c.s1)[0]
        tau_s = proxy_threshold(xs, tau_x, c.s2, proxy_values, capacity=capacity, seed=seed,
                                token_chunk=max(1, xs.shape[0]), tp=sp.tp).tau
        rows.append((c.s1, c.s2, _layer_error(sp, xs, tau_x, tau_s, y_dense)))
    best = min(range(len(rows)), key=lambda i: rows[i][2])
    return cands[best], rows


@torch.no_grad()
def sparsify(model: nn.Module, e: float, calibration_inputs=None, *, thresholds=None, split: Optional[str] = None,
             allocation: Optional[str] = None, layer_bounds: Optional[tuple] = None, layer_errors=None,
             allocation_tokens: int = 2048, allocation_step: float = LAYER_GRID_STEP,
             s1_grid=None, backend: str = "auto", prefill: str = "dense", keep_down: bool = False,
             capacity: int = DEFAULT_CAPACITY, seed: int = DEFAULT_SEED, search_tokens: int = 4096,
             options: PlanOptions = PlanOptions(), track_sparsity: bool = False, strict: bool = True,
             model_name: str = "", alpha: Optional[float] = None, dtype: Optional[torch.dtype] = None,
             progress: Optional[Callable[[str], None]] = None) -> ThresholdConfig:
    """Calibrate (or load) thresholds for target effective sparsity e and swap the model's MLPs for SparseMLPs.

    Args:
        model: a causal LM whose decoder layers each hold one gated MLP (Llama, Qwen2/3, Mistral, Gemma).
        e: target effective sparsity (0.4, 0.5, 0.6, 0.7 in the paper): every layer's with allocation="uniform",
            the mean of the layers' own (weighted by their dense FFN cost, 3 d_model d_ff) with "greedy".
        calibration_inputs: token ids [N, T] (or a list of [T] / [1, T] tensors, or of model-input dicts).
        thresholds: instead of calibrating, a thresholds file path, a list of ThresholdConfig or one
            ThresholdConfig (its config for (e, split, allocation) is applied; its e, split and allocation must be
            these).
        split: "paper" (allocation rule, the default) or "search" (per-layer split by FFN output error).
        allocation: how e is spread over the layers: "uniform" (every layer at e, the paper's; the default) or
            "greedy" (each layer its own e, chosen by its measured model-level error: measure_layer_errors, then
            prox.allocation.allocate_layers; beyond the paper). A ThresholdConfig given as thresholds= says its
            own (checked when this is given).
        layer_bounds: greedy: (lo, hi), the range of every layer's e (default (0, 0.9)).
        layer_errors: greedy: the per-layer errors to allocate by, instead of measuring them: a LayerErrors
            (measure_layer_errors()) or a greedy ThresholdConfig of this model (it records them), e.g. to calibrate
            another e.
        allocation_tokens, allocation_step: greedy: the errors are measured on the first allocation_tokens
            calibration tokens, at every layer e on the grid lo, hi and the multiples of allocation_step between.
        backend, prefill, keep_down, options, track_sparsity: SparseMLP's (prefill is set after calibration;
            during calibration finalized layers run Prox on every token).
        strict, model_name: apply_thresholds()'s checks of given thresholds; model_name is also recorded in a
            new config.
        alpha: the allocation's alpha (the split of e between the stages and the search's line of equal e);
            default the weight format's (prox.formats: ALPHA for fp16/bf16 MLPs, FP8_ALPHA for FP8
            ones, where e is the fraction of the dense FP8 FFN's cost saved). Recorded in the config.
        dtype: FP8 MLPs' activation dtype (SparseMLP's dtype=; default: the model's, activation_dtype()).
    Returns the ThresholdConfig (save it with prox.save_thresholds).
    """
    if split not in (None, "paper", "search"):
        raise ValueError(f"prox: split must be 'paper' or 'search', got {split!r}")
    if allocation not in (None,) + ALLOCATIONS:
        raise ValueError(f"prox: allocation must be one of {', '.join(map(repr, ALLOCATIONS))}, got {allocation!r}")
    if allocation != "greedy" and (layer_bounds is not None or layer_errors is not None):
        raise ValueError("prox: layer_bounds and layer_errors are for allocation='greedy' (this call's allocation is "
                         f"{allocation or 'uniform'!r})")
    if thresholds is None and calibration_inputs is None:
        raise ValueError("prox: give calibration_inputs (token ids) or thresholds")
    say = progress or (lambda s: None)
    mlps = find_mlps(model)
    if not mlps:
        raise ValueError("prox: no gated MLP (gate_proj/up_proj/down_proj) found in the model")
    # Every argument is checked here, before the model is touched or run: a bad e or option costs no dense pass.
    _check_options(backend, prefill, options, capacity, search_tokens, dtype)
    # The model's layers share one workspace pool of their own (never another model's).
    kw = dict(backend=backend, keep_down=keep_down, options=options, track_sparsity=track_sparsity,
              workspace_pool=model_pool(model), dtype=dtype)
    act_dtype = activation_dtype(model)

    if thresholds is not None:
        cfg = thresholds
        if isinstance(cfg, ThresholdConfig):
            if abs(cfg.e - e) > 1e-9 or (split is not None and cfg.split != split) or \
                    (allocation is not None and cfg.allocation != allocation):
                raise ValueError(f"prox: the ThresholdConfig given is for e={cfg.e}, split={cfg.split!r}, allocation="
                                 f"{cfg.allocation!r}; this call asks for e={e}"
                                 + (f", split={split!r}" if split is not None else "")
                                 + (f", allocation={allocation!r}" if allocation is not None else ""))
        else:
            cfg = find_config(load_thresholds(cfg) if not isinstance(cfg, list) else cfg, e, split or "paper",
                              allocation or "uniform")
        # All or nothing: the SparseMLPs are built and the thresholds checked against them before the first swap,
        # so a refused file leaves the model as it was.
        layers = {name: m if isinstance(m, SparseMLP) else
                  SparseMLP.from_mlp(m, prefill=prefill, **mlp_kwargs(m, kw, act_dtype)) for name, m in mlps}
        _apply(layers, cfg, strict=strict, model_name=model_name)
        for name, m in mlps:
            if layers[name] is not m:
                set_submodule(model, name, layers[name])
        set_mode(model, prefill=prefill)
        return cfg
    split, allocation = split or "paper", allocation or "uniform"
    alpha = _alpha(mlps, alpha)
    allocate_sparsity(e, alpha)  # checks e (and alpha)
    if allocation == "greedy":
        errors, grid = _greedy_inputs(e, alpha, [n for n, _ in mlps], layer_bounds, layer_errors, allocation_tokens,
                                      allocation_step)

    mlps, layers, seqs = _prepare(model, mlps, calibration_inputs, kw, act_dtype)
    built = {}  # SparseMLPs made for the error measurement, used again below
    if allocation == "greedy":
        if errors is None:
            errors = _measure(model, mlps, layers, seqs, grid, alpha, allocation_tokens, allocation_step, kw,
                              act_dtype, capacity, seed, say, built)
        layer_e = errors.allocate(e)
    else:
        layer_e = [float(e)] * len(mlps)

    was_training = model.training
    model.eval()
    t0 = time.time()
    walk = LayerWalk(model, layers, seqs)
    hidden = list(walk.hidden0)
    say(f"prox.sparsify: e={e:.2f} split={split} allocation={allocation}: {len(layers)} layers, {len(seqs)} "
        f"sequences, {walk.tokens} tokens (captured in {time.time() - t0:.1f} s)")

    cfg = ThresholdConfig(e=float(e), split=split, alpha=float(alpha),
                          calibration={"tokens": walk.tokens, "sequences": len(seqs), "capacity": capacity,
                                       "seed": seed},
                          model=model_name, int4_layout=_int4_layout(), allocation=allocation)
    if allocation == "greedy":
        cfg.calibration["allocation"] = errors.to_dict()
    search_rows = {}
    for li, ((name, mlp), layer) in enumerate(zip(mlps, layers)):
        t1 = time.time()
        x, _ = walk.mlp_inputs(li, mlp, hidden)
        sp = mlp if isinstance(mlp, SparseMLP) else built.get(li) or SparseMLP.from_mlp(
            mlp, prefill="sparse", **mlp_kwargs(mlp, kw, act_dtype))
        sp.prefill = "sparse"
        xs_err = x[:search_tokens]  # the tokens the split search and the reported output error are scored on
        y_dense = _whole(sp, reference.dense_ffn(xs_err, *sp.exact_weights(), sp.act))
        if split == "search":
            choice, rows = _search_split(sp, xs_err, y_dense, split_candidates(layer_e[li], alpha, s1_grid=s1_grid),
                                         capacity, seed)
            search_rows[name] = rows
        else:
            choice = allocate_sparsity(layer_e[li], alpha)
        lt = calibrate_layer(x, choice.s1, choice.s2, sp.proxy_values, capacity=capacity, seed=seed, tp=sp.tp)
        sp.set_thresholds(lt.tau_x, lt.tau_s)
        err = _layer_error(sp, xs_err, lt.tau_x, lt.tau_s, y_dense)
        cfg.layers.append(LayerRecord(name, sp.d_model, sp.d_ff_full, sp.act, choice.s1, choice.s2, lt.tau_x,
                                      lt.tau_s, lt.realized_s1, lt.realized_s2, err, sp.fingerprint(), sp.format,
                                      float(layer_e[li])))
        if sp is not mlp:
            set_submodule(model, name, sp)
        hidden = walk.outputs(li, hidden)  # this layer's outputs, with its sparse rule: the next layer's inputs
        say(f"  {name}: e={layer_e[li]:.3f} s1={choice.s1:.3f} s2={choice.s2:.3f} tau_x={lt.tau_x:.4g} "
            f"tau_s={lt.tau_s:.4g} (realized {lt.realized_s1:.3f}/{lt.realized_s2:.3f}) ffn rel. error {err:.4f} "
            f"[{time.time() - t1:.1f} s]")
    if search_rows:
        cfg.calibration["search"] = {n: [list(r) for r in rows] for n, rows in search_rows.items()}
    for _, m in sparse_mlps(model):  # counters report use after calibration only
        m.reset_counters()
    set_mode(model, prefill=prefill)
    model.train(was_training)
    return cfg


@torch.no_grad()
def measure_layer_errors(model: nn.Module, calibration_inputs, *, layer_bounds: Optional[tuple] = None,
                         step: float = LAYER_GRID_STEP, tokens: int = 2048, alpha: Optional[float] = None,
                         backend: str = "auto", capacity: int = DEFAULT_CAPACITY, seed: int = DEFAULT_SEED,
                         dtype: Optional[torch.dtype] = None,
                         progress: Optional[Callable[[str], None]] = None) -> LayerErrors:
    """Each layer's model-level error at each effective sparsity of the grid layer_grid(lo, hi, step) (layer_bounds
    = (lo, hi), default (0, 0.9)): the mean KL divergence per token of the model's next-token distributions from the
    dense model's when that layer alone runs Prox at that e (the paper's split; thresholds calibrated on the layer's
    dense inputs), on the first ``tokens`` calibration tokens (prox.layerwise.layer_kl_errors). What
    sparsify(allocation="greedy") allocates by; pass it there as layer_errors= to calibrate several e on one
    measurement. The model is left as it was (its SparseMLPs, if any, with their thresholds and modes)."""
    mlps = find_mlps(model)
    if not mlps:
        raise ValueError("prox: no gated MLP (gate_proj/up_proj/down_proj) found in the model")
    _check_options(backend, "dense", PlanOptions(), capacity, 1, dtype)
    alpha = _alpha(mlps, alpha)
    lo, hi = _bounds(layer_bounds, alpha)
    _check_grid_args(tokens, step)
    kw = dict(backend=backend, workspace_pool=model_pool(model), dtype=dtype)
    act_dtype = activation_dtype(model)
    swapped = {n: m for n, m in mlps}
    mlps, layers, seqs = _prepare(model, mlps, calibration_inputs, kw, act_dtype)
    try:
        return _measure(model, mlps, layers, seqs, layer_grid(lo, hi, step), alpha, tokens, step, kw, act_dtype,
                        capacity, seed, progress or (lambda s: None), {})
    finally:
        for name, m in swapped.items():  # MLPs _prepare replaced for their dense forward: put back
            if model.get_submodule(name) is not m:
                set_submodule(model, name, m)


def _alpha(mlps, alpha: Optional[float]) -> float:
    """The allocation's alpha: the one given, else the MLPs' weight format's."""
    if alpha is not None:
        return alpha
    alphas = {formats.of_module(m).alpha for _, m in mlps}
    if len(alphas) > 1:
        raise ValueError("prox: the model's MLPs mix weight formats whose default alphas differ "
                         f"({sorted(alphas)}): give alpha=")
    return alphas.pop()


def _bounds(layer_bounds, alpha: float) -> tuple:
    """(lo, hi) of every layer's e under allocation="greedy", checked."""
    top = max_effective_sparsity(alpha)
    if layer_bounds is None:
        return 0.0, min(LAYER_E_MAX, top)
    try:
        lo, hi = (float(v) for v in layer_bounds)
    except (TypeError, ValueError):
        raise ValueError(f"prox: layer_bounds must be a pair (lo, hi) of effective sparsities, got {layer_bounds!r}")
    if not (0.0 <= lo < hi <= top):
        raise ValueError(f"prox: layer_bounds must be (lo, hi) with 0 <= lo < hi <= {top:.4f} (the largest effective "
                         f"sparsity at alpha={alpha:.4g}), got {layer_bounds!r}")
    return lo, hi


def _check_grid_args(tokens, step) -> None:
    if not (isinstance(tokens, int) and tokens >= 1):
        raise ValueError(f"prox: allocation_tokens must be an int >= 1, got {tokens!r}")
    if not (isinstance(step, (int, float)) and 0.0 < step <= 1.0):
        raise ValueError(f"prox: allocation_step must be in (0, 1], got {step!r}")


def _greedy_inputs(e: float, alpha: float, names: list, layer_bounds, layer_errors, tokens, step) -> tuple:
    """allocation="greedy"'s arguments, checked before any pass: (the given LayerErrors restricted to the bounds, or
    None) and the grid to measure on."""
    _check_grid_args(tokens, step)
    if isinstance(layer_errors, ThresholdConfig):
        rec = layer_errors.calibration.get("allocation")
        if layer_errors.allocation != "greedy" or not rec:
            raise ValueError(f"prox: layer_errors: the ThresholdConfig {describe(layer_errors)} records no layer "
                             "errors (only a greedy config does)")
        layer_errors = LayerErrors.from_dict(rec)
    if layer_errors is not None and not isinstance(layer_errors, LayerErrors):
        raise TypeError(f"prox: layer_errors must be a LayerErrors or a greedy ThresholdConfig, got "
                        f"{type(layer_errors).__name__}")
    if layer_errors is not None and layer_bounds is None:
        lo, hi = layer_errors.grid[0], layer_errors.grid[-1]
    else:
        lo, hi = _bounds(layer_bounds, alpha)
    if not (lo - 1e-12 <= e <= hi + 1e-12):
        raise ValueError(f"prox: e={e} cannot be the mean of layers whose e lie in [{lo:g}, {hi:g}] (layer_bounds): "
                         "widen layer_bounds, or choose e inside them")
    if layer_errors is None:
        return None, layer_grid(lo, hi, step)
    if list(layer_errors.names) != names:
        raise ValueError(f"prox: layer_errors are for the layers {_few(layer_errors.names)}, the model's are "
                         f"{_few(names)}")
    errors = layer_errors.within(lo, hi)
    return errors, errors.grid


def _few(names) -> str:
    names = list(names)
    return f"{len(names)} ({', '.join(names[:2])}{', ...' if len(names) > 2 else ''})"


def _prepare(model: nn.Module, mlps: list, calibration_inputs, kw: dict, act_dtype) -> tuple:
    """(mlps, decoder layers, sequences) for a pass over the layers. MLPs whose own forward is not their format's
    dense MLP (FP8 checkpoint linears: transformers' FP8Linear loads its Triton kernel through the `kernels` package,
    which may not be installed) are swapped for a SparseMLP, whose dense path (the format's prefill) runs their
    dense passes."""
    device = next(model.parameters()).device
    seqs = as_sequences(calibration_inputs, device)
    layers = [model.get_submodule(n.rpartition(".")[0]) for n, _ in mlps]
    if len({id(layer) for layer in layers}) != len(layers) or any(layer is model for layer in layers):
        raise ValueError("prox: sparsify needs one gated MLP per decoder layer")
    mlps = list(mlps)
    for k, (name, m) in enumerate(mlps):
        if not isinstance(m, SparseMLP) and not formats.of_module(m).module_forward_is_dense:
            sp = SparseMLP.from_mlp(m, prefill="dense", **mlp_kwargs(m, kw, act_dtype))
            set_submodule(model, name, sp)
            mlps[k] = (name, sp)
    return mlps, layers, seqs


def _measure(model, mlps, layers, seqs, grid, alpha, tokens, step, kw, act_dtype, capacity, seed, say,
             built: dict) -> LayerErrors:
    """measure_layer_errors on prepared layers (built: the SparseMLPs it makes, by layer index)."""
    t0 = time.time()
    names = [n for n, _ in mlps]
    sparse = list(sparse_mlps(model))
    modes = [(m.prefill, m.batched) for _, m in sparse]
    was_training = model.training
    model.eval()

    def sparse_of(li):
        m = mlps[li][1]
        if isinstance(m, SparseMLP):
            return m
        if li not in built:
            built[li] = SparseMLP.from_mlp(m, prefill="sparse", **mlp_kwargs(m, kw, act_dtype))
        return built[li]
    try:
        set_mode(model, prefill="dense", batched=False)  # SparseMLPs already there run their dense path
        walk = LayerWalk(model, layers, first_tokens(seqs, tokens), keep_logprobs=True)
        say(f"prox: measuring the error of {len(layers)} layers at {len(grid)} effective sparsities each "
            f"({grid[0]:g} .. {grid[-1]:g}) on {walk.tokens} tokens")
        rows = layer_kl_errors(walk, [n.rpartition(".")[0] for n in names], names, sparse_of,
                               [allocate_sparsity(g, alpha) for g in grid], capacity=capacity, seed=seed, say=say)
    finally:
        for (_, m), (p, b) in zip(sparse, modes):
            m.prefill, m.batched = p, b
        model.train(was_training)
    costs = [3.0 * sparse_of(li).d_model * sparse_of(li).d_ff_full for li in range(len(mlps))]  # dense FFN cost
    seconds = time.time() - t0
    say(f"prox: layer errors measured in {seconds:.1f} s")
    return LayerErrors(names, [float(g) for g in grid], rows, costs, "kl", walk.tokens,
                       {"seconds": round(seconds, 3), "step": step, "split": "paper", "alpha": alpha})


def _check_options(backend, prefill, options, capacity, search_tokens, dtype) -> None:
    """sparsify()'s arguments that are checked where they are used only after the dense pass."""
    check_run_options(backend, prefill, options)
    if not (isinstance(capacity, int) and capacity >= 1):
        raise ValueError(f"prox: capacity must be an int >= 1, got {capacity!r}")
    if not (isinstance(search_tokens, int) and search_tokens >= 1):
        raise ValueError(f"prox: search_tokens must be an int >= 1, got {search_tokens!r}")
    if dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"prox: dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {dtype}")


def _int4_layout() -> str:
    return _ops.int4_layout() if _ops.available() else INT4_LAYOUT


def apply_thresholds(model: nn.Module, config: ThresholdConfig, *, strict: bool = True, model_name: str = "") -> None:
    """Set every SparseMLP's thresholds from a config (device fills: no re-plan, valid inside captured graphs).

    Thresholds hold only for the weights they were calibrated on. Checked first (all or nothing): every
    SparseMLP has a record and every record a SparseMLP (by name), with the layer's shape and activation,
    the weights' fingerprint (computed once per layer and weight version, so switching configs per request
    costs only the fills), the INT4 layout, and the model name when both the config and ``model_name`` have
    one. strict=False applies what matches by name and shape despite the other differences, with a warning
    (layers without a record keep their thresholds). A shape mismatch is refused either way. Records without
    a fingerprint (version-1 files) are applied with a warning that their weights could not be checked.

    Records are full layers: a tensor-parallel shard takes its layer's record at any TP degree (its shape is
    checked with d_ff_full, its fingerprint is the full layer's: prox.distributed.fingerprints, one all-reduce
    for every sharded layer). Every rank agrees on errors, and one all-gather checks that the ranks hold the
    same thresholds afterwards."""
    layers = dict(sparse_mlps(model))
    if not layers:
        raise ValueError("prox: the model has no SparseMLP (sparsify or swap_mlps first)")
    _apply(layers, config, strict=strict, model_name=model_name)


def _apply(layers: dict, config: ThresholdConfig, *, strict: bool, model_name: str) -> None:
    """apply_thresholds() on SparseMLPs by name ({name: SparseMLP}, in the model or not yet): checked, then set."""
    recs = config.by_name()
    tp = [m for m in layers.values() if m.tp is not None]
    fps = tp_fingerprints(tp)  # collective (every rank, every sharded layer) before any check can raise
    with agreed(tp[0].tp.group if tp else None, enabled=bool(tp)):
        _apply_checked(config, recs, layers, fps, strict, model_name)
    check_same_thresholds(tp)


def _apply_checked(config: ThresholdConfig, recs: dict, layers: dict, tp_fps: list, strict: bool,
                   model_name: str) -> None:
    fps = {id(m): f for m, f in zip([m for m in layers.values() if m.tp is not None], tp_fps)}
    problems, unverified = [], []
    missing = [n for n in layers if n not in recs]
    extra = [n for n in recs if n not in layers]
    if missing:
        problems.append(f"no thresholds for {len(missing)} layer(s) ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''})")
    if extra:
        problems.append(f"thresholds for {len(extra)} layer(s) the model does not have ({', '.join(extra[:3])}"
                        f"{', ...' if len(extra) > 3 else ''})")
    layout = _int4_layout()
    if config.int4_layout and config.int4_layout != layout:
        problems.append(f"INT4 layout {config.int4_layout!r}, this build's is {layout!r}")
    if config.model and model_name and config.model != model_name:
        problems.append(f"calibrated for model {config.model!r}, applied to {model_name!r}")
    for name, m in layers.items():
        r = recs.get(name)
        if r is None:
            continue
        if (r.d_model, r.d_ff) != (m.d_model, m.d_ff_full):
            raise ValueError(f"prox: {name}: thresholds for shape ({r.d_model}, {r.d_ff}), layer is "
                             f"({m.d_model}, {m.d_ff_full})")
        if r.act != m.act:
            problems.append(f"{name}: calibrated with activation {r.act!r}, the layer runs {m.act!r}")
        if r.format != m.format:
            problems.append(f"{name}: calibrated on {r.format!r} weights, the layer runs the {m.format!r} format")
        if r.fingerprint is None:
            unverified.append(name)
        else:
            why = fingerprint_mismatch(r.fingerprint, fps[id(m)] if m.tp is not None else m.fingerprint())
            if why:
                problems.append(f"{name}: other weights ({why})")
    if problems:
        msg = (f"prox: the thresholds {describe(config)} do not match this model: " + "; ".join(problems[:4])
               + (f"; and {len(problems) - 4} more" if len(problems) > 4 else ""))
        if strict:
            raise ValueError(msg + ". Pass strict=False to apply them anyway")
        warnings.warn(msg + " (applied anyway: strict=False)", RuntimeWarning, stacklevel=3)
    if unverified:
        warnings.warn(f"prox: {len(unverified)} layer record(s) of the thresholds {describe(config)} carry "
                      "no weight fingerprint (a version-1 file): they cannot be checked against the weights. Re-save "
                      "the file (prox.save_thresholds(path, configs, fingerprints=model)) once the model is known "
                      "to be the one calibrated on", RuntimeWarning, stacklevel=3)
    for name, m in layers.items():
        r = recs.get(name)
        if r is not None:
            m.set_thresholds(r.tau_x, r.tau_s)


def sparsity_report(model: nn.Module) -> dict:
    """Runtime sparsity over every SparseMLP built with track_sparsity=True (summed counters; one read of
    the device for all layers). Raises when no SparseMLP counts (a report of zeros would be read as data)."""
    all_layers = [m for _, m in sparse_mlps(model)]
    layers = [m for m in all_layers if m.counters is not None]
    if not layers:
        raise RuntimeError(f"prox: sparsity_report: none of the model's {len(all_layers)} SparseMLPs counts "
                           "sparsity: pass track_sparsity=True to sparsify() / swap_mlps() / SparseMLP"
                           if all_layers else "prox: sparsity_report: the model has no SparseMLP")
    dev = layers[0].counters.device
    counts = torch.stack([m.counters.to(dev) for m in layers]).tolist()
    alphas = {m.alpha for m in layers}
    if len(alphas) > 1:
        raise ValueError("prox: sparsity_report: the layers mix weight formats of different alphas (FP8 and "
                         "fp16/bf16): report them apart")
    return summed_report(((c, m.d_model, m.d_ff) for c, m in zip(counts, layers)), alphas.pop())
