# SPDX-License-Identifier: Apache-2.0
"""bench_decode's generate mode (``python -m prox.bench_decode --generate``): what a transformers user gets from
``model.generate``, dense against Prox, with the default cache and with ``cache_implementation="static"``.

    python -m prox.bench_decode --generate --models 8b --dtypes bf16 --contexts 512      # an H100/H200
    python -m prox.bench_decode --generate --device cpu --models tiny                     # a smoke test

Setup: benchlib's Qwen3-shaped model with random weights (nothing downloaded), a prompt of --contexts random
tokens, greedy decoding of --new-tokens tokens (``do_sample=False``, ``min_new_tokens`` = ``max_new_tokens``, so
every run makes the same number of steps). Prox is what a user runs: ``prox.sparsify`` with the paper's split,
calibrated on --calib-tokens random tokens per e (or the configs of a --thresholds file), the MLPs swapped for
SparseMLPs once, and ``prox.apply_thresholds`` switching e in device memory between runs. Prefill runs dense (the
SparseMLP default), the one-token decode steps through the CUDA op.

Two caches per model:
- "dynamic": ``model.generate``'s default (a DynamicCache), eager: each step is the transformers forward in Python;
- "static": ``cache_implementation="static"``, which transformers compiles by itself on CUDA (``torch.compile``,
  mode "reduce-overhead": CUDA graphs); the first run of each MLP kind pays the compilation (``warmup_s``).

Reported per cell (model, dtype, context, cache): the decode tokens/s ((new tokens - 1) / (time of a run of new
tokens - time of a run of one token): the steps after the prefill), the end-to-end tokens/s of a run (prefill
included), dense and Prox at each e with the speed-up, and the realized s1/s2/e of the decode steps. Medians of
--repeats runs. On the CPU nothing is timed: every (cache, MLP kind, e) runs once through the torch reference, and
the cell records whether the static cache generated the dynamic cache's tokens.
"""
from __future__ import annotations

import statistics
import time

import torch

import prox
from prox.benchlib import DTYPES, build_model, dtype_name, log, realized, require_op, target

CACHES = ("dynamic", "static")


def generate(model, ids: torch.Tensor, new_tokens: int, cache: str) -> tuple[float, torch.Tensor]:
    """(seconds, generated ids) of one greedy ``model.generate`` of exactly ``new_tokens`` tokens."""
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    if ids.is_cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kw)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t, out[0, ids.shape[1]:]


def timing(model, ids: torch.Tensor, new_tokens: int, cache: str, repeats: int) -> dict:
    """Decode and end-to-end tokens/s of ``new_tokens``-token runs, medians of ``repeats``; the one-token runs
    (prefill and the first token) are subtracted for the decode rate."""
    t_n = statistics.median(generate(model, ids, new_tokens, cache)[0] for _ in range(repeats))
    t_1 = statistics.median(generate(model, ids, 1, cache)[0] for _ in range(repeats))
    step = max(t_n - t_1, 1e-12) / (new_tokens - 1)
    return {"tok_s": 1.0 / step, "ms": step * 1e3, "prefill_ms": t_1 * 1e3, "e2e_tok_s": new_tokens / t_n}


def thresholds_for(args, model, calib_ids: torch.Tensor, kw: dict) -> dict:
    """{e: ThresholdConfig}: the --thresholds file's configs (the paper's split), or prox.sparsify's calibration on
    the random calibration tokens, one e at a time, the dense MLPs put back after each."""
    if args.thresholds:
        known = prox.load_thresholds(args.thresholds)
        try:
            return {e: prox.find_config(known, e, "paper") for e in args.e}
        except prox.thresholds.MissingThresholds as exc:
            raise SystemExit(f"prox.bench_decode --generate: {exc}") from None
    originals = dict(prox.find_mlps(model))
    configs = {}
    for e in args.e:
        configs[e] = prox.sparsify(model, e, calib_ids, alpha=args.alpha, **kw)
        prox.nn.restore_mlps(model, originals=originals)
    return configs


@torch.no_grad()
def run_model(args, name: str, requested: str, results: dict, save) -> None:
    """The generate cells of one model and dtype: every context and cache, dense and Prox at each e."""
    dev = torch.device(args.device)
    t = time.time()
    model, cfg = build_model(name, DTYPES[requested], dev, max(args.contexts) + args.new_tokens)
    model.generation_config.pad_token_id = 0  # a random model: no tokenizer, any id pads
    label = dtype_name(model.lm_head.weight.dtype)
    gen = torch.Generator().manual_seed(1)
    calib_ids = torch.randint(0, cfg.vocab_size, (1, args.calib_tokens), generator=gen).to(dev)
    kw = dict(backend="torch" if args.smoke else "op", keep_down=True, track_sparsity=True)
    configs = thresholds_for(args, model, calib_ids, kw)
    log(f"{name} {label}: model built and thresholds {'loaded' if args.thresholds else 'calibrated'} for e = "
        f"{args.e} in {time.time() - t:.1f} s")
    originals = dict(prox.find_mlps(model))
    for ctx in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), generator=gen).to(dev)
        tokens = {}  # (cache, kind) -> the generated ids (the smoke test compares the caches)
        for cache in CACHES:
            key = f"{name}/{label}/{ctx}/generate-{cache}"
            t = time.time()
            cell = {"model": name, "dtype": label, "context": ctx, "step": f"generate-{cache}",
                    "compiled": dev.type == "cuda" and cache == "static", "prox": {}}
            try:
                run_cell(args, model, configs, originals, ids, cache, cell, tokens, kw)
            except Exception as exc:  # noqa: BLE001  (one failing cache must not lose the other)
                log(f"  {key}: FAILED: {type(exc).__name__}: {exc}")
                cell["error"] = f"{type(exc).__name__}: {exc}"
            prox.nn.restore_mlps(model, originals=originals)
            cell["seconds"] = time.time() - t
            results["cells"][key] = cell
            save()
            if "error" in cell:
                continue
            if args.smoke:
                log(f"  {key}: smoke test passed (dense and Prox generated {args.new_tokens} tokens; realized e "
                    + ", ".join(f"{k}: {v['realized']['effective']:.2f}" for k, v in cell["prox"].items())
                    + f"; nothing timed) [{time.time() - t:.0f} s]")
            else:
                log(f"  {key}: dense {cell['dense']['tok_s']:.1f} tok/s decode ({cell['dense']['e2e_tok_s']:.1f} "
                    "end to end); Prox " + ", ".join(f"e={k}: {v['tok_s']:.1f} tok/s ({v['speedup']:.2f}x)"
                                                     for k, v in cell["prox"].items())
                    + f" [{time.time() - t:.0f} s]")


def run_cell(args, model, configs: dict, originals: dict, ids, cache: str, cell: dict, tokens: dict, kw: dict):
    """Fill ``cell`` for one cache: the dense model's runs, then Prox's at each e (one swap, e switched by
    apply_thresholds)."""
    t = time.time()
    _, tokens[cache, "dense"] = generate(model, ids, args.new_tokens, cache)  # warm-up (and the compilation)
    cell["warmup_s"] = {"dense": time.time() - t}
    if not args.smoke:
        cell["dense"] = timing(model, ids, args.new_tokens, cache, args.repeats)
    es = list(configs)
    prox.sparsify(model, es[0], thresholds=configs[es[0]], **kw)
    sparse = [m for _, m in prox.nn.sparse_mlps(model)]
    cell["backend_used"] = require_op(sparse, args.smoke)
    for i, e in enumerate(es):
        prox.apply_thresholds(model, configs[e])
        t = time.time()
        _, tokens[cache, e] = generate(model, ids, args.new_tokens, cache)  # warm-up (the first: the compilation)
        if i == 0:
            cell["warmup_s"]["prox"] = time.time() - t
        for sp in sparse:
            sp.reset_counters()
        if args.smoke:
            generate(model, ids, args.new_tokens, cache)
            row = {}
        else:
            row = timing(model, ids, args.new_tokens, cache, args.repeats)
            row["speedup"] = row["tok_s"] / cell["dense"]["tok_s"]
        row.update(realized=realized(sparse), target=target(e, args.alpha))
        cell["prox"][str(e)] = row
    if args.smoke:
        cell["smoke"] = True
    if cache != CACHES[0]:
        cell["same_tokens_as_dynamic"] = {str(k): bool(torch.equal(tokens[cache, k], tokens[CACHES[0], k]))
                                          for k in ["dense", *es]}
