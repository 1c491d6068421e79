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
