"""What every plot of :mod:`readback.analysis.plots` draws with: one colour per group, the mean over
seeds with its band, the marks of diverged and unfinished runs, legends that count runs, and
panel grids (module docstring of :mod:`readback.analysis.plots`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from readback.analysis.load import Runs, natural_key

BANDS = ("minmax", "std", None)


def colors(runs: Runs) -> dict[str, tuple]:
    """One colour per group, stable across all plots of the same runs."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {g: cmap(i % 10) for i, g in enumerate(runs.groups)}


def save_figure(fig: Figure, path: str | os.PathLike | None) -> Figure:
    """``fig``, saved first as a PNG at ``path`` (its folder made) when there is one."""
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _xcol(curve: pd.DataFrame, x: str) -> str:
    if x not in ("tokens", "step"):
        raise ValueError(f"x must be 'tokens' or 'step', not {x!r}")
    if x == "tokens" and (not len(curve) or curve["tokens"].isna().any()):
        return "step"
    return x


def empty_panel(ax, text: str) -> None:
    """A panel with nothing to draw says why, instead of standing blank."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def aggregate(curve: pd.DataFrame, x: str = "step", by: str = "group") -> pd.DataFrame:
    """Per (group, x): ``mean``, ``std`` (ddof=1), ``min``, ``max`` and ``n`` of ``value`` over the
    runs that logged it (finite values only)."""
    c = curve[np.isfinite(curve["value"].to_numpy(dtype=float))]
    if not len(c):
        return pd.DataFrame(columns=[by, x, "mean", "std", "min", "max", "n"])
    c = c.assign(**{by: c[by].astype(str)})
    g = c.groupby([by, x], sort=True)["value"]
    out = g.agg(["mean", "std", "min", "max", "count"]).rename(columns={"count": "n"}).reset_index()
    return out


def draw_curves(
    ax,
    runs: Runs,
    key: str,
    *,
    x: str,
    band: str | None,
    cmap: dict,
    by: str = "group",
    logy: bool = False,
    marker: str | None = None,
    mark: bool = False,
    label: bool = True,
    linestyle: str = "-",
    linewidth: float = 1.6,
) -> bool:
    """Draw ``key``: one mean line (+ band) per group. Returns whether anything was drawn."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {BANDS}, not {band!r}")
    curve = runs.curve(key)
    if logy:
        curve = curve[curve["value"] > 0]
    if not len(curve):
        return False
    xc = _xcol(curve, x)
    agg = aggregate(curve, xc, by)
    present = set(agg[by])
    order = [g for g in runs.groups if g in present] if by == "group" else sorted(present)
    for group in order:
        a = agg[agg[by] == group]
        color = cmap.get(group)
        ax.plot(
            a[xc],
            a["mean"],
            color=color,
            marker=marker,
            markersize=3 if marker else None,
            linestyle=linestyle,
            linewidth=linewidth,
            label=_label(runs, group) if label else None,
        )
        if band == "minmax" and (a["n"] > 1).any():
            ax.fill_between(a[xc], a["min"], a["max"], color=color, alpha=0.2, linewidth=0)
        elif band == "std" and (a["n"] > 1).any():
            sd = a["std"].fillna(0.0)
            lo = a["mean"] - sd
            if logy:
                lo = lo.where(lo > 0, a["min"])
            ax.fill_between(a[xc], lo, a["mean"] + sd, color=color, alpha=0.2, linewidth=0)
    if mark:
        _mark_runs(ax, runs, curve, xc, cmap)
    if logy:
        ax.set_yscale("log")
        _plain_log_ticks(ax)
    ax.set_xlabel(xc)
    return True


def _plain_log_ticks(ax) -> None:
    """Log-axis tick labels as plain numbers (0.02, 6) rather than 2x10^-2, 6x10^0."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
    ax.yaxis.set_major_formatter(fmt)
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 100:  # few decades: label the minor ticks too, but only 2 and 5
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(fmt)
    else:
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _label(runs: Runs, group: str) -> str:
    s = runs.summary[runs.summary["group"] == group]
    n, d = len(s), int(s["diverged"].sum())
    text = f"{group} (n={n}"
    if d:
        text += f", {d} diverged"
    bad = int(s["status"].isin(["failed", "running"]).sum())
    if bad:
        text += f", {bad} unfinished"
    return text + ")"


def _mark_runs(ax, runs: Runs, curve: pd.DataFrame, xc: str, cmap: dict) -> None:
    s = runs.summary
    for run, r in s.iterrows():
        diverged = bool(r["diverged"])
        unfinished = r["status"] in ("failed", "running")
        if not (diverged or unfinished):
            continue
        c = curve[curve["run"].astype(str) == run].sort_values("step")
        if not len(c):
            continue
        if diverged and not pd.isna(r["diverged_at_step"]):
            at = float(r["diverged_at_step"])
            before = c[c["step"] <= at]
            point = before.iloc[-1] if len(before) else c.iloc[0]
        else:
            point = c.iloc[-1]
        color = cmap.get(r["group"])
        if diverged:
            ax.plot(
                [point[xc]], [point["value"]], marker="x", markersize=9, mew=2, color=color, linestyle="none", zorder=5
            )
        else:
            ax.plot(
                [point[xc]],
                [point["value"]],
                marker="o",
                markersize=7,
                mfc="none",
                mew=1.5,
                color=color,
                linestyle="none",
                zorder=5,
            )


def legend(ax, runs: Runs, marks: bool = False) -> None:
    """The groups' legend; with ``marks`` also what the diverged and unfinished markers mean."""
    handles, labels = ax.get_legend_handles_labels()
    s = runs.summary
    if marks and len(s) and s["diverged"].any():
        handles.append(Line2D([], [], color="0.2", marker="x", mew=2, linestyle="none"))
        labels.append("run marked diverged")
    if marks and len(s) and s["status"].isin(["failed", "running"]).any():
        handles.append(Line2D([], [], color="0.2", marker="o", mfc="none", linestyle="none"))
        labels.append("last point of a failed/running run")
    if handles:
        ax.legend(handles, labels, fontsize=8)


def panel_grid(n: int, ncols: int, w: float = 4.6, h: float = 3.2) -> tuple[Figure, list]:
    """A figure of ``n`` panels of ``w`` x ``h`` inches, ``ncols`` a row; the spare cells hidden."""
    ncols = max(1, min(ncols, n))
    nrows = max(1, -(-n // ncols))
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def layer_sites(runs: Runs, prefix: str, pattern: str) -> list[str]:
    """Names ``n`` of the keys ``prefix + n`` that match ``pattern``, naturally sorted."""
    return sorted({k[len(prefix) :] for k in runs.keys(prefix + pattern)}, key=natural_key)


def short_layer(layer: str) -> str:
    """``layer 3 (layers.3.attn.core)``: the layer's number first, for panel titles."""
    m = re.search(r"layers\.(\d+)", layer)
    return f"layer {m.group(1)} ({layer})" if m else layer
