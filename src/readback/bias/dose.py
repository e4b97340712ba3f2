"""Dose and response: the bias meter at one checkpoint under a range of site margins K (the
stress, ``scale / 2**K`` at the swept pattern), combined in ``dose.json`` and drawn in ``dose.png``.

``dose.json``: ``pattern``, ``margins``, the meter's ``policy`` and ``batches``, the run's
``checkpoint_step`` and ``run_dir``, and one point per K: ``margin``, ``dir`` (its ``bias.*``),
``site_margin`` (every margin applied), the ``contrib.*`` statistics (``stats[read][group][stat]``)
and ``o_rounding`` (O's rounding per attention layer)."""

from __future__ import annotations

import math
from pathlib import Path

from readback.bias.meter import BiasResult
from readback.bias.report import write_json

D_READ, FRESH = "contrib.exact_read.attention.D", "contrib.fresh_reround"
COLOURS = {D_READ: "tab:red", FRESH: "tab:blue"}


def combine(pattern: str, points: list[tuple[int, BiasResult, str]]) -> dict:
    """The dose of ``points`` (margin K, the meter's result under it, its directory), in order of K."""
    points = sorted(points, key=lambda point: point[0])
    first = points[0][1]
    return {
        "pattern": pattern,
        "margins": [k for k, _, _ in points],
        "policy": first.policy,
        "batches": first.batches,
        **{key: first.info[key] for key in ("checkpoint_step", "run_dir") if key in first.info},
        "points": [
            {
                "margin": k,
                "dir": directory,
                "site_margin": result.site_margin,
                "stats": {name: s for name, s in result.stats.items() if name.startswith("contrib.")},
                "o_rounding": result.o_rounding,
            }
            for k, result, directory in points
        ],
    }


def write_dose(dose: dict, out: str | Path) -> dict[str, Path]:
    """``dose.json`` and ``dose.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "dose.json", "plot": out / "dose.png"}
    write_json(paths["json"], dose)
    plot_dose(dose, paths["plot"])
    return paths


def rows_of(dose: dict) -> list[tuple[str, str | None]]:
    """``(gradient group, attention layer)`` per plot row: ``total`` (every layer's O), then each
    attention layer with its first parameter group (FOG's QKV, where its D term acts first)."""
    groups = list(next(iter(dose["points"][0]["stats"].values()), {}))
    rows: list[tuple[str, str | None]] = [("total", None)]
    for layer in dose["points"][0]["o_rounding"]:
        mine = [g for g in groups if g.startswith(layer + ".")]
        if mine:
            rows.append((mine[0], layer))
    return rows


def plot_dose(dose: dict, path: str | Path | None = None):
    """Against K, one row per :func:`rows_of` row: each read's bias (solid) and floor (dotted),
    its projection ± SE, its debiased squared bias ± SE (dotted: the floor squared), and O's
    underflow and relative rounding error. The middle two are linear within the floor."""
    from matplotlib.figure import Figure

    margins = dose["margins"]
    reads = list(dose["points"][0]["stats"])
    rows = rows_of(dose)
    fig = Figure(figsize=(17, 3.2 * len(rows)))
    axes = fig.subplots(len(rows), 4, squeeze=False)
    for (group, layer), (norm_ax, projection_ax, squared_ax, o_ax) in zip(rows, axes):

        def series(read: str, stat: str, group: str = group) -> list[float]:
            return [json_number(point["stats"][read][group][stat]) for point in dose["points"]]

        for i, read in enumerate(reads):
            colour = COLOURS.get(read, f"C{2 + i % 8}")
            width = 2.2 if read == D_READ else 1.0
            label = read.removeprefix("contrib.")
            norm_ax.plot(margins, series(read, "bias"), "o-", color=colour, lw=width, label=label)
            norm_ax.plot(margins, series(read, "floor"), ":", color=colour, lw=width)
            for ax, stat in ((projection_ax, "projection"), (squared_ax, "debiased_sq")):
                errors = _errors(series(read, f"{stat}_se"))
                ax.errorbar(margins, series(read, stat), errors, fmt="o-", color=colour, lw=width, capsize=2)
            squared_ax.plot(margins, [f * f for f in series(read, "floor")], ":", color=colour, lw=width)
        floors = [f for read in reads for f in series(read, "floor") if f > 0]
        noise = min(floors) if floors else 1e-6
        for ax, threshold in ((projection_ax, noise), (squared_ax, noise**2)):
            ax.axhline(0.0, color="k", lw=0.5)
            ax.set_yscale("symlog", linthresh=threshold)
        norm_ax.set_yscale("log")
        norm_ax.set_ylabel(group)
        for layer_name in [layer] if layer else list(dose["points"][0]["o_rounding"]):
            o = [point["o_rounding"].get(layer_name, {}) for point in dose["points"]]
            o_ax.plot(margins, [json_number(x.get("underflow")) for x in o], "s-", label=f"{layer_name} underflow")
            o_ax.plot(margins, [json_number(x.get("rel_err")) for x in o], "^--", label=f"{layer_name} rel. error")
        o_ax.set_yscale("log")
        o_ax.legend(fontsize=6)
    for ax, title in zip(
        axes[0],
        (
            "|mean error| / |G| (dotted: floor)",
            "projection -mean(e).G / |G|² ± SE",
            "debiased |E e|² / |G|² ± SE (dotted: floor²)",
            "O: underflow fraction, |O - O8| / |O|",
        ),
    ):
        ax.set_title(title, fontsize=9)
    axes[0][0].legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel(f"margin K at {dose['pattern']} (scale / 2^K)")
    fig.suptitle(f"dose and response, policy {dose['policy']}, {dose['batches']} batches")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def json_number(value: float | None) -> float:
    """A JSON null (a statistic the batches did not allow) as NaN, which a plot leaves out."""
    return math.nan if value is None else float(value)


def _errors(se: list[float]) -> list[float]:
    return [0.0 if math.isnan(s) else s for s in se]
