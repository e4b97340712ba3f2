"""Paired-seed comparison of each group with a control experiment.

Runs with the same seed share the initialisation, the data order and the validation batches,
so most of the seed-to-seed spread is common to an experiment and its control. The paired
difference ``d_s = x_group(seed s) - x_control(seed s)`` cancels it: its mean over seeds with
SE = sd(d) / sqrt(n) resolves effects far below the spread of either experiment. The unpaired
figure (difference of the means, SE = sqrt(var_g/n_g + var_c/n_c)) stands beside it: an effect
that only the paired SE resolves is real but small against seed noise.

A group ``exp [k=v]`` is compared with ``control [k=v]`` when that group exists (same
settings, e.g. the same learning rate), else with the plain control experiment.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from readback.analysis.groups import group_experiment, group_settings
from readback.analysis.load import Runs
from readback.analysis.tables import FINISHED

#: Per-run values compared: the summary's final train loss and final validation loss.
PAIRED_METRICS = ("final_loss", "val_loss")
PAIRED_COLUMNS = (
    "group",
    "control",
    "metric",
    "n_pairs",
    "paired_mean",
    "paired_se",
    "paired_z",
    "n",
    "n_control",
    "unpaired_mean",
    "unpaired_se",
    "unpaired_z",
)


def control_group(group: str, groups: list[str], control: str) -> str | None:
    """The control group that ``group`` is compared with (``None``: none loaded, or it is one)."""
    if group_experiment(group) == control:
        return None
    settings = group_settings(group)
    same = f"{control} [{settings}]" if settings else control
    if same in groups:
        return same
    return control if control in groups else None


def _values(summary: pd.DataFrame, group: str, metric: str) -> pd.Series:
    """``seed -> value`` of the finished runs of a group with a finite value (first run per seed)."""
    sub = summary[(summary["group"] == group) & summary["status"].isin(FINISHED)]
    vals = pd.to_numeric(sub[metric], errors="coerce")
    keep = np.isfinite(vals.to_numpy(dtype=float)) & sub["seed"].notna().to_numpy()
    out = pd.Series(vals[keep].to_numpy(dtype=float), index=sub["seed"][keep].astype(int).to_numpy())
    return out[~out.index.duplicated()]


def paired_table(runs: Runs, control: str, metrics: tuple[str, ...] = PAIRED_METRICS) -> pd.DataFrame:
    """One row per (group, metric) for every group with a control: the paired and unpaired
    differences (group minus control), their SEs and their ratio ``z`` (NaN below 2 pairs)."""
    s = runs.summary
    groups = runs.groups
    rows: list[dict[str, Any]] = []
    for group in groups:
        ctrl = control_group(group, groups, control)
        if ctrl is None:
            continue
        for metric in metrics:
            a, b = _values(s, group, metric), _values(s, ctrl, metric)
            seeds = sorted(set(a.index) & set(b.index))
            d = (a[seeds] - b[seeds]).to_numpy(dtype=float)
            pm, pse = _mean_se(d)
            um = float(a.mean() - b.mean()) if len(a) and len(b) else math.nan
            use = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)) if len(a) > 1 and len(b) > 1 else math.nan
            rows.append(
                {
                    "group": group,
                    "control": ctrl,
                    "metric": metric,
                    "n_pairs": len(seeds),
                    "paired_mean": pm,
                    "paired_se": pse,
                    "paired_z": _ratio(pm, pse),
                    "n": len(a),
                    "n_control": len(b),
                    "unpaired_mean": um,
                    "unpaired_se": use,
                    "unpaired_z": _ratio(um, use),
                }
            )
    return pd.DataFrame(rows, columns=list(PAIRED_COLUMNS))


def _mean_se(d: np.ndarray) -> tuple[float, float]:
    if not len(d):
        return math.nan, math.nan
    return float(d.mean()), (float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan)


def _ratio(mean: float, se: float) -> float:
    return mean / se if math.isfinite(mean) and math.isfinite(se) and se > 0 else math.nan


def paired_curve(runs: Runs, control: str, key: str = "val_loss") -> pd.DataFrame:
    """The paired difference of ``key`` at every step both runs of a seed logged it: one row per
    (group, step) with ``n_pairs``, ``mean`` and ``se`` (NaN below 2 pairs). The gap's trajectory
    over training, where :func:`paired_table` has its final value only."""
    curve = runs.curve(key)
    columns = ["group", "control", "key", "step", "n_pairs", "mean", "se"]
    rows: list[dict[str, Any]] = []
    for group in runs.groups:
        ctrl = control_group(group, runs.groups, control)
        if ctrl is None:
            continue
        mine, theirs = (
            curve[curve["group"] == g].pivot_table(index="step", columns="seed", values="value") for g in (group, ctrl)
        )
        for step in sorted(set(mine.index) & set(theirs.index)):
            d = (mine.loc[step] - theirs.loc[step]).dropna().to_numpy(dtype=float)
            if len(d):
                mean, se = _mean_se(d)
                rows.append(
                    {
                        "group": group,
                        "control": ctrl,
                        "key": key,
                        "step": int(step),
                        "n_pairs": len(d),
                        "mean": mean,
                        "se": se,
                    }
                )
    return pd.DataFrame(rows, columns=columns)
