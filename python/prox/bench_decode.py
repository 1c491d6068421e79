# SPDX-License-Identifier: Apache-2.0
"""End-to-end batch-1 decode speed, dense vs Prox, on Qwen3-8B- and 14B-shaped models with random weights.

    python -m prox.bench_decode                       # the default sweep (about 6-7 min on an H100)
    python -m prox.bench_decode --models 8b --dtypes bf16 --contexts 512 --steps lean
    python -m prox.bench_decode --models 8b --dtypes bf16 --contexts 512 --steps lean --allocation uniform,greedy
    torchrun --nproc-per-node 2 -m prox.bench_decode --tp 2 --models 32b   # tensor parallel: prox.bench_tp
    python -m prox.bench_decode --device cpu --models tiny   # a smoke test of the code paths: no timings
    python -m prox.bench_decode --models 8b --fp8 block128   # Qwen3-8B-FP8-shaped: FP8 MLPs (prox.bench_decode_fp8)
    python -m prox.bench_decode --generate --models 8b --dtypes bf16 --contexts 512   # transformers' generate

This module is the command line and the fp16/bf16 sweep; the models, steps, runner and arithmetic are
prox.benchlib's, and the FP8, TP and generate modes are modules of their own (prox.bench_decode_fp8,
prox.bench_tp, prox.bench_generate).

Prox is timed through the CUDA op only: without the compiled extension (or with a source tree shadowing the
installed package) the benchmark stops instead of timing the torch reference. The JSON records the backend
the layers ran ("backend_used"), whether the extension loaded, and why not. On the CPU it is a smoke test:
every step kind runs a few tokens through the torch reference and nothing is timed or compared; the model is
float32 there unless --dtypes says otherwise, and each cell is labelled with the dtype its model ran.

Setup (the same for dense and Prox; only the MLPs differ):
- a transformers Qwen3ForCausalLM built from a Qwen3Config in code (nothing downloaded), random weights on
  the GPU; Q/K/V and gate/up weights are stored fused ([q; k; v], [gate; up]) and the model's Linear
  modules hold views of them, so the lean step's fused GEMVs cost no extra memory;
- a static KV cache of context + new tokens, one decode step (embedding -> logits -> argmax -> next token,
  position + 1, all on the device) captured in one CUDA graph and replayed for each new token;
- thresholds calibrated per layer (the paper's split of e) on the MLP inputs of a 64-token dense prefill of
  random tokens: the timing depends only on the densities, reported as realized during the timed tokens.
  One Prox graph per step serves every e: the thresholds live in device memory and are switched between
  runs (no re-capture);
- with --allocation uniform,greedy, also a per-layer allocation at each e (prox.sparsify(allocation="greedy") on
  the same random tokens: each layer's e chosen by its measured KL of the logits, their cost-weighted mean e,
  calibrated sequentially), timed in the same graphs after the uniform thresholds ("prox_greedy" beside "prox",
  with "vs_uniform": the uniform step's time over the greedy one's).

Steps measured:
- "hf": the transformers model's forward (sdpa attention, static cache), no torch.compile, in a CUDA graph;
- "lean": a gpt-fast-like step written here on the same weights: per layer one torch.compile'd attention
  block (RMSNorm, fused QKV GEMV, q/k RMSNorm, RoPE, cache write, GQA attention as two small GEMMs over
  the cache, o_proj, residual, RMSNorm) and the MLP (dense: fused gate/up GEMV + SiLU*mul + down GEMV,
  compiled; Prox: the op), the whole step in one CUDA graph. Compiling one layer's block (reused by every
  layer) keeps compile time in seconds; an engine runs such a step because its non-MLP part is close to
  its weight bytes, so the MLP's share, and with it what a faster FFN gives, is largest.
- "hfc" (optional): the transformers model under torch.compile (default mode), captured in a CUDA graph;
  slow to compile (minutes for 8B).

Per step it reports tokens/s dense and Prox at each e, the MLP's share of the dense step (dense step minus
the step with the MLPs removed), the FFN speed-up measured in the same run (the MLP stack alone, dense vs
Prox, on inputs captured from the model) and the Amdahl bound it implies, and the fraction of that bound
reached. JSON is rewritten after every cell (partial results survive a time-out); a plot at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch
import torch.nn as nn
from transformers import StaticCache

import prox
from prox import bench_decode_fp8, bench_generate, bench_tp
from prox.allocation import weighted_mean
from prox.nn import SparseMLP
from prox.benchlib import (DTYPES, HelpFormatter, LeanDecoder, MODELS, Runner, ZeroMLP, build_model, calibrate_greedy,
                           calibrate_random, dtype_name, git_commit, hf_step, log, realized, require_op,
                           reset_cache_position, set_mlps, time_cell, time_graph, write_plot)


def run_model(args, name: str, requested: str, results: dict, save):
    """The fp16/bf16 (or, on the CPU, float32) cells of one model and dtype: every context and step kind. The
    cells are labelled with the dtype the model was built in."""
    dtype = DTYPES[requested]
    dev = torch.device(args.device)
    use_graph = dev.type == "cuda"
    max_len = max(args.contexts) + args.new_tokens
    t = time.time()
    model, cfg = build_model(name, dtype, dev, max_len)
    label = dtype_name(model.lm_head.weight.dtype)
    dense_mlps = [layer.mlp for layer in model.model.layers]
    thresholds = torch.zeros(len(dense_mlps), 2, dtype=torch.float32, device=dev)
    sparse = []
    pool = prox.WorkspacePool()  # this model's workspaces
    for i, m in enumerate(dense_mlps):
        sp = SparseMLP.from_mlp(m, act="silu", keep_down=True, track_sparsity=True, workspace_pool=pool,
                                backend="torch" if args.smoke else "op")
        sp.thresholds = thresholds[i]  # one [L, 2] table: switching e is one copy
        sparse.append(sp)
    results["backend_used"] = require_op(sparse, args.smoke)
    mem = prox.memory_report(nn.ModuleList(sparse))
    log(f"{name} {label}: model built in {time.time() - t:.1f} s; Prox adds "
        f"{mem['proxies'] / 2**30:.2f} GiB proxies + {mem['w_down_t'] / 2**30:.2f} GiB W_down^T "
        f"(+{mem['scales'] / 2**20:.1f} MiB scales)")
    ids = torch.randint(0, cfg.vocab_size, (1, args.calib_tokens), device=dev)
    tables, xs = calibrate_random(model, sparse, args.e, args.calib_tokens, dev, cfg.vocab_size, args.alpha, ids=ids)
    log(f"  thresholds calibrated for e = {args.e}")
    greedy = None
    if "greedy" in args.allocation:
        t = time.time()
        greedy, layer_e = calibrate_greedy(model, sparse, dense_mlps, args.e, ids, args.alpha)
        seconds = time.time() - t
        results.setdefault("greedy", {})[f"{name}/{label}"] = {
            "calibration_s": seconds, "tokens": args.calib_tokens, "layer_e": {str(e): v for e, v in layer_e.items()}}
        costs = [3.0 * sp.d_model * sp.d_ff for sp in sparse]
        log(f"  greedy allocation calibrated in {seconds:.1f} s (layer errors measured once, on the same "
            f"{args.calib_tokens} random tokens): " + "; ".join(
                f"e={e}: layer e {min(v):.2f}..{max(v):.2f}, mean {weighted_mean(v, costs):.3f}"
                for e, v in layer_e.items()))

    if args.smoke:
        log("  smoke test: the FFN alone is not timed")
        return run_cells(args, name, label, results, save, model, cfg, dense_mlps, sparse, thresholds, tables,
                         max_len, use_graph, None, dtype, greedy)
    # the FFN alone, dense vs Prox, on the inputs captured from the model: the speed-up of this run
    lean_tmp = LeanDecoder(model, cfg, 8, dense_mlps, compile=not args.no_compile)
    xs1 = [x[-1:].contiguous() for x in xs]

    def ffn_dense():
        for m, x in zip(dense_mlps, xs1):
            lean_tmp.mlp_dense(x, m._fused_gate_up, m.down_proj.weight, cfg.intermediate_size)

    def ffn_prox():
        for sp, x in zip(sparse, xs1):
            sp(x)
    ffn = {"dense_us": time_graph(ffn_dense, args.ffn_iters, use_graph) * 1e6 / len(sparse), "prox_us": {}}
    for e in args.e:
        thresholds.copy_(tables[e])
        ffn["prox_us"][str(e)] = time_graph(ffn_prox, args.ffn_iters, use_graph) * 1e6 / len(sparse)
    ffn["speedup"] = {k: ffn["dense_us"] / v for k, v in ffn["prox_us"].items()}
    if greedy is not None:
        ffn["greedy_us"] = {}
        for e in args.e:
            thresholds.copy_(greedy[e])
            ffn["greedy_us"][str(e)] = time_graph(ffn_prox, args.ffn_iters, use_graph) * 1e6 / len(sparse)
        ffn["greedy_speedup"] = {k: ffn["dense_us"] / v for k, v in ffn["greedy_us"].items()}

    log(f"  FFN alone: dense {ffn['dense_us']:.1f} us/layer; Prox "
        + ", ".join(f"e={k}: {v:.1f} us ({ffn['speedup'][k]:.2f}x)" for k, v in ffn["prox_us"].items())
        + ("" if greedy is None else "; greedy " + ", ".join(
            f"e={k}: {v:.1f} us ({ffn['greedy_speedup'][k]:.2f}x)" for k, v in ffn["greedy_us"].items())))
    run_cells(args, name, label, results, save, model, cfg, dense_mlps, sparse, thresholds, tables, max_len,
              use_graph, ffn, dtype, greedy)


def run_cells(args, name, label, results, save, model, cfg, dense_mlps, sparse, thresholds, tables, max_len,
              use_graph, ffn, dtype, greedy=None):
    dev = torch.device(args.device)
    zero = [ZeroMLP() for _ in dense_mlps]
    tok = torch.ones(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    for ctx in args.contexts:
        for kind in args.steps:
            key = f"{name}/{label}/{ctx}/{kind}"
            t = time.time()
            try:
                cell = run_cell(args, kind, model, cfg, dense_mlps, sparse, zero, thresholds, tables, tok, pos, ctx,
                                max_len, use_graph, ffn, dtype, greedy)
            except Exception as exc:  # noqa: BLE001  (one failing step kind must not lose the others)
                log(f"  {key}: FAILED: {type(exc).__name__}: {exc}")
                cell = {"error": f"{type(exc).__name__}: {exc}"}
                set_mlps(model, dense_mlps)
            cell.update(model=name, dtype=label, context=ctx, step=kind, ffn=ffn, seconds=time.time() - t)
            results["cells"][key] = cell
            save()
            if "error" not in cell and args.smoke:
                log(f"  {key}: smoke test passed (dense, no-MLP and Prox steps ran; realized e "
                    + ", ".join(f"{k}: {v['realized']['effective']:.2f}" for k, v in cell["prox"].items())
                    + ("" if greedy is None else "; greedy " + ", ".join(
                        f"{k}: {v['realized']['effective']:.2f}" for k, v in cell["prox_greedy"].items()))
                    + f"; nothing timed) [{time.time() - t:.0f} s]")
            elif "error" not in cell:
                log(f"  {key}: dense {cell['dense']['tok_s']:.1f} tok/s ({cell['dense']['ms']:.2f} ms), MLP share "
                    f"{cell['mlp_share']:.0%}; Prox " + ", ".join(
                        f"e={k}: {v['speedup']:.2f}x (bound {v['amdahl_bound']:.2f}x, {v['fraction_of_bound']:.0%})"
                        for k, v in cell["prox"].items())
                    + ("" if greedy is None else "; greedy " + ", ".join(
                        f"e={k}: {v['speedup']:.2f}x ({v['vs_uniform']:.3f} of uniform's speed, realized e "
                        f"{v['realized']['effective']:.3f} against {cell['prox'][k]['realized']['effective']:.3f})"
                        for k, v in cell["prox_greedy"].items())) + f" [{time.time() - t:.0f} s]")
    set_mlps(model, dense_mlps)  # the caller frees the model (this frame's references end here)


def run_cell(args, kind, model, cfg, dense_mlps, sparse, zero, thresholds, tables, tok, pos, ctx, max_len, use_graph,
             ffn, dtype, greedy=None):
    runners = {}
    if kind == "lean":
        lean = LeanDecoder(model, cfg, ctx + args.new_tokens, dense_mlps, compile=not args.no_compile)
        t = time.time()
        runners["dense"] = Runner(lambda a, b: lean.step(a, b, "dense"), tok, pos, ctx, use_graph)
        compile_s = time.time() - t
        runners["none"] = Runner(lambda a, b: lean.step(a, b, "none"), tok, pos, ctx, use_graph)
        runners["prox"] = Runner(lambda a, b: lean.step(a, b, "prox", sparse), tok, pos, ctx, use_graph)
    else:
        cache = StaticCache(config=cfg, max_cache_len=ctx + args.new_tokens)
        compiled = torch.compile(model, dynamic=False) if kind == "hfc" else None
        t = time.time()
        for name, mlps in (("dense", dense_mlps), ("none", zero), ("prox", sparse)):
            runners[name] = Runner(hf_step(model, cache, compiled, mlps), tok, pos, ctx, use_graph,
                                   on_reset=lambda n: reset_cache_position(cache, n))
            if name == "dense":
                compile_s = time.time() - t
        set_mlps(model, dense_mlps)
    cell = time_cell(args, runners, thresholds, tables, sparse, ffn, compile_s, realized, greedy)
    del runners
    return cell


def check_lean(args):
    """The lean step computes what the transformers model computes: logits of a few decode steps compared
    (dense MLPs, same random weights; run on CPU in float32 for tests, or on the device)."""
    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else DTYPES[args.dtypes[0]]
    model, cfg = build_model(args.check_model, dtype, dev, 64)
    lean = LeanDecoder(model, cfg, 64, [layer.mlp for layer in model.model.layers],
                       compile=dev.type == "cuda" and not args.no_compile)
    cache = StaticCache(config=cfg, max_cache_len=64)
    hf = hf_step(model, cache)
    tok_a = torch.full((1, 1), 3, dtype=torch.long, device=dev)
    tok_b = tok_a.clone()
    pos_a = torch.zeros(1, dtype=torch.long, device=dev)
    pos_b = pos_a.clone()
    worst = 0.0
    with torch.no_grad():
        for _ in range(6):
            la = hf(tok_a, pos_a).float()
            lb = lean.step(tok_b, pos_b, "dense").float()
            worst = max(worst, float((la - lb).norm() / la.norm()))
            tok_b.copy_(tok_a)  # follow the same tokens
    return worst


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prox.bench_decode", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--models", default="8b,14b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--dtypes", default=None,
                   help="comma list of " + ", ".join(DTYPES) + " (default: fp16,bf16 on CUDA, fp32 on the CPU; bf16 "
                        "with --fp8)")
    p.add_argument("--contexts", default="512,2048", help="comma list of tokens in the KV cache before the timed ones")
    p.add_argument("--e", default="0.4,0.5,0.6,0.7", help="comma list of effective sparsities")
    p.add_argument("--allocation", default="uniform",
                   help="comma list of uniform (every layer at e, the paper's) and greedy (each layer its own e at the "
                        "cost-weighted mean e: prox.sparsify(allocation='greedy') on the same random calibration "
                        "tokens, timed beside uniform in the same graph; the lean and hf steps)")
    p.add_argument("--steps", default=None, help="comma list of hf, lean, hfc (transformers + torch.compile: slow) "
                                                 "(default: hf,lean; lean with --fp8)")
    p.add_argument("--fp8", choices=("channel", "block128"), default=None,
                   help="FP8 e4m3 MLPs (the Qwen3-*-FP8 checkpoints: block128): the lean step, dense FP8 (the faster "
                        "of torch._scaled_mm and prox's own FP8 Stage 2 with every channel kept) against Prox-FP8; "
                        "the rest of the model stays in --dtypes (prox/bench_decode_fp8.py; default: off)")
    p.add_argument("--generate", action="store_true",
                   help="time the transformers model's own model.generate (the default dynamic cache and "
                        "cache_implementation='static'), dense against Prox (prox/bench_generate.py)")
    p.add_argument("--thresholds", default="",
                   help="--generate: a thresholds file with a config for every --e (default: calibrate on random "
                        "tokens)")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel degree, under torchrun: runs prox.bench_tp with the rest of the command "
                        "line (its flags: python -m prox.bench_tp --help; default: no tensor parallelism)")
    p.add_argument("--alpha", type=float, default=None,
                   help="the allocation's alpha (default: the paper's 1/3, or prox.FP8_ALPHA with --fp8)")
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps per timed run (at most 4 on the CPU)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of new-tokens steps per cell (median)")
    p.add_argument("--ffn-iters", type=int, default=20, help="graph replays of the MLP stack alone")
    p.add_argument("--calib-tokens", type=int, default=64, help="random tokens of the calibration prefill")
    p.add_argument("--only-14b", default="fp16:512",
                   help="for 14b, the dtype:context cells to run (comma list; 'all' for every cell) to fit the budget")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the code paths (--models tiny)")
    p.add_argument("--no-compile", action="store_true", help="lean step without torch.compile")
    p.add_argument("--check", action="store_true", help="first compare the lean step's logits with transformers'")
    p.add_argument("--check-model", default="tiny", help="the model --check compares on")
    p.add_argument("--out", default="decode.json", help="JSON results path (rewritten after every cell)")
    p.add_argument("--plot", default="", help="SVG/PNG path for the plot (default: --out with .svg; needs "
                                              "matplotlib)")
    return p


def main(argv=None) -> int:
    if any(a == "--tp" or a.startswith("--tp=") for a in (sys.argv[1:] if argv is None else argv)):
        return bench_tp.main(argv)  # tensor parallelism: torchrun, one process per GPU (its own flags)
    p = parser()
    args = p.parse_args(argv)
    args.smoke = torch.device(args.device).type != "cuda"
    if args.steps is None:
        args.steps = "lean" if args.fp8 else "hf,lean"
    if args.dtypes is None:
        args.dtypes = "bf16" if args.fp8 else "fp32" if args.smoke else "fp16,bf16"
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.e = [float(e) for e in args.e.split(",") if e]
    args.steps = [s for s in args.steps.split(",") if s]
    args.allocation = [a for a in args.allocation.split(",") if a]
    if not args.allocation or any(a not in ("uniform", "greedy") for a in args.allocation) \
            or "uniform" not in args.allocation:
        p.error(f"--allocation: a comma list of uniform and greedy, uniform included (greedy is timed beside it), "
                f"got {','.join(args.allocation)!r}")
    if "greedy" in args.allocation and (args.fp8 or args.generate):
        p.error("--allocation greedy times the fp16/bf16 lean and hf steps (not --fp8 or --generate)")
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r} (one of {', '.join(MODELS)})")
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r} (one of {', '.join(DTYPES)})")
    for s in args.steps:
        if s not in ("hf", "lean", "hfc"):
            p.error(f"unknown step {s}")
    if args.fp8 and args.steps != ["lean"]:
        p.error("--fp8 measures the lean step only (--steps lean): the transformers step would run the FP8 "
                "linears' own kernels, not the dense baselines of the issue")
    if args.generate and args.fp8:
        p.error("--generate times bf16/fp16 models (--fp8 is the lean step's)")
    if args.thresholds and not args.generate:
        p.error("--thresholds is --generate's (the lean and hf steps calibrate on random tokens)")
    if args.fp8 and args.alpha is None:
        args.alpha = prox.FP8_ALPHA
    if args.smoke:
        if args.models != ["tiny"]:
            p.error(f"--device {args.device} is a smoke test of the code paths (the torch reference, no timings): "
                    "use --models tiny")
        args.no_compile, args.new_tokens, args.repeats = True, min(args.new_tokens, 4), 1
        log("smoke test on the CPU: each step kind runs a few tokens through the torch reference of Prox; "
            "nothing is timed (speed-ups are measured on a GPU with the CUDA op)")
    else:
        if prox.cuda_unavailable_reason():
            p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()} (--device cpu --models tiny runs a "
                    "smoke test)")
        if not prox.ops_available():
            raise SystemExit(f"prox.bench_decode: the CUDA op is not loaded: {prox.ops_import_error()}. Refusing to "
                             "time Prox through the torch reference")
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512

    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke,
               "prox_file": prox.__file__, "ops_available": prox.ops_available(),
               "ops_import_error": prox.ops_import_error(),
               "argv": sys.argv[1:] if argv is None else list(argv),
               "config": {"new_tokens": args.new_tokens, "repeats": args.repeats, "e": args.e,
                          "calibration_tokens": args.calib_tokens, "allocation": args.allocation}, "cells": {},
               "fp8": args.fp8, "alpha": args.alpha if args.alpha is not None else prox.ALPHA}
    if args.fp8:
        results["non_mlp"] = "+".join(args.dtypes)

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)

    if args.check:
        results["lean_check_rel_error"] = check_lean(args)
        log(f"lean step vs transformers: worst relative logits difference {results['lean_check_rel_error']:.2e}")
        save()
    run = bench_decode_fp8.run_model_fp8 if args.fp8 else bench_generate.run_model if args.generate else run_model
    only = None if args.only_14b == "all" else {tuple(c.split(":")) for c in args.only_14b.split(",") if c}
    for name in args.models:
        for dt in args.dtypes:
            a = args
            if name == "14b" and only is not None:
                ctxs = [c for c in args.contexts if (dt, str(c)) in only]
                if not ctxs:
                    continue
                a = argparse.Namespace(**{**vars(args), "contexts": ctxs})
            run(a, name, dt, results, save)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    save()
    log(write_plot(results, args.out, args.plot) if not args.generate else f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
