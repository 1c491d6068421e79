# SPDX-License-Identifier: Apache-2.0
"""The package's house (docs/python.md, "The package's layout"): every module of python/prox sits on a floor and
imports only modules on its own floor or below, with no import circle. Read with ast, imports inside functions
included (an import moved into a function to dodge a circle is still the circle)."""
from __future__ import annotations

import ast
import os

import pytest

PKG = "prox"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)

#: Bottom floor first. Same-floor imports are allowed (never in a circle).
FLOORS = [
    ["_abi", "allocation", "reference", "calibration", "thresholds", "models"],  # pure rules; checkpoint loading
    ["_ops", "layer_ops", "nccl"],    # the extension; one layer's op calls; libnccl through ctypes
    ["fp8"],                          # FP8 e4m3 numerics
    ["formats"],                      # the Stage-2 weight formats (the registry)
    ["planned", "workspace"],         # PlannedFfn; the workspace pool
    ["mlp_weights", "sparse_mlp"],    # a gated MLP's weights and derived state; SparseMLP, which runs it
    ["nn"],                           # model walkers (find, swap, restore, report)
    ["distributed"],                  # tensor parallelism: shards and wraps what is below
    ["layerwise", "sparsify"],        # model calibration: layers one at a time, per-layer errors; sparsify
    ["__init__"],                     # the package facade
]
#: The top floor: the tools (benchmarks, evaluation and their library).
TOOLS = ("bench", "eval_")

def modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def floor_of(mod: str) -> int:
    for i, names in enumerate(FLOORS):
        if mod in names:
            return i
    if mod.startswith(TOOLS):
        return len(FLOORS)
    raise AssertionError(f"prox/{mod}.py is on no floor: add it to FLOORS in {os.path.basename(__file__)}")


def imports(mod: str) -> set[str]:
    """The package modules ``mod`` imports (anywhere in it), as module names ("__init__" for the package)."""
    with open(os.path.join(ROOT, mod + ".py")) as f:
        tree = ast.parse(f.read())
    here = set(modules())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == PKG:
                    out.add(parts[1] if len(parts) > 1 and parts[1] in here else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] != PKG:
                continue
            if node.level > 1:
                raise AssertionError(f"prox/{mod}.py: a relative import beyond the package")
            path = (node.module or "").split(".") if node.level else (node.module or "").split(".")[1:]
            path = [p for p in path if p]
            if path:
                out.add(path[0] if path[0] in here else "__init__")
            else:  # from . import a, b / from prox import a, b
                for a in node.names:
                    out.add(a.name if a.name in here else "__init__")
    out.discard(mod)
    return out


def test_every_module_has_a_floor_and_the_floors_exist():
    mods = set(modules())
    for m in mods:
        floor_of(m)
    missing = [m for names in FLOORS for m in names if m not in mods]
    assert not missing, f"FLOORS names modules that do not exist: {missing}"


def test_no_import_runs_up():
    ups = []
    for m in modules():
        for d in imports(m):
            if floor_of(d) > floor_of(m):
                ups.append(f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})")
    assert not ups, "imports from a lower floor to a higher one:\n  " + "\n  ".join(ups)


def test_no_import_circle():
    graph = {m: imports(m) - {"__init__"} for m in modules()}
    state, stack, circles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


@pytest.mark.parametrize("src, expected", [
    ("from . import _ops, fp8", {"_ops", "fp8"}),
    ("from .nn import SparseMLP", {"nn"}),
    ("import prox", {"__init__"}),
    ("from prox import fp8", {"fp8"}),
    ("from prox.nn import SparseMLP", {"nn"}),
    ("def f():\n    from .distributed import agreed", {"distributed"}),
    ("import torch\nfrom torch import nn", set()),
])
def test_the_reader_sees_every_kind_of_import(tmp_path, monkeypatch, src, expected):
    """The checker's own reader (an import it misses would pass unseen): each form, at module level and inside
    a function."""
    pkg = tmp_path / PKG
    pkg.mkdir()
    for m in ("_ops", "fp8", "nn", "distributed", "__init__"):
        (pkg / f"{m}.py").write_text("")
    (pkg / "probe.py").write_text(src + "\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(pkg))
    assert imports("probe") == expected
