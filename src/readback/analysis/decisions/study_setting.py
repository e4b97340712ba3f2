"""The study-setting test's calls (``docs/results/d_term/preregistration_study_setting.md``) from
the folder ``sweeps/study_setting.sh`` wrote: per test (S14, O's stress 2^-14; S0, no stress) the
registered contrasts, the equivalence figures and the call, each as pre-registered, on the final
validation loss and again on the final train loss; then the meter's secondary figures.

    python -m readback.cli.decide study_setting SWEEP [--out DIR]

Each contrast pairs two arms by seed over the seeds whose five arms all ended. A diverged run
counts with its last value, and the calls are made again on the seeds without a diverged run;
where the two calls differ, the call is "inconclusive" (as registered). A test whose runs span
CPU kinds (``launch.json``'s model and ISA) is not called: kinds differ in bits. ``--out`` writes
``decision.md`` and ``decision.json`` there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from readback.analysis.decisions.common import ENDED, diverged_rule, over_seeds, seed_table, side
from readback.analysis.files import load_runs
from readback.analysis.paired import seed_paired
from readback.analysis.render import se_digits

REUSE, FRESH, CONTROL = "reuse_rounded", "fresh_reround", "no_saved_copy"
TE_FIX, BF16_O_FIX = "reuse_rounded_bf16_bwd", "original_bf16_bwd"
ARMS = (REUSE, FRESH, CONTROL, TE_FIX, BF16_O_FIX)
CONTRASTS = (
    (REUSE, CONTROL),
    (REUSE, FRESH),
    (TE_FIX, REUSE),
    (BF16_O_FIX, REUSE),
    (FRESH, CONTROL),
    (TE_FIX, CONTROL),
    (BF16_O_FIX, CONTROL),
    (BF16_O_FIX, TE_FIX),
)
MARGIN = 0.007  # the equivalence margin, nats
STRESSED = "attn.core.output:14"  # in the run folder's name of the S14 test
METER_STEPS = (500, 1000, 1500, 2000)
LAYERS = ("layers.0.attn.qkv", "layers.1.attn.qkv")
# the read whose contribution each arm's meter reports: the D read of O8 (or of the BF16 O), or the fresh draw
METER_READS = {
    REUSE: "contrib.exact_read.attention.D",
    TE_FIX: "contrib.exact_read.attention.D",
    BF16_O_FIX: "contrib.exact_read.attention.D",
    FRESH: "contrib.fresh_reround",
}


def contrasts(final: pd.DataFrame) -> dict[str, dict]:
    """Every registered contrast ``a - b`` paired by seed, with TOST's equivalence within MARGIN."""
    out = {}
    for a, b in CONTRASTS:
        p = seed_paired((final[a] - final[b]).to_numpy(float))
        p["equivalent"] = bool(p["ci90"][0] > -MARGIN and p["ci90"][1] < MARGIN)
        out[f"{a} - {b}"] = p
    return out


def _fix_call(c: dict) -> str:
    te, bf16_o = side(c[f"{TE_FIX} - {REUSE}"]), side(c[f"{BF16_O_FIX} - {REUSE}"])
    if bf16_o == "ahead" and te != "ahead":
        return "only the BF16-O fix helps: the gap follows the D read of O8 under either backward"
    if te == "ahead" and bf16_o == "ahead":
        return "both fixes help: the gap is not (only) the D read; it sits in what both fixes change"
    if te == "ahead":
        return "inconclusive: only TE's fix helps"
    return "neither fix helps: both readings of the fix keep the gap"


def call(test: str, c: dict) -> str:
    """The registered call of test ``S14`` or ``S0`` on its contrasts ``c``."""
    reuse_vs_control, reuse_vs_fresh = side(c[f"{REUSE} - {CONTROL}"]), side(c[f"{REUSE} - {FRESH}"])
    if test == "S14":
        if reuse_vs_control != "behind":
            return "void: the positive control (reuse_rounded behind no_saved_copy) did not replicate"
        return _fix_call(c)
    if "behind" in (reuse_vs_control, reuse_vs_fresh):
        return "the reuse costs loss without stress; " + _fix_call(c)
    return "no loss cost of the reuse detected without stress"


def finals(runs: pd.DataFrame, column: str, diverged: bool) -> pd.DataFrame:
    """Seed x arm table of ``column`` over the seeds whose five arms all ended (with ``diverged``
    False, over those none of whose runs diverged)."""
    return seed_table(runs, column, ARMS, statuses=ENDED if diverged else ("completed",))


def judged(runs: pd.DataFrame, test: str, column: str) -> dict:
    """One test's contrasts and call on ``column``, with the diverged-run rule applied."""
    with_diverged, without = finals(runs, column, True), finals(runs, column, False)
    c = contrasts(with_diverged)
    first, second = call(test, c), call(test, contrasts(without))
    kinds = sorted(set(runs["cpu"].dropna()))
    if len(kinds) > 1:
        verdict = f"not decided: its runs span CPU kinds ({'; '.join(kinds)})"
    elif len(with_diverged) < 2:
        verdict = "not decided: fewer than 2 seeds have all five arms ended"
    else:
        verdict = diverged_rule(first, second)
    return {"seeds": [int(s) for s in with_diverged.index], "cpu": kinds, "contrasts": c, "call": verdict}


def meter_figures(runs: pd.DataFrame, wide: pd.DataFrame) -> dict:
    """Secondary: each arm's read contribution (METER_READS) to the QKV gradients, the debiased
    squared bias and the projection, mean and SE over seeds per layer and step."""
    out: dict = {}
    for arm, read in METER_READS.items():
        ids = runs[runs["experiment"] == arm]["run_id"]
        for stat in ("grad_bias_debiased_sq", "grad_bias_projection"):
            for layer in LAYERS:
                key = f"{stat}/{read}/{layer}"
                for step in METER_STEPS:
                    values = [wide[key].get((rid, step), np.nan) if key in wide else np.nan for rid in ids]
                    out[f"{arm} {key} @{step}"] = over_seeds(values)
    return out


def decide(sweep: Path) -> dict:
    keys = ["val_loss", "loss", "grad_bias_debiased_sq/*", "grad_bias_projection/*"]
    loaded = load_runs(sweep, keys=keys)
    runs = loaded.summary.reset_index().rename(columns={"run": "run_id"})
    runs["test"] = np.where(runs["run_id"].str.contains(STRESSED, regex=False), "S14", "S0")
    wide = loaded.wide()
    out: dict = {"runs": {f"{r.test} {r.experiment} seed {r.seed}": str(r.status) for r in runs.itertuples()}}
    out["diverged"] = sorted(k for k, s in out["runs"].items() if s == "diverged")
    for test in ("S14", "S0"):
        sub = runs[runs["test"] == test]
        out[test] = {
            "val_loss": judged(sub, test, "val_loss"),
            "train_loss": judged(sub, test, "final_loss"),
            "meter": meter_figures(sub, wide),
        }
    return out


def _row(name: str, p: dict) -> str:
    return (
        f"| {name} | {p['n']} | {p['mean']:+.4f} | {p['se']:.4f} | {p['t']:+.2f} | "
        f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] | [{p['ci90'][0]:+.4f}, {p['ci90'][1]:+.4f}] | "
        f"{'yes' if p['equivalent'] else 'no'} |"
    )


def _meter_row(name: str, m: dict) -> str:
    """A meter figure to the precision its SE needs (two significant digits of the SE)."""
    n = se_digits(m["se"])
    return f"| {name} | {m['n']} | {m['mean']:+.{n}f} | {m['se']:.{n}f} |"


def report(d: dict) -> str:
    """The decision as Markdown."""
    lines = []
    for test, title in (("S14", "S14, O's stress 2^-14"), ("S0", "S0, no stress")):
        lines += [f"## {title}", ""]
        for loss in ("val_loss", "train_loss"):
            v = d[test][loss]
            kinds = " and ".join(v["cpu"]) or "no CPU: no run"
            lines += [
                f"**{loss}** (final, paired by seed, seeds {v['seeds']}, on {kinds}): {v['call']}.",
                "",
                f"| contrast | n | mean | SE | t | 95 % interval | 90 % interval | equivalent within ±{MARGIN} |",
                "|---|---|---|---|---|---|---|---|",
                *(_row(name, p) for name, p in v["contrasts"].items()),
                "",
            ]
        lines += ["| meter figure | n | mean | SE |", "|---|---|---|---|"]
        lines += [_meter_row(k, m) for k, m in d[test]["meter"].items()]
        lines += [""]
    lines += [f"Runs: {len(d['runs'])}; diverged: {', '.join(d['diverged']) or 'none'}."]
    return "\n".join(lines) + "\n"
