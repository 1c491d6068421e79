#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up, build everything (library checks, tests, benches, examples; sm_80 + sm_90a) and run the
# tests. GPU test executables report "skipped" (ctest skip code 77) on a machine without a GPU.
#   bash scripts/test.sh            # preset "default" (build/)
#   PROX_PRESET=ci bash scripts/test.sh
#   PROX_PYTHON=0 bash scripts/test.sh   # without the Python package (scripts/python.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
preset="${PROX_PRESET:-default}"
cmake --preset "$preset"
cmake --build --preset "$preset" -j "${PROX_JOBS:-$(nproc)}"
ctest --preset "$preset" -j 2
# The Python package (torch custom ops): build against torch 2.11.0 and run its tests.
if [[ "${PROX_PYTHON:-1}" != 0 ]]; then bash scripts/python.sh; fi
