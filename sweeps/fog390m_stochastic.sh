#!/usr/bin/env bash
# The study's grid with stochastic forward rounding (precision.rounding=stochastic): the 4 FP8
# experiments x 3 seeds = 12 Slurm jobs of one node, 8 GPUs, 8 ranks. With a stochastic
# forward, fresh_reround's re-rounding is another draw from the very distribution the forward
# drew from. bf16_baseline has no FP8 rounding: its runs are in multirun/fog390m.
#
#   sweeps/fog390m_stochastic.sh [OVERRIDES...]
#
# Runs land in multirun/fog390m_stochastic/<experiment>/<overrides>/; it can run alongside
# fog390m.sh. Cluster settings: sweeps/README.md. Everything else is as in fog390m.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SWEEP_DIR=multirun/fog390m_stochastic EXPERIMENTS=reuse_rounded,fresh_reround,no_saved_copy,reuse_rounded_bf16_bwd \
    exec sweeps/fog390m.sh precision.rounding=stochastic "$@"
