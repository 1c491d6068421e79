#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file report.py  Turn prox_bench's Google Benchmark JSON and prox_alpha's JSON into the tables
and the plots of docs/benchmarks.md.

Tables are written between marker comments in the document:
    <!-- BEGIN prox-report:SECTION -->  ...  <!-- END prox-report:SECTION -->
for SECTION in provenance, dense, ffn, budget, kernels, targets, alpha, fixed, batch, plots. Text outside the markers
is never touched. Every generated table starts with the GPU, the commit and the command that
produced its figures, taken from the JSON context (--commit overrides the commit).

Usage:
    python3 bench/report.py --bench out/bench.json [more.json ...] --alpha out/alpha.json \
        [--fixed out/fixed.json] [--batch out/batch.json] --doc docs/benchmarks.md [--img-dir docs/img] \
        [--commit SHA] [--no-plots] [--stdout]
(--batch: prox_batch_bench's JSON, the section "batch" and its plot.)
The tables need the standard library only. The plots (SVG, under --img-dir, default <doc dir>/img) need
matplotlib (Debian/Ubuntu python3-matplotlib, or pip); without it report.py stops before writing anything
unless --no-plots is given, which leaves the plots and the plots section as they are.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys

MODELS = ["Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B"]
DTYPES = ["f16", "bf16"]
TARGETS = [40, 50, 60, 70]
# prox_batch_bench's mask models: independent random tokens (the worst case) and correlated tokens (a shared
# component plus per-token noise), and the batch targets of issue 23 (H100): the FFN speed-up reaches
# BATCH_FLOOR_FRAC of the union byte floor's at B = 2 and 4; the union bytes stream at >= BATCH_COPY_FRAC of
# copy bandwidth on the 8B and 14B shapes.
BATCH_MASKS = ["indep", "corr"]
BATCH_MASK_TEXT = {"indep": "independent tokens", "corr": "correlated tokens"}
BATCH_FLOOR_FRAC = 0.85
BATCH_FLOOR_BATCHES = [2, 4]
BATCH_COPY_FRAC = 0.85
BATCH_COPY_MODELS = ["Qwen3-8B", "Qwen3-14B"]
# The weight-streaming kernels the >= 85 % target is about: Stage 1, the GLU and down ops, and the fused
# Stage 2 the FFN runs. The threshold op reads only x (kilobytes) and is latency-bound: not judged.
KERNEL_OPS = ["proxy_int4", "glu", "down", "prox_stage2"]
SECTIONS = ["provenance", "dense", "ffn", "budget", "kernels", "targets", "alpha", "fixed", "batch", "plots"]

# The project's H100 performance targets, as listed in docs/benchmarks.md, "Targets" (set by the project,
# not by the paper): speed-up per target e on the 8B and 14B shapes, fraction of copy bandwidth per shape,
# α, and the bf16/fp16 time ratio.
TARGET_SPEEDUP = {70: 3.0, 50: 2.0}
TARGET_SPEEDUP_MODELS = ["Qwen3-8B", "Qwen3-14B"]
TARGET_FRAC = {"Qwen3-8B": 0.85, "Qwen3-14B": 0.85, "Qwen3-1.7B": 0.70}
TARGET_ALPHA = 0.28
TARGET_BF16 = 1.03
# From the paper (Prox: Training-Free FFN Activation Sparsity via Approximate Intermediate-Channel Salience
# in LLMs), appendix "Empirical Proxy-Cost Ratios", table "Measured proxy-cost ratio α", as printed there:
# GPU, then (model, α at input sparsity 0/10/55/70 %).
PAPER_ALPHA_TABLE = [
    ("NVIDIA A6000", [("Qwen3-4B", (0.280, 0.292, 0.304, 0.286)), ("Qwen3-8B", (0.267, 0.272, 0.286, 0.277)),
                      ("Qwen3-14B", (0.261, 0.273, 0.287, 0.292)), ("Qwen3-32B", (0.255, 0.263, 0.268, 0.262))]),
    ("NVIDIA GeForce RTX 3090", [("Qwen3-4B", (0.300, 0.311, 0.328, 0.309)), ("Qwen3-8B", (0.279, 0.298, 0.310, 0.292)),
                                 ("Qwen3-14B", (0.274, 0.291, 0.316, 0.323)),
                                 ("Qwen3-32B", (0.261, 0.278, 0.290, 0.281))]),
    ("NVIDIA A100", [("Qwen3-4B", (0.234, 0.292, 0.274, 0.273)), ("Qwen3-8B", (0.281, 0.341, 0.261, 0.248)),
                     ("Qwen3-14B", (0.279, 0.351, 0.320, 0.241)), ("Qwen3-32B", (0.272, 0.313, 0.288, 0.239))]),
]


def model_order(m):
    return MODELS.index(m) if m in MODELS else len(MODELS)


# ---------------------------------------------------------------- reading
def read_run(run, path, commit_override):
    """Sets run.path, run.context (the commit overridden if asked), empty run.rows and run.errors; returns the
    Google Benchmark JSON document of path."""
    with open(path) as f:
        data = json.load(f)
    run.path = path
    run.context = data.get("context", {})
    if commit_override:
        run.context["prox_commit"] = commit_override
    run.rows = {}
    run.errors = []
    return data


class BenchRun:
    """One Google Benchmark JSON file: its context and its rows keyed by (bench, model, dtype, e)."""

    def __init__(self, path, commit_override=None):
        data = read_run(self, path, commit_override)
        samples = {}
        medians = {}
        for b in data.get("benchmarks", []):
            run_name = b.get("run_name") or b.get("name", "")
            key = parse_name(run_name)
            if key is None:
                continue
            if b.get("error_occurred"):
                self.errors.append((run_name, b.get("error_message", "")))
                continue
            if b.get("run_type") == "aggregate":
                if b.get("aggregate_name") == "median":
                    medians[key] = b
                continue
            samples.setdefault(key, []).append(b)
        for key, rows in samples.items():
            self.rows[key] = merge_rows(rows)
        for key, b in medians.items():  # --benchmark_repetitions: Google Benchmark's own median wins
            self.rows[key] = dict(self.rows.get(key, {}), **counters_of(b))

    def get(self, bench, model, dtype, e=None):
        return self.rows.get((bench, model, dtype, e))

    def models(self):
        return sorted({k[1] for k in self.rows}, key=model_order)

    def dtypes(self):
        return [d for d in DTYPES if any(k[2] == d for k in self.rows)]

    def targets(self):
        return sorted({k[3] for k in self.rows if k[3] is not None})

    def each(self, bench):
        """(model, dtype, e, row) of every row of a per-target bench, in table order."""
        for m in self.models():
            for d in self.dtypes():
                for e in self.targets():
                    row = self.get(bench, m, d, e)
                    if row is not None:
                        yield m, d, e, row


def parse_name(name):
    """'prox_ffn/Qwen3-8B/f16/e70/iterations:30/manual_time' -> ('prox_ffn', 'Qwen3-8B', 'f16', 70)."""
    parts = [p for p in name.split("/") if p and ":" not in p and p != "manual_time" and p != "real_time"]
    if len(parts) < 3:
        return None
    e = None
    if len(parts) >= 4 and re.fullmatch(r"e\d+", parts[3]):
        e = int(parts[3][1:])
    return (parts[0], parts[1], parts[2], e)


NON_COUNTERS = {"name", "run_name", "run_type", "repetitions", "repetition_index", "threads", "iterations",
                "real_time", "cpu_time", "time_unit", "family_index", "per_family_instance_index",
                "aggregate_name", "aggregate_unit", "label", "error_occurred", "error_message"}


def counters_of(b):
    out = {k: v for k, v in b.items() if k not in NON_COUNTERS and isinstance(v, (int, float))}
    if "label" in b:
        out["label"] = b["label"]
    return out


def merge_rows(rows):
    """Several repetitions of one bench without aggregates: the median of every counter."""
    if len(rows) == 1:
        return counters_of(rows[0])
    cs = [counters_of(r) for r in rows]
    out = {}
    for k in cs[0]:
        vals = [c[k] for c in cs if k in c]
        out[k] = statistics.median(vals) if all(isinstance(v, (int, float)) for v in vals) else vals[-1]
    return out


class BatchRun:
    """prox_batch_bench's JSON: rows keyed by (model, dtype, e, B, mask) from names such as
    'batch_ffn/Qwen3-8B/f16/e70/b2/indep/iterations:20/manual_time'."""

    def __init__(self, path, commit_override=None):
        data = read_run(self, path, commit_override)
        self.empty = {}  # (model, dtype, B) -> batch_ffn_empty row: the batched FFN's fixed cost
        samples, empties = {}, {}
        for b in data.get("benchmarks", []):
            run_name = b.get("run_name") or b.get("name", "")
            parts = [p for p in run_name.split("/") if p and ":" not in p and p not in ("manual_time", "real_time")]
            if len(parts) == 4 and parts[0] == "batch_ffn_empty" and re.fullmatch(r"b\d+", parts[3]):
                if b.get("error_occurred"):
                    self.errors.append((run_name, b.get("error_message", "")))
                elif b.get("run_type") != "aggregate":
                    empties.setdefault((parts[1], parts[2], int(parts[3][1:])), []).append(b)
                continue
            if (len(parts) != 6 or parts[0] != "batch_ffn" or not re.fullmatch(r"e\d+", parts[3])
                    or not re.fullmatch(r"b\d+", parts[4])):
                continue
            key = (parts[1], parts[2], int(parts[3][1:]), int(parts[4][1:]), parts[5])
            if b.get("error_occurred"):
                self.errors.append((run_name, b.get("error_message", "")))
            elif b.get("run_type") != "aggregate":
                samples.setdefault(key, []).append(b)
        for key, rows in samples.items():
            self.rows[key] = merge_rows(rows)
        for key, rows in empties.items():
            self.empty[key] = merge_rows(rows)

    def get(self, model, dtype, e, b, mask):
        return self.rows.get((model, dtype, e, b, mask))

    def fixed_us(self, model, dtype, b):
        """The batched FFN's fixed cost at B tokens (batch_ffn_empty's t_us), or None."""
        return cell(self.empty.get((model, dtype, b)), "t_us")

    def models(self):
        return sorted({k[0] for k in self.rows}, key=model_order)

    def dtypes(self):
        return [d for d in DTYPES if any(k[1] == d for k in self.rows)]

    def targets(self):
        return sorted({k[2] for k in self.rows})

    def batches(self):
        return sorted({k[3] for k in self.rows})

    def masks(self):
        return [m for m in BATCH_MASKS if any(k[4] == m for k in self.rows)]


# ---------------------------------------------------------------- formatting
def fmt_us(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_pct(v):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100.0 * v:.0f} %"


def fmt_range_pct(vals):
    """'a % to b %' over vals, or one 'a %' where both ends print alike."""
    lo, hi = fmt_pct(min(vals)), fmt_pct(max(vals))
    return lo if lo == hi else f"{lo} to {hi}"


def fmt_x(v):
    return "-" if v is None else f"{v:.2f}×"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def captioned_table(ctx, caption, header, rows):
    """Lines of one table: its run's provenance (when ctx is given), a caption (when given), the table."""
    out = []
    if ctx is not None:
        out += [provenance(ctx), ""]
    if caption:
        out += [caption, ""]
    return out + [table(header, rows), ""]


def cuda_version(ctx):
    """'CUDA 13.0' from the context's CUDART_VERSION (13000); 'CUDA runtime X' if not a number; ''."""
    rt = ctx.get("cuda_runtime", "")
    try:
        return f"CUDA {int(rt) // 1000}.{(int(rt) % 1000) // 10}"
    except (TypeError, ValueError):
        return f"CUDA runtime {rt}" if rt else ""


def provenance(ctx, what="Measured"):
    gpu = ctx.get("gpu", "unknown GPU")
    arch = ctx.get("gpu_arch", "")
    rt = cuda_version(ctx)
    copy = ctx.get("copy_GBps")
    parts = [f"{what} on **{gpu}**" + (f" ({arch}, {rt})" if arch or rt else "")]
    if copy:
        parts.append(f"copy bandwidth {float(copy):.0f} GB/s (same run)")
    parts.append(f"commit `{ctx.get('prox_commit', 'unknown')}`")
    if ctx.get("date"):
        parts.append(str(ctx["date"]))
    line = ", ".join(parts) + "."
    cmd = ctx.get("prox_command")
    if cmd:
        line += f"\nCommand: `{cmd}`"
    return line


def cell(row, key):
    return None if row is None else row.get(key)


# ---------------------------------------------------------------- sections
def section_provenance(runs, alpha):
    lines = []
    for r in runs:
        lines.append(f"- `{os.path.basename(r.path)}`: " + provenance(r.context).replace("\n", " "))
        if r.context.get("prox_options"):
            lines.append(f"  Options: `{r.context['prox_options']}`.")
        if r.errors:
            lines.append(f"  {len(r.errors)} benchmark(s) reported errors: " +
                         "; ".join(f"`{n}`: {m}" for n, m in r.errors[:5]) + (" …" if len(r.errors) > 5 else ""))
    if alpha:
        lines.append(f"- `{os.path.basename(alpha['path'])}`: " + provenance(alpha["context"]).replace("\n", " "))
    if not lines:
        lines.append("_No results yet: run the commands above and then `bench/report.py`._")
    return "\n".join(lines)


def section_dense(runs):
    out = []
    for r in runs:
        rows = []
        for m in r.models():
            for d in r.dtypes():
                ffn = r.get("dense_ffn", m, d)
                up = r.get("dense_gemv_up", m, d)
                down = r.get("dense_gemv_down", m, d)
                if not (ffn or up or down):
                    continue
                rows.append([m, d, fmt_us(cell(ffn, "t_us")), f"{cell(ffn, 'GBps') or 0:.0f}" if ffn else "-",
                             fmt_pct(cell(ffn, "frac_copy")), fmt_us(cell(up, "t_us")), fmt_pct(cell(up, "frac_copy")),
                             fmt_us(cell(down, "t_us")), fmt_pct(cell(down, "frac_copy"))])
        if rows:
            out += captioned_table(r.context, None, ["model", "dtype", "dense FFN µs", "GB/s", "of copy",
                                                     "GEMV up µs", "of copy", "GEMV down µs", "of copy"], rows)
    return "\n".join(out) if out else "_No dense results in the input._"


def time_split(r, m, d, e, f):
    """A Prox FFN row f split into its fixed costs and its streaming: the two stages' fixed costs
    (proxy_int4_empty, stage2_empty: the same launches with nothing kept), their sum, the time the bytes that
    had to be read take at the copy bandwidth (the floor), and the floor over the time left after the fixed
    costs (how close the streaming part is to copy). NaN where a bench is missing."""
    nan = float("nan")
    f1 = cell(r.get("proxy_int4_empty", m, d, e), "t_us")
    f2 = cell(r.get("stage2_empty", m, d, e), "t_us")
    fixed = f1 + f2 if f1 is not None and f2 is not None else nan
    floor = f.get("bytes_needed", 0) / (f.get("copy_GBps", nan) * 1e3)
    rest = f.get("t_us", nan) - fixed
    return {"fixed1": f1, "fixed2": f2, "fixed": fixed, "floor": floor,
            "rest_frac": floor / rest if rest == rest and rest > 0 else nan}


def faster_dense(r, m):
    """The faster of the run's fp16 and bf16 dense FFN times of shape m (µs), or None. cuBLAS's time moves by
    up to 5 % between processes and dtypes, so speed-up targets are judged against the faster one."""
    dense = [t for t in (cell(r.get("dense_ffn", m, d), "t_us") for d in r.dtypes()) if t]
    return min(dense) if dense else None


def section_ffn(runs):
    out = []
    for r in runs:
        targets = r.targets()
        rows = []
        for m in r.models():
            for d in r.dtypes():
                cells = []
                for e in targets:
                    f = r.get("prox_ffn", m, d, e)
                    if f is None:
                        cells.append("-")
                        continue
                    cells.append(f"{fmt_us(f.get('t_us'))} µs, **{fmt_x(f.get('speedup_vs_dense'))}**, "
                                 f"ê {100 * f.get('e_hat', float('nan')):.1f} %")
                if any(c != "-" for c in cells):
                    dense = r.get("dense_ffn", m, d)
                    rows.append([m, d, fmt_us(cell(dense, "t_us"))] + cells)
        if rows:
            out += captioned_table(r.context,
                                   "Each cell: Prox FFN time per token, speed-up over the cuBLAS dense FFN of the "
                                   "same run, and the effective sparsity ê measured from the masks.",
                                   ["model", "dtype", "dense µs"] + [f"e = {e} %" for e in targets], rows)
            # Where the time goes: Stage 2 alone, Stage 1 alone, and the byte floor.
            rows2 = []
            for m, d, e, f in r.each("prox_ffn"):
                t = time_split(r, m, d, e, f)
                rows2.append([m, d, f"{e} %", f"{f.get('s1', 0) * 100:.1f} / {f.get('s2', 0) * 100:.1f}",
                              fmt_us(f.get("t_us")), fmt_us(cell(r.get("proxy_int4", m, d, e), "t_us")),
                              fmt_us(cell(r.get("prox_stage2", m, d, e), "t_us")),
                              f"{fmt_us(t['fixed1'])} + {fmt_us(t['fixed2'])}",
                              f"{f.get('bytes_needed', 0) / 1e6:.1f}", fmt_us(t["floor"]),
                              fmt_pct(f.get("frac_copy")), fmt_pct(t["rest_frac"])])
            if rows2:
                out += captioned_table(
                    None,
                    "Breakdown: Stage 1 alone (`proxy_int4`), Stage 2 alone on Stage 1's masks "
                    "(`prox_stage2`), the two stages' fixed costs (`proxy_int4_empty` + `stage2_empty`: "
                    "the same launches with nothing kept, so no weight byte is read), the bytes that had "
                    "to be read, the time those bytes take at the copy bandwidth (the floor), the FFN's "
                    "fraction of copy, and the fraction of copy of the time left after the fixed costs.",
                    ["model", "dtype", "e", "s1 / s2 measured %", "FFN µs", "Stage 1 µs", "Stage 2 µs",
                     "fixed µs (1 + 2)", "MB read", "floor µs", "of copy", "of copy w/o fixed"], rows2)
        rows3 = []
        for m, d, e, p in r.each("ffn_paired"):
            f = r.get("prox_ffn", m, d, e) or {}
            rows3.append([m, d, f"{e} %", fmt_us(p.get("t_us")), fmt_us(p.get("dense_us")),
                          f"**{fmt_x(p.get('speedup_vs_dense'))}**",
                          f"{fmt_x(p.get('speedup_pair_median'))} ({fmt_x(p.get('speedup_pair_min'))}–"
                          f"{fmt_x(p.get('speedup_pair_max'))})",
                          fmt_x(f.get("speedup_vs_dense"))])
        if rows3:
            out += captioned_table(
                None,
                "Paired (`ffn_paired`): the Prox FFN and the dense FFN of the same dtype replayed in alternation "
                "(one graph replay of each per pair, the order switching every pair), so both are timed in the same "
                "GPU state; medians over the pairs, the speed-up as their ratio and as the median (range) of the "
                "per-pair ratios, next to `prox_ffn`'s speed-up against the separately timed `dense_ffn`.",
                ["model", "dtype", "e", "Prox µs", "dense µs", "speed-up", "per pair: median (min–max)",
                 "unpaired speed-up"], rows3)
    return "\n".join(out) if out else "_No Prox FFN results in the input._"


def section_budget(runs):
    """The speed-up targets' time budget against what the FFN's fixed costs and its bytes leave."""
    out = []
    for r in runs:
        rows = []
        for m in TARGET_SPEEDUP_MODELS:
            dense = faster_dense(r, m)
            for d in r.dtypes():
                for e, need in sorted(TARGET_SPEEDUP.items()):
                    f = r.get("prox_ffn", m, d, e)
                    if f is None or dense is None:
                        continue
                    t = time_split(r, m, d, e, f)
                    budget = dense / need
                    left = budget - t["fixed"]
                    needed = fmt_pct(t["floor"] / left) if left > 0 else "-"
                    rows.append([m, d, f"{e} %", f"{need:.1f}×: ≤ {fmt_us(budget)}", fmt_us(f.get("t_us")),
                                 f"{fmt_us(t['fixed1'])} + {fmt_us(t['fixed2'])}", fmt_us(t["floor"]),
                                 fmt_us(t["floor"] + t["fixed"]), fmt_pct(t["rest_frac"]), needed])
        if rows:
            out += captioned_table(
                r.context,
                "The speed-up targets as a time budget (the faster of the shape's fp16 and bf16 dense FFN times "
                "divided by the target), the Prox FFN time, its two fixed costs (`proxy_int4_empty` + "
                "`stage2_empty`), the floor (the bytes that had to be read at the copy bandwidth), floor + fixed "
                "costs (the FFN with its fixed costs as they are and every byte at the copy bandwidth), the "
                "fraction of copy the streaming part reaches now, and the fraction it would need to meet the "
                "target with the fixed costs as they are (above 100 %: out of reach unless the fixed costs fall).",
                ["model", "dtype", "e", "target: budget µs", "FFN µs", "fixed µs (1 + 2)", "floor µs",
                 "floor + fixed µs", "streaming now, of copy", "streaming needed, of copy"], rows)
    return "\n".join(out) if out else "_No Prox FFN results in the input._"


def section_kernels(runs):
    out = []
    ops = [("threshold", "threshold"), ("proxy_int4", "Stage 1 INT4 proxy"), ("glu", "GLU"), ("down", "down"),
           ("prox_stage2", "Stage 2 fused"), ("prox_ffn", "FFN")]
    for r in runs:
        rows = []
        for m in r.models():
            for d in r.dtypes():
                for e in r.targets():
                    cells = []
                    for op, _ in ops:
                        x = r.get(op, m, d, e)
                        cells.append("-" if x is None else f"{fmt_us(x.get('t_us'))} µs / {fmt_pct(x.get('frac_copy'))}")
                    if any(c != "-" for c in cells):
                        rows.append([m, d, f"{e} %"] + cells)
        if rows:
            out += captioned_table(r.context,
                                   "Each cell: time per launch / bytes that had to be read per second as a fraction "
                                   "of the copy bandwidth of the same run. The threshold op reads only x and is "
                                   "latency-bound.",
                                   ["model", "dtype", "e"] + [name for _, name in ops], rows)
    return "\n".join(out) if out else "_No per-kernel results in the input._"


def section_fixed(r):
    """The FFN's fixed cost alone and inside a layer sequence, from one prox_bench run of the ffn_empty,
    proxy_int4_empty, stage2_empty, attn_gemv, chain_* and prox_ffn benches (docs/data/fixed-cost-h100.json)."""
    es = r.targets()
    if not es:
        return "_No fixed-cost results in the input._"
    lo, hi = es[0], es[-1]
    rows = []
    for m in r.models():
        for d in r.dtypes():
            fe, pe, se = (r.get(b, m, d, hi) for b in ("ffn_empty", "proxy_int4_empty", "stage2_empty"))
            ag, ce = r.get("attn_gemv", m, d), r.get("chain_ffn_empty", m, d, hi)
            pf = {e: r.get("prox_ffn", m, d, e) for e in (lo, hi)}
            cf = {e: r.get("chain_ffn", m, d, e) for e in (lo, hi)}
            if None in (fe, pe, se, ag, ce) or None in pf.values() or None in cf.values():
                continue
            rows.append([m.replace("Qwen3-", ""), d, f"{fmt_us(fe['t_us'])} µs",
                         f"{fmt_us(pe['t_us'])} + {fmt_us(se['t_us'])} µs", f"{fmt_us(ag['t_us'])} µs",
                         f"{fmt_us(ce['ffn_us'])} µs"]
                        + [f"{fmt_x(pf[e]['speedup_vs_dense'])} → {fmt_x(cf[e]['ffn_speedup'])}" for e in (lo, hi)]
                        + [f"{fmt_x(cf[lo]['speedup_vs_dense'])} / {fmt_x(cf[hi]['speedup_vs_dense'])}"])
    if not rows:
        return "_No fixed-cost results in the input._"
    caption = (f"Fixed costs at the e = {hi} % plans; speed-ups of the FFN alone (`prox_ffn` against `dense_ffn`) "
               f"→ the FFN inside the sequence (`ffn_speedup`), and of the whole sequence (`chain_ffn` against "
               f"`chain_dense`) at e = {lo} % / {hi} %:")
    header = ["model", "dtype", "`ffn_empty`", "Stage 1 + Stage 2 empty", "`attn_gemv`", "fixed cost in the sequence",
              f"e = {lo} %", f"e = {hi} %", f"sequence, e = {lo} % / {hi} %"]
    return "\n".join(captioned_table(r.context, caption, header, rows))


def verdict(ok):
    return "**pass**" if ok else "**FAIL**"


def worst_bf16_ratio(r, ops, models, label):
    """(largest bf16/fp16 time ratio over ops x models x targets of run r, label(op, m, e)), or None."""
    worst = None
    for op in ops:
        for m in models:
            for e in r.targets():
                a = r.get(op, m, "f16", e)
                b = r.get(op, m, "bf16", e)
                if a and b and a.get("t_us") and b.get("t_us"):
                    q = b["t_us"] / a["t_us"]
                    if worst is None or q > worst[0]:
                        worst = (q, label(op, m, e))
    return worst


def section_targets(runs, alpha):
    rows = []
    for r in runs:
        tag = f"{r.context.get('gpu', '?')} @ `{r.context.get('prox_commit', '?')}`"
        for e, need in sorted(TARGET_SPEEDUP.items(), reverse=True):
            for m in TARGET_SPEEDUP_MODELS:
                # Against the faster dense FFN of the shape (faster_dense): a ratio against the slower one
                # would pass on cuBLAS's noise. The ratio against the row's own dtype is kept in brackets.
                dense = faster_dense(r, m)
                for d in r.dtypes():
                    f = r.get("prox_ffn", m, d, e)
                    if f is None or f.get("speedup_vs_dense") is None:
                        continue
                    own = f["speedup_vs_dense"]
                    s = dense / f["t_us"] if dense and f.get("t_us") else own
                    shown = fmt_x(s) + (f" (own dtype {fmt_x(own)})" if fmt_x(own) != fmt_x(s) else "")
                    # Where the run has the paired bench (Prox and dense replays alternating), its ratio
                    # must pass too: a pass has to hold whichever way the dense time is taken.
                    p = cell(r.get("ffn_paired", m, d, e), "speedup_vs_dense")
                    ok = s >= need and (p is None or p >= need)
                    if p is not None:
                        shown += f"; paired {fmt_x(p)}"
                    rows.append([f"FFN speed-up ≥ {need:.1f}× at e = {e} %", f"{m} {d}", shown, verdict(ok), tag])
        for m, need in TARGET_FRAC.items():
            worst = None
            for op in KERNEL_OPS:
                for d in r.dtypes():
                    for e in r.targets():
                        x = r.get(op, m, d, e)
                        if x is None or x.get("frac_copy") is None:
                            continue
                        if worst is None or x["frac_copy"] < worst[0]:
                            worst = (x["frac_copy"], f"{op} {d} e{e}")
            if worst:
                rows.append([f"every kernel ≥ {need * 100:.0f} % of copy", m, f"min {fmt_pct(worst[0])} ({worst[1]})",
                             verdict(worst[0] >= need), tag])
        for what, where, ops, models, label in [
                ("FFN", "all shapes", ["prox_ffn"], r.models(), lambda op, m, e: f"{m} e{e}"),
                ("each kernel", "8B, 14B", ["threshold"] + KERNEL_OPS, TARGET_SPEEDUP_MODELS,
                 lambda op, m, e: f"{op} {m} e{e}")]:
            worst = worst_bf16_ratio(r, ops, models, label)
            if worst:
                rows.append([f"bf16 within 3 % of fp16 ({what})", where, f"max bf16/fp16 {worst[0]:.3f} ({worst[1]})",
                             verdict(worst[0] <= TARGET_BF16), tag])
    if alpha:
        vals = [(r["alpha"], r["model"], r["s1_target"]) for r in alpha["rows"]]
        if vals:
            hi = max(vals)
            tag = f"{alpha['context'].get('gpu', '?')} @ `{alpha['context'].get('prox_commit', '?')}`"
            rows.append([f"α ≤ {TARGET_ALPHA}", "4B/8B/14B/32B × s1",
                         f"max {hi[0]:.3f} ({hi[1]}, s1 {hi[2] * 100:.0f} %), min {min(vals)[0]:.3f}",
                         verdict(hi[0] <= TARGET_ALPHA), tag])
    if not rows:
        return "_No results yet._"
    paired = any(next(r.each("ffn_paired"), None) for r in runs)
    note = ("FFN speed-ups are judged against the faster of the run's fp16 and bf16 cuBLAS dense FFN times of "
            "the shape; where the ratio against the row's own dtype differs, it is given in brackets.")
    if paired:
        note += (" \"paired\" is the `ffn_paired` bench of the same run: Prox and dense FFN graph replays "
                 "alternating, ratio of their medians; a speed-up target passes only if both ratios reach it.")
    return note + "\n\n" + table(["target", "where", "measured", "verdict", "run"], rows)


def section_alpha(alpha):
    if not alpha:
        return "_No alpha results yet: run `prox_alpha` (see above)._"
    rows = alpha["rows"]
    s1s = sorted({r["s1_target"] for r in rows})
    models = sorted({r["model"] for r in rows}, key=model_order)
    by = {(r["model"], r["s1_target"]): r for r in rows}
    out = [provenance(alpha["context"]), ""]
    out.append("Measured proxy-cost ratio α = t(INT4 proxy GEMV) / t(FP16 input-sparse GEMV) at the same input "
               "sparsity, same kernel family (`proxy_gemv<Int4Weights>` vs `proxy_gemv<DenseWeights<half>>`), "
               "same tokens and kept inputs; best policy of each candidate list. Target α ≤ 0.28; the paper "
               "measured 0.234–0.351 on A6000, RTX 3090 and A100.")
    out.append("")
    hdr = ["Model"] + [f"{s * 100:.0f} %" for s in s1s]
    # Laid out like the paper's measured-α table: "Input sparsity" over the columns, the GPU as a group
    # row, and the paper's three GPUs below for comparison (their values as the paper prints them).
    gpu = alpha["context"].get("gpu", "this GPU")
    main_hdr = ["**Model**"] + [("**Input sparsity** " if i == 0 else "") + f"**{s * 100:.0f} %**"
                                for i, s in enumerate(s1s)]
    main = [[f"**{gpu}** (prox, this run)"] + [""] * len(s1s)]
    main += [[m] + [f"{by[(m, s)]['alpha']:.3f}" if (m, s) in by else "-" for s in s1s] for m in models]
    if [round(s * 100) for s in s1s] == [0, 10, 55, 70]:
        for name, vals in PAPER_ALPHA_TABLE:
            main.append([f"**{name}** (paper)"] + [""] * len(s1s))
            main += [[m] + [f"{v:.3f}" for v in row] for m, row in vals]
    out.append(table(main_hdr, main))
    out.append("")
    out.append("With the plan-time default policy of each list:")
    out.append("")
    out.append(table(hdr, [[m] + [f"{by[(m, s)]['alpha_default']:.3f}" if (m, s) in by else "-" for s in s1s]
                           for m in models]))
    out.append("")
    fixed = all("t_int4_empty_us" in r for r in rows)  # prox_alpha since the fixed-cost runs
    if fixed:
        target = float(alpha.get("target_alpha_max", 0.28))

        def streaming(r):  # computed from the times, so older runs (with alpha_marginal) render the same way
            return (r["t_int4_us"] - r["t_int4_empty_us"]) / r["t_fp16_us"]

        def budget(r):
            return target * r["t_fp16_us"] - (r["t_int4_us"] - r["t_int4_empty_us"])

        out.append("α without the INT4 kernel's fixed cost, (t_INT4 − t_INT4,empty) / t_FP16, where t_INT4,empty is "
                   "the same INT4 policy with τ_x = +inf (nothing kept, no weight byte read). It is how far the INT4 "
                   "streaming is from the byte ratio. The fp16 kernel's empty time (last column of the details) is "
                   "not subtracted: its grid is 3–12 times larger and runs in several waves, whose scheduling "
                   "overlaps the streaming once rows are kept, so it is not an additive cost of that kernel:")
        out.append("")
        out.append(table(hdr, [[m] + [f"{streaming(by[(m, s)]):.3f}" if (m, s) in by else "-" for s in s1s]
                               for m in models]))
        out.append("")
        out.append(f"The INT4 fixed cost at which α would be {target:.2f}, the streaming as measured, "
                   f"{target:.2f} t_FP16 − (t_INT4 − t_INT4,empty), in µs (measured fixed cost in the details):")
        out.append("")
        out.append(table(hdr, [[m] + [f"{budget(by[(m, s)]):.2f}" if (m, s) in by else "-" for s in s1s]
                               for m in models]))
        out.append("")
    det = []
    copy = float(alpha["context"].get("copy_GBps", "nan"))
    for m in models:
        for s in s1s:
            r = by.get((m, s))
            if not r:
                continue
            det.append([m, f"{s * 100:.0f} %", f"{r['s1_measured'] * 100:.2f} %", f"{r['t_int4_us']:.2f}",
                        f"`{r['policy_int4']}`", f"{r['int4_GBps'] / copy * 100:.0f} %", f"{r['t_fp16_us']:.2f}",
                        f"`{r['policy_fp16']}`", f"{r['fp16_GBps'] / copy * 100:.0f} %", f"{r['byte_ratio']:.3f}",
                        f"{r['alpha']:.3f}"]
                       + ([f"{r['t_int4_empty_us']:.2f}", f"{r['t_fp16_empty_us']:.2f}"] if fixed else []))
    out.append("Details (time per launch; bandwidth as a fraction of the copy bandwidth; the byte ratio is the α a "
               "purely bandwidth-bound pair would give):")
    out.append("")
    out.append(table(["model", "s1", "s1 measured", "INT4 µs", "INT4 policy", "of copy", "fp16 µs", "fp16 policy",
                      "of copy", "byte ratio", "α"]
                     + (["INT4 µs, nothing kept", "fp16 µs, nothing kept"] if fixed else []), det))
    return "\n".join(out)


def batch_limit(br, m, d, e, mask):
    """(the largest B of the run at which the Prox FFN beats cuBLAS dense at the same B, its speed-up), or
    (None, None) when no B does."""
    best = (None, None)
    for b in br.batches():
        x = br.get(m, d, e, b, mask)
        if x and x.get("speedup_vs_dense", 0) > 1.0:
            best = (b, x["speedup_vs_dense"])
    return best


def batch_rows(br, d, mask):
    rows = []
    for m in br.models():
        for e in br.targets():
            for b in br.batches():
                x = br.get(m, d, e, b, mask)
                if x is None:
                    continue
                rows.append([m, f"{e} %", b, fmt_us(x.get("t_us")), fmt_us(x.get("dense_us")),
                             fmt_x(x.get("speedup_vs_dense")),
                             f"{fmt_pct(x.get('in_token'))} / {fmt_pct(x.get('in_union'))}",
                             f"{fmt_pct(x.get('ch_token'))} / {fmt_pct(x.get('ch_union'))}",
                             fmt_x(x.get("floor_speedup")), fmt_pct(x.get("frac_floor")), fmt_pct(x.get("frac_copy"))])
    return rows


def batch_split(br, m, d, b, x):
    """A batch row x split as time_split does for batch 1: the batched FFN's fixed cost at B (batch_ffn_empty),
    the floor (union bytes at the copy bandwidth), the streaming part's fraction of copy now, the fraction it
    would need for each batch target with the fixed cost as it is (None where the target does not apply or
    the fixed cost alone exceeds the budget: out of reach), and cuBLAS dense's own fraction of copy at the
    same B (dense bytes / dense time). None when the run has no batch_ffn_empty row for (m, d, b)."""
    fixed = br.fixed_us(m, d, b)
    copy, t, dense = x.get("copy_GBps"), x.get("t_us"), x.get("dense_us")
    ub, fl = x.get("union_bytes"), x.get("floor_speedup")
    if fixed is None or not (copy and t and dense and ub and fl):
        return None
    floor = ub / (copy * 1e3)

    def needed(budget):
        return floor / (budget - fixed) if budget > fixed else None

    return {"fixed": fixed, "floor": floor, "now": floor / (t - fixed) if t > fixed else None,
            "copy": needed(floor / BATCH_COPY_FRAC),
            "floor_frac": needed(dense / (BATCH_FLOOR_FRAC * fl)) if b in BATCH_FLOOR_BATCHES else None,
            "dense": ub * fl / (dense * 1e3) / copy}


def batch_budget(br, d):
    """The batch targets as a time budget on the 8B and 14B shapes (dtype d): what each would need of the
    streaming part with the batched FFN's fixed cost as it is, against cuBLAS dense's own fraction of copy."""
    rows, tallies = [], {"copy": [], "floor_frac": []}
    for m in BATCH_COPY_MODELS:
        for mask in br.masks():
            for e in br.targets():
                for b in br.batches():
                    x = br.get(m, d, e, b, mask)
                    if b < 2 or x is None:
                        continue
                    sp = batch_split(br, m, d, b, x)
                    if sp is None:
                        continue
                    for k, got in (("copy", x.get("frac_copy")), ("floor_frac", x.get("frac_floor"))):
                        if k == "copy" or b in BATCH_FLOOR_BATCHES:
                            met = got is not None and got >= (BATCH_COPY_FRAC if k == "copy" else BATCH_FLOOR_FRAC)
                            tallies[k].append((met, sp[k], sp["dense"]))
                    rows.append([m, BATCH_MASK_TEXT.get(mask, mask), f"{e} %", b, fmt_us(x.get("t_us")),
                                 fmt_us(sp["fixed"]), f"{x['union_bytes'] / 1e6:.0f}", fmt_us(sp["floor"]),
                                 fmt_us(sp["floor"] + sp["fixed"]), fmt_pct(sp["now"]),
                                 fmt_pct(sp["copy"]) if sp["copy"] is not None else "out of reach",
                                 "" if b not in BATCH_FLOOR_BATCHES else
                                 fmt_pct(sp["floor_frac"]) if sp["floor_frac"] is not None else "out of reach",
                                 fmt_pct(sp["dense"])])
    if not rows:
        return []
    fixed = ", ".join(f"{m.replace('Qwen3-', '')} " + " / ".join(fmt_us(br.fixed_us(m, d, b)) for b in br.batches())
                      for m in BATCH_COPY_MODELS if any(br.fixed_us(m, d, b) for b in br.batches()))
    out = [f"**Time budget of the batch targets** ({d}). The batched FFN's fixed cost (`batch_ffn_empty`: the "
           "same plans with thresholds +inf, so nothing is kept and no weight byte is read) at B = "
           + " / ".join(str(b) for b in br.batches()) + f": {fixed} µs. With that cost as it is, each target "
           "leaves the streaming part (the time less the fixed cost) a budget, and so needs a fraction of copy "
           "bandwidth from it; cuBLAS dense reaches its own fraction at the same B in the same run (dense bytes / "
           "dense time), streaming whole contiguous matrices:", ""]
    names = {"copy": f"union bytes at ≥ {BATCH_COPY_FRAC * 100:.0f} % of copy (B ≥ 2)",
             "floor_frac": f"≥ {BATCH_FLOOR_FRAC * 100:.0f} % of the union byte floor (B = "
                           + " and ".join(str(b) for b in BATCH_FLOOR_BATCHES) + ")"}
    for k, cells in tallies.items():
        if not cells:
            continue
        missed = [c for c in cells if not c[0]]
        need = [c[1] for c in missed if c[1] is not None]
        over = sum(1 for c in missed if c[1] is None or c[1] > 1.0)
        dense = [c[2] for c in missed]
        line = f"- {names[k]}: {len(cells) - len(missed)} of {len(cells)} cells met"
        if missed:
            line += (f"; the {len(missed)} missed would need the streaming part at "
                     + (f"{fmt_range_pct(need)} of copy" if need else "more than its budget")
                     + (f" ({over} of them above 100 %: out of reach)" if over else "")
                     + f", where cuBLAS dense streams at {fmt_range_pct(dense)}")
        out.append(line + ".")
    out += ["", "<details><summary>Time budget per cell (8B and 14B, " + d + ")</summary>", "",
            table(["model", "tokens", "e", "B", "Prox µs", "fixed µs", "union MB", "floor µs", "floor + fixed µs",
                   "streaming now, of copy", f"needed for {BATCH_COPY_FRAC * 100:.0f} % of copy",
                   f"needed for {BATCH_FLOOR_FRAC * 100:.0f} % of floor", "cuBLAS dense, of copy"], rows),
            "", "</details>", ""]
    return out


def section_batch(br):
    """Batched decode: where Prox stops beating dense, the batch targets, and every row of the run."""
    ctx = br.context
    out = [provenance(ctx), ""]
    if br.errors:
        out += [f"{len(br.errors)} benchmark(s) reported errors: " +
                "; ".join(f"`{n}`: {m}" for n, m in br.errors[:5]) + (" …" if len(br.errors) > 5 else ""), ""]
    d0 = "f16" if "f16" in br.dtypes() else br.dtypes()[0]
    others = [d for d in br.dtypes() if d != d0]
    out += [f"**Where Prox stops beating dense.** The largest B at which the Prox FFN is faster than cuBLAS dense "
            f"at the same B, and its speed-up there ({d0}"
            + (f"; {', '.join(others)} in brackets where its B differs" if others else "") +
            "). B = 1: batching never pays against dense; \"-\": not even batch 1 wins.", ""]
    header = ["model", "tokens"] + [f"e = {e} %" for e in br.targets()]
    rows = []
    for m in br.models():
        for mask in br.masks():
            cells = []
            for e in br.targets():
                b, sp = batch_limit(br, m, d0, e, mask)
                c = "-" if b is None else f"B = {b} ({fmt_x(sp)})"
                for d in others:
                    bo, _ = batch_limit(br, m, d, e, mask)
                    if bo != b:
                        c += f" [{d}: {'-' if bo is None else f'B = {bo}'}]"
                cells.append(c)
            rows.append([m, BATCH_MASK_TEXT.get(mask, mask)] + cells)
    out += [table(header, rows), ""]

    trows = []
    tag = f"{ctx.get('gpu', '?')} @ `{ctx.get('prox_commit', '?')}`"
    for mask in br.masks():
        for where, models in (("all shapes", br.models()), ("8B, 14B", BATCH_COPY_MODELS)):
            worst = None
            for m in models:
                for d in br.dtypes():
                    for e in br.targets():
                        for b in BATCH_FLOOR_BATCHES:
                            x = br.get(m, d, e, b, mask)
                            if x and x.get("frac_floor") is not None and (worst is None or x["frac_floor"] < worst[0]):
                                worst = (x["frac_floor"], f"{m} {d} e{e} B{b}")
            if worst:
                trows.append([f"FFN speed-up ≥ {BATCH_FLOOR_FRAC * 100:.0f} % of the union byte floor's at B = "
                              + " and ".join(str(b) for b in BATCH_FLOOR_BATCHES), f"{where}, {mask}",
                              f"min {fmt_pct(worst[0])} ({worst[1]})", verdict(worst[0] >= BATCH_FLOOR_FRAC), tag])
    for mask in br.masks():
        for m in BATCH_COPY_MODELS:
            worst = None
            for d in br.dtypes():
                for e in br.targets():
                    for b in br.batches():
                        x = br.get(m, d, e, b, mask)
                        if b > 1 and x and x.get("frac_copy") is not None and (worst is None or x["frac_copy"] < worst[0]):
                            worst = (x["frac_copy"], f"{d} e{e} B{b}")
            if worst:
                trows.append([f"union bytes at ≥ {BATCH_COPY_FRAC * 100:.0f} % of copy bandwidth (B ≥ 2)",
                              f"{m}, {mask}", f"min {fmt_pct(worst[0])} ({worst[1]})",
                              verdict(worst[0] >= BATCH_COPY_FRAC), tag])
    if trows:
        out += ["Targets (issue 23). \"of copy\" is the FFN's union bytes over its time, against the copy "
                "bandwidth of the same run.", "", table(["target", "where", "measured", "verdict", "run"], trows), ""]

    out += batch_budget(br, d0)

    header = ["model", "e", "B", "Prox µs", "dense µs", "speed-up", "inputs kept: token / union",
              "channels: token / union", "floor speed-up", "of floor", "of copy"]
    for mask in br.masks():
        for d in br.dtypes():
            rows = batch_rows(br, d, mask)
            if rows:
                out += [f"<details><summary>All rows: {d}, {BATCH_MASK_TEXT.get(mask, mask)}</summary>", "",
                        table(header, rows), "", "</details>", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- plots
# matplotlib is imported only when plots are drawn: the tables, and tests/check_docs.py (which imports this
# module in CI), need the standard library alone. The SVGs are made reproducible for one matplotlib version
# (fixed hash salt, no date, text as text); docs_in_sync checks that they exist and parse, not their bytes.
PLOT_OPS = ["proxy_int4", "glu", "down", "prox_ffn"]
PAPER_ALPHA = (0.234, 0.351)  # the range of the paper's measured-α table (PAPER_ALPHA_TABLE)
FRAC_LINE = 0.85  # TARGET_FRAC of the 8B and 14B shapes


def pyplot():
    """matplotlib.pyplot with the Agg backend and reproducible SVG settings, or None if not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "prox", "svg.fonttype": "none", "font.family": "sans-serif",
                                "font.size": 9, "axes.grid": True, "grid.color": "#e0e0e0",
                                "axes.axisbelow": True})
    import matplotlib.pyplot as plt
    return plt


def save(plt, fig, path):
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    plt.close(fig)


def run_tag(ctx):
    return f"{ctx.get('gpu', 'unknown GPU')} @ {ctx.get('prox_commit', 'unknown')}"


def byte_floor(r):
    """(model, dtype, [(e, dense FFN bytes / Prox FFN bytes)]): the speed-up if both streamed at one bandwidth.
    From the Qwen3-8B shape where the run has it (the ratio moves by < 0.01 between shapes), fp16 first."""
    models = sorted(r.models(), key=lambda m: (m != "Qwen3-8B", model_order(m)))
    for m in models:
        for d in r.dtypes():
            dense = cell(r.get("dense_ffn", m, d), "bytes_needed")
            pts = [(e, dense / f["bytes_needed"]) for e in r.targets()
                   for f in [r.get("prox_ffn", m, d, e)] if dense and f and f.get("bytes_needed")]
            if pts:
                return m, d, pts
    return None, None, []


def plot_ffn_speedup(plt, r, path):
    series = []
    for i, m in enumerate(r.models()):
        for d, style in (("f16", "-"), ("bf16", "--")):
            pts = [(e, f["speedup_vs_dense"]) for e in r.targets()
                   for f in [r.get("prox_ffn", m, d, e)] if f and f.get("speedup_vs_dense")]
            if pts:
                series.append((f"{m} {d}", f"C{i}", style, pts))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(8.0, 4.2))
    for label, color, style, pts in series:
        ax.plot(*zip(*pts), style, color=color, marker="o", markersize=4, label=label)
    fm, fd, floor = byte_floor(r)
    if floor:
        ax.plot(*zip(*floor), ":", color="#222222", label=f"byte floor ({fm} {fd}): dense / Prox FFN bytes")
    ax.set_xticks(sorted({e for s in series for e, _ in s[3]}))
    ax.set_xlabel("target effective sparsity e (%)")
    ax.set_ylabel("speed-up over cuBLAS dense FFN")
    ax.set_title(f"Prox FFN speed-up over cuBLAS dense FFN, {run_tag(r.context)}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    save(plt, fig, path)
    return True


def plot_kernel_bandwidth(plt, r, path):
    models = r.models()
    targets = r.targets()
    d = "f16" if "f16" in r.dtypes() else (r.dtypes() or ["f16"])[0]
    vals = {(op, m, e): x["frac_copy"] for op in PLOT_OPS for m in models for e in targets
            for x in [r.get(op, m, d, e)] if x and x.get("frac_copy") is not None}
    if not vals:
        return False
    fig, axes = plt.subplots(1, len(targets), figsize=(2.4 * len(targets), 3.8), sharey=True, squeeze=False)
    width = 0.8 / len(PLOT_OPS)
    for ax, e in zip(axes[0], targets):
        for j, op in enumerate(PLOT_OPS):
            xs = [i - 0.4 + (j + 0.5) * width for i, m in enumerate(models) if (op, m, e) in vals]
            ys = [vals[(op, m, e)] for m in models if (op, m, e) in vals]
            ax.bar(xs, ys, width, color=f"C{j}", label=op)
        ax.axhline(FRAC_LINE, linestyle=":", color="#222222", label=f"{FRAC_LINE:.2f} of copy (8B, 14B target)")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([m.replace("Qwen3-", "") for m in models])
        ax.grid(axis="x", visible=False)
        ax.set_title(f"e = {e} % ({d})", fontsize=9)
    axes[0][0].set_ylabel("fraction of copy bandwidth")
    fig.supxlabel("Qwen3 model", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles, labels = handles[1:] + handles[:1], labels[1:] + labels[:1]  # the bars first, the target line last
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.93), ncol=len(labels), fontsize=8,
               frameon=False)
    fig.suptitle(f"Kernel bandwidth as a fraction of copy bandwidth, {run_tag(r.context)}", y=1.04)
    save(plt, fig, path)
    return True


def plot_alpha(plt, alpha, path):
    rows = alpha["rows"]
    models = sorted({x["model"] for x in rows}, key=model_order)
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    ax.axhspan(*PAPER_ALPHA, color="#d0d0d0", label=f"paper range {PAPER_ALPHA[0]:.3f}–{PAPER_ALPHA[1]:.3f}")
    ax.axhline(TARGET_ALPHA, linestyle=":", color="#222222", label=f"target α ≤ {TARGET_ALPHA}")
    for i, m in enumerate(models):
        pts = sorted((x["s1_target"] * 100, x["alpha"]) for x in rows if x["model"] == m)
        ax.plot(*zip(*pts), "-", color=f"C{i}", marker="o", markersize=4, label=m)
    ax.set_xticks(sorted({round(x["s1_target"] * 100, 6) for x in rows}))
    ax.set_xlabel("input sparsity s1 (%)")
    ax.set_ylabel("α = t(INT4) / t(FP16)")
    ax.set_title(f"Measured α = t(INT4) / t(FP16), {run_tag(alpha['context'])}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    save(plt, fig, path)
    return True


def plot_batch_speedup(plt, br, path):
    """Speed-up over cuBLAS dense at the same B against B: a panel per shape and mask model, a line per e
    (fp16), the union byte floor dotted in the same colour."""
    models, masks, targets = br.models(), br.masks(), br.targets()
    d = "f16" if "f16" in br.dtypes() else (br.dtypes() or ["f16"])[0]
    if not models or not masks:
        return False
    fig, axes = plt.subplots(len(masks), len(models), figsize=(2.6 * len(models), 2.6 * len(masks)), sharex=True,
                             sharey=True, squeeze=False)
    for i, mask in enumerate(masks):
        for j, m in enumerate(models):
            ax = axes[i][j]
            for k, e in enumerate(targets):
                pts = [(b, x["speedup_vs_dense"], x.get("floor_speedup")) for b in br.batches()
                       for x in [br.get(m, d, e, b, mask)] if x and x.get("speedup_vs_dense")]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=f"C{k}", marker="o", markersize=3,
                        label=f"e = {e} %")
                fl = [(p[0], p[2]) for p in pts if p[2]]
                if fl:
                    ax.plot(*zip(*fl), ":", color=f"C{k}", linewidth=1)
            ax.axhline(1.0, color="#222222", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(br.batches())
            ax.set_xticklabels([str(b) for b in br.batches()])
            ax.set_title(f"{m.replace('Qwen3-', '')}, {BATCH_MASK_TEXT.get(mask, mask)}", fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("tokens B")
    for row in axes:
        row[0].set_ylabel("speed-up over dense")
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], linestyle=":", color="#222222"))
    labels.append("union byte floor (dense / union bytes)")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.9), ncol=len(labels), fontsize=8,
               frameon=False)
    fig.suptitle(f"Batched Prox FFN ({d}) over cuBLAS dense at the same B, {run_tag(br.context)}", y=0.98)
    save(plt, fig, path)
    return True


BATCH_PLOT = ("Batched Prox FFN speed-up over cuBLAS dense against B", "prox_batch_speedup.svg")


def plot_list(runs, alpha, batch=None):
    """(title, file name, draw function, data) of every plot the inputs allow. The batch plot is linked from
    the section "batch", the others from the section "plots"."""
    plots = []
    if batch is not None and batch.rows:
        plots.append(BATCH_PLOT + (plot_batch_speedup, batch))
    if runs and next(runs[0].each("prox_ffn"), None):
        plots += [("Prox FFN speed-up over cuBLAS dense", "prox_ffn_speedup.svg", plot_ffn_speedup, runs[0]),
                  ("Kernel bandwidth as a fraction of copy bandwidth", "prox_kernel_bandwidth.svg",
                   plot_kernel_bandwidth, runs[0])]
    if alpha and alpha["rows"]:
        plots.append(("Measured α", "prox_alpha.svg", plot_alpha, alpha))
    return plots


def section_plots(runs, alpha, rel):
    """The plots section: one image link per plot, relative to the document (rel: the image directory)."""
    links = [f"![{title}]({rel}/{name})" for title, name, _, _ in plot_list(runs, alpha) if name != BATCH_PLOT[1]]
    return "\n\n".join(links) if links else "_Nothing to plot._"


def make_plots(plt, runs, alpha, img_dir, batch=None):
    """Writes every plot of plot_list under img_dir."""
    os.makedirs(img_dir, exist_ok=True)
    for _, name, draw, data in plot_list(runs, alpha, batch):
        draw(plt, data, os.path.join(img_dir, name))


# ---------------------------------------------------------------- document update
def replace_section(doc, name, body):
    begin = f"<!-- BEGIN prox-report:{name} -->"
    end = f"<!-- END prox-report:{name} -->"
    i = doc.find(begin)
    j = doc.find(end)
    if i < 0 or j < 0 or j < i:
        print(f"report.py: warning: markers for section '{name}' not found; section skipped", file=sys.stderr)
        return doc
    return doc[: i + len(begin)] + "\n" + body.rstrip() + "\n" + doc[j:]


def load_alpha(path, commit_override):
    with open(path) as f:
        data = json.load(f)
    if "rows" not in data:
        raise ValueError(f"{path} is not prox_alpha output (no 'rows')")
    ctx = data.get("context", {})
    if commit_override:
        ctx["prox_commit"] = commit_override
    return {"path": path, "context": ctx, "rows": data["rows"]}


def render_sections(runs, alpha, rel="img", plots=True, fixed=None, batch=None):
    """Every generated section report.py can fill from the inputs, by name; the plots section links images
    under rel (relative to the document). Standard library only: tests/check_docs.py calls it too. `fixed`
    (a BenchRun of the fixed-cost and chained benches) fills the section "fixed" alone, `batch` (a BatchRun)
    the section "batch" with its plot's link."""
    extra = {}
    if fixed:
        extra["fixed"] = section_fixed(fixed)
    if batch is not None and batch.rows:
        extra["batch"] = section_batch(batch)
        if plots:
            extra["batch"] += f"\n![{BATCH_PLOT[0]}]({rel}/{BATCH_PLOT[1]})\n"
    if not runs and not alpha:
        return extra
    sections = dict({"provenance": section_provenance(runs, alpha)}, **extra)
    if runs:
        sections["dense"] = section_dense(runs)
        sections["ffn"] = section_ffn(runs)
        sections["budget"] = section_budget(runs)
        sections["kernels"] = section_kernels(runs)
    sections["targets"] = section_targets(runs, alpha)
    if alpha:
        sections["alpha"] = section_alpha(alpha)
    if plots:
        sections["plots"] = section_plots(runs, alpha, rel)
    return sections


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", nargs="*", default=[], help="prox_bench JSON (--benchmark_out_format=json)")
    ap.add_argument("--alpha", help="prox_alpha JSON (--json=...)")
    ap.add_argument("--fixed", help="prox_bench JSON of the ffn_empty, chain_* and related benches (section 'fixed')")
    ap.add_argument("--batch", help="prox_batch_bench JSON (section 'batch' and its plot)")
    ap.add_argument("--doc", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md"))
    ap.add_argument("--img-dir", default=None, help="where the SVG plots go (default: <doc dir>/img)")
    ap.add_argument("--commit", help="commit to record (overrides the JSON context)")
    ap.add_argument("--no-plots", action="store_true", help="leave the plots and the plots section as they are")
    ap.add_argument("--stdout", action="store_true", help="print the generated sections instead of editing --doc")
    args = ap.parse_args(argv)

    runs = [BenchRun(p, args.commit) for p in args.bench]
    alpha = load_alpha(args.alpha, args.commit) if args.alpha else None
    fixed = BenchRun(args.fixed, args.commit) if args.fixed else None
    batch = BatchRun(args.batch, args.commit) if args.batch else None
    if not runs and not alpha and not fixed and not batch:
        ap.error("give --bench, --alpha, --fixed and/or --batch")
    plt = None
    if not args.no_plots and not args.stdout and (runs or alpha or batch):
        plt = pyplot()
        if plt is None:  # checked before anything is written, so a failed run changes nothing
            ap.error("the plots need matplotlib (Debian/Ubuntu: apt install python3-matplotlib; or pip install "
                     "matplotlib); --no-plots updates the tables and leaves the plots as they are")

    doc_path = os.path.abspath(args.doc)
    doc_dir = os.path.dirname(doc_path)
    img_dir = os.path.abspath(args.img_dir) if args.img_dir else os.path.join(doc_dir, "img")
    rel = os.path.relpath(img_dir, doc_dir).replace(os.sep, "/")
    sections = render_sections(runs, alpha, rel, plots=not args.no_plots and bool(runs or alpha or batch), fixed=fixed,
                               batch=batch)

    if args.stdout:
        for k in SECTIONS:
            if k in sections:
                print(f"## [{k}]\n{sections[k]}\n")
        return 0
    if plt is not None:
        make_plots(plt, runs, alpha, img_dir, batch)
    with open(doc_path, encoding="utf-8") as f:
        doc = f.read()
    for k in SECTIONS:
        if k in sections:
            doc = replace_section(doc, k, sections[k])
    with open(doc_path, "w", encoding="utf-8") as f:
        f.write(doc)
    print(f"report.py: updated {doc_path}" + ("" if args.no_plots else f" (plots under {img_dir})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
