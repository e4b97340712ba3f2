#!/usr/bin/env bash
# The BF16 GEMM kernel's effect on training: every experiment x seeds 0,1,2 x precision.bf16_gemm
# fp32 (the default: an FP32 GEMM of the BF16 values, rounded once) and native (torch's BF16 GEMM),
# the tiny FOG of `make train` (1,000 steps, the embedded text). The runs of one experiment and
# seed share everything but the kernel, so the two kernels are compared seed by seed:
#   python -m readback.cli.analysis multirun/bf16_gemm --control none --pair-axis precision.bf16_gemm=native
# 30 runs; about 40 minutes on 2 cores (SEEDS=, EXPERIMENTS= for fewer).
#
#   sweeps/bf16_gemm.sh [OVERRIDES...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/bf16_gemm}" \
    seed="${SEEDS:-0,1,2}" \
    +experiment="${EXPERIMENTS:-reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,bf16_baseline}" \
    precision.bf16_gemm=fp32,native \
    logger=none trainer.resume=true trainer.progress=false \
    "$@"
