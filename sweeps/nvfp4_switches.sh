#!/usr/bin/env bash
# The paired test of two NVFP4 switches on the tiny FOG (pre-registered in
# docs/results/recipes/preregistration_nvfp4.md): reuse_rounded under precision.recipe=nvfp4 with
# TE's defaults, with 1x16 weight blocks (precision.disable_2d_quantization=true: dgrad reads W's
# own columnwise copy, not the one fprop multiplied), with dY rounded to nearest
# (precision.disable_stochastic_rounding=true), and with both; seeds 200 to 207, on the
# +sweep=cpu_stress preset (tiny FOG, embedded Shakespeare text, 2,000 steps of 16 x 128 tokens at
# LR 1e-2, the same 8 validation batches every 250 steps, the bias meter every 500), no stress.
# Seed is the outer loop, so a sweep stopped early holds whole seed quadruples; trainer.resume=true
# continues a stopped run from its last checkpoint and skips finished ones. 32 runs, about 7
# core-hours at one thread each. Run every seed on one code version and one CPU kind.
#
#   sweeps/nvfp4_switches.sh [OVERRIDES...]      (SEEDS=200,201 runs a subset, e.g. one stream a core)
#
# Runs land in multirun/nvfp4_switches/reuse_rounded/<switches,seed>/; the tests:
#   python -m readback.cli.decide nvfp4_switches multirun/nvfp4_switches
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}

exec "$PY" train.py --multirun \
    hydra.sweep.dir="${SWEEP_DIR:-multirun/nvfp4_switches}" \
    seed="${SEEDS:-$(seq -s, 200 207)}" \
    +experiment=reuse_rounded \
    precision.recipe=nvfp4 \
    precision.disable_2d_quantization=false,true \
    precision.disable_stochastic_rounding=false,true \
    +sweep=cpu_stress \
    trainer.resume=true trainer.progress=false \
    "$@"
