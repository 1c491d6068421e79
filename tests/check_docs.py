#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file check_docs.py  The measured numbers in the docs are the stored measurements (ctest docs_in_sync).

1. docs/benchmarks.md: every section bench/report.py generates, the plots section included, is what
   report.py renders from the stored JSON (docs/data/bench-h100.json, docs/data/alpha-h100.json), byte
   for byte, and so is every SVG plot in docs/img (rendered into a temporary directory with --img-dir;
   a committed SVG report.py does not write, or one it writes that is not committed, fails too). A hand
   edit inside a generated section or a plot, or a JSON replaced without re-running the report, fails.
2. README.md, "Measured numbers": the provenance sentence (GPU, CUDA, commit, copy bandwidth) and
   every cell of the FFN table (time, speed-up against the faster of the shape's fp16 and bf16
   dense FFN, and the dense time in the row label) are recomputed from docs/data/bench-h100.json.

Usage: python3 tests/check_docs.py [--root DIR]   (exit 0: in sync; 1: lists every difference)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

SECTION_RE = re.compile(r"<!-- BEGIN prox-report:(\w+) -->\n(.*?)<!-- END prox-report:\1 -->", re.S)


def sections(text):
    return {m.group(1): m.group(2) for m in SECTION_RE.finditer(text)}


def check_benchmarks_md(root, errors):
    doc = os.path.join(root, "docs", "benchmarks.md")
    bench = os.path.join(root, "docs", "data", "bench-h100.json")
    alpha = os.path.join(root, "docs", "data", "alpha-h100.json")
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "benchmarks.md")
        img = os.path.join(tmp, "img")  # beside the copy, as docs/img is beside the page: same image links
        shutil.copyfile(doc, copy)
        r = subprocess.run([sys.executable, os.path.join(root, "bench", "report.py"), "--bench", bench, "--alpha",
                            alpha, "--doc", copy, "--img-dir", img], capture_output=True, text=True)
        if r.returncode != 0:
            errors.append(f"report.py failed ({r.returncode}): {r.stderr.strip()}")
            return
        with open(doc, encoding="utf-8") as f:
            committed = f.read()
        with open(copy, encoding="utf-8") as f:
            rendered = f.read()
        check_plots(root, img, errors)
    want = sections(rendered)
    have = sections(committed)
    if not want:
        errors.append("docs/benchmarks.md: no generated sections found")
    for name, body in want.items():
        if have.get(name) != body:
            a = (have.get(name) or "").splitlines()
            b = body.splitlines()
            first = next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), 0)
            errors.append(f"docs/benchmarks.md section '{name}' differs from report.py's rendering of the stored "
                          f"JSON; first difference at line {first + 1} of the section:\n"
                          f"    committed: {a[first] if first < len(a) else '<none>'}\n"
                          f"    rendered:  {b[first] if first < len(b) else '<none>'}")


def check_plots(root, rendered_dir, errors):
    """Every SVG report.py rendered into rendered_dir equals docs/img's, byte for byte, and docs/img has no other."""
    committed_dir = os.path.join(root, "docs", "img")
    rendered = sorted(n for n in os.listdir(rendered_dir) if n.endswith(".svg"))
    committed = []
    if os.path.isdir(committed_dir):
        committed = sorted(n for n in os.listdir(committed_dir) if n.endswith(".svg"))
    if not rendered:
        errors.append("report.py wrote no SVG plot")
    for name in rendered:
        path = os.path.join(committed_dir, name)
        if name not in committed:
            errors.append(f"docs/img/{name}: missing; report.py renders it from the stored JSON")
            continue
        with open(path, "rb") as f:
            have = f.read()
        with open(os.path.join(rendered_dir, name), "rb") as f:
            want = f.read()
        if have != want:
            a, b = have.decode("utf-8", "replace").splitlines(), want.decode("utf-8", "replace").splitlines()
            first = next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), 0)
            errors.append(f"docs/img/{name} differs from report.py's rendering of the stored JSON; first difference "
                          f"at line {first + 1}:\n"
                          f"    committed: {a[first] if first < len(a) else '<none>'}\n"
                          f"    rendered:  {b[first] if first < len(b) else '<none>'}")
    for name in committed:
        if name not in rendered:
            errors.append(f"docs/img/{name}: report.py does not write it from the stored JSON (stale plot?)")


def check_readme(root, errors):
    sys.dont_write_bytecode = True  # no __pycache__ in the source tree
    sys.path.insert(0, os.path.join(root, "bench"))
    import report  # noqa: E402  (bench/report.py: the same parsing and formatting as the docs)

    run = report.BenchRun(os.path.join(root, "docs", "data", "bench-h100.json"))
    ctx = run.context
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    m = re.search(r"## Measured numbers\n(.*?)\n## ", readme, re.S)
    if m is None:
        errors.append("README.md: no 'Measured numbers' section")
        return
    text = m.group(1)
    prose = " ".join(text.split())
    gpu = ctx.get("gpu", "")
    commit = str(ctx.get("prox_commit", ""))[:7]
    copy = f"copy bandwidth {float(ctx.get('copy_GBps', 0)):.0f} GB/s"
    for what, needle in (("GPU", gpu), ("commit", f"`{commit}`"), ("copy bandwidth", copy),
                         ("CUDA version", report.cuda_version(ctx))):
        if not needle or needle not in prose:
            errors.append(f"README.md 'Measured numbers': {what} '{needle}' of docs/data/bench-h100.json not quoted")

    row_re = re.compile(r"^\| (Qwen3-[\w.]+) (f16|fp16|bf16)( \(dense ([\d.]+) µs\))? \|(.*)\|\s*$")
    rows = 0
    for line in text.splitlines():
        r = row_re.match(line)
        if r is None:
            continue
        rows += 1
        model, dtype, dense_label = r.group(1), r.group(2), r.group(4)
        dtype = "f16" if dtype == "fp16" else dtype
        dense = [run.get("dense_ffn", model, d) for d in report.DTYPES]
        dense_times = [d["t_us"] for d in dense if d and "t_us" in d]
        if not dense_times:
            errors.append(f"README.md row '{model} {dtype}': no dense_ffn in the JSON")
            continue
        faster = min(dense_times)
        if dense_label is not None and dense_label != report.fmt_us(faster):
            errors.append(f"README.md row '{model} {dtype}': dense {dense_label} µs, JSON {report.fmt_us(faster)} µs "
                          "(the faster of fp16 and bf16)")
        cells = [c.strip() for c in r.group(5).split("|")]
        for e, cell in zip(report.TARGETS, cells):
            b = run.get("prox_ffn", model, dtype, e)
            if b is None:
                errors.append(f"README.md row '{model} {dtype}' e = {e} %: no prox_ffn in the JSON")
                continue
            want = f"{report.fmt_us(b['t_us'])} µs, {report.fmt_x(faster / b['t_us'])}"
            have = cell.replace("**", "")
            if have != want:
                errors.append(f"README.md row '{model} {dtype}' e = {e} %: '{have}', JSON gives '{want}'")
        if len(cells) != len(report.TARGETS):
            errors.append(f"README.md row '{model} {dtype}': {len(cells)} cells, expected {len(report.TARGETS)}")
    if rows == 0:
        errors.append("README.md 'Measured numbers': no FFN table rows found")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    errors = []
    check_benchmarks_md(root, errors)
    check_readme(root, errors)
    for e in errors:
        print(f"check_docs: {e}")
    if errors:
        print(f"check_docs: {len(errors)} difference(s); re-run bench/report.py or fix the quoted figures")
        return 1
    print("check_docs: docs/benchmarks.md, its SVG plots and README.md match docs/data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
