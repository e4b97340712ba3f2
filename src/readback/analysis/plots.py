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
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def _save(fig: Figure, path: str | os.PathLike | None) -> Figure:
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


def _empty(ax, text: str) -> None:
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


def _draw(
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


def _legend(ax, runs: Runs, marks: bool = False) -> None:
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


def _grid(n: int, ncols: int, w: float = 4.6, h: float = 3.2) -> tuple[Figure, list]:
    ncols = max(1, min(ncols, n))
    nrows = max(1, -(-n // ncols))
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


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
    fig, axes = _grid(2 if has_val else 1, 2, w=6.0, h=4.0)
    cmap = colors(runs)
    if _draw(axes[0], runs, "loss", x=x, band=band, cmap=cmap, logy=logy, mark=True):
        _legend(axes[0], runs, marks=True)
    else:
        _empty(axes[0], "no loss records")
    axes[0].set_title("train loss")
    axes[0].set_ylabel("loss")
    if has_val:
        _draw(axes[1], runs, "val_loss", x=x, band=band, cmap=cmap, logy=logy, marker="o")
        axes[1].set_title("validation loss")
        axes[1].set_ylabel("val loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _layer_sites(runs: Runs, prefix: str, pattern: str) -> list[str]:
    """Names ``n`` of the keys ``prefix + n`` that match ``pattern``, naturally sorted."""
    return sorted({k[len(prefix) :] for k in runs.keys(prefix + pattern)}, key=natural_key)


def plot_grad_error(
    runs: Runs,
    *,
    stats: Sequence[str] = ("rel_err", "bias"),
    sites: str = "*.attn.core.dq",
    x: str = "tokens",
    band: str | None = "minmax",
    noise_floor: bool = True,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Gradient error against the executed forward's gradient (probe steps only), log scale.

    Rows: ``total`` (every probed gradient concatenated), then each site matching ``sites``
    (default the attention query gradient of every layer, where a D-term error shows first);
    columns: ``stats`` (``rel_err``: |g - g_ref| / |g_ref| averaged over repeats; ``bias``:
    |mean error| / |mean reference| over ``probe.repeats`` independent roundings, only with
    repeats > 1; also ``cosine``, ``noise``). With ``noise_floor`` the bias panels also show,
    dotted, the bias's standard error (``grad_error_se/bias``): a bias at that level is what
    pure noise gives; one above it is systematic.
    """
    stats = list(stats)
    names = ["total"] + [
        n for n in _layer_sites(runs, f"grad_error/{stats[0] if stats else 'rel_err'}/", sites) if n != "total"
    ]
    if len(stats) > 1:
        for st in stats[1:]:
            for n in _layer_sites(runs, f"grad_error/{st}/", sites):
                if n not in names:
                    names.append(n)
    fig, axes = _grid(len(names) * len(stats), len(stats), w=5.0, h=3.0)
    cmap = colors(runs)
    legend_ax = None
    floor = False
    for i, name in enumerate(names):
        for j, st in enumerate(stats):
            ax = axes[i * len(stats) + j]
            logy = st != "cosine"
            drawn = _draw(ax, runs, f"grad_error/{st}/{name}", x=x, band=band, cmap=cmap, logy=logy, marker="o")
            if drawn and st == "bias" and noise_floor:
                floor |= _draw(
                    ax,
                    runs,
                    f"grad_error_se/bias/{name}",
                    x=x,
                    band=None,
                    cmap=cmap,
                    logy=True,
                    label=False,
                    linestyle=":",
                    linewidth=1.0,
                )
            if not drawn:
                hint = " (needs probe.repeats > 1)" if st in ("bias", "noise") else " (probe.every = 0?)"
                _empty(ax, f"no grad_error/{st}/{name}{hint}")
            ax.set_title(f"{st} / {name}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
            if drawn and legend_ax is None:
                legend_ax = ax
    if legend_ax is not None:
        h, lab = legend_ax.get_legend_handles_labels()
        if floor:
            h.append(Line2D([], [], color="0.3", linestyle=":"))
            lab.append("bias noise floor (1 se)")
        legend_ax.legend(h, lab, fontsize=7)
    return _save(fig, path)


def plot_kurtosis(
    runs: Runs,
    *,
    x: str = "tokens",
    band: str | None = "minmax",
    logy: bool = True,
    path: str | os.PathLike | None = None,
) -> Figure:
    """Activation kurtosis (``kurtosis/*``: the largest over layers of the attention output and of
    the FFN input; 3 for a Gaussian): outliers grow before FP8 training breaks."""
    keys = runs.keys("kurtosis/*")
    fig, axes = _grid(max(1, len(keys)), 2, w=5.5, h=3.6)
    if not keys:
        _empty(axes[0], "no kurtosis records")
        return _save(fig, path)
    cmap = colors(runs)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        _draw(ax, runs, key, x=x, band=band, cmap=cmap, logy=logy)
        ax.axhline(3.0, color="0.5", linestyle="--", linewidth=0.8)
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if i == 0:
            _legend(ax, runs)
    return _save(fig, path)


def plot_attn_rowsum(
    runs: Runs,
    *,
    stat: str = "z",
    x: str = "tokens",
    band: str | None = "minmax",
    linthresh: float = 10.0,
    path: str | os.PathLike | None = None,
) -> Figure:
    """The D-term diagnostic per attention layer: ``attn_rowsum/z/<layer>``, the z-score of the mean
    row sum of ``dS`` over a logging window (0 in expectation under the exact rule; |z| > 2
    again and again, with one sign, means a systematic D-term error). Dashed lines at ±2. When
    some |z| exceeds ``3 * linthresh`` the y axis is symmetric-log (linear within
    ``±linthresh``). ``stat="mean"`` plots the mean row sum itself."""
    layers = _layer_sites(runs, f"attn_rowsum/{stat}/", "*")
    fig, axes = _grid(max(1, len(layers)), 4, w=4.6, h=3.2)
    if not layers:
        _empty(axes[0], f"no attn_rowsum/{stat} records")
        return _save(fig, path)
    cmap = colors(runs)
    for i, (ax, layer) in enumerate(zip(axes, layers)):
        _draw(ax, runs, f"attn_rowsum/{stat}/{layer}", x=x, band=band, cmap=cmap, marker="o")
        if stat == "z":
            z = runs.curve(f"attn_rowsum/{stat}/{layer}")["value"].abs()
            if len(z) and z.max() > 3 * linthresh:
                ax.set_yscale("symlog", linthresh=linthresh)
            for y in (-2.0, 2.0):
                ax.axhline(y, color="0.5", linestyle="--", linewidth=0.8)
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ax.set_title(f"{stat} / {_short(layer)}", fontsize=10)
        ax.grid(alpha=0.3)
        if i == 0:
            _legend(ax, runs)
    return _save(fig, path)


MECHANISM = (
    ("attn_logit/max/", "max logit"),
    ("attn_entropy/mean/", "attention entropy"),
    ("attn_dq_dterm_cos/mean/", "cos(dQ D-term, mean key)"),
    ("fp8_underflow/", "O underflow fraction"),
)


def plot_mechanism(
    runs: Runs, *, x: str = "tokens", band: str | None = "minmax", path: str | os.PathLike | None = None
) -> Figure:
    """Per attention layer (one row each): max logit, attention entropy, the cosine between dQ's
    D-term component and the mean attended key, and the fraction of O that FP8 flushes to zero
    or subnormals; last panel: O's kurtosis. A divergence driven by the D-term shows as the
    cosine leaving 0 with one sign while the logits grow."""
    layers = _layer_sites(runs, "attn_logit/max/", "*")
    fig, axes = _grid(4 * len(layers) + 1, 4, w=4.2, h=3.0)
    cmap = colors(runs)
    for row, layer in enumerate(layers):
        for col, (prefix, title) in enumerate(MECHANISM):
            ax = axes[4 * row + col]
            key = f"{prefix}{layer}.output" if prefix == "fp8_underflow/" else f"{prefix}{layer}"
            if not _draw(ax, runs, key, x=x, band=band, cmap=cmap):
                _empty(ax, f"no {key} records")
            ax.set_title(f"{title} / {_short(layer)}", fontsize=9)
            ax.grid(alpha=0.3)
    ax = axes[4 * len(layers)]
    if not _draw(ax, runs, "kurtosis/attn_out_max", x=x, band=band, cmap=cmap, logy=True):
        _empty(ax, "no kurtosis/attn_out_max records")
    ax.set_title("O kurtosis (max over layers)", fontsize=9)
    _legend(axes[0], runs)
    return _save(fig, path)


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
    fig, axes = _grid(max(1, len(keys)), 3, w=4.8, h=3.3)
    if not keys:
        _empty(axes[0], f"no records of {pattern}")
        return _save(fig, path)
    cmap = colors(runs)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        _draw(ax, runs, key, x=x, band=band, cmap=cmap, logy=logy, marker="o")
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            _legend(ax, runs)
    return _save(fig, path)


def _short(layer: str) -> str:
    m = re.search(r"layers\.(\d+)", layer)
    return f"layer {m.group(1)} ({layer})" if m else layer


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
