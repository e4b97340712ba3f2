"""Where the D read's bias sets in, per model shape: each run measured at several stresses K,
seeds pooled, against where O's rms lands on O8's grid.

``python -m readback.cli.bias_onset SWEEP_DIR --out DIR [--measured 'bias/dose/margin*' bias/width]``

Every run folder under ``SWEEP_DIR`` with a ``bias.json`` in a folder matching one of the
``--measured`` globs (relative to the run) gives one point per measurement: its K is the margin
its meter applied at ``attn.core.output``, its figures those of :func:`readback.bias.shapes.run_point`.
Writes ``onset.md`` (per shape and attention layer, one column per K: the read's debiased squared
bias in the layer's QKV gradient x 1e4 ± SE, with ``log2(rms(O) * scale)`` beside it),
``onset.json`` and ``onset.png`` (the debiased squared bias against ``log2(rms(O) * scale)``, a
panel per layer and head dim, a line per T, E4M3's smallest normal drawn). Seeds pool as in
``shapes``: the between-seed SE, or the meter's own for one seed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from readback.bias.attribution import D_READ
from readback.bias.shapes import pool, run_point
from readback.numerics.formats import E4M3

PATTERN = "attn.core.output"
SCALE = 1e4  # the table's unit for the debiased squared bias


def measurements(sweep: Path, globs: list[str]) -> dict[int, list[tuple[Path, str]]]:
    """``{K: [(run folder, measured folder relative to it), ...]}`` for every ``bias.json`` under
    ``sweep`` whose folder matches a glob; K read from the measurement itself."""
    found: dict[int, list[tuple[Path, str]]] = {}
    for glob in globs:
        depth = len(Path(glob).parts)
        for bias in sorted(sweep.rglob(f"{glob}/bias.json")):
            run = bias.parents[depth]
            measured = bias.parent.relative_to(run).as_posix()
            if (run / ".hydra" / "config.yaml").is_file():
                margin = json.loads(bias.read_text()).get("site_margin", {}).get(PATTERN, 0)
                found.setdefault(int(margin), []).append((run, measured))
    return dict(sorted(found.items()))


def onset_rows(sweep: Path, globs: list[str], read: str = D_READ) -> list[dict]:
    """Per (head dim, T, layer): ``{K: pooled figures}`` under ``by_margin``."""
    rows: dict[tuple, dict] = {}
    for margin, found in measurements(sweep, globs).items():
        for row in pool([run_point(run, measured, read) for run, measured in found]):
            key = (row["head_dim"], row["seq_len"], row["layer"])
            rows.setdefault(key, {"head_dim": key[0], "seq_len": key[1], "layer": key[2], "by_margin": {}})
            rows[key]["by_margin"][margin] = row
    return [rows[key] for key in sorted(rows)]


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    value, se, where = row["debiased_sq"], row["debiased_sq_se"], row["log2_rms_scaled"]
    text = f"{value * SCALE:+.1f}" + ("" if math.isnan(se) else f" ± {se * SCALE:.1f}")
    return text + ("" if math.isnan(where) else f" ({where:+.1f})")


def _seeds(by_margin: dict[int, dict]) -> str:
    """The seeds pooled, with the margins each set of seeds was measured at where they differ."""
    margins_of: dict[str, list[str]] = {}
    for k, row in by_margin.items():
        margins_of.setdefault(",".join(map(str, row["seeds"])), []).append(str(k))
    if len(margins_of) == 1:
        return next(iter(margins_of))
    return "; ".join(f"{seeds} (K {','.join(ks)})" for seeds, ks in margins_of.items())


def to_markdown(rows: list[dict], read: str = D_READ) -> str:
    margins = sorted({k for r in rows for k in r["by_margin"]})
    lines = [
        f"`{read.removeprefix('contrib.')}`: the debiased squared bias in each layer's QKV gradient over |G|², "
        f"x 1e4, mean over seeds ± SE, with log2(rms(O) * scale) in brackets; K is O's margin "
        f"({PATTERN}) at measurement time. E4M3's smallest normal sits at {E4M3.min_exponent} on that axis.",
        "",
        "| head dim | T | layer | seeds | " + " | ".join(f"K {k}" for k in margins) + " |",
        "|---|---|---|---|" + "---|" * len(margins),
    ]
    for r in rows:
        cells = [_cell(r["by_margin"].get(k)) for k in margins]
        lines.append(
            f"| {r['head_dim']} | {r['seq_len']} | {r['layer']} | {_seeds(r['by_margin'])} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str | Path | None = None):
    """A row of panels per attention layer, a panel per head dim: the debiased squared bias ± SE
    against log2(rms(O) * scale), a line per T, so that lengths compare at the same place on the
    grid; the dashed line is E4M3's smallest normal."""
    from matplotlib.figure import Figure

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    dims = sorted({r["head_dim"] for r in rows})
    lengths = sorted({r["seq_len"] for r in rows})
    fig = Figure(figsize=(4.2 * len(dims), 3.4 * len(layers)), layout="constrained")
    axes = fig.subplots(len(layers), len(dims), squeeze=False, sharex="all", sharey="row")
    axes[0][0].invert_xaxis()  # shared: coarser rounding to the right in every panel
    for r in rows:
        ax = axes[layers.index(r["layer"])][dims.index(r["head_dim"])]
        points = [r["by_margin"][k] for k in sorted(r["by_margin"])]
        ax.errorbar(
            [p["log2_rms_scaled"] for p in points],
            [p["debiased_sq"] for p in points],
            [0.0 if math.isnan(p["debiased_sq_se"]) else p["debiased_sq_se"] for p in points],
            fmt="o-",
            color=f"C{lengths.index(r['seq_len'])}",
            capsize=2,
            label=f"T {r['seq_len']}",
        )
    for layer, row_axes in zip(layers, axes):
        for head_dim, ax in zip(dims, row_axes):
            ax.axvline(E4M3.min_exponent, color="k", ls="--", lw=0.8)
            ax.axhline(0.0, color="k", lw=0.5)
            ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_xlabel("log2(rms(O) * scale)")
            ax.set_title(f"{layer}, head dim {head_dim}: debiased bias² / |G|²", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


if __name__ == "__main__":  # the old command, which sweeps and pages name: python -m readback.cli.bias_onset
    import runpy

    runpy.run_module("readback.cli.bias_onset", run_name="__main__", alter_sys=True)
