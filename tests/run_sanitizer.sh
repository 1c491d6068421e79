#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#! @file tests/run_sanitizer.sh  compute-sanitizer over the GPU tests: memcheck on Stage 1, Stage 2 and
#! the FFN, racecheck and initcheck on the kernels with shared-memory or workspace traffic.
#!   bash tests/run_sanitizer.sh RUN BINARY     # one run (the ctest entries sanitizer_RUN call this)
#!   bash tests/run_sanitizer.sh all BINARY     # every run, in order; exit 1 if any failed
#!   bash tests/run_sanitizer.sh --list         # the run names
#! BINARY is prox_gpu_tests (e.g. .devbuild/tests/prox_gpu_tests). Exit 77 (ctest's "skipped") when no
#! CUDA device is visible or no compute-sanitizer is found ($PROX_COMPUTE_SANITIZER, PATH,
#! $CUDA_HOME/bin, /usr/local/cuda/bin). The [large] cases (8B shapes) are left out: under a sanitizer
#! they take minutes each and exercise the same code paths as the small shapes.
set -uo pipefail

readonly runs=(memcheck_stage1 memcheck_stage2 memcheck_ffn memcheck_batched memcheck_fp8 racecheck racecheck_stage2
              racecheck_batched racecheck_fp8 initcheck)

# RUN -> "tool|Catch2 test spec" (",": or; "~": not).
spec_of() {
  case "$1" in
    memcheck_stage1) echo 'memcheck|[stage1]~[large],[threshold]' ;;
    memcheck_stage2) echo 'memcheck|[stage2]~[large]~[fp8]' ;;   # GLU, down and the fused glu_down
    memcheck_ffn) echo 'memcheck|[ffn]~[large]~[pending-error]~[fp8]' ;;  # that case makes an API error on purpose
    memcheck_batched) echo 'memcheck|[batched]~[large]~[fp8]' ;;  # batched Stage 1, GLU and down (run_batch)
    # The FP8 Stage-2 ops (both scale layouts, batch 1 and batched), the FP8 SparseFfn, fp8.cuh's helpers.
    memcheck_fp8) echo 'memcheck|[fp8]~[large]' ;;
    # Shared-memory hazards: the block compaction (threshold, Stage 1), the split-K tile reduction and
    # the fused Stage 2's rows.
    racecheck) echo 'racecheck|[threshold],[stage1]~[large],[reduce]' ;;
    # The fused Stage 2 apart: ~250 launches of a 264-396 block grid, about 5 minutes under racecheck.
    racecheck_stage2) echo 'racecheck|[gludown]~[large]~[status]' ;;
    racecheck_batched) echo 'racecheck|[batched]~[large]~[validation]~[fp8]' ;;
    racecheck_fp8) echo 'racecheck|[fp8]~[large]~[status]' ;;
    # Reads of global memory nothing wrote: the workspace contract and the ops' partial buffers.
    initcheck) echo 'initcheck|[workspace]~[large],[threshold],[stage1]~[large],[batched]~[large]' ;;
    *) return 1 ;;
  esac
}

usage() {
  local IFS='|'
  echo "usage: $0 {${runs[*]}|all} PATH/TO/prox_gpu_tests   |   $0 --list" >&2
  exit 2
}

if [[ ${1:-} == --list ]]; then
  printf '%s\n' "${runs[@]}"
  exit 0
fi
[[ $# -eq 2 ]] || usage
run=$1
bin=$2
[[ $run == all ]] || spec_of "$run" >/dev/null || usage
[[ -x $bin ]] || { echo "run_sanitizer: $bin is not an executable" >&2; exit 2; }

find_sanitizer() {
  local c
  for c in "${PROX_COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
           "${CUDA_HOME:+$CUDA_HOME/bin/compute-sanitizer}" /usr/local/cuda/bin/compute-sanitizer; do
    [[ -n $c && -x $c ]] && { echo "$c"; return 0; }
  done
  return 1
}

# The test binary is its own device probe: with no usable CUDA device it exits 77 before Catch2 runs
# (tests/gpu_main.cpp), and so without needing nvidia-smi or a driver-matching compute-sanitizer.
# Any other exit code means a device is there (Catch2 2 exits with the number of tags it listed).
"$bin" --list-tags >/dev/null 2>&1
if [[ $? -eq 77 ]]; then
  echo "run_sanitizer: no CUDA device visible: skipped"
  exit 77
fi
if ! sanitizer=$(find_sanitizer); then
  echo "run_sanitizer: compute-sanitizer not found (set PROX_COMPUTE_SANITIZER): skipped"
  exit 77
fi

one() {
  local name=$1 spec tool tags rc
  spec=$(spec_of "$name") || usage
  tool=${spec%%|*}
  tags=${spec#*|}
  echo "== $name: $sanitizer --tool $tool --error-exitcode 1 $bin '$tags'"
  local t0=$SECONDS
  "$sanitizer" --tool "$tool" --error-exitcode 1 "$bin" "$tags"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  return $rc
}

if [[ $run == all ]]; then
  failed=()
  for r in "${runs[@]}"; do one "$r" || failed+=("$r"); done
  if ((${#failed[@]})); then
    echo "run_sanitizer: FAILED: ${failed[*]}"
    exit 1
  fi
  echo "run_sanitizer: all ${#runs[@]} runs passed"
  exit 0
fi
one "$run"
