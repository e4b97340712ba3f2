#!/usr/bin/env bash
# The CPU mini-study: the 5 experiments x 3 seeds = 15 runs of the tiny FOG on the embedded
# Shakespeare text, one after the other, each 600 steps of 16 x 128 tokens (1.2M tokens) with a
# gradient probe (2 repeats) every 100 steps. About 30 minutes on 2 cores; `make sweep-cpu` runs it.
# The small FOG (10.5M parameters) trains ~12x slower per token on a CPU: add `model=small` and
# fewer steps on a machine with more cores (sweeps/README.md).
#
#   sweeps/cpu_mini.sh [OVERRIDES...]       e.g. hydra/launcher=local (all runs at once)
#
# The fixed settings are conf/sweep/cpu_mini.yaml. Runs land in
# multirun/cpu_mini/<experiment>/<overrides>/ (e.g. reuse_rounded/seed=0/); running it again,
# or with more seeds or axes, resumes unfinished runs and leaves finished ones where they are.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
EXPERIMENTS=${EXPERIMENTS:-reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,bf16_baseline}
SEEDS=0,1,2

# One run after the other, each takes the threads trainer.threads=auto gives it. With
# hydra/launcher=local every run starts at once, so each takes its share of the cores, cores / runs
# and at least 1 (auto reads OMP_NUM_THREADS; one set by the caller stands).
if [[ " $* " == *" hydra/launcher=local "* ]]; then
    IFS=, read -ra experiments <<<"$EXPERIMENTS"
    IFS=, read -ra seeds <<<"$SEEDS"
    runs=$(( ${#experiments[@]} * ${#seeds[@]} ))
    share=$(( $(nproc) / runs ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( share > 0 ? share : 1 ))}
fi

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/cpu_mini}" \
    +experiment="$EXPERIMENTS" \
    seed="$SEEDS" \
    +sweep=cpu_mini \
    trainer.resume=true trainer.progress=false \
    "$@"
