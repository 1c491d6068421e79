# SPDX-License-Identifier: Apache-2.0
"""The FP8 prefill (SparseMLP's dense path of several tokens) before and after issue 47: time and peak memory of a
prefill through a stack of Qwen3-8B-FP8-shaped MLP layers.

    python -m prox.bench_prefill                                  # 512 tokens, 4 layers of 4096 x 12288, both layouts
    python -m prox.bench_prefill --layouts block128 --paths float32,auto --reps 50
    python -m prox.bench_prefill --device cpu --d-model 256 --d-ff 768 --layers 2 --tokens 16 --reps 1  # smoke

Each layer is a SparseMLP on prox.Fp8Linear projections (random bfloat16 weights quantized with prox's rule, per
channel or in 128 x 128 blocks; keep_down=False unless --keep-down), run as ``h = h + mlp(h)`` on ``--tokens`` tokens
of one sequence. The paths:

- ``float32``: the dense path before issue 47 (nn.py:730-739 at c11d97e, reproduced here): every call dequantizes
  W_gate, W_up and W_down^T to float32 and runs float32 GEMMs (the "before" figure);
- ``dequantized``: SparseMLP(prefill_gemm="dequantized"): each weight dequantized to the activation dtype when its
  GEMM runs, one matrix at a time (weight-only, what Prox's Stage 2 computes);
- ``auto``: SparseMLP's default: torch._scaled_mm where torch takes the scale layout (bfloat16 on sm_89+ per
  channel, sm_90 in blocks; the activations quantized to e4m3 per token or 1 x 128 group), W_down^T dequantized
  (the FP8 GEMM needs W_down row-major: --keep-down gives it), else as ``dequantized``.

Reported per (layout, path): milliseconds per prefill of the stack (CUDA events, mean of --reps after --warmup), the
peak memory the prefill allocates above what was allocated before it (torch.cuda.max_memory_allocated), the
GEMMs that ran, and the relative L2 difference of the stack's output from the float32 path's. JSON (--out) and a
markdown table.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import prox
from prox import fp8, formats, reference
from prox.bench_decode import git_commit, log

PATHS = ("float32", "dequantized", "auto")


def float32_prefill(sp: prox.SparseMLP, x: torch.Tensor) -> torch.Tensor:
    """The FP8 dense path before issue 47 (SparseMLP.dense at c11d97e): the three matrices dequantized to float32 on
    every call, float32 GEMMs, the result in x's dtype."""
    wg, wu, wdt = sp.exact_weights(torch.float32)
    xf = x.to(torch.float32)
    h = reference.activation(sp.act)(F.linear(xf, wg)) * F.linear(xf, wu)
    return torch.matmul(h, wdt).to(x.dtype)


def build_stack(layers: int, d_model: int, d_ff: int, layout: str, dtype, device, keep_down: bool, seed: int = 0):
    """``layers`` SparseMLPs on FP8 projections quantized in ``layout`` from random weights (std 1/sqrt(fan-in))."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(layers):
        mlp = nn.Module()
        for name, (o, i) in (("gate_proj", (d_ff, d_model)), ("up_proj", (d_ff, d_model)),
                             ("down_proj", (d_model, d_ff))):
            w = (torch.randn(o, i, generator=g) / i ** 0.5).to(device=device, dtype=torch.bfloat16)
            q, s = fp8.quantize(w, layout)
            setattr(mlp, name, prox.Fp8Linear(q, s))
        mlp.act_fn = nn.SiLU()
        out.append(prox.SparseMLP.from_mlp(mlp, dtype=dtype, keep_down=keep_down))
    return out


def run_stack(stack, x: torch.Tensor, path: str) -> torch.Tensor:
    h = x
    for sp in stack:
        if path == "float32":
            h = h + float32_prefill(sp, h)
        else:
            sp.prefill_gemm = path
            h = h + sp.dense(h)
    return h


def measure(stack, x, path: str, warmup: int, reps: int) -> dict:
    """Time (CUDA events; wall clock elsewhere) and peak extra memory of one prefill of the stack."""
    cuda = x.is_cuda
    with torch.no_grad():
        for _ in range(warmup):
            run_stack(stack, x, path)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        y = run_stack(stack, x, path)
        peak = (torch.cuda.max_memory_allocated() - before) if cuda else None
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                run_stack(stack, x, path)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / reps
        else:
            t = time.perf_counter()
            for _ in range(reps):
                run_stack(stack, x, path)
            ms = (time.perf_counter() - t) * 1e3 / reps
    return {"ms": ms, "peak_extra_bytes": peak, "y": y}


def gemms(sp: prox.SparseMLP, x: torch.Tensor, path: str) -> str:
    """Which GEMMs a path runs for this layer and x [tokens, d_model]."""
    if path == "float32":
        return "float32 (3 matrices dequantized to float32)"
    fp8_ok = path == "auto" and sp.fmt.scaled_mm_ok(x, sp.d_ff, sp.d_model)
    if not fp8_ok:
        return f"{str(x.dtype)[6:]} (each matrix dequantized to it when its GEMM runs)"
    scaling = "row-wise" if sp.layout == "channel" else "1x128 x 128x128 blocks"
    down = "_scaled_mm" if sp.keep_down else "W_down^T dequantized"
    return f"torch._scaled_mm ({scaling}) for gate/up, {down} for down"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prox.bench_prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=512, help="tokens of the prefill (one sequence)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers in the stack")
    p.add_argument("--d-model", type=int, default=4096, help="d_model (Qwen3-8B: 4096)")
    p.add_argument("--d-ff", type=int, default=12288, help="d_ff (Qwen3-8B: 12288)")
    p.add_argument("--layouts", default="channel,block128", help="FP8 scale layouts, comma-separated")
    p.add_argument("--paths", default=",".join(PATHS), help=f"paths to run, comma-separated, of {PATHS}")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="activation dtype")
    p.add_argument("--keep-down", action="store_true", help="keep W_down (the FP8 GEMM then runs for down too)")
    p.add_argument("--warmup", type=int, default=3, help="untimed prefills before timing")
    p.add_argument("--reps", type=int, default=20, help="timed prefills (the mean is reported)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (cpu: a smoke run of the code paths, no figures)")
    p.add_argument("--out", default="bench-prefill-fp8.json", help="JSON output ('' for none)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and prox.cuda_unavailable_reason():
        p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()} (--device cpu runs a smoke test)")
    paths = [s for s in args.paths.split(",") if s]
    layouts = [s for s in args.layouts.split(",") if s]
    for s in paths:
        if s not in PATHS:
            p.error(f"--paths: {s!r} is not one of {PATHS}")
    for s in layouts:
        formats.fp8_format(s)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "commit": git_commit(), "command": "python -m prox.bench_prefill "
            + " ".join(sys.argv[1:] if argv is None else argv), "tokens": args.tokens, "layers": args.layers,
            "d_model": args.d_model, "d_ff": args.d_ff, "dtype": args.dtype, "keep_down": args.keep_down,
            "smoke": device.type != "cuda"}
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.tokens, args.d_model, generator=gen).to(device=device, dtype=dtype)
    for layout in layouts:
        stack = build_stack(args.layers, args.d_model, args.d_ff, layout, dtype, device, args.keep_down)
        ref = None
        for path in paths:
            r = measure(stack, x, path, args.warmup, args.reps)
            y = r.pop("y").double()
            ref = y if path == "float32" or ref is None else ref
            rows.append({"layout": layout, "path": path, "ms": r["ms"], "ms_per_layer": r["ms"] / args.layers,
                         "peak_extra_mib": None if r["peak_extra_bytes"] is None else r["peak_extra_bytes"] / 2 ** 20,
                         "gemms": gemms(stack[0], x, path),
                         "rel_diff_vs_first_path": float((y - ref).norm() / ref.norm())})
            peak = rows[-1]["peak_extra_mib"]
            log(f"{layout:9s} {path:12s} {r['ms']:9.3f} ms  peak {'-' if peak is None else f'+{peak:.1f} MiB'}  "
                f"{rows[-1]['gemms']}")
        del stack
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nFP8 prefill, {args.tokens} tokens through {args.layers} MLP layers of {args.d_model} x {args.d_ff} "
          f"({args.dtype}; {meta['gpu']}, torch {meta['torch']}, commit {meta['commit'] or '?'})\n")
    print("| layout | path | ms / prefill | ms / layer | peak extra MiB | GEMMs | rel. diff vs first path |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
        print(f"| {r['layout']} | {r['path']} | {r['ms']:.3f} | {r['ms_per_layer']:.3f} | {peak} | {r['gemms']} | "
              f"{r['rel_diff_vs_first_path']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
