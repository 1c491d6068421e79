#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the Debian/Ubuntu packages prox's tests, benches and examples need. Idempotent: installs
# only what is missing. The library itself needs only the CUDA Toolkit (nvcc, cudart, CCCL).
# Every distribution's own versions work: Debian 12 and 13, Ubuntu 22.04 and 24.04 (CMake >= 3.22,
# Catch2 2.13 or 3, fmt 8-10, Google Benchmark 1.6-1.9). python3 runs the docs_in_sync test.
set -euo pipefail
pkgs=(cmake ninja-build catch2 libfmt-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev python3)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "prox setup: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "prox setup: ${pkgs[*]} already installed"
fi
command -v nvcc >/dev/null || { [[ -x /usr/local/cuda/bin/nvcc ]] && echo "prox setup: add /usr/local/cuda/bin to PATH"; } \
  || echo "prox setup: warning: nvcc (CUDA Toolkit 12+) not found"
