#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""@file check_docs.py  The measured numbers in the docs are the stored measurements (ctest docs_in_sync).

1. docs/benchmarks.md: every section bench/report.py generates is what report.py renders from the stored
   JSON (docs/data/bench-h100.json, docs/data/alpha-h100.json, docs/data/fixed-cost-h100.json,
   docs/data/batch-h100.json): the same
   text, and every number within the tolerance below. A hand edit inside a generated section, or a JSON replaced without re-running the
   report, fails.
2. README.md, "Measured numbers": the provenance line (GPU, CUDA, commit, copy bandwidth) and every cell
   of the FFN table (time, speed-up against the faster of the shape's fp16 and bf16 dense FFN, and the
   dense time in the row label) are recomputed from docs/data/bench-h100.json, within the tolerance.
3. Plots: every SVG an image link of README.md or docs/*.md names exists and is an SVG document
   (parseable XML, root element <svg>), and every SVG under docs/img is linked from somewhere. The
   bytes are not compared: they depend on the matplotlib version that drew them, and the numbers they
   show are the ones checked in 1.
4. Provenance: every stored JSON under docs/data that has a "commit" field names one (not ""), and every
   shell script README.md or docs/*.md names (a path ending in .sh; a bare name is looked up in scripts/ and
   tests/) is in the repository.
5. The Python step: README.md quotes how many translation units the extension's build compiles, and it is
   the number scripts/python_build_units.py counts from python/setup.py (a new format or activation changes
   it, and the build time quoted beside it). docs/python.md's "The N units (M layer types" is held to the same.
6. The stored tuning cache: docs/tuning.md quotes the policy hash that docs/data/prox-tune-h100.tsv records.

Tolerance: a printed number matches a value if they differ by at most 0.5 % of the value or one unit in
the last printed digit, whichever is larger (so "42.5" matches 42.55, and "2.65" matches 2.66).

Needs the standard library only (report.py draws the plots with matplotlib, but this check never draws).
Usage: python3 tests/check_docs.py [--root DIR]   (exit 0: in sync; 1: lists every difference)
"""

import argparse
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

REL_TOL = 0.005
SECTION_RE = re.compile(r"<!-- BEGIN prox-report:(\w+) -->\n(.*?)<!-- END prox-report:\1 -->", re.S)
# A number standing on its own: not part of a word, a hash, a name such as Qwen3-8B or sm_90, or a version.
NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w|\.\d)")
IMAGE_RE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.svg)\)")
# A shell script a document names: a path or bare name ending in .sh.
SCRIPT_RE = re.compile(r"(?<![\w./-])([\w./-]*\w\.sh)\b")


def sections(text):
    return {m.group(1): m.group(2) for m in SECTION_RE.finditer(text)}


def unit(s):
    """One unit in the last printed digit of the number s ('42.5' -> 0.1, '46' -> 1)."""
    return 10.0 ** -(len(s) - s.index(".") - 1) if "." in s else 1.0


def close(printed, value, value_unit=0.0):
    """printed (a string) matches value within REL_TOL of value or one unit of its last digit."""
    return abs(float(printed) - value) <= max(REL_TOL * abs(value), unit(printed), value_unit) * (1 + 1e-9)


def split_numbers(text):
    """(the text with every number replaced by '#' and whitespace collapsed, [the numbers as printed])."""
    nums = NUMBER_RE.findall(text)
    return " ".join(NUMBER_RE.sub("#", text).split()), nums


def compare_text(where, have, want, errors):
    """have (committed) against want (rendered): the same words, and the numbers within the tolerance."""
    hs, hn = split_numbers(have)
    ws, wn = split_numbers(want)
    if hs != ws or len(hn) != len(wn):
        a, b = have.splitlines(), want.splitlines()
        first = next((i for i in range(max(len(a), len(b)))
                      if i >= len(a) or i >= len(b) or split_numbers(a[i])[0] != split_numbers(b[i])[0]), 0)
        errors.append(f"{where}: the text differs from report.py's rendering of the stored JSON; first at line "
                      f"{first + 1} of the section:\n"
                      f"    committed: {a[first] if first < len(a) else '<none>'}\n"
                      f"    rendered:  {b[first] if first < len(b) else '<none>'}")
        return
    bad = [(h, w) for h, w in zip(hn, wn) if not close(h, float(w), unit(w))]
    if bad:
        shown = ", ".join(f"{h} (stored data: {w})" for h, w in bad[:5]) + (" …" if len(bad) > 5 else "")
        errors.append(f"{where}: {len(bad)} number(s) differ from the stored JSON beyond the tolerance: {shown}")


def check_benchmarks_md(root, report, runs, alpha, fixed, batch, errors):
    with open(os.path.join(root, "docs", "benchmarks.md"), encoding="utf-8") as f:
        have = sections(f.read())
    want = report.render_sections(runs, alpha, rel="img", fixed=fixed, batch=batch)
    if not have:
        errors.append("docs/benchmarks.md: no generated sections found")
    for name, body in want.items():
        if name not in have:
            errors.append(f"docs/benchmarks.md: no generated section '{name}' (markers "
                          f"<!-- BEGIN prox-report:{name} --> ... <!-- END prox-report:{name} -->)")
        else:
            compare_text(f"docs/benchmarks.md section '{name}'", have[name], body.rstrip() + "\n", errors)
    for name in have:
        if name not in want:
            errors.append(f"docs/benchmarks.md: section '{name}' is not one report.py generates from the stored JSON")


def check_readme(root, report, run, errors):
    ctx = run.context
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    m = re.search(r"## Measured numbers\n(.*?)\n## ", readme, re.S)
    if m is None:
        errors.append("README.md: no 'Measured numbers' section")
        return
    text = m.group(1)
    prose = " ".join(text.split())
    commit = str(ctx.get("prox_commit", ""))[:7]
    for what, needle in (("GPU", ctx.get("gpu", "")), ("commit", f"`{commit}`"), ("CUDA version",
                                                                                   report.cuda_version(ctx))):
        if not needle or needle not in prose:
            errors.append(f"README.md 'Measured numbers': {what} '{needle}' of docs/data/bench-h100.json not quoted")
    copy = float(ctx.get("copy_GBps", 0))
    c = re.search(r"copy bandwidth (\d+(?:\.\d+)?) GB/s", prose)
    if c is None:
        errors.append("README.md 'Measured numbers': no 'copy bandwidth N GB/s' in the provenance")
    elif not close(c.group(1), copy):
        errors.append(f"README.md 'Measured numbers': copy bandwidth {c.group(1)} GB/s, stored {copy:.0f} GB/s")

    row_re = re.compile(r"^\| (Qwen3-[\w.]+) (f16|fp16|bf16)( \(dense ([\d.]+) µs\))? \|(.*)\|\s*$")
    cell_re = re.compile(r"^\**([\d.]+)\** µs, \**([\d.]+)×\**$")
    rows = 0
    for line in text.splitlines():
        r = row_re.match(line)
        if r is None:
            continue
        rows += 1
        model, dtype, dense_label = r.group(1), r.group(2), r.group(4)
        dtype = "f16" if dtype == "fp16" else dtype
        where = f"README.md row '{model} {r.group(2)}'"
        faster = report.faster_dense(run, model)
        if faster is None:
            errors.append(f"{where}: no dense_ffn in the JSON")
            continue
        if dense_label is not None and not close(dense_label, faster):
            errors.append(f"{where}: dense {dense_label} µs, stored {faster:.2f} µs (the faster of fp16 and bf16)")
        cells = [c.strip() for c in r.group(5).split("|")]
        if len(cells) != len(report.TARGETS):
            errors.append(f"{where}: {len(cells)} cells, expected {len(report.TARGETS)}")
        for e, cell in zip(report.TARGETS, cells):
            b = run.get("prox_ffn", model, dtype, e)
            if b is None:
                errors.append(f"{where} e = {e} %: no prox_ffn in the JSON")
                continue
            p = cell_re.match(cell)
            if p is None:
                errors.append(f"{where} e = {e} %: '{cell}' is not 'T µs, S×'")
                continue
            t, s = b["t_us"], faster / b["t_us"]
            for what, printed, value, u in (("time", p.group(1), t, " µs"), ("speed-up", p.group(2), s, "×")):
                if not close(printed, value):
                    errors.append(f"{where} e = {e} %: {what} {printed}{u}, docs/data/bench-h100.json gives "
                                  f"{value:.3f}{u} ({100 * (float(printed) / value - 1):+.1f} %; tolerance 0.5 % "
                                  "or one unit in the last digit)")
    if rows == 0:
        errors.append("README.md 'Measured numbers': no FFN table rows found")


def check_plots(root, errors):
    linked = set()
    for doc in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        with open(doc, encoding="utf-8") as f:
            links = IMAGE_RE.findall(f.read())
        for link in links:
            path = os.path.normpath(os.path.join(os.path.dirname(doc), link))
            linked.add(path)
            name = os.path.relpath(doc, root)
            if not os.path.isfile(path):
                errors.append(f"{name}: image {link} does not exist")
                continue
            try:
                tag = ET.parse(path).getroot().tag
            except ET.ParseError as e:
                errors.append(f"{name}: image {link} is not well-formed XML ({e})")
                continue
            if tag not in ("svg", "{http://www.w3.org/2000/svg}svg"):
                errors.append(f"{name}: image {link} is not an SVG document (root element {tag})")
    for path in sorted(glob.glob(os.path.join(root, "docs", "img", "*.svg"))):
        if os.path.normpath(path) not in linked:
            errors.append(f"{os.path.relpath(path, root)}: no document links it (stale plot?)")


def check_provenance(root, errors):
    for path in sorted(glob.glob(os.path.join(root, "docs", "data", "*.json"))):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("commit", None) == "":
            errors.append(f"{os.path.relpath(path, root)}: \"commit\" is empty (fill it in where the docs or git "
                          "history make it certain, and say where it came from)")
    for doc in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        with open(doc, encoding="utf-8") as f:
            names = set(SCRIPT_RE.findall(f.read()))
        for name in sorted(names):
            places = [name] if "/" in name else [os.path.join("scripts", name), os.path.join("tests", name)]
            if not any(os.path.isfile(os.path.join(root, p)) for p in places):
                errors.append(f"{os.path.relpath(doc, root)}: cites {name}, which is not in the repository "
                              "(give the command itself)")


def check_python_step(root, errors):
    sys.path.insert(0, os.path.join(root, "scripts"))
    import python_build_units  # noqa: E402  (scripts/python_build_units.py: what scripts/python.sh prints)

    units = python_build_units.count(root)
    layer_types = len(python_build_units.layer_types(root))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        quoted = re.findall(r"(\d+)\s+translation\s+units", f.read())
    if not quoted:
        errors.append("README.md: the Python step does not say how many translation units the extension's build "
                      f"compiles ({units} today, scripts/python_build_units.py)")
    for n in quoted:
        if int(n) != units:
            errors.append(f"README.md: the Python step quotes {n} translation units; the build compiles {units} "
                          "(scripts/python_build_units.py): re-measure the build time quoted beside it")
    with open(os.path.join(root, "docs", "python.md"), encoding="utf-8") as f:
        for n, m in re.findall(r"The (\d+) units \((\d+) layer types", f.read()):
            if (int(n), int(m)) != (units, layer_types):
                errors.append(f"docs/python.md: 'The {n} units ({m} layer types'; the build compiles {units} units, "
                              f"{layer_types} of them layer types (scripts/python_build_units.py)")


def check_tuning_cache(root, errors):
    with open(os.path.join(root, "docs", "data", "prox-tune-h100.tsv"), encoding="utf-8") as f:
        m = re.search(r"^# policy_hash\t([0-9a-f]{16})$", f.read(), re.M)
    with open(os.path.join(root, "docs", "tuning.md"), encoding="utf-8") as f:
        tuning = f.read()
    if m is None:
        errors.append("docs/data/prox-tune-h100.tsv: no '# policy_hash' line")
    elif f"`{m.group(1)}`" not in tuning:
        errors.append(f"docs/tuning.md: does not quote the stored cache's policy hash `{m.group(1)}` "
                      "(docs/data/prox-tune-h100.tsv)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    sys.dont_write_bytecode = True  # no __pycache__ in the source tree
    sys.path.insert(0, os.path.join(root, "bench"))
    import report  # noqa: E402  (bench/report.py: the same parsing and formatting as the docs; no matplotlib)

    run = report.BenchRun(os.path.join(root, "docs", "data", "bench-h100.json"))
    alpha = report.load_alpha(os.path.join(root, "docs", "data", "alpha-h100.json"), None)
    fixed = report.BenchRun(os.path.join(root, "docs", "data", "fixed-cost-h100.json"))
    batch = report.BatchRun(os.path.join(root, "docs", "data", "batch-h100.json"))
    errors = []
    check_benchmarks_md(root, report, [run], alpha, fixed, batch, errors)
    check_readme(root, report, run, errors)
    check_plots(root, errors)
    check_provenance(root, errors)
    check_python_step(root, errors)
    check_tuning_cache(root, errors)
    for e in errors:
        print(f"check_docs: {e}")
    if errors:
        print(f"check_docs: {len(errors)} difference(s); re-run bench/report.py or fix the quoted figures")
        return 1
    print("check_docs: docs/benchmarks.md and README.md match docs/data; every linked SVG plot is an SVG; every "
          "stored run names its commit and every cited script exists; the Python step's unit count and the stored "
          "cache's policy hash are the ones quoted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
