#!/usr/bin/env bash
# The D-term bias against head dimension and sequence length (docs/results/d_term, part 3): a
# 2-layer FOG of width 128 with 8, 4, 2 and 1 heads (head dims 16 to 128, every head its own K
# and V) at sequence lengths 128, 512 and 1024, each trained 400 steps of 2,048 tokens (the same
# tokens for every shape: the micro-batch is 2,048 / T) under reuse_rounded at O's scale stress
# 2^-14, seeds 0 and 1; then the bias meter on each final checkpoint (16 validation batches), and
# the onset: the same checkpoint measured with O's margin replaced by K = 10 to 13 (8 batches a K).
# The fixed settings are conf/sweep/d_term_width.yaml. 24 trainings, 24 measurements and 24 onset
# doses: several hours on 2 cores (a measurement at T 1024 costs about 11 training steps a batch).
#
#   sweeps/d_term_width.sh [OVERRIDES...]        e.g. trainer.steps=200
#   HEADS="8 1" LENGTHS=128 STRESS=12 SEEDS=0 BATCHES=16 DOSE=10,11,12,13 sweeps/d_term_width.sh
#   DOSE= sweeps/d_term_width.sh                 (no onset measurements)
#
# Runs land in multirun/d_term_width/T<T>/<experiment>/<overrides>/, each meter's bias.* in the
# run's bias/width/ and the onset's in bias/dose/margin<K>/; run again, it continues unfinished
# trainings and measures only what has no bias.json or dose.json yet. At the end, the tables and
# figures of what is measured so far: python -m readback.cli.bias_shapes "$SWEEP_DIR" --out
# "$SWEEP_DIR/shapes" (per shape, and each length against the shortest) and
# python -m readback.cli.bias_onset "$SWEEP_DIR" --out "$SWEEP_DIR/onset" (per shape and K).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
SWEEP_DIR=${SWEEP_DIR:-multirun/d_term_width}
STRESS=${STRESS:-14}
DOSE=${DOSE-10,11,12,13}  # set and empty: no onset measurements

for T in ${LENGTHS:-128 512 1024}; do
    micro=$((2048 / T))
    for heads in ${HEADS:-8 4 2 1}; do
        "$PY" train.py --multirun \
            hydra.sweep.dir="$SWEEP_DIR/T$T" \
            seed="${SEEDS:-0,1}" \
            +experiment="${EXPERIMENT:-reuse_rounded}" \
            model.n_heads="$heads" model.n_kv_groups="$heads" \
            model.seq_len="$T" trainer.micro_batch="$micro" model.global_batch="$micro" \
            "precision.site_margin={attn.core.output:$STRESS}" \
            +sweep=d_term_width \
            trainer.resume=true trainer.progress=false logger=none \
            "$@"
    done
    for run in "$SWEEP_DIR/T$T"/*/*/; do
        [ -f "$run/summary.json" ] && [ ! -f "$run/bias/width/bias.json" ] || continue
        "$PY" -m readback.cli.bias "$run" --batches "${BATCHES:-16}" --out "$run/bias/width"
    done
    for run in "$SWEEP_DIR/T$T"/*/*/; do
        [ -n "$DOSE" ] && [ -f "$run/summary.json" ] && [ ! -f "$run/bias/dose/dose.json" ] || continue
        "$PY" -m readback.cli.bias "$run" --batches 8 --sweep-margin "attn.core.output=$DOSE" \
            --out "$run/bias/dose"
    done
done
"$PY" -m readback.cli.bias_shapes "$SWEEP_DIR" --out "$SWEEP_DIR/shapes"
[ -z "$DOSE" ] || "$PY" -m readback.cli.bias_onset "$SWEEP_DIR" --out "$SWEEP_DIR/onset"
