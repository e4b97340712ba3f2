#!/usr/bin/env bash
# FOG 8B on FineWeb-Edu (conf/sweep/fog8b.yaml): 8B does not fit one GPU replicated (16 bytes a parameter: ~129 GB before
# activations), so every run shards it with FSDP2 over several nodes: by default 4 nodes x 8 GPUs
# = 32 ranks a job (NODES=... to change). Check the per-GPU memory first:
#
#   WORLD_SIZE=32 python train.py model=fog_8b backend=te trainer.parallel=fsdp trainer.micro_batch=1 trainer.dry_run=true
#   sweeps/fog8b.sh [OVERRIDES...]        e.g. hydra.launcher.partition=gpu hydra.launcher.account=abc
#
# Runs land in multirun/fog8b/<experiment>/<overrides>/; requeued jobs resume from their newest
# checkpoint, at any world size (checkpoints hold full, unsharded states). Cluster settings:
# sweeps/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
LOCAL=; test -f conf/local/cluster.yaml && LOCAL=+local@hydra.launcher=cluster

exec "$PY" train.py --multirun \
    hydra/launcher=slurm $LOCAL \
    hydra.launcher.nodes="${NODES:-4}" \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/fog8b}" \
    +experiment="${EXPERIMENTS:-reuse_rounded,fresh_reround,bf16_baseline}" \
    seed=0 \
    +sweep=fog8b \
    trainer.resume=true trainer.progress=false \
    "$@"
