"""The NVFP4 switch test's calls (``docs/results/recipes/preregistration_nvfp4.md``) from the folder
``sweeps/nvfp4_switches.sh`` wrote: each switch's arm against TE's defaults, paired by seed on the
final validation loss, as pre-registered, then what is reported beside the tests.

    python -m readback.cli.decide nvfp4_switches SWEEP [--out DIR]

An arm is read from its run folder's name (``precision.disable_2d_quantization=...``,
``precision.disable_stochastic_rounding=...``). ``--out`` writes ``decision.md`` and
``decision.json`` there.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from readback.analysis.decisions.common import over_seeds, seed_table
from readback.analysis.files import load_runs
from readback.analysis.paired import seed_paired

DEFAULT, WEIGHTS_1D, NEAREST, BOTH = "TE defaults", "1x16 weights", "dY rounded to nearest", "both switches"
ARMS = {(False, False): DEFAULT, (True, False): WEIGHTS_1D, (False, True): NEAREST, (True, True): BOTH}
TESTED = (WEIGHTS_1D, NEAREST)
METER_STEPS = (500, 1000, 1500, 2000)
METER_GROUPS = ("total", "layers.0.attn.qkv", "layers.1.attn.qkv")


def arm_of(path: str) -> str:
    """The arm of a run folder, from its two switches."""
    switch = {k: v == "True" for k, v in re.findall(r"precision\.(disable_\w+)=(True|False)", path)}
    return ARMS[(switch["disable_2d_quantization"], switch["disable_stochastic_rounding"])]


def call(p: dict) -> str:
    """The pre-registered call on one arm's paired difference from TE's defaults."""
    if p["n"] < 2:
        return f"not tested: {p['n']} complete seeds"
    if p["t"] >= p["t_two_sided"]:
        return "behind TE's defaults: the switch costs loss"
    if p["t"] <= -p["t_two_sided"]:
        return "ahead of TE's defaults"
    return "no difference detected"


def finals(runs: pd.DataFrame, column: str, statuses: tuple[str, ...]) -> pd.DataFrame:
    """Seed x arm table of ``column`` over the seeds whose four arms all ended with ``statuses``."""
    return seed_table(runs, column, list(ARMS.values()), by="arm", statuses=statuses)


def paired_tests(runs: pd.DataFrame, column: str) -> dict:
    """Each arm against TE's defaults and the both-switches arm against each one-switch arm; the
    two tested calls, again without the seeds of a diverged run where one diverged (a call that
    then differs is inconclusive)."""
    table = finals(runs, column, ("completed", "diverged"))
    others = [arm for arm in ARMS.values() if arm != DEFAULT]
    out = {f"{arm} - {DEFAULT}": seed_paired((table[arm] - table[DEFAULT]).to_numpy(float)) for arm in others}
    out |= {f"{BOTH} - {arm}": seed_paired((table[BOTH] - table[arm]).to_numpy(float)) for arm in TESTED}
    complete = finals(runs, column, ("completed",))
    calls = {}
    for arm in TESTED:
        first = call(out[f"{arm} - {DEFAULT}"])
        again = call(seed_paired((complete[arm] - complete[DEFAULT]).to_numpy(float)))
        calls[arm] = first if first == again else "inconclusive (a diverged run changes the call)"
    return {"contrasts": out, "calls": calls, "seeds": [int(s) for s in table.index]}


def meter(runs: pd.DataFrame, wide: pd.DataFrame) -> dict:
    """The meter's contributions in training, mean and SE over seeds per arm, group and step:
    the dgrad read in the 1x16 arm, the linears' gradient roundings in every arm."""
    out = {}
    for arm in ARMS.values():
        ids = runs[runs["arm"] == arm]["run_id"]
        for read in ("contrib.exact_read.linear.dgrad", "contrib.exact_bwd.linear"):
            for stat in ("grad_bias_debiased_sq", "grad_bias_projection"):
                for group in METER_GROUPS:
                    key = f"{stat}/{read}/{group}"
                    if key not in wide:
                        continue
                    for step in METER_STEPS:
                        out[f"{arm} {key} @{step}"] = over_seeds(wide[key].get((rid, step), np.nan) for rid in ids)
    return out


def decide(sweep: Path) -> dict:
    loaded = load_runs(sweep, keys=["val_loss", "grad_bias_debiased_sq/*", "grad_bias_projection/*"])
    runs = loaded.summary.reset_index().rename(columns={"run": "run_id"})
    runs["arm"] = runs["path"].map(arm_of)
    return {
        "runs": {f"{r.arm} seed {r.seed}": str(r.status) for r in runs.itertuples()},
        "val_loss": paired_tests(runs, "val_loss"),
        "train_loss": paired_tests(runs, "final_loss"),
        "meter": meter(runs, loaded.wide()),
    }


def report(d: dict) -> str:
    lines = []
    for loss in ("val_loss", "train_loss"):
        v = d[loss]
        lines += [f"**{loss}** (final, paired by seed over seeds {v['seeds']}):", ""]
        lines += [f"* {arm}: {c}" for arm, c in v["calls"].items()]
        lines += ["", "| contrast | n | mean | SE | t | 95 % interval |", "|---|---|---|---|---|---|"]
        for name, p in v["contrasts"].items():
            lines.append(
                f"| {name} | {p['n']} | {p['mean']:+.4f} | {p['se']:.4f} | {p['t']:+.2f} "
                f"| [{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}] |"
            )
        lines.append("")
    lines += ["| meter figure | n | mean | SE |", "|---|---|---|---|"]
    lines += [f"| {k} | {m['n']} | {m['mean']:+.3e} | {m['se']:.3e} |" for k, m in d["meter"].items()]
    statuses = sorted(set(d["runs"].values()))
    lines += ["", f"Runs: {len(d['runs'])}; statuses: {', '.join(statuses)}."]
    return "\n".join(lines) + "\n"
