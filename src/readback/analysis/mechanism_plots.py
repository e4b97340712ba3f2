"""The mechanism plots: activation kurtosis, the attention row-sum z-scores (the D-term
diagnostic) and, per attention layer, what drives a D-term divergence."""

from __future__ import annotations

import os

from matplotlib.figure import Figure

from readback.analysis.drawing import (
    colors,
    draw_curves,
    empty_panel,
    layer_sites,
    legend,
    panel_grid,
    save_figure,
    short_layer,
)
from readback.analysis.load import Runs


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
    fig, axes = panel_grid(max(1, len(keys)), 2, w=5.5, h=3.6)
    if not keys:
        empty_panel(axes[0], "no kurtosis records")
        return save_figure(fig, path)
    cmap = colors(runs)
    for i, (ax, key) in enumerate(zip(axes, keys)):
        draw_curves(ax, runs, key, x=x, band=band, cmap=cmap, logy=logy)
        ax.axhline(3.0, color="0.5", linestyle="--", linewidth=0.8)
        ax.set_title(key, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if i == 0:
            legend(ax, runs)
    return save_figure(fig, path)


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
    layers = layer_sites(runs, f"attn_rowsum/{stat}/", "*")
    fig, axes = panel_grid(max(1, len(layers)), 4, w=4.6, h=3.2)
    if not layers:
        empty_panel(axes[0], f"no attn_rowsum/{stat} records")
        return save_figure(fig, path)
    cmap = colors(runs)
    for i, (ax, layer) in enumerate(zip(axes, layers)):
        draw_curves(ax, runs, f"attn_rowsum/{stat}/{layer}", x=x, band=band, cmap=cmap, marker="o")
        if stat == "z":
            z = runs.curve(f"attn_rowsum/{stat}/{layer}")["value"].abs()
            if len(z) and z.max() > 3 * linthresh:
                ax.set_yscale("symlog", linthresh=linthresh)
            for y in (-2.0, 2.0):
                ax.axhline(y, color="0.5", linestyle="--", linewidth=0.8)
        ax.axhline(0.0, color="0.3", linewidth=0.6)
        ax.set_title(f"{stat} / {short_layer(layer)}", fontsize=10)
        ax.grid(alpha=0.3)
        if i == 0:
            legend(ax, runs)
    return save_figure(fig, path)


MECHANISM = (
    ("attn_logit/max/", "max logit"),
    ("attn_entropy/mean/", "attention entropy"),
    ("attn_dq_dterm_cos/mean/", "cos(dQ D-term, mean key)"),
    ("fp8_underflow/", "O underflow fraction"),
    ("attn_out_rel_err/mean/", "|O - O8| / |O|"),
    ("attn_out_amax_to_rms/mean/", "max|O| / rms(O)"),
    ("attn_out_history_amax_to_rms/mean/", "history amax / rms(O)"),
    ("attn_out_log2_rms_scaled/mean/", "log2(rms(O) * scale)"),
)
COLUMNS = 4  # a layer's panels take two rows of the grid
E4M3_MIN_NORMAL_EXPONENT = -6  # below it on the grid, most of O8 is subnormal


def plot_mechanism(
    runs: Runs, *, x: str = "tokens", band: str | None = "minmax", path: str | os.PathLike | None = None
) -> Figure:
    """Per attention layer (two rows of four): max logit, attention entropy, the cosine between
    dQ's D-term component and the mean attended key, the fraction of O that FP8 flushes to zero
    or subnormals, O8's relative rounding error, O's amax-to-rms ratio, the amax-to-rms ratio of
    the amax history the delayed scale came from (a held spike shows here) and where O's rms
    lands on O8's grid (dashed: E4M3's smallest normal; the D read's bias appears below it); last panel:
    O's kurtosis. A divergence driven by the D-term shows as the cosine leaving 0 with one sign
    while the logits grow."""
    layers = layer_sites(runs, "attn_logit/max/", "*")
    per_layer = -(-len(MECHANISM) // COLUMNS) * COLUMNS
    fig, axes = panel_grid(per_layer * len(layers) + 1, COLUMNS, w=4.2, h=3.0)
    cmap = colors(runs)
    for row, layer in enumerate(layers):
        for ax in axes[per_layer * row + len(MECHANISM) : per_layer * (row + 1)]:
            ax.set_visible(False)  # the rest of the layer's last row
        for col, (prefix, title) in enumerate(MECHANISM):
            ax = axes[per_layer * row + col]
            key = f"{prefix}{layer}.output" if prefix == "fp8_underflow/" else f"{prefix}{layer}"
            if not draw_curves(ax, runs, key, x=x, band=band, cmap=cmap):
                empty_panel(ax, f"no {key} records")
            elif prefix.startswith("attn_out_log2_rms_scaled"):
                ax.axhline(E4M3_MIN_NORMAL_EXPONENT, color="k", ls="--", lw=0.8)
            ax.set_title(f"{title} / {short_layer(layer)}", fontsize=9)
            ax.grid(alpha=0.3)
    ax = axes[per_layer * len(layers)]
    if not draw_curves(ax, runs, "kurtosis/attn_out_max", x=x, band=band, cmap=cmap, logy=True):
        empty_panel(ax, "no kurtosis/attn_out_max records")
    ax.set_title("O kurtosis (max over layers)", fontsize=9)
    legend(axes[0], runs)
    return save_figure(fig, path)
