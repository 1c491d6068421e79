#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install the Debian packages prox's tests, benches and examples need. Idempotent: installs only
# what is missing. The library itself needs only the CUDA Toolkit (nvcc, cudart, CCCL).
set -euo pipefail
pkgs=(cmake ninja-build catch2 libfmt-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev)
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
