#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up, build and run the minimal Prox FFN example (Qwen3-8B-shaped synthetic layer, e = 50%).
# Extra arguments go to the example (try --help). It needs a GPU: without one the example prints
# "prox example: no CUDA device found" and this script exits 1 (scripts/test.sh needs no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default
cmake --build --preset default --target prox_example_ffn -j "${PROX_JOBS:-$(nproc)}"
exec ./build/examples/prox_example_ffn "$@"
