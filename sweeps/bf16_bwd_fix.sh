#!/usr/bin/env bash
# The paired test of the study's fix as Transformer Engine runs it (pre-registered in
# docs/results/d_term/preregistration_bf16_bwd.md): reuse_rounded, reuse_rounded_bf16_bwd (the
# BF16 attention backward with attention.bwd_reads=te: D from O8, the original Q, K, V, P
# rebuilt with the FP8 forward's LSE) and no_saved_copy (the control), at O's stress 2^-14
# (precision.site_margin={attn.core.output:14}), fresh seeds 100 to 115, on the +sweep=cpu_stress
# preset (tiny FOG, embedded Shakespeare text, 2,000 steps of 16 x 128 tokens at LR 1e-2, the
# same 8 validation batches every 250 steps, the bias meter every 500, replaying in FP64 as in
# parts 1 to 5 of the D-term page). Seed is the outer loop,
# so the runs go seed by seed and a sweep stopped early holds whole seed triples;
# trainer.resume=true continues a stopped run from its last checkpoint and skips finished ones.
# 48 runs; about 4.6 core-hours at one thread each (from a timed 50-step run, scaled: see the
# pre-registration). Run every seed on one code version and one CPU kind.
#
#   sweeps/bf16_bwd_fix.sh [OVERRIDES...]      (SEEDS=100,101 runs a subset, e.g. one stream a core)
#
# Runs land in multirun/bf16_bwd_fix/<experiment>/<precision.site_margin,seed>/; the tests:
#   python -m readback.cli.analysis multirun/bf16_bwd_fix --control no_saved_copy
#   python -m readback.cli.analysis multirun/bf16_bwd_fix --control reuse_rounded
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/bf16_bwd_fix}" \
    seed="${SEEDS:-$(seq -s, 100 115)}" \
    +experiment=reuse_rounded,reuse_rounded_bf16_bwd,no_saved_copy \
    "precision.site_margin={attn.core.output:14}" \
    +sweep=cpu_stress \
    probe.dtype=fp64 \
    trainer.resume=true trainer.progress=false \
    "$@"
