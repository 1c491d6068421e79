# SPDX-License-Identifier: Apache-2.0
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # refs.py

import prox  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

#: GPU tests: the op needs a device (sm_80+) and the compiled extension.
requires_cuda = pytest.mark.skipif(not (HAS_CUDA and prox.ops_available()),
                                   reason="needs a CUDA GPU and the compiled extension")
requires_ext = pytest.mark.skipif(not prox.ops_available(), reason="needs the compiled extension prox._C")


def pytest_report_header(config):
    return (f"prox {prox.__version__}: extension loaded: {prox.ops_available()}; torch {torch.__version__}; "
            f"CUDA device: {torch.cuda.get_device_name() if HAS_CUDA else 'none'}")


def assert_replays_follow_thresholds(mlp, x) -> None:
    """Capture mlp(x) in a CUDA graph, then switch the thresholds between replays: each replay must give the eager
    call's output bit for bit (the thresholds live in device memory, read by the captured kernels)."""
    with torch.no_grad():
        mlp(x)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = mlp(x)
        for t in [(0.3, 0.02), (0.0, 0.0), (1.0, 0.1)]:
            mlp.set_thresholds(*t)
            g.replay()
            assert torch.equal(y, mlp(x))


class Decoder(torch.nn.Module):
    """A residual around an MLP, with exact elementwise ops only, so a compiled Decoder computes bit for bit what
    the eager one computes (the torch.compile tests)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, h):
        return h + self.mlp(h * 0.5)
