#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Copy an include/ tree and stamp Stage 1's and the fused Stage 2's kernels with prox_trace.cuh's per-block
%globaltimer marks (entry, after the PDL wait, the fused kernel's barrier arrive and release, exit).
Development only (docs/history.md, issue 19): build the FFN harness with -DPROX_TRACE -include prox_trace.cuh
against the copy.

    python3 bench/experiments/trace/instrument.py include /tmp/tr_new   # then -I/tmp/tr_new/include
"""
import os
import shutil
import sys


def stamp(path, kernel, kind, barrier):
    with open(path) as f:
        s = f.read()
    k = s.index(f"void {kernel}(")
    body = s.index(") {", k) + 2
    s = s[: body + 1] + f"\n  ProxTrace _prox_trace({kind});" + s[body + 1:]
    s = s.replace("pdl_wait();  //", "pdl_wait(); _prox_trace.waited();  //", 1)
    if barrier:
        arrive = f"  if (tid == 0) detail::GridBarrier::arrive({barrier}, gen, static_cast<unsigned>(blocks));"
        wait = f"          if (tid == 0) detail::GridBarrier::wait({barrier}, gen);"
        if arrive not in s or wait not in s:
            sys.exit(f"instrument.py: the fused kernel's barrier calls were not found in {path}")
        s = s.replace(arrive, "  _prox_trace.mark3();\n" + arrive, 1)
        s = s.replace(wait, wait + " _prox_trace.mark4();", 1)
    with open(path, "w") as f:
        f.write(s)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], os.path.join(sys.argv[2], "include")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    prox = os.path.join(dst, "prox")
    stamp(os.path.join(prox, "proxy_gemv.cuh"), "proxy_gemv_kernel", 1, None)
    gd = os.path.join(prox, "glu_down_gemv.cuh")
    with open(gd) as f:
        barrier = "ws.sync" if "GridBarrier::arrive(ws.sync" in f.read() else "barrier"
    stamp(gd, "glu_down_gemv_kernel", 2, barrier)
    print(f"instrument.py: stamped {prox}")


if __name__ == "__main__":
    main()
