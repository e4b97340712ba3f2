#!/usr/bin/env bash
# The meter ladder over the attention backward's parts, as pre-registered in
# docs/results/d_term/preregistration_parts_ladder.md: reuse_rounded checkpoints at the 390M's
# attention shape (head dim 128, 2 heads over 1 KV group; +sweep=parts_ladder), then the bias
# meter's --parts on each, at the registered sequence lengths, forward roundings and backwards.
# Stage by stage in the registered order (the cheapest complete answer first); resumable: a
# finished checkpoint is skipped by trainer.resume=true, a finished meter by its bias.json.
#
#   sweeps/parts_ladder.sh [train|meter|all] [NAME...]    (default all; NAMEs: only those checkpoints,
#                                                          e.g. one stream a core: "train d2_t4096")
#
# Checkpoints land in multirun/parts_ladder/<name>/, meters in <name>/bias/; the decision:
#   python -m readback.cli.decide parts_ladder multirun/parts_ladder
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
ROOT=${LADDER_DIR:-multirun/parts_ladder}
STAGE=${1:-all}
ONLY=" ${*:2} "

wanted() {  # NAME: trained and metered in this call?
    [[ $ONLY == "  " || $ONLY == *" $1 "* ]]
}
FP8_END=fp8-qkv,fp8-probs,fp8-grad_output,fp8-grad_scores,fp8-gemms,fp8-grad_output_in_d

train() {  # NAME OVERRIDES...
    local name=$1
    shift
    wanted "$name" || return 0
    test -f "$ROOT/$name/summary.json" && return 0
    "$PY" train.py --multirun hydra.sweep.dir="$ROOT" hydra.sweep.subdir="$name" +sweep=parts_ladder \
        +experiment=reuse_rounded seed=400 trainer.resume=true trainer.progress=false "$@"
}

meter() {  # NAME T BATCHES ROUNDING PARTS LABEL [EXTRA...]   (PARTS "": every backward)
    local name=$1 t=$2 batches=$3 rounding=$4 parts=$5 label=$6
    shift 6
    wanted "$name" || return 0
    local out="$ROOT/$name/bias/T$t-$rounding-$label"
    test -f "$out/bias.json" && return 0
    "$PY" -m readback.cli.bias "$ROOT/$name" --batches "$batches" --seq-len "$t" \
        --precision "rounding=$rounding" --parts "$parts" --out "$out" "$@"
}

if [[ $STAGE == train || $STAGE == all ]]; then
    train d2 model.n_layers=2
    train d2_stochastic model.n_layers=2 precision.rounding=stochastic
    train d8 model.n_layers=8
    train d2_t4096 model.n_layers=2 model.seq_len=4096 model.global_batch=1
    train d4 model.n_layers=4
fi
if [[ $STAGE == meter || $STAGE == all ]]; then
    # 1. the headline: depth 2 at T 4,096, every backward, both forward roundings
    meter d2 4096 8 nearest "" all
    meter d2 4096 8 stochastic "" all
    # 2. the deepest at T 4,096: the FP8 end's parts one at a time
    meter d8 4096 4 nearest "$FP8_END" fp8_end
    meter d8 4096 4 stochastic "$FP8_END" fp8_end
    # 3. the T ladder at depth 2
    for t in 128 512 1024 2048; do
        meter d2 "$t" 8 nearest "" all
        meter d2 "$t" 8 stochastic "" all
    done
    # 4. trained as metered: a stochastic forward in training, and T 4,096 trained natively
    meter d2_stochastic 4096 8 stochastic "" all
    meter d2_t4096 4096 8 nearest "" all
    # 5. a held amax spike of 2^12 on O (as a site margin: what the history's max does for its window)
    meter d2 4096 8 nearest "" spike12 --site-margin attn.core.output=12
    # 6. depth 4 between
    meter d4 4096 4 nearest "$FP8_END" fp8_end
fi
