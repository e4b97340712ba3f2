#!/usr/bin/env bash
# The GPU check of readback, for one bare CUDA machine (written for an H200), in about 8 minutes:
#
#   1. tests/test_gpu.py           fp8_mm via torch._scaled_mm vs the emulation; tiny FOG on CUDA
#   2. python -m readback.audit     the read-rule audit of single ops
#   3. tests/test_te_backend.py    backend=te: mapping, stand-in wiring, real TE model steps
#   4. benchmarks/gpu_step.py      tokens/s, MFU, peak memory: fog_390m, seq 1024, micro-batch 8
#
# Each part has its own time limit and the script goes on when one fails; the exit code is the
# number of failed parts. Logs (one per part, env.log, summary.txt, gpu_step.json) go to $OUT
# when it is set, else to ./gpu_check_logs.
#
# Python packages the machine lacks (Transformer Engine, hydra-core, pytest, ...) can travel as
# wheels in .whl/ at the repository root: they are installed offline, without dependencies, into
# /tmp/site, which goes on PYTHONPATH. torch with CUDA is expected to be installed.
#
#   bash scripts/gpu_check.sh               # PYTHON=python3.12 bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-$PWD/gpu_check_logs}
mkdir -p "$LOGS"
: > "$LOGS/summary.txt"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled HYDRA_FULL_ERROR=1
T0=$(date +%s)

if compgen -G ".whl/*.whl" > /dev/null; then
  echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
  timeout 60 "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --target /tmp/site .whl/*.whl \
    > "$LOGS/install.log" 2>&1 || echo "installing .whl/ failed (see install.log); going on"
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
  "$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, platform
print("python", platform.python_version())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(), "sm", torch.cuda.get_device_capability())
except Exception as error:
    print("torch: cannot import:", error)
for dist in ("transformer_engine", "transformer_engine_torch", "transformer_engine_cu12", "hydra-core",
             "omegaconf", "pytest", "hypothesis"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "MISSING")
missing = [m for m in ("hydra", "omegaconf", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if missing:
    print("missing modules:", " ".join(missing), "(carry their wheels in .whl/)")
EOF
} > "$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

FAILED=0
run() {  # run NAME SECONDS COMMAND...: log to NAME.log, one line in summary.txt
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
  local status=ok
  [ "$rc" -eq 0 ] || status="FAILED rc=$rc"
  [ "$rc" -eq 124 ] && status="TIMED OUT after ${limit}s"
  echo "$name: $status ($(( $(date +%s) - start ))s)" | tee -a "$LOGS/summary.txt"
  tail -n 25 "$LOGS/$name.log"
}

PYTEST=("$PY" -m pytest -q -rA -p no:cacheprovider)
run gpu_tests 80 "${PYTEST[@]}" tests/test_gpu.py
run audit 50 "$PY" -m readback.audit
run te_tests 90 "${PYTEST[@]}" tests/test_te_backend.py
run benchmark 230 "$PY" benchmarks/gpu_step.py --steps 300 --max-seconds 12 --case-timeout 60 \
  --json "$LOGS/gpu_step.json"

echo "total $(( $(date +%s) - T0 ))s, $FAILED part(s) failed" | tee -a "$LOGS/summary.txt"
exit "$FAILED"
