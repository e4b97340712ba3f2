#!/usr/bin/env bash
# The CPU mini-study with stochastic forward rounding: the 4 FP8 experiments x 3 seeds = 12 runs
# of cpu_mini.sh's settings with precision.rounding=stochastic (bf16_baseline, which rounds
# nothing to FP8, is in multirun/cpu_mini). About 25 minutes on 2 cores.
#
#   sweeps/cpu_mini_stochastic.sh [OVERRIDES...]
#
# Runs land in multirun/cpu_mini_stochastic/<experiment>/<overrides>/.
set -euo pipefail
cd "$(dirname "$0")/.."
SWEEP_DIR=multirun/cpu_mini_stochastic EXPERIMENTS=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd \
    exec sweeps/cpu_mini.sh precision.rounding=stochastic "$@"
