#!/usr/bin/env bash
# Scale stress on the CPU: reuse_rounded, fresh_reround and no_saved_copy x seeds 0,1,2 with the
# attention output's scale pushed down by 2^-12 and 2^-14 (precision.site_margin), the tiny FOG
# on the embedded Shakespeare text, 2,000 steps of 16 x 128 tokens at LR 1e-2, validation on the
# same 8 batches for every run, the bias meter every 500 steps. Runs are paired by seed (same
# initialisation, data order and validation batches), so the analysis compares each experiment
# with no_saved_copy seed by seed; the runs go seed by seed, so a sweep stopped early still holds
# whole pairs. The fixed settings live in conf/sweep/cpu_stress.yaml. 
# 18 runs; several hours on 2 cores (STRESS=14 halves it).
#
#   sweeps/cpu_stress.sh [OVERRIDES...]      e.g. trainer.steps=600
#
# Runs land in multirun/cpu_stress/<experiment>/<precision.site_margin,seed>/; the results page (paired-seed
# table per stress, loss, row-sum, mechanism plots):
#   python -m readback.cli.analysis multirun/cpu_stress --html
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
MARGINS=$(for k in ${STRESS:-12 14}; do printf '{attn.core.output:%s},' "$k"; done)

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/cpu_stress}" \
    seed="${SEEDS:-0,1,2}" \
    +experiment="${EXPERIMENTS:-reuse_rounded,fresh_reround,no_saved_copy}" \
    "precision.site_margin=${MARGINS%,}" \
    +sweep=cpu_stress \
    trainer.resume=true trainer.progress=false \
    "$@"
