#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The multi-GPU tensor-parallel tests (python/tests/tp_gpu_main.py): one process per GPU under torchrun, NCCL,
# the CUDA op. Prints one line per case, then "ALL PASSED" (exit 0) or "FAILED"; a hang ends at the timeout
# (exit 124). NVLink multicast stays off.
#   bash scripts/tp_tests.sh            # 2 GPUs
#   bash scripts/tp_tests.sh 4          # 4 GPUs
#   PYTHON=build/python-venv/bin/python PROX_TP_TIMEOUT=300 bash scripts/tp_tests.sh
# prox is imported from the environment (an installed package, or PYTHONPATH pointing at a build of it).
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-2}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec timeout -k 10 "${PROX_TP_TIMEOUT:-300}" "${PYTHON:-python3}" -m torch.distributed.run --nproc-per-node "$n" \
  python/tests/tp_gpu_main.py
