#!/usr/bin/env bash
# The CPU mini-study with stochastic forward rounding: the 4 FP8 experiments x 3 seeds = 12 runs
# of cpu_mini.sh's settings with precision.rounding=stochastic (bf16_baseline, which rounds
# nothing to FP8, is in multirun/cpu_mini). About 50 minutes on a laptop.
#
#   sweeps/cpu_mini_stochastic.sh [OVERRIDES...]
#
# Runs land in multirun/cpu_mini_stochastic/<experiment>/seed<N>/<job>/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir=multirun/cpu_mini_stochastic \
    +experiment=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd \
    precision.rounding=stochastic \
    seed=0,1,2 \
    model=small data=shakespeare \
    trainer.steps=40 trainer.optim.warmup_steps=4 \
    trainer.log_every=2 trainer.eval_every=10 trainer.eval_batches=4 trainer.ckpt_every=20 \
    probe.every=10 \
    trainer.resume=true trainer.progress=false \
    "$@"
