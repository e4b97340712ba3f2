"""The gradient-error plot: the probe's error against the executed forward's gradient, per site."""

from __future__ import annotations

import os
from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from readback.analysis.drawing import colors, draw_curves, empty_panel, layer_sites, panel_grid, save_figure
from readback.analysis.load import Runs


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
        n for n in layer_sites(runs, f"grad_error/{stats[0] if stats else 'rel_err'}/", sites) if n != "total"
    ]
    if len(stats) > 1:
        for st in stats[1:]:
            for n in layer_sites(runs, f"grad_error/{st}/", sites):
                if n not in names:
                    names.append(n)
    fig, axes = panel_grid(len(names) * len(stats), len(stats), w=5.0, h=3.0)
    cmap = colors(runs)
    legend_ax = None
    floor = False
    for i, name in enumerate(names):
        for j, st in enumerate(stats):
            ax = axes[i * len(stats) + j]
            logy = st != "cosine"
            drawn = draw_curves(ax, runs, f"grad_error/{st}/{name}", x=x, band=band, cmap=cmap, logy=logy, marker="o")
            if drawn and st == "bias" and noise_floor:
                floor |= draw_curves(
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
                empty_panel(ax, f"no grad_error/{st}/{name}{hint}")
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
    return save_figure(fig, path)
