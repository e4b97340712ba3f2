#!/usr/bin/env bash
# The GPU check of readback, for one bare CUDA machine (written for an H200), in 8 minutes at most.
# It prints the Python, torch, CUDA, Triton and Transformer Engine versions first, then runs every
# part the machine can run and names, for each part it cannot, what is missing (scripts/gpu_env.py
# decides, from what imports):
#
#   first_steps     scripts/gpu_policy_runs.py --runs reuse_rounded: 3 steps through train.py on CUDA;
#                   if they fail (an import-time error, a Python or torch the code does not run on),
#                   the check stops there instead of spending its minutes on parts that would fail too
#   emulated_tests  tests/unit/backends/test_gpu.py: torch._scaled_mm against the emulation (bit-identical
#                   fraction per accumulation mode: fp32, and Hopper's fast and split against readback's
#                   model of them), a head-dim-128 FOG step on CUDA against the CPU
#   accumulation    the same bit-identical fractions with CUBLASLT_WORKSPACE_SIZE=0 (cuBLAS cannot split K)
#   policy_runs     scripts/gpu_policy_runs.py: every policy and BF16, 20 steps of a head-dim-128 FOG
#                   through train.py on CUDA (completed, every loss finite)
#   audit           python -m readback.cli.audit: the read-rule audit of single ops
#   kernel_tests    tests/unit/backends/test_gpu_kernel.py: the Triton attention core on CUDA against the ops core
#                   on the CPU (codes, counts, O and gradients within the interpreter tests' bounds)
#   kernel_benchmark  benchmarks/attention_kernel.py: the FP8 core's forward + backward on the Triton kernel and
#                   on the ops against SDPA in BF16 (flash) and, where TE imports, TE's fused FP8 attention,
#                   ms and peak memory at T 4,096, head dim 128
#   benchmark       benchmarks/gpu_step.py: fog_390m, emulated FP8 against BF16, tokens/s, MFU, peak memory
#                   at sequence 1024 (micro-batch 8) and 4096 (micro-batch 2); its attention runs on the
#                   Triton kernel (attention.kernel=auto)
#   kernel_step     benchmarks/gpu_step.py: reuse_rounded with attention.kernel=ops at sequence 4096, the step
#                   the benchmark's reuse_rounded (the Triton core) is compared with
#   te_tests        tests/unit/backends/test_te_backend.py -m gpu, with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 (TE logs
#                   why it disables a backend)                                  [needs Transformer Engine]
#   te_benchmark    benchmarks/gpu_step.py, the TE cases (BF16, FP8 delayed scaling)  [needs Transformer Engine]
#
# Without a CUDA build of torch it prints one line saying so and runs nothing. It installs nothing:
# the wheels readback needs beyond the machine's own packages come from scripts/gpu_bundle.py,
# which prints the command that installs them offline and then runs this script. Each part runs
# under its own time limit, cut to what is left of the 8 minutes; a test part that runs no test
# fails (the check never passes by skipping). The exit code is the number of failed parts, or
# 100 when no part could run. Logs (one per part, plan.txt, summary.txt, gpu_step*.json,
# policy_runs/) go to $OUT when it is set, else to ./gpu_check_logs.
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

say() { echo "$1" | tee -a "$LOGS/summary.txt"; }

command -v "$PY" > /dev/null || { say "gpu_check: needs a CUDA build of torch; there is no $PY (set PYTHON): nothing run"; exit 100; }
timeout 60 "$PY" scripts/versions.py | tee "$LOGS/versions.txt"
PLAN=$(timeout 120 "$PY" scripts/gpu_env.py 2> "$LOGS/gpu_env.log")
[ "$?" -eq 0 ] || { say "gpu_check: ${PLAN:-the environment check failed under $PY (see gpu_env.log)}"; exit 100; }
echo "$PLAN" | tee "$LOGS/plan.txt"

FAILED=0 RAN=0 NOT_RUN=""
part() {  # part NAME SECONDS COMMAND...: if the plan says run, log to NAME.log and one line in summary.txt
  local name=$1 limit=$2 verdict start rc status
  shift 2
  verdict=$(sed -n "s/^$name: //p" <<< "$PLAN")
  if [ "$verdict" != run ]; then
    NOT_RUN="$NOT_RUN${NOT_RUN:+; }$name (${verdict#not run: })"
    say "$name: ${verdict:-not run: not in the plan}"
    return
  fi
  RAN=$((RAN + 1))
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
  say "$name: $status ($(( $(date +%s) - start ))s)"
  tail -n 20 "$LOGS/$name.log" 2>/dev/null
}

PYTEST=("$PY" -m pytest -q -rA -p no:cacheprovider)
part first_steps 90 "$PY" scripts/gpu_policy_runs.py --out "$LOGS/first_steps" --steps 3 --runs reuse_rounded
if [ "$FAILED" -gt 0 ]; then
  say "gpu_check: the first training steps failed (first_steps.log): no other part run"
  exit "$FAILED"
fi
BENCH=("$PY" benchmarks/gpu_step.py --seq 1024 4096 --micro-batch 8 2 --steps 300 --max-seconds 12 --case-timeout 50)
part emulated_tests 90 "${PYTEST[@]}" tests/unit/backends/test_gpu.py
part accumulation 60 env CUBLASLT_WORKSPACE_SIZE=0 "${PYTEST[@]}" -s tests/unit/backends/test_gpu.py -k accumulation_mode
grep -h "^scaled_mm bit-identical" "$LOGS/emulated_tests.log" "$LOGS/accumulation.log" 2>/dev/null \
  | tee -a "$LOGS/summary.txt"
part policy_runs 100 "$PY" scripts/gpu_policy_runs.py --out "$LOGS/policy_runs"
part audit 40 "$PY" -m readback.cli.audit
part kernel_tests 90 "${PYTEST[@]}" tests/unit/backends/test_gpu_kernel.py
part kernel_benchmark 60 "$PY" benchmarks/attention_kernel.py --seq 4096 --json "$LOGS/attention_kernel.json"
grep -h "^attention at seq " "$LOGS/kernel_benchmark.log" 2>/dev/null | tee -a "$LOGS/summary.txt"
part benchmark 220 "${BENCH[@]}" --cases emulated_bf16 emulated_reuse_rounded --json "$LOGS/gpu_step.json"
grep -hE "^emulated_.* at seq " "$LOGS/benchmark.log" 2>/dev/null | tee -a "$LOGS/summary.txt"
part kernel_step 70 "$PY" benchmarks/gpu_step.py --seq 4096 --micro-batch 2 --steps 300 --max-seconds 12 \
  --case-timeout 60 --cases emulated_reuse_rounded_ops --json "$LOGS/gpu_step_ops.json"
grep -hE "^emulated_.* at seq " "$LOGS/kernel_step.log" 2>/dev/null | tee -a "$LOGS/summary.txt"
part te_tests 110 env NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 "${PYTEST[@]}" -s -m gpu tests/unit/backends/test_te_backend.py
grep -hoE "Disabling [^.]*|Selected backend = [A-Za-z]+" "$LOGS/te_tests.log" 2>/dev/null | sort | uniq -c \
  | sort -rn | head -n 12 | tee "$LOGS/te_backend_reasons.txt"
part te_benchmark 100 "${BENCH[@]}" --cases te_bf16 te_fp8 --json "$LOGS/gpu_step_te.json"

say "total $(( $(date +%s) - T0 ))s: $RAN part(s) ran, $FAILED failed; not run: ${NOT_RUN:-none}"
[ "$RAN" -gt 0 ] || { say "gpu_check: no part ran"; exit 100; }
exit "$FAILED"
