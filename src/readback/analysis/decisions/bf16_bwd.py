"""The BF16-backward test's decision (``docs/results/d_term/preregistration_bf16_bwd.md``) from the
folder ``sweeps/bf16_bwd_fix.sh`` wrote: the positive control, the primary contrast, the
equivalence test and the verdict, each as pre-registered, then the secondary figures.

    python -m readback.cli.decide bf16_bwd SWEEP [--out DIR]

Each test pairs two arms by seed on the final validation loss (the last ``val_loss`` of a run,
step 2,000) over the seeds that have all three arms. ``--out`` writes ``decision.md`` and
``decision.json`` there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from readback.analysis.decisions.common import over_seeds, seed_table
from readback.analysis.files import load_runs
from readback.analysis.paired import mean_se, seed_paired

CONTROL, REUSE, FIX = "no_saved_copy", "reuse_rounded", "reuse_rounded_bf16_bwd"
ARMS = (REUSE, FIX, CONTROL)
MARGIN = 0.007  # the equivalence margin, nats
METER_STEPS = (500, 1000, 1500, 2000)
LAYERS = ("layers.0.attn.qkv", "layers.1.attn.qkv")
D_READ = "contrib.exact_read.attention.D"
FIX_DEPARTURES = tuple(f"contrib.exact_read.attention.{g}" for g in ("dS", "dV", "dQ", "dK", "dP"))


def paired(final: pd.DataFrame, a: str, b: str) -> dict:
    """``a - b`` paired by seed (``analysis.paired.seed_paired``)."""
    return seed_paired((final[a] - final[b]).dropna().to_numpy(float))


def verdict(final: pd.DataFrame) -> dict:
    """The three tests and the pre-registered decision on a seed x arm table of final losses."""
    control, primary, vs_control = paired(final, REUSE, CONTROL), paired(final, FIX, REUSE), paired(final, FIX, CONTROL)
    t2, t1, se = control["t_two_sided"], control["t_one_sided"], vs_control["se"]
    equivalent = bool((vs_control["mean"] + MARGIN) / se > t1 and (vs_control["mean"] - MARGIN) / se < -t1)
    if not control["t"] >= t2:
        call = "void: the positive control did not replicate"
    elif vs_control["t"] >= t2 and primary["t"] > -t2:
        call = "the gap survives the fix: the D-read account is falsified as the explanation of the 390M divergence"
    elif primary["t"] <= -t2 and equivalent:
        call = "the fix closes the gap: the tiny-scale mechanism is falsified"
    else:
        call = "inconclusive"
    return {
        "positive_control": control,
        "primary": primary,
        "fix_vs_control": vs_control | {"equivalent_within": MARGIN, "equivalent": equivalent},
        "verdict": call,
    }


def meter_figures(runs: pd.DataFrame, wide: pd.DataFrame) -> dict:
    """Secondary: the meter's contributions on the QKV gradients, mean and SE over seeds per arm,
    layer and step; the D read's paired difference between the reuse arms at step 2,000."""
    out: dict = {}
    for arm in (REUSE, FIX):
        ids = runs[runs["experiment"] == arm].set_index("seed")["run_id"]
        for contribution in (D_READ, *(FIX_DEPARTURES if arm == FIX else ())):
            for stat in ("grad_bias", "grad_bias_projection"):
                for layer in LAYERS:
                    key = f"{stat}/{contribution}/{layer}"
                    for step in METER_STEPS if contribution == D_READ else METER_STEPS[-1:]:
                        values = [wide[key].get((rid, step), np.nan) for rid in ids if key in wide]
                        out[f"{arm} {key} @{step}"] = over_seeds(values)
    by_arm = {}
    for arm in (REUSE, FIX):
        ids = runs[runs["experiment"] == arm].set_index("seed")["run_id"]
        by_arm[arm] = {
            layer: pd.Series(
                {s: wide[f"grad_bias/{D_READ}/{layer}"].get((rid, 2000), np.nan) for s, rid in ids.items()}
            )
            for layer in LAYERS
        }
    for layer in LAYERS:
        d = (by_arm[FIX][layer] - by_arm[REUSE][layer]).dropna().to_numpy(float)
        mean, se = mean_se(d)
        out[f"D read, {FIX} - {REUSE}, grad_bias/{layer} @2000"] = {"n": len(d), "mean": mean, "se": se}
    return out


def finals(runs: pd.DataFrame, column: str) -> pd.DataFrame:
    """Seed x arm table of ``column`` over the seeds whose three arms all ran to their end (a
    diverged run counts with its last value, as pre-registered; a running one does not)."""
    return seed_table(runs, column, ARMS)


def decide(sweep: Path) -> dict:
    loaded = load_runs(sweep, keys=["val_loss", "loss", "grad_bias/*", "grad_bias_projection/*"])
    runs = loaded.summary.reset_index().rename(columns={"run": "run_id"})
    statuses = {f"{r.experiment} seed {r.seed}": str(r.status) for r in runs.itertuples()}
    val = finals(runs, "val_loss")
    return {
        "runs": statuses,
        "diverged": sorted(k for k, s in statuses.items() if s == "diverged"),
        "complete_seeds": [int(s) for s in val.index],
        "final_val_loss": {arm: val[arm].tolist() for arm in ARMS},
        "val_loss": verdict(val),
        "train_loss": verdict(finals(runs, "final_loss")),
        "meter": meter_figures(runs, loaded.wide()),
    }


def _row(name: str, p: dict) -> str:
    return (
        f"| {name} | {p['n']} | {p['mean']:+.4f} | {p['se']:.4f} | {p['t']:+.2f} | "
        f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] | [{p['ci90'][0]:+.4f}, {p['ci90'][1]:+.4f}] |"
    )


def report(d: dict) -> str:
    """The decision as Markdown."""
    lines = []
    for loss in ("val_loss", "train_loss"):
        v = d[loss]
        lines += [
            f"**{loss}** (final, paired by seed): {v['verdict']}.",
            "",
            "| contrast | n | mean | SE | t | 95 % interval | 90 % interval |",
            "|---|---|---|---|---|---|---|",
            _row(f"positive control: {REUSE} - {CONTROL}", v["positive_control"]),
            _row(f"primary: {FIX} - {REUSE}", v["primary"]),
            _row(f"{FIX} - {CONTROL}", v["fix_vs_control"]),
            "",
            f"Equivalence of {FIX} with the control within ±{MARGIN}: {v['fix_vs_control']['equivalent']}.",
            "",
        ]
    lines += ["| meter figure | n | mean | SE |", "|---|---|---|---|"]
    lines += [f"| {k} | {m['n']} | {m['mean']:+.5f} | {m['se']:.5f} |" for k, m in d["meter"].items()]
    lines += ["", f"Runs: {len(d['runs'])}; diverged: {', '.join(d['diverged']) or 'none'}."]
    return "\n".join(lines) + "\n"
