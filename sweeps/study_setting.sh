#!/usr/bin/env bash
# The study's own setting, tested as pre-registered in docs/results/d_term/preregistration_study_setting.md:
# a stochastic forward rounding (precision.rounding=stochastic), the five arms reuse_rounded,
# fresh_reround, no_saved_copy (the control), reuse_rounded_bf16_bwd (the fix read as TE's BF16
# backward: D from O8) and original_bf16_bwd (the fix read as a BF16 backward over BF16 tensors: D
# from the BF16 O), at O's stress 2^-14 first and then without stress, fresh seeds 300 to 307, on the
# +sweep=cpu_stress preset (tiny FOG, embedded Shakespeare text, 2,000 steps of 16 x 128 tokens at
# LR 1e-2, the same 8 validation batches every 250 steps, the bias meter every 500, replaying in
# FP64). The stress is the outer loop, then the seed, so a sweep stopped early holds whole seed
# quintuples of the stress-14 test first; trainer.resume=true continues a stopped run from its last
# checkpoint and skips finished ones. 80 runs, about 11 core-hours at one thread each (the timed
# pilot: see the pre-registration). Run every run on one code version and one CPU kind.
#
#   sweeps/study_setting.sh [OVERRIDES...]      (SEEDS=300,302,304,306 runs a subset, e.g. one stream a core)
#
# Runs land in multirun/study_setting/<experiment>/<precision.site_margin,seed>/; the tests:
#   python -m readback.cli.decide study_setting multirun/study_setting
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/study_setting}" \
    "precision.site_margin={attn.core.output:14},{}" \
    seed="${SEEDS:-$(seq -s, 300 307)}" \
    +experiment=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd,original_bf16_bwd \
    precision.rounding=stochastic \
    +sweep=cpu_stress \
    probe.dtype=fp64 \
    trainer.resume=true trainer.progress=false \
    "$@"
