#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The translation units of the Python extension's build (prox._C): one per entry of python/setup.py's
LAYER_TYPES (generated into python/csrc/generated/), python/csrc's own .cu files and bindings.cpp.

setup.py builds when it runs, so its list assignments (DTYPES, ACTIVATIONS, FORMATS, LAYER_TYPES) are evaluated
on their own. Standard library only. scripts/python.sh prints the count before the build; tests/check_docs.py
checks the count README.md quotes against it.
Usage: python3 scripts/python_build_units.py [--root DIR]   (prints the count)
"""

import argparse
import ast
import os

LISTS = ("DTYPES", "ACTIVATIONS", "FORMATS", "LAYER_TYPES")


def layer_types(root):
    """setup.py's LAYER_TYPES: [(dtype, activation, format)]."""
    with open(os.path.join(root, "python", "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", None) in LISTS for t in n.targets)]
    ns = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "python/setup.py", "exec"), ns)  # dicts and one list
    return ns["LAYER_TYPES"]


def count(root):
    """The number of translation units the extension's build compiles."""
    csrc = os.path.join(root, "python", "csrc")
    own = [f for f in os.listdir(csrc) if f.endswith(".cu") or f == "bindings.cpp"]
    return len(layer_types(root)) + len(own)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(count(os.path.abspath(ap.parse_args().root)))
