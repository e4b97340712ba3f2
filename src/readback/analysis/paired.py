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
            pm, pse = mean_se(d)
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


def mean_se(d: np.ndarray) -> tuple[float, float]:
    if not len(d):
        return math.nan, math.nan
    return float(d.mean()), (float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan)


def seed_paired(d: np.ndarray) -> dict[str, Any]:
    """The test figures of a seed-paired difference ``d``: n, mean, SE, t, the two-sided and
    one-sided 5 % points of Student's t with n - 1 degrees of freedom, and the 95 % and 90 %
    intervals (a pre-registered test's numbers; NaN below 2 pairs)."""
    mean, se = mean_se(d)
    t2, t1 = (t_quantile(0.95, len(d) - 1), t_quantile(0.90, len(d) - 1)) if len(d) > 1 else (math.nan, math.nan)
    return {
        "n": len(d),
        "mean": mean,
        "se": se,
        "t": _ratio(mean, se),
        "ci95": [mean - t2 * se, mean + t2 * se],
        "ci90": [mean - t1 * se, mean + t1 * se],
        "t_two_sided": t2,
        "t_one_sided": t1,
    }


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
                mean, se = mean_se(d)
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


#: Columns of :func:`axis_table`.
AXIS_COLUMNS = ("group", "base", "metric", "n_pairs", "paired_mean", "paired_se", "level", "low", "high")


def axis_table(
    runs: Runs, axis: str, base: str, metrics: tuple[str, ...] = PAIRED_METRICS, level: float = 0.90
) -> pd.DataFrame:
    """Each group whose setting ``axis`` (an override key) is not ``base`` against the group that
    differs from it only there, seed by seed (e.g. ``precision.bf16_gemm=fp32`` against
    ``=native`` within each experiment): the paired difference's mean, SE and its two-sided
    Student-t interval at ``level`` (``low``, ``high``; NaN below 2 pairs)."""
    s, groups = runs.summary, runs.groups
    rows: list[dict[str, Any]] = []
    for group in groups:
        tags = group_settings(group).split(", ")
        value = next((t.split("=", 1)[1] for t in tags if t.startswith(f"{axis}=")), None)
        if value is None or value == base:
            continue
        rest = ", ".join(f"{axis}={base}" if t.startswith(f"{axis}=") else t for t in tags)
        other = f"{group_experiment(group)} [{rest}]"
        if other not in groups:
            continue
        for metric in metrics:
            a, b = _values(s, group, metric), _values(s, other, metric)
            seeds = sorted(set(a.index) & set(b.index))
            mean, se = mean_se((a[seeds] - b[seeds]).to_numpy(dtype=float))
            half = t_quantile(level, len(seeds) - 1) * se if len(seeds) > 1 else math.nan
            rows.append(
                {
                    "group": group,
                    "base": other,
                    "metric": metric,
                    "n_pairs": len(seeds),
                    "paired_mean": mean,
                    "paired_se": se,
                    "level": level,
                    "low": mean - half,
                    "high": mean + half,
                }
            )
    return pd.DataFrame(rows, columns=list(AXIS_COLUMNS))


def t_quantile(level: float, df: int) -> float:
    """``t`` with ``P(|T| < t) = level`` for Student's t with ``df`` (an integer >= 1) degrees of
    freedom: the closed form of ``P(|T| < t)`` (Abramowitz and Stegun 26.7.3-4), inverted by bisection."""
    if df < 1 or not 0 < level < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0 < level < 1, not df={df}, level={level}")

    def inside(t: float) -> float:
        theta = math.atan(t / math.sqrt(df))
        s, c2 = math.sin(theta), math.cos(theta) ** 2
        if df % 2:  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + ... + cos^(df-2)))
            term, total = math.cos(theta), 0.0
            for k in range(1, (df - 1) // 2 + 1):
                total += term
                term *= 2 * k / (2 * k + 1) * c2
            return 2 / math.pi * (theta + s * total)
        term, total = 1.0, 0.0  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... + cos^(df-2))
        for k in range(1, df // 2 + 1):
            total += term
            term *= (2 * k - 1) / (2 * k) * c2
        return s * total

    low, high = 0.0, 1e7
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if inside(mid) < level else (low, mid)
    return (low + high) / 2
