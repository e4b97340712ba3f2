#!/usr/bin/env bash
# The meter cells of docs/results/d_term/preregistration_bf16_fix_cost.md: what TE's own reads (the
# unrounded Q, K, V and P rebuilt with the FP8 forward's LSE) cost the gradient at the 390M's
# attention shape (head dim 128), against the BF16 backward of the forward's Q8, K8, V8 and P8.
# The parts ladder's checkpoints (+sweep=parts_ladder, seed 400: depth 2, 8, 4) are trained again
# by sweeps/parts_ladder.sh, then each is metered with --parts bf16,bf16+qkv+probs (reuse_rounded,
# fresh_reround, no_saved_copy under fp8, bf16 and bf16+qkv+probs; te_reads@<policy> per batch).
# In the registered order; one process at a time; a finished checkpoint or meter is skipped.
#
#   OMP_NUM_THREADS=1 nice -n 19 sweeps/bf16_fix_cost_meters.sh
#
# The decision: python -m readback.cli.decide te_reads_meter multirun/bf16_fix_cost_ladder
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
export LADDER_DIR=${LADDER_DIR:-multirun/bf16_fix_cost_ladder}

meter() {  # NAME T BATCHES ROUNDING
    local out="$LADDER_DIR/$1/bias/T$2-$4-te_reads"
    test -f "$out/bias.json" && return 0
    "$PY" -m readback.cli.bias "$LADDER_DIR/$1" --batches "$3" --seq-len "$2" \
        --precision "rounding=$4" --parts bf16,bf16+qkv+probs --out "$out"
}

sweeps/parts_ladder.sh train d2
for r in nearest stochastic; do meter d2 4096 8 "$r"; done
sweeps/parts_ladder.sh train d8
for r in nearest stochastic; do meter d8 4096 4 "$r"; done
for t in 512 1024 2048; do
    for r in nearest stochastic; do meter d2 "$t" 8 "$r"; done
done
sweeps/parts_ladder.sh train d4
meter d4 4096 4 nearest
