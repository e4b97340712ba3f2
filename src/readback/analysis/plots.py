"""Plots of a sweep: loss, gradient error, activation kurtosis, attention row-sum z-scores.

Each function takes a :class:`~readback.analysis.load.Runs`, draws one line per group (the
experiment, split by any config axis that varies within it) as the mean over seeds with a band
(``band="minmax"``: min to max over seeds, ``"std"``: mean ± sample std, ``None``: no band),
returns a ``matplotlib.figure.Figure`` and, given ``path``, saves it as PNG. Figures are made
without ``pyplot`` (no global state, any backend, headless-safe); in a notebook show them with
``IPython.display.display(fig)`` or display the saved PNG. The x axis is ``tokens`` (default)
or ``step``. On the train-loss panel diverged runs are marked ``x`` where they were marked
diverged, failed or running runs with an open circle at their last logged point; every legend
entry counts the group's runs, diverged and unfinished ones.

The loss and any-metric plots and :data:`PLOTS` live here, the gradient-error plot in
:mod:`readback.analysis.grad_error_plots`, the kurtosis, row-sum and mechanism plots in
:mod:`readback.analysis.mechanism_plots`, what they all draw with in
:mod:`readback.analysis.drawing`; every plot function is importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from readback.analysis.drawing import colors, draw_curves, empty_panel, legend, panel_grid, save_figure
from readback.analysis.grad_error_plots import plot_grad_error
from readback.analysis.load import Runs
from readback.analysis.mechanism_plots import plot_attn_rowsum, plot_kurtosis, plot_mechanism


def plot_loss(
    runs: Runs,
    *,
    x: str = "tokens",
    band: str | None = "minmax",
    logy: bool = False,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Train loss (the logged window mean) and, where evaluated, validation loss, per group:
    mean over seeds with a band; diverged runs marked ``x`` at the step they were marked."""
    has_val = bool(len(runs.curve("val_loss")))
    fig, axes = panel_grid(2 if has_val else 1, 2, w=6.0, h=4.0)
    cmap = colors(runs)
    if draw_curves(axes[0], runs, "loss", x=x, band=band, cmap=cmap, logy=logy, mark=True):
        legend(axes[0], runs, marks=True)
    else:
        empty_panel(axes[0], "no loss records")
    axes[0].set_title("train loss")
    axes[0].set_ylabel("loss")
    if has_val:
        draw_curves(axes[1], runs, "val_loss", x=x, band=band, cmap=cmap, logy=logy, marker="o")
        axes[1].set_title("validation loss")
        axes[1].set_ylabel("val loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_metric(
    runs: Runs,
    pattern: str,
    *,
    x: str = "tokens",
    band: str | None = "minmax",
    logy: bool = False,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Any logged key (a glob: one panel per matching key), e.g. ``grad_norm`` or
    ``fp8_saturation/*``: mean over seeds per group with a band."""
    keys = runs.keys(pattern)
    fig, axes = panel_grid(max(1, len(keys)), 3, w=4.8, h=3.3)
    if not keys:
        empty_panel(axes[0], f"no records of {pattern}")
        return save_figure(fig, path)
    cmap = colors(runs)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        draw_curves(ax, runs, key, x=x, band=band, cmap=cmap, logy=logy, marker="o")
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            legend(ax, runs)
    return save_figure(fig, path)


def plot_paired_gap(curve: pd.DataFrame, path: str | os.PathLike | None = None) -> Figure:
    """The paired gap over training (:func:`readback.analysis.paired.paired_curve`): per group,
    the mean over seed pairs of group minus control at each step, ± 1 SE and ± 2 SE bands."""
    fig, axes = panel_grid(1, 1, w=7.0, h=4.0)
    ax = axes[0]
    if not len(curve):
        empty_panel(ax, "no step that a group and its control both logged")
        return save_figure(fig, path)
    for i, (group, rows) in enumerate(curve.groupby("group", sort=False)):
        se = rows["se"].fillna(0.0)
        ax.plot(rows["step"], rows["mean"], "o-", ms=3, color=f"C{i}", label=f"{group} - {rows['control'].iloc[0]}")
        for k, alpha in ((1, 0.25), (2, 0.1)):
            ax.fill_between(rows["step"], rows["mean"] - k * se, rows["mean"] + k * se, color=f"C{i}", alpha=alpha)
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel(f"paired Δ {curve['key'].iloc[0]} (bands: 1 and 2 SE)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


#: name -> plot function, in the order the CLI and the notebook show them.
PLOTS: dict[str, Callable[..., Any]] = {
    "loss": plot_loss,
    "grad_error": plot_grad_error,
    "kurtosis": plot_kurtosis,
    "attn_rowsum": plot_attn_rowsum,
    "mechanism": plot_mechanism,
}


def save_all(
    runs: Runs, out_dir: str | os.PathLike, *, x: str = "tokens", band: str | None = "minmax"
) -> dict[str, Path]:
    """Every plot of :data:`PLOTS` as ``out_dir/<name>.png``; returns name -> path."""
    out = Path(out_dir)
    paths = {}
    for name, fn in PLOTS.items():
        p = out / f"{name}.png"
        fig = fn(runs, x=x, band=band, path=p)
        paths[name] = p
        del fig
    return paths
