# SPDX-License-Identifier: Apache-2.0
"""bench_decode's FP8 model (``python -m prox.bench_decode --fp8 block128``): end-to-end batch-1 decode with FP8
e4m3 MLPs, dense FP8 against Prox-FP8, on a Qwen3-8B-FP8-shaped model built from a config in code (nothing
downloaded).

    python -m prox.bench_decode --models 8b --fp8 block128                 # the official Qwen3-8B-FP8's layout
    python -m prox.bench_decode --models 8b --fp8 block128 --alpha 0.45    # the allocation with a measured alpha
    python -m prox.bench_decode --device cpu --models tiny --fp8 block128  # a smoke test of the code paths

Setup: bench_decode's Qwen3 model with random bf16 weights, whose MLP projections are then quantized to FP8 e4m3
with prox's rule (prox.fp8.quantize: 128 x 128 block scales as Qwen3-*-FP8 ships them, ``weight_scale_inv``, in
transformers' fine-grained FP8Linear; or one scale per output channel, prox.Fp8Linear), and the bf16 MLP weights
freed. The rest of the model, attention included, stays bf16 (--dtypes): the FP8 attention path (FP8 QKV and
o_proj GEMMs, an FP8 KV cache) is not what Prox changes, and keeping it bf16 keeps the step's non-MLP part the one
bench_decode's bf16 rows measure, so the MLP's share and the Amdahl bound are read against a known step. An FP8
engine's non-MLP part would be faster, which raises the MLP's share and the bound.

The lean step (bench_decode's: compiled attention block, one CUDA graph per step) runs four MLP variants:
- dense (a): the dense FP8 FFN through ``torch._scaled_mm`` (prox.benchlib.make_scaled_mm, bench_ffn_fp8's (a)
  too): activations quantized per token (1 x 128 groups with the block-scaled weights, per row with per-channel
  weights), M padded to 16, gate/up fused in one GEMM, compiled.
  Block scales go to cuBLAS's blockwise FP8 GEMM (sm_90, CUDA 12.9+); where torch refuses them, the weights are
  requantized per channel for this baseline and row-wise scales are used (the JSON says which);
- dense (b): prox's own FP8 Stage-2 kernel with every channel selected and no Stage 1 (torch.ops.prox.dense_ffn);
- none: the MLPs removed (the non-MLP part);
- prox: SparseMLP on the FP8 linears (the FP8 op), one graph for every e (thresholds switched in device memory).
The dense step is the faster of (a) and (b), chosen by the FFN alone (the 36 MLPs in a graph, on inputs captured
from the model): the FFN speed-up, the MLP share and the Amdahl bound are read against it. The thresholds come from
a 64-token prefill (the FP8 MLPs' dense path) with the allocation's alpha (--alpha, default prox.FP8_ALPHA): e is
the fraction of the dense FP8 FFN's cost that Prox saves.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

import prox
from prox.benchlib import (DTYPES, LeanDecoder, Runner, build_fp8_model, calibrate_random, log, make_scaled_mm,
                           realized, require_op, time_cell, time_graph)
from prox.nn import SparseMLP


def run_model_fp8(args, name: str, dtype_name: str, results: dict, save) -> None:
    dtype = DTYPES[dtype_name]
    dev = torch.device(args.device)
    use_graph = dev.type == "cuda"
    max_len = max(args.contexts) + args.new_tokens
    t = time.time()
    model, cfg = build_fp8_model(name, dtype, dev, max_len, args.fp8)
    if use_graph:
        torch.cuda.empty_cache()
    mlps = [layer.mlp for layer in model.model.layers]
    thresholds = torch.zeros(len(mlps), 2, dtype=torch.float32, device=dev)
    pool = prox.WorkspacePool()
    sparse = []
    for i, m in enumerate(mlps):  # keep_down: W_down in nn.Linear layout is the scaled_mm baseline's operand
        sp = SparseMLP.from_mlp(m, act="silu", keep_down=True, track_sparsity=True, workspace_pool=pool,
                                dtype=dtype, backend="torch" if args.smoke else "op")
        sp.thresholds = thresholds[i]
        sparse.append(sp)
    for layer, sp in zip(model.model.layers, sparse):
        layer.mlp = sp  # the prefill runs the FP8 MLPs' dense path (their own forward may need FP8 GEMM kernels)
    results["backend_used"] = require_op(sparse, args.smoke)
    key_model = f"{name}-fp8"
    mem = prox.memory_report(nn.ModuleList(sparse))
    log(f"{key_model} ({args.fp8}) {dtype_name}: model built in {time.time() - t:.1f} s; FP8 MLP weights "
        f"{mem['dense_mlp'] / 2**30:.2f} GiB; Prox adds {mem['proxies'] / 2**30:.2f} GiB proxies "
        f"(+{mem['scales'] / 2**20:.1f} MiB scales); alpha {args.alpha}")
    tables, xs = calibrate_random(model, sparse, args.e, args.calib_tokens, dev, cfg.vocab_size, args.alpha)
    log(f"  thresholds calibrated for e = {args.e} (alpha {args.alpha})")
    xs1 = [x[-1:].contiguous() for x in xs]

    if args.smoke:  # no scaled_mm, no prox dense kernel: the dense step is the MLPs' dense path (the reference)
        dense_fns = [sp.dense for sp in sparse]
        ffn = None
        dense_info = {"kind": "dense path (smoke test)"}
    else:
        fns_a, info_a = make_scaled_mm(sparse, xs1[0], not args.no_compile)
        fns_b = [sp.dense_kernel for sp in sparse]
        for sp, x in zip(sparse, xs1):
            sp.dense_kernel(x)  # plans the dense Stage 2 (outside capture)
        ffn = {"dense_prox_kernels_us": _ffn_us(fns_b, xs1, args, use_graph), "prox_us": {}, "scaled_mm": info_a}
        if fns_a is not None:
            ffn["dense_scaled_mm_us"] = _ffn_us(fns_a, xs1, args, use_graph)
        kinds = {"prox_kernels": (ffn["dense_prox_kernels_us"], fns_b)}
        if fns_a is not None:
            kinds["scaled_mm"] = (ffn["dense_scaled_mm_us"], fns_a)
        kind = min(kinds, key=lambda k: kinds[k][0])
        ffn["dense_kind"], ffn["dense_us"] = kind, kinds[kind][0]
        dense_fns = kinds[kind][1]
        dense_info = {"kind": kind, "scaled_mm": info_a}
        for e in args.e:
            thresholds.copy_(tables[e])
            ffn["prox_us"][str(e)] = _ffn_us([sp for sp in sparse], xs1, args, use_graph)
        ffn["speedup"] = {k: ffn["dense_us"] / v for k, v in ffn["prox_us"].items()}
        ffn["speedup_vs"] = {k: {"scaled_mm": ffn.get("dense_scaled_mm_us", float("nan")) / v,
                                 "prox_kernels": ffn["dense_prox_kernels_us"] / v} for k, v in ffn["prox_us"].items()}
        log(f"  FFN alone: dense (a) scaled_mm {ffn.get('dense_scaled_mm_us', float('nan')):.1f} us/layer "
            f"({info_a.get('scales', 'refused')}), (b) prox kernels {ffn['dense_prox_kernels_us']:.1f} us/layer: "
            f"dense = {kind}; Prox " + ", ".join(f"e={k}: {v:.1f} us ({ffn['speedup'][k]:.2f}x)"
                                                  for k, v in ffn["prox_us"].items()))
        dense_info["others"] = {k: v[1] for k, v in kinds.items() if k != kind}

    tok = torch.ones(1, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    for ctx in args.contexts:
        key = f"{key_model}/{dtype_name}/{ctx}/lean"
        t = time.time()
        try:
            cell = _run_cell(args, model, cfg, sparse, dense_fns, dense_info, thresholds, tables, tok, pos, ctx,
                             use_graph, ffn)
        except Exception as exc:  # noqa: BLE001
            log(f"  {key}: FAILED: {type(exc).__name__}: {exc}")
            cell = {"error": f"{type(exc).__name__}: {exc}"}
        cell.update(model=key_model, dtype=dtype_name, context=ctx, step="lean", ffn=ffn, fp8=args.fp8,
                    alpha=args.alpha, seconds=time.time() - t)
        results["cells"][key] = cell
        save()
        if "error" in cell:
            continue
        if args.smoke:
            log(f"  {key}: smoke test passed (dense, no-MLP and Prox steps ran; realized e "
                + ", ".join(f"{k}: {v['realized']['effective']:.2f}" for k, v in cell["prox"].items())
                + f"; nothing timed) [{time.time() - t:.0f} s]")
        else:
            log(f"  {key}: dense ({cell['dense_kind']}) {cell['dense']['tok_s']:.1f} tok/s, MLP share "
                f"{cell['mlp_share']:.0%}; Prox " + ", ".join(
                    f"e={k}: {v['speedup']:.2f}x (bound {v['amdahl_bound']:.2f}x, {v['fraction_of_bound']:.0%})"
                    for k, v in cell["prox"].items()) + f" [{time.time() - t:.0f} s]")


def _ffn_us(fns, xs1, args, use_graph) -> float:
    """Microseconds per layer of the MLP stack alone (every layer once, in a graph)."""
    def run():
        for f, x in zip(fns, xs1):
            f(x)
    return time_graph(run, args.ffn_iters, use_graph) * 1e6 / len(fns)


def _run_cell(args, model, cfg, sparse, dense_fns, dense_info, thresholds, tables, tok, pos, ctx, use_graph, ffn):
    lean = LeanDecoder(model, cfg, ctx + args.new_tokens, sparse, compile=not args.no_compile, dense_fns=dense_fns)
    t = time.time()
    runners = {"dense": Runner(lambda a, b: lean.step(a, b, "dense"), tok, pos, ctx, use_graph)}
    compile_s = time.time() - t
    runners["none"] = Runner(lambda a, b: lean.step(a, b, "none"), tok, pos, ctx, use_graph)
    runners["prox"] = Runner(lambda a, b: lean.step(a, b, "prox", sparse), tok, pos, ctx, use_graph)
    other = {}  # the other dense kind's step, for the record
    for k, fns in ({} if args.smoke else dense_info.get("others", {})).items():
        lean_o = LeanDecoder(model, cfg, ctx + args.new_tokens, sparse, compile=not args.no_compile, dense_fns=fns)
        r = Runner(lambda a, b, lo=lean_o: lo.step(a, b, "dense"), tok, pos, ctx, use_graph)
        t_o = r.time(args.new_tokens, args.repeats)
        other[k] = {"ms": t_o * 1e3, "tok_s": 1.0 / t_o}
        del r
    cell = time_cell(args, runners, thresholds, tables, sparse, ffn, compile_s, realized)
    cell.update(dense_kind=dense_info["kind"], dense_other=other)
    del runners
    return cell
