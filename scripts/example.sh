#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Set up, build and run the minimal Prox FFN example (Qwen3-8B-shaped synthetic layer, e = 50%).
# Extra arguments go to the example (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default
cmake --build --preset default --target prox_example_ffn -j "${PROX_JOBS:-$(nproc)}"
exec ./build/examples/prox_example_ffn "$@"
