#!/usr/bin/env bash
# The amax-spike route (docs/results/d_term/preregistration_spike.md): reuse_rounded, fresh_reround
# and no_saved_copy x seeds 0-3, 4,000 steps of the cpu_stress preset's tiny FOG without its
# constant stress, O's amax multiplied by 2^12 as it enters the history at step 1,000 (held by
# the 1,024-entry history: steps 1,001-2,024 run with O's scale lowered 2^12); then the secondary
# k = 14 pair on seed 0; then the bias meter (16 batches) on the reuse_rounded checkpoints at
# steps 500, 1,500 and 2,500. Seed by seed, resumable (a stop leaves whole seed triples and
# restarts where it was). 14 runs and 12 meters, about 2.4 core-hours.
#
#   sweeps/amax_spike.sh [OVERRIDES...]
#
# Runs land in multirun/amax_spike/<experiment>/<precision.amax_spike,seed>/; the paired table:
#   python -m readback.cli.analysis multirun/amax_spike --html
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
SWEEP=${SWEEP_DIR:-multirun/amax_spike}
COMMON=(+sweep=cpu_stress trainer.steps=4000 trainer.ckpt_every=500 trainer.keep_last=8
        trainer.resume=true trainer.progress=false hydra.sweep.dir="$SWEEP")

for seed in ${SEEDS:-0 1 2 3}; do
    "$PY" train.py --multirun seed="$seed" "${COMMON[@]}" \
        +experiment=reuse_rounded,fresh_reround,no_saved_copy \
        "precision.amax_spike={site:attn.core.output,step:1000,k:12}" "$@"
done
"$PY" train.py --multirun seed=0 "${COMMON[@]}" +experiment=reuse_rounded,no_saved_copy \
    "precision.amax_spike={site:attn.core.output,step:1000,k:14}" "$@"

shopt -s nullglob
for run in "$SWEEP"/reuse_rounded/*k:12*; do
    for step in 500 1500 2500; do
        ckpt=$(printf '%s/checkpoints/step_%07d' "$run" "$step")
        test -f "$run/bias/step$step/bias.json" || "$PY" -m readback.cli.bias "$ckpt" --batches 16 --out "$run/bias/step$step"
    done
done
