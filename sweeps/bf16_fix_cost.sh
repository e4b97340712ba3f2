#!/usr/bin/env bash
# What the study's BF16 fix costs by itself, and why, as pre-registered in
# docs/results/d_term/preregistration_bf16_fix_cost.md: part 8's unstressed setting (S0: the
# +sweep=cpu_stress preset without its stress, a stochastic forward, the meter replaying in FP64),
# seeds 700 to 707. Per seed, the reuse_rounded run trains its 2,000 steps (arm R; every checkpoint
# kept); then each other arm starts from a copy of R's step-1,500 checkpoint and trains the last 500
# steps under its own backward (trainer.resume_changed_config=true):
#   T   reuse_rounded_bf16_bwd                            TE's BF16 backward (bwd_reads=te), D from O8
#   B   original_bf16_bwd                                 the same reads, D from the BF16 O
#   Tf  reuse_rounded_bf16_bwd attention.bwd_reads=forward  a BF16 backward of the forward's Q8, K8, V8, P8
#   Bf  original_bf16_bwd attention.bwd_reads=forward       its twin with D from the BF16 O
#   Tp  reuse_rounded_bf16_bwd attention.bwd_probs=forward  T with P read as the forward had it (P8, P)
# and, on the first seed only, R itself branched the same way (a check that a branch continues its
# base bit for bit). Seed by seed, the base first, so a stop leaves whole seeds. One process at a
# time; each run checkpoints every 100 steps and resumes from its newest checkpoint when the script
# is launched again (a finished run is skipped). Run it at one commit on one CPU kind.
#
#   OMP_NUM_THREADS=1 nice -n 19 sweeps/bf16_fix_cost.sh         (SEEDS="700 701" runs a subset)
#
# Runs land in multirun/bf16_fix_cost/<arm>/seed=<seed>/; the decision:
#   python -m readback.cli.decide bf16_fix_cost multirun/bf16_fix_cost
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
ROOT=${SWEEP_DIR:-multirun/bf16_fix_cost}
BRANCH_STEP=1500
SETTING=(+sweep=cpu_stress precision.rounding=stochastic probe.dtype=fp64 logger=none
    trainer.progress=false trainer.resume=true trainer.ckpt_every=100)

finished() {  # RUN_DIR: has the run ended (completed or diverged)?
    test -f "$1/summary.json" && grep -Eq '"status": "(completed|diverged)"' "$1/summary.json"
}

base() {  # SEED: arm R, trained from step 0, all its checkpoints kept (the branches start from one)
    local dir="$ROOT/R/seed=$1"
    finished "$dir" && return 0
    "$PY" train.py "hydra.run.dir='$dir'" +experiment=reuse_rounded seed="$1" "${SETTING[@]}" trainer.keep_last=100
}

branch() {  # ARM SEED OVERRIDES...: the last 500 steps from R's step-1,500 checkpoint
    local arm=$1 seed=$2
    shift 2
    local dir="$ROOT/$arm/seed=$seed" from="$ROOT/R/seed=$seed"
    finished "$dir" && return 0
    if ! compgen -G "$dir/checkpoints/step_*" >/dev/null; then
        local ckpt
        ckpt=$(printf '%s/checkpoints/step_%07d' "$from" "$BRANCH_STEP")
        test -d "$ckpt" || { echo "no checkpoint $ckpt to branch $arm from" >&2; return 1; }
        mkdir -p "$dir/checkpoints"
        cp -r "$ckpt" "$dir/checkpoints/"
        cp "$from/metrics.jsonl" "$dir/metrics.jsonl"  # the shared steps; the run keeps those up to 1,500
        printf '{"branched_from": "%s", "step": %d}\n' "$ckpt" "$BRANCH_STEP" >"$dir/branch.json"
    fi
    "$PY" train.py "hydra.run.dir='$dir'" seed="$seed" "${SETTING[@]}" trainer.resume_changed_config=true "$@"
}

read -ra seeds <<<"${SEEDS:-700 701 702 703 704 705 706 707}"
for s in "${seeds[@]}"; do
    base "$s"
    [[ $s == 700 ]] && branch R_branch "$s" +experiment=reuse_rounded
    branch T "$s" +experiment=reuse_rounded_bf16_bwd
    branch B "$s" +experiment=original_bf16_bwd
    branch Tf "$s" +experiment=reuse_rounded_bf16_bwd attention.bwd_reads=forward
    branch Bf "$s" +experiment=original_bf16_bwd attention.bwd_reads=forward
    branch Tp "$s" +experiment=reuse_rounded_bf16_bwd attention.bwd_probs=forward
done
