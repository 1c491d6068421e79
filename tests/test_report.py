#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file test_report.py  bench/report.py's batch budget arithmetic on a hand-made prox_batch_bench JSON
(ctest report_budget): batch_ffn_empty rows are read as the batched fixed cost, and batch_split's floor,
streaming fractions and budgets are the formulas docs/benchmarks.md states, checked against values worked out
by hand. Needs the standard library only. Exit 0: every check holds; 1: lists the failures.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import report  # noqa: E402

FAILURES = []


def check(what, got, want, tol=1e-9):
    ok = (got is None and want is None) or (got is not None and want is not None and abs(got - want) <= tol * max(1.0, abs(want)))
    if not ok:
        FAILURES.append(f"{what}: got {got!r}, want {want!r}")


def row(name, **counters):
    return dict({"name": name + "/iterations:20/manual_time", "run_name": name + "/iterations:20/manual_time",
                 "run_type": "iteration"}, **counters)


def cell(model, e, b, t_us, dense_us, union_bytes, floor_speedup, mask="indep"):
    copy = 3000.0
    return row(f"batch_ffn/{model}/f16/e{e}/b{b}/{mask}", t_us=t_us, dense_us=dense_us, union_bytes=union_bytes,
               floor_speedup=floor_speedup, copy_GBps=copy, speedup_vs_dense=dense_us / t_us,
               frac_floor=(dense_us / t_us) / floor_speedup, frac_copy=union_bytes / (t_us * 1e3) / copy,
               ch_union=0.5, ch_token=0.25, in_union=0.5, in_token=0.3)


def main():
    doc = {"context": {"gpu": "test GPU", "prox_commit": "abc1234", "copy_GBps": "3000"}, "benchmarks": [
        # 150 MB of union at 3000 GB/s: floor 50 us; dense bytes 300 MB in 105 us. Of the floor: (105 / 62) / 2
        # = 0.847, missed.
        cell("Qwen3-8B", 70, 2, 62.0, 105.0, 150e6, 2.0),
        # B = 8: the floor target does not apply; a fixed cost above the 85 %-of-copy budget (50 / 0.85).
        cell("Qwen3-8B", 70, 8, 120.0, 115.0, 150e6, 2.0),
        row("batch_ffn_empty/Qwen3-8B/f16/b2", t_us=10.0),
        row("batch_ffn_empty/Qwen3-8B/f16/b8", t_us=70.0),
        row("batch_ffn_empty/Qwen3-8B/f16/b4", t_us=1.0, error_occurred=True, error_message="boom"),
    ]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(doc, f)
        path = f.name
    try:
        br = report.BatchRun(path)
    finally:
        os.unlink(path)

    check("fixed cost B = 2", br.fixed_us("Qwen3-8B", "f16", 2), 10.0)
    check("fixed cost B = 8", br.fixed_us("Qwen3-8B", "f16", 8), 70.0)
    check("an errored empty row is no fixed cost", br.fixed_us("Qwen3-8B", "f16", 4), None)
    if not any("batch_ffn_empty/Qwen3-8B/f16/b4" in n for n, _ in br.errors):
        FAILURES.append("the errored batch_ffn_empty row is not listed in errors")
    if set(br.rows) != {("Qwen3-8B", "f16", 70, 2, "indep"), ("Qwen3-8B", "f16", 70, 8, "indep")}:
        FAILURES.append(f"the empty rows leaked into the cells: {sorted(br.rows)}")

    sp = report.batch_split(br, "Qwen3-8B", "f16", 2, br.get("Qwen3-8B", "f16", 70, 2, "indep"))
    check("floor", sp["floor"], 50.0)
    check("streaming now", sp["now"], 50.0 / (62.0 - 10.0))
    check("needed for 85 % of copy", sp["copy"], 50.0 / (50.0 / 0.85 - 10.0))
    check("needed for 85 % of floor", sp["floor_frac"], 50.0 / (105.0 / (0.85 * 2.0) - 10.0))
    check("cuBLAS dense, of copy", sp["dense"], 300e6 / (105.0 * 1e3) / 3000.0)

    sp8 = report.batch_split(br, "Qwen3-8B", "f16", 8, br.get("Qwen3-8B", "f16", 70, 8, "indep"))
    check("B = 8: no floor target", sp8["floor_frac"], None)
    check("B = 8: fixed cost above the copy budget", sp8["copy"], None)
    check("B = 8: streaming now", sp8["now"], 50.0 / 50.0)

    text = "\n".join(report.batch_budget(br, "f16"))
    # The copy target: both cells missed, both out of reach (B = 2 needs 102 %; B = 8's fixed cost alone is
    # over its budget); the floor target: B = 2 missed, needing 97 % (50 / 51.76).
    for want in ("0 of 2 cells met", "(2 of them above 100 %: out of reach)", "0 of 1 cells met",
                 "the 1 missed would need the streaming part at 97 % of copy", "| out of reach |", "| 10.0 |"):
        if want not in text:
            FAILURES.append(f"batch_budget's text lacks {want!r}")
    no_empty = report.BatchRun.__new__(report.BatchRun)
    no_empty.rows, no_empty.empty, no_empty.context, no_empty.errors = br.rows, {}, br.context, []
    if report.batch_budget(no_empty, "f16"):
        FAILURES.append("batch_budget renders a table without batch_ffn_empty rows")

    for f in FAILURES:
        print("test_report:", f)
    print(f"test_report: {'FAILED' if FAILURES else 'ok'}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
