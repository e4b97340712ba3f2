#!/usr/bin/env bash
# The study's grid with stochastic forward rounding (precision.rounding=stochastic): the 4 FP8
# experiments x 3 seeds = 12 Slurm jobs of one node, 8 GPUs, 8 ranks. With a stochastic
# forward, fresh_reround's re-rounding is another draw from the very distribution the forward
# drew from. bf16_baseline has no FP8 rounding: its runs are in multirun/fog390m.
#
#   sweeps/fog390m_stochastic.sh [OVERRIDES...]
#
# Runs land in multirun/fog390m_stochastic/<experiment>/seed<N>/<job>/; it can run alongside
# fog390m.sh. Cluster settings: sweeps/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
LOCAL=; test -f conf/local/cluster.yaml && LOCAL=+local@hydra.launcher=cluster

exec "$PY" train.py --multirun \
    hydra/launcher=slurm $LOCAL \
    hydra.sweep.dir=multirun/fog390m_stochastic \
    +experiment=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd \
    precision.rounding=stochastic \
    seed=0,1,2 \
    model=fog_390m data=fineweb_edu \
    trainer.steps=15000 \
    probe.every=100 \
    trainer.resume=true trainer.progress=false \
    "$@"
