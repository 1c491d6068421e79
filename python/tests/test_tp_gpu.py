# SPDX-License-Identifier: Apache-2.0
"""The multi-GPU tensor-parallel tests under plain pytest: with 2 or more GPUs (and the extension), run
scripts/tp_tests.sh (torchrun, one process per GPU, NCCL: tp_gpu_main.py) and require "ALL PASSED" and a clean
exit; skipped with fewer GPUs. The same cases run on the CPU in test_tp_host.py."""
import os
import subprocess
import sys

import pytest
import torch

import prox

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and prox.ops_available()),
                    reason="needs 2 or more CUDA GPUs and the compiled extension")
def test_tensor_parallel_on_gpus():
    n = min(torch.cuda.device_count(), int(os.environ.get("PROX_TP_GPUS", "2")))
    env = dict(os.environ, PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(prox.__file__)),
                                                      os.environ.get("PYTHONPATH", "")] if p))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "tp_tests.sh"), str(n)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ALL PASSED" in out, out[-20000:]
