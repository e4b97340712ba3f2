"""The final-loss table (the study's headline: reuse_rounded 7.314 vs no_saved_copy 3.256) and a
dependency-free Markdown renderer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from readback.analysis.load import Runs

#: Statuses whose final losses enter the means (a failed or running run stopped part-way).
FINISHED = ("completed", "diverged")
DIVERGED_MARK = "†"

TABLE_COLUMNS = (
    "group", "experiment", "n_runs", "n", "n_completed", "n_diverged", "n_failed", "n_running",
    "final_loss_mean", "final_loss_std", "final_loss_min", "final_loss_max",
    "val_loss_mean", "val_loss_std", "n_val", "diverged_at_steps",
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
        rows.append({
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
        })
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def _finite(col: pd.Series) -> np.ndarray:
    a = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
    return a[np.isfinite(a)]


def _mean(a: np.ndarray) -> float:
    return float(a.mean()) if len(a) else math.nan


def _std(a: np.ndarray) -> float:
    return float(a.std(ddof=1)) if len(a) > 1 else math.nan


def _pm(mean: float, std: float, digits: int) -> str:
    if not math.isfinite(mean):
        return "-"
    if not math.isfinite(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def format_final_loss_table(table: pd.DataFrame, digits: int = 3) -> str:
    """The table of :func:`final_loss_table` as Markdown: group, seeds, final loss and val loss
    (mean ± std), diverged (count of runs; the final loss marked † when any diverged), and
    failed/running counts when there are any. A footnote explains the marks."""
    headers = ["experiment", "seeds", "final loss", "val loss", "diverged"]
    extra = bool(len(table)) and bool((table["n_failed"] + table["n_running"]).sum())
    if extra:
        headers.append("failed / running")
    rows = []
    for _, r in table.iterrows():
        loss = _pm(r["final_loss_mean"], r["final_loss_std"], digits)
        if r["n_diverged"]:
            loss += f" {DIVERGED_MARK}"
        div = f"{r['n_diverged']}/{r['n_runs']}"
        if r["diverged_at_steps"]:
            div += " (step " + ", ".join(str(x) for x in r["diverged_at_steps"]) + ")"
        seeds = str(r["n"]) if r["n"] == r["n_runs"] else f"{r['n']} of {r['n_runs']}"
        row = [str(r["group"]), seeds, loss, _pm(r["val_loss_mean"], r["val_loss_std"], digits), div]
        if extra:
            row.append(f"{r['n_failed']} / {r['n_running']}")
        rows.append(row)
    text = markdown_table(headers, rows, align=["l", "r", "r", "r", "r", "r"][: len(headers)])
    notes = ["final loss: last logged train loss of each finished run (completed or diverged), "
             "mean ± sample std over seeds; val loss likewise."]
    if len(table) and table["n_diverged"].any():
        notes.append(f"{DIVERGED_MARK} at least one seed diverged (its final loss is included).")
    return text + "\n\n" + "\n".join(notes) + "\n"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured Markdown table (no third-party formatter). ``align``: ``l``/``r``/``c``
    per column. ``|`` in cells is escaped."""
    cells = [[_cell(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    n = len(headers)
    if any(len(r) != n for r in cells):
        raise ValueError("every row needs one cell per header")
    align = list(align or ["l"] * n)
    width = [max(3, *(len(r[i]) for r in cells)) for i in range(n)]
    rule = {"l": lambda w: ":" + "-" * (w - 1), "r": lambda w: "-" * (w - 1) + ":",
            "c": lambda w: ":" + "-" * (w - 2) + ":"}
    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(width[i]) if align[i] == "r" else c.ljust(width[i])
                                 for i, c in enumerate(r)) + " |"
    out = [line(cells[0]), "| " + " | ".join(rule[a](width[i]) for i, a in enumerate(align)) + " |"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")
