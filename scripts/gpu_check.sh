#!/usr/bin/env bash
# The GPU check of readback, for one bare CUDA machine (written for an H200), in 8 minutes at most:
#
#   0. one line: torch, CUDA, cuDNN and Transformer Engine versions, the GPU and its capability
#   1. tests/unit/backends/test_gpu.py         fp8_mm via torch._scaled_mm vs the emulation; FOG (head dim
#                                              128) on CUDA
#   2. tests/unit/backends/test_te_backend.py  backend=te: real TE model steps, TE vs the emulated loss; with
#                                              NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2, so TE logs why it disables a backend
#   3. python -m readback.audit                the read-rule audit of single ops
#   4. benchmarks/gpu_step.py                  tokens/s, MFU, peak memory: fog_390m, seq 1024, micro-batch 8
#
# It uses what the machine has and installs nothing from a registry. It stops at once, with one
# line naming what is missing, when the machine lacks a CUDA torch, a GPU, Transformer Engine or
# readback's Python dependencies; wheels of the small ones (hydra-core, omegaconf, antlr4, pytest,
# hypothesis) may be carried in .whl/ at the repository root and are installed offline into
# /tmp/site. Each part runs under its own time limit, cut to what is left of the 8 minutes; a
# part that runs no test fails (the check never passes by skipping). The exit code is the number
# of failed parts. Logs (one per part, summary.txt, gpu_step.json) go to $OUT when it is set,
# else to ./gpu_check_logs.
#
#   bash scripts/gpu_check.sh               # PYTHON=python3.12 bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-$PWD/gpu_check_logs}
TOTAL_S=${GPU_CHECK_SECONDS:-480}
mkdir -p "$LOGS"
: > "$LOGS/summary.txt"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HYDRA_FULL_ERROR=1
T0=$(date +%s)

stop() {  # stop LINE: the one line saying what is missing, and exit
  echo "gpu_check: $1" | tee -a "$LOGS/summary.txt"
  exit 100
}

if compgen -G ".whl/*.whl" > /dev/null; then
  timeout 60 "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --target /tmp/site .whl/*.whl \
    > "$LOGS/install.log" 2>&1 || stop "installing the wheels in .whl/ failed (see install.log)"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

command -v "$PY" > /dev/null || stop "missing: $PY (set PYTHON to a Python with a CUDA torch)"
timeout 60 "$PY" scripts/versions.py | tee "$LOGS/versions.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || stop "missing: torch (a CUDA build) for $PY"
MISSING=$(timeout 60 "$PY" - <<'EOF'
import importlib.util
import torch
missing = []
if not torch.cuda.is_available():
    missing.append("a CUDA device visible to torch" if torch.version.cuda else "a CUDA build of torch (this one is CPU-only)")
elif torch.cuda.get_device_capability() < (8, 9):
    missing.append(f"an FP8 GPU (sm89+; {torch.cuda.get_device_name()} is sm{''.join(map(str, torch.cuda.get_device_capability()))})")
modules = {"transformer_engine": "transformer_engine (Transformer Engine)", "hydra": "hydra-core",
           "omegaconf": "omegaconf", "pytest": "pytest", "hypothesis": "hypothesis"}
missing += [name for module, name in modules.items() if importlib.util.find_spec(module) is None]
print(", ".join(missing))
EOF
) || stop "the environment check itself failed under $PY"
[ -z "$MISSING" ] || stop "missing: $MISSING"

FAILED=0
part() {  # part NAME SECONDS COMMAND...: log to NAME.log, one line in summary.txt
  local name=$1 limit=$2 start rc status
  shift 2
  local left=$(( TOTAL_S - ($(date +%s) - T0) - 5 ))
  [ "$limit" -le "$left" ] || limit=$left
  start=$(date +%s)
  if [ "$limit" -le 0 ]; then
    rc=124
  else
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
  fi
  status=ok
  [ "$rc" -eq 0 ] || status="FAILED rc=$rc"
  [ "$rc" -eq 124 ] && status="TIMED OUT after ${limit}s"
  if [ "$rc" -eq 0 ] && [ "${name%_tests}" != "$name" ] && ! grep -Eq "[1-9][0-9]* passed" "$LOGS/$name.log"; then
    rc=1 status="FAILED: ran no test (all skipped)"
  fi
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
  echo "$name: $status ($(( $(date +%s) - start ))s)" | tee -a "$LOGS/summary.txt"
  tail -n 20 "$LOGS/$name.log" 2>/dev/null
}

PYTEST=("$PY" -m pytest -q -rA -p no:cacheprovider)
part gpu_tests 80 "${PYTEST[@]}" tests/unit/backends/test_gpu.py
part te_tests 110 env NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 "${PYTEST[@]}" -s -m gpu tests/unit/backends/test_te_backend.py
grep -hoE "Disabling [^.]*|Selected backend = [A-Za-z]+" "$LOGS/te_tests.log" 2>/dev/null | sort | uniq -c \
  | sort -rn | head -n 12 | tee "$LOGS/te_backend_reasons.txt"
part audit 50 "$PY" -m readback.audit
part benchmark 200 "$PY" benchmarks/gpu_step.py --steps 300 --max-seconds 12 --case-timeout 45 \
  --json "$LOGS/gpu_step.json"

echo "total $(( $(date +%s) - T0 ))s, $FAILED part(s) failed" | tee -a "$LOGS/summary.txt"
exit "$FAILED"
