#!/usr/bin/env bash
# The CPU mini-study: the 5 experiments x 3 seeds = 15 runs of the small FOG (~10.5M
# parameters) on the embedded Shakespeare text, one after the other on this machine, each run
# 80 steps of 16 x 128 tokens with a gradient probe every 20 steps. About 45 minutes on 2 cores
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
    hydra.sweep.dir="${SWEEP_DIR:-multirun/cpu_mini}" \
    +experiment="${EXPERIMENTS:-reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,bf16_baseline}" \
    seed=0,1,2 \
    model=small model.seq_len=128 model.global_batch=16 data=shakespeare \
    trainer.steps=80 trainer.micro_batch=16 trainer.optim.warmup_steps=8 \
    trainer.log_every=4 trainer.eval_every=20 trainer.eval_batches=4 trainer.ckpt_every=40 \
    probe.every=20 probe.repeats=2 \
    trainer.resume=true trainer.progress=false \
    "$@"
