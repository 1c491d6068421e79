#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file test_fp8_report.py  bench/fp8_report.py on the stored FP8 measurements (ctest fp8_report; pytest too):
cells of its batch-1, candidate and batched tables and its targets verdicts against values worked out here
straight from docs/data/fp8-h100.json, fp8-batch-h100.json and ffn-fp8-h100.json (the benches' own counters
where they exist); the plot is a well-formed SVG with one line per shape x layout; two runs give the same bytes.
Needs the standard library only. Exit 0: every check holds; 1: lists the failures.
"""

import json
import os
import re
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import fp8_report  # noqa: E402

DATA = os.path.join(ROOT, "docs", "data")
NUM = re.compile(r"\d+(?:\.\d+)?")


def load_gbench(name):
    """{name parts: row} of a Google Benchmark JSON under docs/data, read here without fp8_report's reader."""
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        doc = json.load(f)
    out = {}
    for b in doc["benchmarks"]:
        parts = tuple(p for p in b["name"].split("/") if ":" not in p and p != "manual_time")
        out[parts] = b
    return doc["context"], out


def close(printed, value):
    """A printed number matches value within its last digit (half a unit, plus float slack) or 0.5 %."""
    s = NUM.search(printed).group(0)
    unit = 10.0 ** -(len(s) - s.index(".") - 1) if "." in s else 1.0
    return abs(float(s) - value) <= max(0.5 * unit, 0.005 * abs(value)) * (1 + 1e-9)


def table_row(text, *first):
    """The cells of the first table row starting with the cells first."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and tuple(cells[:len(first)]) == tuple(str(x) for x in first):
            return cells
    return None


def run_report(tmp, tag):
    md, svg = os.path.join(tmp, f"{tag}.md"), os.path.join(tmp, f"{tag}.svg")
    assert fp8_report.main(["--out", md, "--svg", svg]) == 0
    with open(md, encoding="utf-8") as f:
        text = f.read()
    with open(svg, "rb") as f:
        return text, f.read(), svg


def check_all():
    failures = []

    def check(what, ok):
        if not ok:
            failures.append(what)

    _, sweep = load_gbench("fp8-h100.json")
    _, batch = load_gbench("fp8-batch-h100.json")
    with open(os.path.join(DATA, "ffn-fp8-h100.json"), encoding="utf-8") as f:
        smm = {(r["shape"], r["layout"], r["batch"]): r for r in json.load(f)["rows"]}

    with tempfile.TemporaryDirectory() as tmp:
        text, svg_bytes, svg_path = run_report(tmp, "a")
        text2, svg_bytes2, _ = run_report(tmp, "b")
        check("two runs print the same tables", text == text2)
        check("two runs write the same SVG bytes", svg_bytes == svg_bytes2)

        # Batch 1, per (shape, layout), Prox-FP8 on candidate p1.
        for model, shape, lay in [("Qwen3-8B", "8b", "channel"), ("Qwen3-14B", "14b", "block128"),
                                  ("Qwen3-32B", "32b", "channel")]:
            row = table_row(text, model, lay)
            check(f"batch-1 row {model} {lay} present", row is not None and len(row) == 12)
            if row is None or len(row) != 12:
                continue
            where = f"batch 1 {model} {lay}"
            dense = {p: sweep[("fp8_dense", model, "bf16", lay, f"p{p}")] for p in (0, 1, 2)}
            best_p = min(dense, key=lambda p: dense[p]["t_us"])
            prox = {e: sweep[("fp8_ffn", model, "bf16", lay, f"e{e}", "p1")] for e in (40, 50, 60, 70)}
            t70, t50 = prox[70]["t_us"], prox[50]["t_us"]
            a = smm[(shape, lay, 1)]["scaled_mm_us"]
            d = sweep[("dense_ffn", model, "bf16")]["t_us"]
            floor = prox[70]["fp8_floor_us"]
            check(f"{where}: (a) {row[2]} vs {a}", close(row[2], a))
            check(f"{where}: (b) {row[3]} is p{best_p} at {dense[best_p]['t_us']}",
                  close(row[3], dense[best_p]["t_us"]) and f"(p{best_p})" in row[3])
            check(f"{where}: (b) of copy {row[4]}", close(row[4], 100 * dense[best_p]["frac_copy"]))
            check(f"{where}: (c) {row[5]}", close(row[5], floor))
            check(f"{where}: (d) {row[6]}", close(row[6], d))
            ts = NUM.findall(row[7])
            check(f"{where}: Prox-FP8 {row[7]}", len(ts) == 4 and all(close(s, prox[e]["t_us"])
                                                                       for s, e in zip(ts, (40, 50, 60, 70))))
            vc = NUM.findall(row[8])
            # The bench's own counter speedup_vs_fp8_floor is the same ratio.
            check(f"{where}: vs (c) {row[8]}", len(vc) == 2 and close(vc[0], prox[50]["speedup_vs_fp8_floor"])
                  and close(vc[1], prox[70]["speedup_vs_fp8_floor"]))
            va = NUM.findall(row[9])
            check(f"{where}: vs (a) {row[9]}", len(va) == 2 and close(va[0], a / t50) and close(va[1], a / t70))
            check(f"{where}: vs (b) {row[10]}", close(row[10], dense[best_p]["t_us"] / t70))
            check(f"{where}: vs (d) {row[11]}", close(row[11], prox[70]["speedup_vs_bf16_dense"]))

        # Candidates: the 70 % column lists p0 / p1 / p2.
        rows14 = [line for line in text.splitlines() if line.startswith("| Qwen3-14B | channel |")]
        check("candidate table row 14B channel", len(rows14) >= 2)
        if len(rows14) >= 2:
            cells = [c.strip() for c in rows14[1].strip().strip("|").split("|")]
            v = NUM.findall(cells[3])
            check(f"candidates 14B channel e70 {cells[3]}", len(v) == 3 and all(
                close(s, sweep[("fp8_ffn", "Qwen3-14B", "bf16", "channel", "e70", f"p{p}")]["t_us"])
                for s, p in zip(v, (0, 1, 2))))

        # Batched, 8B block128 and 32B channel at B = 4.
        for model, shape, lay, b in [("Qwen3-8B", "8b", "block128", 2), ("Qwen3-32B", "32b", "channel", 4)]:
            row = table_row(text, model, lay, b)
            check(f"batched row {model} {lay} B={b} present", row is not None and len(row) == 10)
            if row is None or len(row) != 10:
                continue
            where = f"batched {model} {lay} B={b}"
            rows = {e: batch[("batch_fp8", model, "bf16", lay, f"e{e}", f"b{b}", "indep")] for e in (40, 50, 60, 70)}
            d = batch[("batch_ffn", model, "bf16", "e70", f"b{b}", "indep")]["dense_us"]
            check(f"{where}: (a) {row[3]}", close(row[3], smm[(shape, lay, b)]["scaled_mm_us"]))
            check(f"{where}: (c) {row[5]}", close(row[5], rows[70]["fp8_floor_us"]))
            check(f"{where}: (d) {row[6]}", close(row[6], d))
            vc = NUM.findall(row[8])
            check(f"{where}: vs (c) {row[8]}", len(vc) == 2 and close(vc[0], rows[50]["speedup_vs_fp8_floor"])
                  and close(vc[1], rows[70]["speedup_vs_fp8_floor"]))
            check(f"{where}: vs (d) {row[9]}", close(row[9], d / rows[70]["t_us"]))

        # Targets: the verdicts follow the numbers (Qwen3-8B, channel, p1).
        line = next((x for x in text.splitlines() if x.startswith("Issue 40's targets")), "")
        p8 = {e: sweep[("fp8_ffn", "Qwen3-8B", "bf16", "channel", f"e{e}", "p1")] for e in (50, 70)}
        a8 = smm[("8b", "channel", 1)]["scaled_mm_us"]
        for e, need_c, need_a in [(70, 1.75, 4.0), (50, 1.25, 3.0)]:
            m = re.search(rf"e = {e} %: ([\d.]+)× over \(c\) \(target ≥ [\d.]+×: (met|\*\*not met\*\*)\) and "
                          rf"([\d.]+)× over \(a\) \(target ≥ [\d.]+×: (met|\*\*not met\*\*)\)", line)
            check(f"targets e = {e} % in '{line}'", m is not None)
            if m:
                sc, sa = p8[e]["speedup_vs_fp8_floor"], a8 / p8[e]["t_us"]
                check(f"targets e = {e} %: {m.group(1)} vs (c) {sc}", close(m.group(1), sc))
                check(f"targets e = {e} %: {m.group(3)} vs (a) {sa}", close(m.group(3), sa))
                check(f"targets e = {e} %: verdict over (c)", (m.group(2) == "met") == (sc >= need_c))
                check(f"targets e = {e} %: verdict over (a)", (m.group(4) == "met") == (sa >= need_a))
        for model, short in [("Qwen3-8B", "8B"), ("Qwen3-14B", "14B")]:
            f = max(sweep[("fp8_dense", model, "bf16", "channel", f"p{p}")]["frac_copy"] for p in (0, 1, 2))
            m = re.search(rf"(\d+) % of copy on {short} \(p\d; (met|\*\*not met\*\*)\)", line)
            check(f"targets copy {short}", m is not None and close(m.group(1), 100 * f)
                  and (m.group(2) == "met") == (f >= 0.85))
        check("p1 note line", "after this run the library moved it to index 0" in text)
        check("no missing benchmarks reported", "Missing from the JSON" not in text)

        # The plot: well-formed SVG, 6 lines of 4 points, the targets as stars, the provenance in the footer.
        root = ET.parse(svg_path).getroot()
        ns = "{http://www.w3.org/2000/svg}"
        check(f"SVG root {root.tag}", root.tag == ns + "svg")
        lines = root.findall(f"{ns}polyline")
        check(f"SVG: {len(lines)} lines, want 6", len(lines) == 6 and all(len(x.get("points").split()) == 4
                                                                          for x in lines))
        check("SVG: 3 stars (two targets, one legend)", len(root.findall(f"{ns}polygon")) == 3)
        texts = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
        for needle in ("NVIDIA H100 80GB HBM3", "3bf0907", "prox_bench --prox_fp8=channel,block128",
                       "effective sparsity e (%)", "Qwen3-32B, block128", "issue 40 targets (8B)"):
            check(f"SVG text has '{needle}'", needle in texts)
    return failures


def test_fp8_report():
    failures = check_all()
    assert not failures, "\n".join(failures)


def main():
    failures = check_all()
    for f in failures:
        print(f"test_fp8_report: FAIL {f}")
    if failures:
        return 1
    print("test_fp8_report: every check holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
