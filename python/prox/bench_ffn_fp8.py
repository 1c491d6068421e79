# SPDX-License-Identifier: Apache-2.0
"""The dense FP8 FFN through ``torch._scaled_mm`` (issue 40's baseline (a)), one FFN layer at a time, next to the
bf16 cuBLAS FFN (d) and the FP8 byte floor (c), on Qwen3-8B, 14B and 32B shapes at batch 1, 2 and 4. prox_bench
measures Prox-FP8, (b), (c) and (d) in C++; (a) is torch's and is measured here.

    python -m prox.bench_ffn_fp8                                  # 3 shapes x 2 layouts x 3 batches
    python -m prox.bench_ffn_fp8 --shapes 8b --batches 1 --quick  # one shape, fewer replays
    python -m prox.bench_ffn_fp8 --no-compile                     # (a) eager: see below why it is not the default
    python -m prox.bench_ffn_fp8 --device cpu --shapes tiny       # a smoke test of the code paths: no timings

Setup per shape: random bf16 W_gate, W_up [d_ff, d_model] and W_down [d_model, d_ff], N(0, 0.02^2) times a
log-normal factor (sigma 0.5) per row and per 128-column group, as real layers vary by channel; the factors also
make a misplaced scale visible to the check. Each layout quantizes them with prox's rule (prox.fp8.quantize:
"channel", one scale per output channel; "block128", 128 x 128 blocks as Qwen3-*-FP8 ships them). Weights come
in copies, rotated call after call inside one CUDA graph, enough that one pass over them exceeds twice the L2: every
call reads its weights from HBM, as prox_bench's do. Times are graph replays (CUDA events) divided by the calls.

- (a) ``scaled_mm_us``: prox.benchlib's ``scaled_mm_mlp``: the activations quantized to e4m3 per token
  (1 x 128 groups against block scales, one scale per row against per-channel scales), gate/up fused in one GEMM,
  SiLU * up, the down GEMM, M padded to 16 rows. The B tokens sit in a [16, d_model] buffer whose other rows are
  zero, as an engine padding its batch for cuBLAS's FP8 GEMM holds them: cuBLAS runs the same GEMMs for every
  B <= 16, and torch.compile compiles once per shape and layout (not per batch). Compiled by default (inductor,
  its GEMMs left to aten, i.e. cuBLAS, no Triton autotuning): eager, the two activation quantizations and SiLU * up
  are some 20 small elementwise kernels a call (abs, amax, divide, clamp, cast, ...), launches the compiled
  function fuses away and an engine would not pay, so eager (a) would overstate the baseline. ``scaling``:
  "block128 x 1x128" (cuBLAS's blockwise FP8 GEMM on the weights' own block scales, sm_90 with CUDA 12.9+) or
  "row-wise"; where torch refuses block scales, the weights are requantized per channel for this baseline
  (``requantized``) and ``refused`` holds torch's message. ``compiled`` is false with --no-compile or where
  torch.compile failed (its message in ``refused``). ``scaled_mm_setup_s``: quantization and compile time.
- (c) ``fp8_floor_us``: the layout's bytes (3 d_model d_ff codes + its fp32 scales) at the copy bandwidth measured
  in this run (prox_bench's: an eager device-to-device cudaMemcpyAsync of max(4 x L2, 1 GiB), median of 15; GB/s =
  2 bytes / time, read + written), prox_bench's floor.
- (d) ``bf16_us``: prox.benchlib's dense_mlp on the bf16 weights (F.linear: cuBLAS; [gate; up] fused), eager (two
  GEMMs, SiLU and the multiply), per shape and batch, the same in every layout's rows.

Before timing, every cell's output is checked against float32 on the dequantized weights of its layout (copy 0 and
the last copy): relative L2 error at most ``CHECK_BOUND`` for (a), ``BF16_BOUND`` for (d); else it raises.
JSON (--out) has the device, torch, the commit, the copy bandwidth, the L2 size and one row per (shape, layout,
batch); a markdown table is printed. On the CPU nothing is timed: (a) is tried and torch refuses it (its CPU
_scaled_mm takes per-tensor scales only), which the rows record as ``skipped``; the weights, the quantization, the
references and (d)'s check run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch._inductor.config

import prox
from prox import fp8
from prox.benchlib import SCALED_MM_ROWS, HelpFormatter, dense_mlp, git_commit, log, make_scaled_mm, time_graph

#: (d_model, d_ff) of the released Qwen3 models' config.json, and a small shape for smoke tests.
SHAPES = {"8b": (4096, 12288), "14b": (5120, 17408), "32b": (5120, 25600), "tiny": (256, 768)}
#: (a)'s bound on ||y - y_ref|| / ||y_ref|| against float32 on the layout's dequantized weights. Rounding x and h to
#: e4m3 (3 mantissa bits: at most 2^-4 relative an element) is the error: an emulation of (a) on these weights (the
#: same code, _scaled_mm replaced by float32 on the dequantized operands; 8b shape, B 1 and 4) gives 3.9-4.5 %, and
#: 6.1-6.6 % with the per-channel requantization, whose weights carry a second rounding the reference's do not.
#: 10 % leaves room for cuBLAS's accumulation and bf16 output; a misplaced scale (block scales or 1 x 128 activation
#: scales read with the wrong strides) gives 100 % and more in the same emulation.
CHECK_BOUND = 0.10
#: (d)'s bound: bf16 rounding of g, u, h and y (2^-9 relative each) against float32 on the same bf16 weights.
BF16_BOUND = 0.02
#: Most weight copies per rotation (prox_bench's cap).
MAX_COPIES = 64


def make_weights(d_model: int, d_ff: int, device, seed: int = 0):
    """W_gate, W_up [d_ff, d_model] and W_down [d_model, d_ff], bf16 (see the module's docstring)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def one(rows, cols):
        w = torch.randn(rows, cols, generator=g, device=device) * 0.02
        w *= torch.exp(0.5 * torch.randn(rows, 1, generator=g, device=device))
        groups = torch.exp(0.5 * torch.randn(1, fp8.blocks(cols), generator=g, device=device))
        w *= groups.repeat_interleave(fp8.BLOCK, 1)[:, :cols]
        return w.to(torch.bfloat16)
    return one(d_ff, d_model), one(d_ff, d_model), one(d_model, d_ff)


def copies_for(copy_bytes: int, l2_bytes: int) -> int:
    """Copies whose one pass exceeds 2 x L2: at least 2 (consecutive calls never share weights), at most
    MAX_COPIES."""
    return max(2, min(MAX_COPIES, 2 * l2_bytes // copy_bytes + 1))


def scale_bytes(layout: str, d_model: int, d_ff: int) -> int:
    """The fp32 scales of W_gate, W_up and W_down in ``layout``."""
    if layout == "channel":
        return 4 * (2 * d_ff + d_model)
    return 4 * 3 * fp8.blocks(d_ff) * fp8.blocks(d_model)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def check(what: str, err: float, bound: float) -> None:
    if not math.isfinite(err) or err > bound:
        raise RuntimeError(f"prox.bench_ffn_fp8: {what}: relative L2 error {err:.4f} against the float32 reference "
                           f"exceeds {bound} (wrong scales or layout): refusing to time it")


def per_call_us(fns, x, iters: int) -> float:
    """Microseconds per FFN call: every copy once per graph replay, in rotation."""
    def run():
        for f in fns:
            f(x)
    return time_graph(run, iters, True) * 1e6 / len(fns)


def copy_gbps(l2_bytes: int, device, reps: int = 15):
    """(GB/s, bytes) of a device-to-device copy of max(4 x L2, 1 GiB), bytes read + written: prox_bench's
    measurement (bench_common.cuh measure_copy_bandwidth), so the floors agree. Each copy is one eager
    cudaMemcpyAsync (torch's copy_ of a contiguous tensor of one dtype), timed with events; the median of ``reps``
    after 3 warm-up copies. Not in a graph: a captured device-to-device memcpy runs as a graph memcpy node, which
    reads lower (H200, torch 2.11, 1 GiB: 2,712 GB/s in a graph, 4,088 GB/s eager; H100: 2,441 in a graph,
    prox_bench ~3,000)."""
    n = max(4 * l2_bytes, 1 << 30)
    src = torch.full((n,), 0x5A, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ts = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            ts.append(a.elapsed_time(b) * 1e-3)
    t = sorted(ts)[len(ts) // 2]
    return 2.0 * n / t / 1e9, n


def fp8_layers(ws, layout: str, copies: int):
    """The quantized weights (q, scales) of W_gate, W_up, W_down, and ``copies`` layers of them (each its own
    storage) in the form make_scaled_mm reads: gate_proj, up_proj, down_proj as prox.Fp8Linear."""
    qs = [fp8.quantize(w, layout) for w in ws]
    d_ff, d_model = ws[0].shape
    layers = [SimpleNamespace(layout=layout, d_model=d_model, d_ff=d_ff,
                              **{n: fp8.Fp8Linear(q.clone(), s.clone())
                                 for n, (q, s) in zip(("gate_proj", "up_proj", "down_proj"), qs)})
              for _ in range(copies)]
    return qs, layers


@torch.no_grad()
def run_shape(args, name: str, results: dict, dev, l2: int, gbps: float) -> None:
    d_model, d_ff = SHAPES[name]
    t0 = time.time()
    ws = make_weights(d_model, d_ff, dev, args.seed)
    x_all = torch.randn(SCALED_MM_ROWS, d_model, generator=torch.Generator(device=dev).manual_seed(args.seed + 1),
                        device=dev).to(torch.bfloat16)
    xs16 = {b: torch.cat([x_all[:b], torch.zeros_like(x_all[b:])]) for b in args.batches}  # (a)'s padded inputs

    # (d): bf16 dense, F.linear
    w_gu = torch.cat(ws[:2])
    ref_w = (w_gu.float(), ws[2].float())
    n_bf16 = 1 if args.smoke else copies_for(2 * 3 * d_model * d_ff, l2)
    bf16_ws = [(w_gu.clone(), ws[2].clone()) for _ in range(n_bf16)]
    bf16_fns = [(lambda x, a=a, b=b: dense_mlp(x, a, b, d_ff)) for a, b in bf16_ws]
    bf16 = {}
    for b in args.batches:
        x = x_all[:b]
        ref = dense_mlp(x.float(), *ref_w, d_ff)
        err = max(rel_err(bf16_fns[i](x), ref) for i in {0, n_bf16 - 1})
        check(f"{name} bf16 B={b}", err, BF16_BOUND)
        bf16[b] = {"bf16_check_rel_err": err, "bf16_copies": n_bf16}
        if not args.smoke:
            bf16[b]["bf16_us"] = per_call_us(bf16_fns, x, args.iters)
    del bf16_ws, bf16_fns, w_gu, ref_w

    for layout in args.layouts:
        t = time.time()
        fp8_bytes = 3 * d_model * d_ff + scale_bytes(layout, d_model, d_ff)
        n = 1 if args.smoke else copies_for(fp8_bytes, l2)
        qs, layers = fp8_layers(ws, layout, n)
        deq = [fp8.dequantize(q, s, layout) for q, s in qs]  # float32: the reference's weights
        ref_w = (torch.cat(deq[:2]), deq[2])
        del deq
        if args.compile:
            torch._dynamo.reset()  # one compile per (shape, layout): no recompile limit reached, no stale code
        with torch._inductor.config.patch(max_autotune_gemm_backends="ATEN"):  # the GEMMs stay cuBLAS's
            fns, info = make_scaled_mm(layers, xs16[args.batches[0]], args.compile)
        setup_s = time.time() - t
        del layers, qs
        for b in args.batches:
            row = {"shape": name, "d_model": d_model, "d_ff": d_ff, "layout": layout, "batch": b,
                   "rows": SCALED_MM_ROWS, "fp8_bytes": fp8_bytes, "fp8_floor_us": fp8_bytes / (gbps * 1e3)
                   if gbps else None, "copies": n, "scaled_mm_setup_s": setup_s, **bf16[b],
                   "refused": info["refused"]}
            if fns is None:
                row["skipped"] = ("torch._scaled_mm refused every scaling on " + dev.type + " ("
                                  + "; ".join(f"{k}: {v}" for k, v in info["refused"].items()) + ")")
            else:
                row.update(scaling=info["scales"], compiled=info["compiled"],
                           requantized=layout == "block128" and info["scales"] == "row-wise")
                x16 = xs16[b]
                ref = dense_mlp(x16[:b].float(), *ref_w, d_ff)
                err = max(rel_err(fns[i](x16)[:b], ref) for i in {0, n - 1})
                check(f"{name} {layout} B={b} (a) {info['scales']}", err, CHECK_BOUND)
                row["check_rel_err"], row["check_bound"] = err, CHECK_BOUND
                if not args.smoke:
                    row["scaled_mm_us"] = per_call_us(fns, x16, args.iters)
            results["rows"].append(row)
        del fns, ref_w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        log(f"{name} {layout}: " + "; ".join(cell_summary(r) for r in results["rows"][-len(args.batches):])
            + f" [{time.time() - t:.1f} s, setup {setup_s:.1f} s]")
    log(f"{name}: done in {time.time() - t0:.1f} s")


def cell_summary(r: dict) -> str:
    a = ("(a) skipped" if "skipped" in r else f"(a) {r['scaled_mm_us']:.1f} us" if "scaled_mm_us" in r
         else f"(a) err {r['check_rel_err']:.4f}")
    d = f"(d) {r['bf16_us']:.1f} us" if "bf16_us" in r else f"(d) err {r['bf16_check_rel_err']:.4f}"
    return f"B={r['batch']}: {a}, {d}"


def table(results: dict) -> str:
    out = ["| shape | scales | B | (a) scaled_mm | scaling | (c) FP8 floor | (c)/(a) | (d) bf16 | (d)/(a) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        a, c, d = r.get("scaled_mm_us"), r.get("fp8_floor_us"), r.get("bf16_us")
        us = (lambda v: f"{v:.1f} us" if v else "-")
        scaling = r.get("scaling", "skipped") + (" (requantized)" if r.get("requantized") else "") \
            + (", compiled" if r.get("compiled") else "")
        out.append(f"| {r['shape']} | {r['layout']} | {r['batch']} | {us(a)} | {scaling} | {us(c)} | "
                   f"{f'{c / a:.0%}' if a and c else '-'} | {us(d)} | {f'{d / a:.2f}x' if a and d else '-'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prox.bench_ffn_fp8", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--shapes", default="8b,14b,32b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--batches", default="1,2,4", help=f"tokens per call, each <= {SCALED_MM_ROWS}")
    p.add_argument("--layouts", default="channel,block128", help="comma list of " + ", ".join(fp8.LAYOUTS))
    p.add_argument("--iters", type=int, default=200, help="graph replays per cell")
    p.add_argument("--quick", action="store_true", help="50 replays per cell")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="(a) eager, which overstates it (default: compiled)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (--shapes tiny)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' and inputs' seed")
    p.add_argument("--out", default="bench-ffn-fp8.json", help="JSON results path")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.layouts = [s for s in args.layouts.split(",") if s]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r} (one of {', '.join(SHAPES)})")
    for lay in args.layouts:
        if lay not in fp8.LAYOUTS:
            p.error(f"unknown layout {lay!r} (one of {', '.join(fp8.LAYOUTS)})")
    if not args.batches or any(not 1 <= b <= SCALED_MM_ROWS for b in args.batches):
        p.error(f"--batches: each between 1 and {SCALED_MM_ROWS} (the rows (a) pads to)")
    if args.quick:
        args.iters = 50
    dev = torch.device(args.device)
    args.smoke = dev.type != "cuda"
    if args.smoke:
        args.compile = False
        log(f"smoke test on {dev.type}: weights, quantization, references and (d)'s check run; nothing is timed "
            "(torch._scaled_mm's CPU path takes per-tensor scales only, so (a) is tried and recorded as skipped)")
    elif prox.cuda_unavailable_reason():
        p.error(f"--device {args.device}: {prox.cuda_unavailable_reason()} (--device cpu --shapes tiny runs a "
                "smoke test)")
    props = torch.cuda.get_device_properties(dev) if not args.smoke else None
    l2 = int(props.L2_cache_size) if props else 0
    results = {"device": props.name if props else dev.type, "torch": torch.__version__, "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:] if argv is None else list(argv),
               "smoke": args.smoke, "l2_bytes": l2, "iters": args.iters, "compile": args.compile,
               "quantizer": "prox op" if prox.ops_available() else "torch reference (the extension is not loaded)",
               "check_bound": CHECK_BOUND, "bf16_check_bound": BF16_BOUND, "rows": []}
    gbps = None
    if not args.smoke:
        gbps, n = copy_gbps(l2, dev)
        results.update(copy_GBps=gbps, copy_bytes=n)
        log(f"{props.name}: L2 {l2 / 1e6:.0f} MB, copy bandwidth {gbps:.0f} GB/s ({n / 2**30:.2f} GiB, read + "
            "written)")

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)

    for name in args.shapes:
        run_shape(args, name, results, dev, l2, gbps)
        save()
    print(table(results), flush=True)
    log(f"wrote {args.out}" + (" (smoke test: no timings)" if args.smoke else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
