#!/usr/bin/env bash
# The CPU mini-study: the 5 experiments x 3 seeds = 15 runs of the small FOG (~10.5M
# parameters) on the embedded Shakespeare text, one after the other on this machine, each run
# 40 steps of 8192 tokens with a gradient probe every 10 steps. About an hour on a laptop
# (sweeps/README.md: how it was sized); `make sweep-cpu` runs it.
#
#   sweeps/cpu_mini.sh [OVERRIDES...]       e.g. hydra/launcher=local (all runs at once)
#
# Runs land in multirun/cpu_mini/<experiment>/seed<N>/<job>/; running it again resumes
# unfinished runs and leaves finished ones as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir=multirun/cpu_mini \
    +experiment=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,bf16_baseline \
    seed=0,1,2 \
    model=small data=shakespeare \
    trainer.steps=40 trainer.optim.warmup_steps=4 \
    trainer.log_every=2 trainer.eval_every=10 trainer.eval_batches=4 trainer.ckpt_every=20 \
    probe.every=10 \
    trainer.resume=true trainer.progress=false \
    "$@"
