"""The final-loss table (the study's headline: reuse_rounded 7.314 vs no_saved_copy 3.256) and the
last-value table of any metric, with their cells; :mod:`readback.analysis.render` writes them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from readback.analysis.load import Runs
from readback.analysis.render import cell_text, difference_cell, markdown_table, plus_minus

#: Statuses whose final losses enter the means (a failed or running run stopped part-way).
FINISHED = ("completed", "diverged")
DIVERGED_MARK = "†"

TABLE_COLUMNS = (
    "group",
    "experiment",
    "n_runs",
    "n",
    "n_completed",
    "n_diverged",
    "n_failed",
    "n_running",
    "final_loss_mean",
    "final_loss_std",
    "final_loss_min",
    "final_loss_max",
    "val_loss_mean",
    "val_loss_std",
    "n_val",
    "diverged_at_steps",
)


def final_loss_table(runs: Runs, by: str = "group") -> pd.DataFrame:
    """Final train loss and final val loss per group (or ``by="experiment"``), over seeds.

    One row per group, the study's experiments first (``Runs.groups``). ``n_runs``: runs in the group;
    ``n``: finished runs (``completed`` or ``diverged``) with a finite final loss, the ones
    ``final_loss_{mean,std,min,max}`` are taken over (diverged runs included: their final loss
    is the study's evidence); ``n_val``: the same for ``val_loss_{mean,std}``. ``std`` is the
    sample standard deviation (``ddof=1``; NaN for a single run). ``n_completed``,
    ``n_diverged``, ``n_failed``, ``n_running`` count statuses (``n_diverged`` counts every run
    marked diverged); ``diverged_at_steps`` lists the steps at which the diverged runs were
    marked.
    """
    s = runs.summary
    rows: list[dict[str, Any]] = []
    if not len(s):
        return pd.DataFrame(columns=list(TABLE_COLUMNS))
    order = runs.groups if by == "group" else runs.experiments if by == "experiment" else list(dict.fromkeys(s[by]))
    for group in order:
        sub = s[s[by] == group]
        finished = sub[sub["status"].isin(FINISHED)]
        fl = _finite(finished["final_loss"])
        vl = _finite(finished["val_loss"])
        div_steps = [int(x) for x in sub.loc[sub["diverged"], "diverged_at_step"] if not pd.isna(x)]
        rows.append(
            {
                "group": group,
                "experiment": sub["experiment"].iloc[0] if by == "group" else group,
                "n_runs": len(sub),
                "n": len(fl),
                "n_completed": int((sub["status"] == "completed").sum()),
                "n_diverged": int(sub["diverged"].sum()),
                "n_failed": int((sub["status"] == "failed").sum()),
                "n_running": int((sub["status"] == "running").sum()),
                "final_loss_mean": _mean(fl),
                "final_loss_std": _std(fl),
                "final_loss_min": float(fl.min()) if len(fl) else math.nan,
                "final_loss_max": float(fl.max()) if len(fl) else math.nan,
                "val_loss_mean": _mean(vl),
                "val_loss_std": _std(vl),
                "n_val": len(vl),
                "diverged_at_steps": sorted(div_steps),
            }
        )
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def _finite(col: pd.Series) -> np.ndarray:
    a = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    return a[np.isfinite(a)]


def _mean(a: np.ndarray) -> float:
    return float(a.mean()) if len(a) else math.nan


def _std(a: np.ndarray) -> float:
    return float(a.std(ddof=1)) if len(a) > 1 else math.nan


def format_final_loss_table(table: pd.DataFrame, digits: int = 3, paired: pd.DataFrame | None = None) -> str:
    """:func:`final_loss_cells` as a Markdown table with its footnotes."""
    headers, rows, notes = final_loss_cells(table, digits, paired)
    text = markdown_table(headers, rows, align=["l"] + ["r"] * (len(headers) - 1))
    return text + "\n\n" + "\n".join(notes) + "\n"


def final_loss_cells(
    table: pd.DataFrame, digits: int = 3, paired: pd.DataFrame | None = None
) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, rows and footnotes of the final-loss table: group, seeds, final loss and val loss
    (mean ± std), diverged (count of runs; the final loss marked † when any diverged), and
    failed/running counts when there are any. With ``paired`` (``paired_table`` of :mod:`readback.analysis.paired`)
    four more columns: the difference from the control in final and val loss, paired by seed and
    unpaired, each ± its SE. A footnote explains the marks."""
    headers = ["experiment", "seeds", "final loss", "val loss", "diverged"]
    extra = bool(len(table)) and bool((table["n_failed"] + table["n_running"]).sum())
    if extra:
        headers.append("failed / running")
    diffs = paired if paired is not None and len(paired) > 0 else None
    if diffs is not None:
        headers += ["Δ final, paired", "Δ final, unpaired", "Δ val, paired", "Δ val, unpaired"]
        by = {(r["group"], r["metric"]): r for _, r in diffs.iterrows()}
    rows = []
    for _, r in table.iterrows():
        loss = plus_minus(r["final_loss_mean"], r["final_loss_std"], digits)
        if r["n_diverged"]:
            loss += f" {DIVERGED_MARK}"
        div = f"{r['n_diverged']}/{r['n_runs']}"
        if r["diverged_at_steps"]:
            div += " (step " + ", ".join(str(x) for x in r["diverged_at_steps"]) + ")"
        seeds = str(r["n"]) if r["n"] == r["n_runs"] else f"{r['n']} of {r['n_runs']}"
        row = [str(r["group"]), seeds, loss, plus_minus(r["val_loss_mean"], r["val_loss_std"], digits), div]
        if extra:
            row.append(f"{r['n_failed']} / {r['n_running']}")
        if diffs is not None:
            for metric in ("final_loss", "val_loss"):
                d = by.get((r["group"], metric))
                row += (
                    ["-", "-"]
                    if d is None
                    else [
                        difference_cell(d["paired_mean"], d["paired_se"], digits, n=d["n_pairs"]),
                        difference_cell(d["unpaired_mean"], d["unpaired_se"], digits),
                    ]
                )
        rows.append(row)
    notes = [
        "final loss: last logged train loss of each finished run (completed or diverged), "
        "mean ± sample std over seeds; val loss likewise."
    ]
    if diffs is not None:
        controls = ", ".join(sorted(set(diffs["control"])))
        notes.append(
            f"Δ: minus the control ({controls}); paired: mean over seeds run in both of the "
            "per-seed difference ± its SE (n = pairs); unpaired: difference of the means ± "
            "sqrt(var/n + var_c/n_c). (k SE) = |Δ| / SE."
        )
    if len(table) and table["n_diverged"].any():
        notes.append(f"{DIVERGED_MARK} at least one seed diverged (its final loss is included).")
    return headers, rows, notes


def metric_table(runs: Runs, pattern: str) -> pd.DataFrame:
    """The last logged finite value of every key matching ``pattern`` per run, summarised per
    group: ``n`` runs, ``mean``, ``std`` (ddof=1), ``min``, ``max``; one row per (group, key)."""
    rows = []
    for key in runs.keys(pattern):
        curve = runs.curve(key).sort_values("step")
        last = curve.groupby("run", observed=True).tail(1)
        for group in runs.groups:
            v = last.loc[last["group"] == group, "value"].to_numpy(dtype=float)
            if len(v):
                rows.append(
                    {
                        "group": group,
                        "key": key,
                        "n": len(v),
                        "mean": float(v.mean()),
                        "std": _std(v),
                        "min": float(v.min()),
                        "max": float(v.max()),
                    }
                )
    return pd.DataFrame(rows, columns=["group", "key", "n", "mean", "std", "min", "max"])


METRIC_HEADERS = ["experiment", "key", "runs", "last value", "range"]


def metric_cells(table: pd.DataFrame, digits: int = 4) -> list[list[str]]:
    """Rows of :func:`metric_table` for :data:`METRIC_HEADERS`: ``mean ± std`` of the last
    values, and their range."""
    return [
        [
            r["group"],
            r["key"],
            str(r["n"]),
            plus_minus(r["mean"], r["std"], digits),
            f"{cell_text(r['min'], f'.{digits}g')} .. {cell_text(r['max'], f'.{digits}g')}",
        ]
        for _, r in table.iterrows()
    ]


def format_metric_table(table: pd.DataFrame, digits: int = 4) -> str:
    return markdown_table(METRIC_HEADERS, metric_cells(table, digits), align=["l", "l", "r", "r", "r"]) + "\n"
