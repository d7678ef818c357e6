#!/usr/bin/env bash
# GPU checks for kernels/: Triton correctness (bf16, tol 1.5e-2, head sizes
# 64/80/96/128/256, block 16/32; plus fp16/fp32, split-KV, CUDA graphs), then
# bench/attention.py. Every step runs under `timeout`; the whole script stays
# within about 8 minutes when a CUDA-capable Python already exists.
# Usage (from anywhere): bash tests/gpu/run.sh        LOG_DIR=... to keep logs elsewhere.
# Through the device tool: run(command="bash tests/gpu/run.sh", timeout_s=540), no carry
# (the local CPU .venv must not travel). Logs and attention.md land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1   # a killed step still leaves its output in the log
LOG_DIR=${LOG_DIR:-${OUT:-/tmp/conveyor-gpu}}
mkdir -p "$LOG_DIR"
BUDGET=470   # seconds for everything, leaving slack under 8 minutes
declare -a SUMMARY=()

has_cuda_stack() {  # $1: python; true if it has torch (CUDA visible), triton, pytest
  [ -x "$(command -v "$1" 2>/dev/null)" ] || return 1
  timeout 90 "$1" -c "import torch, triton, pytest, numpy; assert torch.cuda.is_available()" 2>/dev/null
}

pick_python() {
  for py in .venv/bin/python python3; do
    if has_cuda_stack "$py"; then echo "$py"; return 0; fi
  done
  return 1
}

remaining() { echo $((BUDGET - SECONDS)); }

step() {  # $1: name, $2: timeout seconds, rest: command
  local name=$1 limit=$2; shift 2
  local left; left=$(remaining)
  if [ "$left" -lt 20 ]; then
    SUMMARY+=("SKIP  $name (time budget spent)"); return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (timeout ${limit}s)"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then SUMMARY+=("PASS  $name (${took}s)")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then SUMMARY+=("TIME  $name (killed after ${took}s)")
  else SUMMARY+=("FAIL  $name (rc=$rc, ${took}s)"); fi
  return "$rc"
}

if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /dev/nvidiactl ]; then
  echo "SKIP  no NVIDIA GPU on this machine; tests/gpu/run.sh needs one"
  exit 0
fi
date -u
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
git log --oneline -1 2>/dev/null || true

# No install fallback: a lent GPU machine has no network, and a failed pip would
# only spend the budget.
PY=$(pick_python)
if [ -z "$PY" ]; then
  echo "FAIL  setup: no Python with CUDA torch + triton + pytest + numpy on PATH or in .venv"
  exit 1
fi
timeout 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name(0))"

# A cold Triton cache means ~50 compiles: run them in parallel when xdist is there.
EXTRA=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
"$PY" -c "import pytest_timeout" 2>/dev/null && EXTRA="$EXTRA --timeout=120"
# shellcheck disable=SC2086
step kernel-tests 300 "$PY" -m pytest tests/gpu/test_kernels_gpu.py -q -p no:cacheprovider -rfs \
  --tb=short --durations=10 $EXTRA
tests_rc=$?
# Every test skipped (no CUDA seen by pytest) must not read as a pass.
if grep -qE "^[0-9]+ skipped|, [0-9]+ skipped| skipped in" "$LOG_DIR/kernel-tests.log" 2>/dev/null \
   && ! grep -q " passed" "$LOG_DIR/kernel-tests.log"; then
  SUMMARY+=("FAIL  kernel-tests: everything skipped"); tests_rc=1
fi
step bench 200 "$PY" bench/attention.py
bench_rc=$?

echo
echo "=== summary (logs in $LOG_DIR, ${SECONDS}s total)"
for line in "${SUMMARY[@]}"; do echo "$line"; done
grep -E "passed|failed|error" "$LOG_DIR/kernel-tests.log" 2>/dev/null | tail -n 1
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
