#!/usr/bin/env bash
# The study: FOG 390M on FineWeb-Edu, 5 experiments x 3 seeds = 15 Slurm jobs, each one node
# with 8 GPUs and 8 torch.distributed ranks (conf/hydra/launcher/slurm.yaml). The forward
# rounds to nearest, as in the 390M study; fog390m_stochastic.sh is the same grid with
# stochastic forward rounding.
#
#   sweeps/fog390m.sh [OVERRIDES...]        e.g. hydra.launcher.partition=gpu hydra.launcher.account=abc
#
# Runs land in multirun/fog390m/<experiment>/<overrides>/. Preempted or timed-out jobs are
# requeued and resume from their newest checkpoint; running the script again resumes every
# unfinished run (and leaves finished ones as they are). Cluster settings: sweeps/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
LOCAL=; test -f conf/local/cluster.yaml && LOCAL=+local@hydra.launcher=cluster

exec "$PY" train.py --multirun \
    hydra/launcher=slurm $LOCAL \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/fog390m}" \
    +experiment="${EXPERIMENTS:-reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,bf16_baseline}" \
    seed=0,1,2 \
    +sweep=fog390m \
    trainer.resume=true trainer.progress=false \
    "$@"
