#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file ab_compare.py  A/B of two builds' Google Benchmark JSONs (prox_bench, prox_batch_bench), cell by cell.

    python3 bench/ab_compare.py --a base_r1.json base_r2.json --b head_r1.json head_r2.json \
        [--metric t_us] [--family prox_ffn,batch_ffn] [--tol 1.0] [--json out.json]

Each side may have several rounds (runs interleaved A B A B in one call, so drift hits both); a cell's time is
the mean of its rounds' `--metric` (default t_us, the median the suites report; real_time if absent). Prints,
per benchmark family, the number of cells, the mean and the range of (B / A - 1) in %, and lists every cell
outside +-tol %, with each side's round-to-round spread so that noise can be told from a change. Exit 0
always: the verdict is the reader's (a cell outside the band whose rounds disagree by as much is noise).
"""
import argparse
import collections
import json
import statistics
import sys


def load(paths, metric):
    cells = collections.defaultdict(list)
    ctx = None
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        ctx = ctx or d.get("context", {})
        for b in d.get("benchmarks", []):
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            v = b.get(metric, b.get("real_time"))
            if v is not None:
                cells[b["name"]].append(float(v))
    return cells, ctx


def spread(v):
    return (max(v) / min(v) - 1.0) * 100.0 if len(v) > 1 and min(v) > 0 else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="+", required=True, help="baseline JSON(s), one per round")
    ap.add_argument("--b", nargs="+", required=True, help="candidate JSON(s), one per round")
    ap.add_argument("--metric", default="t_us")
    ap.add_argument("--family", default="", help="comma-separated family prefixes to keep (default: all)")
    ap.add_argument("--tol", type=float, default=1.0, help="band in %% (default 1.0)")
    ap.add_argument("--json", help="write every cell's ratio here")
    a = ap.parse_args(argv)
    A, ctx_a = load(a.a, a.metric)
    B, ctx_b = load(a.b, a.metric)
    fams = [f for f in a.family.split(",") if f]
    names = sorted(n for n in A if n in B and (not fams or n.split("/")[0] in fams))
    missing = sorted(set(A) ^ set(B))
    print(f"A: {ctx_a.get('prox_commit', '?')} on {ctx_a.get('gpu', '?')} ({len(a.a)} rounds); "
          f"B: {ctx_b.get('prox_commit', '?')} on {ctx_b.get('gpu', '?')} ({len(a.b)} rounds); metric {a.metric}")
    if missing:
        print(f"{len(missing)} cells in one side only (first: {missing[0]})")
    by_fam = collections.defaultdict(list)
    rows = []
    for n in names:
        ma, mb = statistics.fmean(A[n]), statistics.fmean(B[n])
        d = (mb / ma - 1.0) * 100.0
        by_fam[n.split("/")[0]].append(d)
        rows.append({"name": n, "a": ma, "b": mb, "delta_pct": d, "spread_a_pct": spread(A[n]),
                     "spread_b_pct": spread(B[n])})
    print(f"{'family':<22} {'cells':>5} {'mean %':>8} {'min %':>8} {'max %':>8}")
    for f, ds in sorted(by_fam.items()):
        print(f"{f:<22} {len(ds):>5} {statistics.fmean(ds):>+8.2f} {min(ds):>+8.2f} {max(ds):>+8.2f}")
    out = [r for r in rows if abs(r["delta_pct"]) > a.tol]
    print(f"{len(out)} of {len(rows)} cells outside +-{a.tol} %" + (":" if out else ""))
    for r in out:
        print(f"  {r['name']:<60} {r['a']:9.2f} -> {r['b']:9.2f} us  {r['delta_pct']:+6.2f} %  "
              f"(round spread A {r['spread_a_pct']:.2f} %, B {r['spread_b_pct']:.2f} %)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"a": ctx_a, "b": ctx_b, "metric": a.metric, "cells": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
