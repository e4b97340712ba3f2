"""The reuse D read's bias against the model's shape: head dimension and sequence length.

``python -m readback.cli.bias_shapes SWEEP_DIR --out DIR [--measured bias/width] [--read READ] [--seeds 2,3]``

Finds every run under ``SWEEP_DIR`` that the bias meter measured (``RUN/<measured>/bias.json``),
takes its shape from ``RUN/.hydra/config.yaml`` (head dim ``model.d_model / model.n_heads``,
``model.seq_len``) and writes ``shapes.md``, ``shapes.json`` and ``shapes.png``: per shape and
attention layer, the read's bias in that layer's QKV gradient (``sqrt(debiased bias²)``, the
debiased squared bias itself, which a null's seeds average to about 0, the projection, the bias
and its floor, over |G|), O's rounding in the meter's forwards (underflow,
``|O - O8| / |O|``, ``max|O| / rms(O)``) and the training's last ``attn_rowsum/z``; then the length contrasts,
each length's debiased squared bias minus the shortest length's at the same head dim and layer.

Seeds are pooled: each figure is the mean over the shape's seeds, its SE the between-seed one
(``sd / sqrt(n)``: it holds the meter's noise and the spread of the trained states), or the
meter's own SE where a shape has one seed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from readback.bias.attribution import D_READ
from readback.bias.dose import json_number
from readback.jsonl import read_jsonl
from readback.numerics.formats import E4M3

STATS = (
    "share",
    "debiased_sq",
    "projection",
    "bias",
    "floor",
    "underflow",
    "rel_err",
    "amax_to_rms",
    "log2_rms_scaled",
    "rowsum_z",
)


def measured_runs(sweep: Path, measured: str = "bias/width") -> list[Path]:
    """The run folders under ``sweep`` with a ``<measured>/bias.json``."""
    parts = Path(measured).parts
    return sorted(p.parents[len(parts)] for p in sweep.rglob("bias.json") if p.parent.parts[-len(parts) :] == parts)


def run_point(run: Path, measured: str = "bias/width", read: str = D_READ) -> dict:
    """One measured run: its shape, seed, and per attention layer the :data:`STATS` (each with
    ``<stat>_se`` where the meter gives one)."""
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    bias = json.loads((run / measured / "bias.json").read_text())
    rowsum = _last_rowsum_z(run / "metrics.jsonl")
    layers = {}
    for layer, o in bias["o_rounding"].items():
        s = bias["stats"][read][f"{layer}.qkv"]
        sq, sq_se = json_number(s["debiased_sq"]), json_number(s["debiased_sq_se"])  # (an SE needs 4 batches)
        layers[layer] = {
            "share": math.sqrt(max(sq, 0.0)) if not math.isnan(sq) else math.nan,
            "share_se": sq_se / (2 * math.sqrt(sq)) if sq > 0 else math.nan,  # delta method
            "debiased_sq": sq,  # unclipped: a null's seeds average to about 0, with a fair SE
            "debiased_sq_se": sq_se,
            **{k: json_number(s[k]) for k in ("projection", "projection_se", "bias", "bias_se", "floor")},
            **{k: json_number(o.get(k)) for k in ("underflow", "rel_err", "amax_to_rms", "log2_rms_scaled")},
            "rowsum_z": rowsum.get(f"{layer}.core", math.nan),
        }
    return {
        "run_dir": str(run),
        "head_dim": int(cfg.model.d_model) // int(cfg.model.n_heads),
        "seq_len": int(cfg.model.seq_len),
        "seed": int(cfg.seed),
        "policy": bias["policy"],
        "batches": bias["batches"],
        "site_margin": bias.get("site_margin", {}),
        "layers": layers,
    }


def _last_rowsum_z(metrics: Path) -> dict[str, float]:
    """``{attention op: z}`` from the last record of ``metrics`` that has ``attn_rowsum/z/...``."""
    last: dict[str, float] = {}
    for record in read_jsonl(metrics):
        found = {k.removeprefix("attn_rowsum/z/"): v for k, v in record.items() if k.startswith("attn_rowsum/z/")}
        last = found or last
    return last


def pool(points: list[dict]) -> list[dict]:
    """Per (head dim, T, layer), in that order: each stat's mean over seeds and its SE."""
    by_shape: dict[tuple, list[dict]] = defaultdict(list)
    for p in points:
        for layer, stats in p["layers"].items():
            by_shape[(p["head_dim"], p["seq_len"], layer)].append({**stats, "seed": p["seed"]})
    rows = []
    for (head_dim, seq_len, layer), seeds in sorted(by_shape.items()):
        row = {"head_dim": head_dim, "seq_len": seq_len, "layer": layer, "seeds": sorted(s["seed"] for s in seeds)}
        for stat in STATS:
            values = [s[stat] for s in seeds]
            row[stat] = sum(values) / len(values)
            if len(values) > 1:
                spread = sum((v - row[stat]) ** 2 for v in values) / (len(values) - 1)
                row[f"{stat}_se"] = math.sqrt(spread / len(values))
            else:
                row[f"{stat}_se"] = seeds[0].get(f"{stat}_se", math.nan)
        rows.append(row)
    return rows


def length_contrasts(rows: list[dict]) -> list[dict]:
    """Per layer, each longer T against the shortest T: at every head dim measured at both, the
    difference of the pooled debiased squared bias (longer minus shorter, SEs added in
    quadrature) and the ratio of ``sqrt(debiased²)``; then ``head_dim`` ``"all"``, the mean
    difference over those head dims, whose SE is the root of the summed squares over their count.
    ``dof``: Welch-Satterthwaite's degrees of freedom for ``z`` (NaN where a shape has one seed,
    whose SE is the meter's and leaves out the spread between trained states)."""
    cell = {(r["layer"], r["head_dim"], r["seq_len"]): r for r in rows}
    contrasts = []
    for layer in dict.fromkeys(r["layer"] for r in rows):
        lengths = sorted({t for (lay, _, t) in cell if lay == layer})
        for seq_len in lengths[1:]:
            pairs = [
                (cell[(layer, d, lengths[0])], cell[(layer, d, seq_len)])
                for d in sorted({d for (lay, d, _) in cell if lay == layer})
                if (layer, d, lengths[0]) in cell and (layer, d, seq_len) in cell
            ]
            mine = [
                {
                    "layer": layer,
                    "head_dim": short["head_dim"],
                    "seq_len": seq_len,
                    "against": lengths[0],
                    "difference": long["debiased_sq"] - short["debiased_sq"],
                    "difference_se": math.hypot(long["debiased_sq_se"], short["debiased_sq_se"]),
                    "share_ratio": long["share"] / short["share"] if short["share"] > 0 else math.nan,
                    "dof": _welch_dof([short, long]),
                }
                for short, long in pairs
            ]
            if len(mine) > 1:
                mine.append(
                    {
                        **mine[0],
                        "head_dim": "all",
                        "difference": sum(c["difference"] for c in mine) / len(mine),
                        "difference_se": math.sqrt(sum(c["difference_se"] ** 2 for c in mine)) / len(mine),
                        "share_ratio": math.nan,
                        "dof": _welch_dof([row for pair in pairs for row in pair]),
                    }
                )
            contrasts += mine
    for c in contrasts:
        c["z"] = c["difference"] / c["difference_se"] if c["difference_se"] > 0 else math.nan
    return contrasts


def _welch_dof(rows: list[dict], stat: str = "debiased_sq") -> float:
    """Welch-Satterthwaite degrees of freedom of a sum of the rows' means (each SE between seeds)."""
    if any(len(r["seeds"]) < 2 for r in rows):
        return math.nan
    variances = [(r[f"{stat}_se"] ** 2, len(r["seeds"]) - 1) for r in rows]
    denominator = sum(v * v / n for v, n in variances)
    return sum(v for v, _ in variances) ** 2 / denominator if denominator > 0 else math.nan


def _pm(row: dict, stat: str, digits: int = 3) -> str:
    value, se = row[stat], row.get(f"{stat}_se", math.nan)
    if math.isnan(value):
        return "n/a"
    return f"{value:.{digits}g}" + ("" if math.isnan(se) else f" ± {se:.2g}")


def to_markdown(rows: list[dict], points: list[dict], read: str = D_READ) -> str:
    first = points[0]
    margins = ", ".join(f"{p}={k}" for p, k in first["site_margin"].items()) or "none"
    lines = [
        f"`{read.removeprefix('contrib.')}` in each layer's QKV gradient, over |G|; meter policy "
        f"{first['policy']}, {first['batches']} batches, site margins {margins}. Mean over seeds ± SE.",
        "",
        "| head dim | T | layer | seeds | sqrt(debiased²) | debiased² | projection | bias | floor | O underflow | "
        "O rel. rounding error | O amax / rms | O log2(rms * scale) | attn_rowsum z |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['head_dim']} | {r['seq_len']} | {r['layer']} | {','.join(map(str, r['seeds']))} | "
            + " | ".join(_pm(r, s, 4 if s == "underflow" else 3) for s in STATS)
            + " |"
        )
    contrasts = length_contrasts(rows)
    if contrasts:
        lines += [
            "",
            "Length: the debiased squared bias at each T minus the shortest T's, same head dim and layer "
            "(SEs in quadrature; `all`: the mean over head dims; dof: Welch's, for z as a t statistic), "
            "and the ratio of sqrt(debiased²).",
            "",
            "| layer | head dim | T | against T | difference of debiased² | z | dof | ratio of sqrt(debiased²) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in contrasts:
            ratio = "" if math.isnan(c["share_ratio"]) else f"{c['share_ratio']:.2g}"
            lines.append(
                f"| {c['layer']} | {c['head_dim']} | {c['seq_len']} | {c['against']} | "
                f"{_pm(c, 'difference', 2)} | {c['z']:+.1f} | {c['dof']:.1f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str | Path | None = None):
    """One row of panels per attention layer, against head dim (one line per T): the read's
    sqrt(debiased²) and floor, its projection, O's relative rounding error and underflow, its
    amax-to-rms ratio and where its rms lands on O8's grid (dashed: E4M3's smallest normal)."""
    from matplotlib.figure import Figure

    layers = list(dict.fromkeys(r["layer"] for r in rows))
    lengths = sorted({r["seq_len"] for r in rows})
    panels = [
        ("share", "sqrt(debiased bias²) / |G| (dotted: floor)"),
        ("projection", "projection on -G / |G|²"),
        ("rel_err", "|O - O8| / |O| (dashed: underflow)"),
        ("amax_to_rms", "max|O| / rms(O)"),
        ("log2_rms_scaled", "log2(rms(O) * scale)"),
    ]
    fig = Figure(figsize=(4.4 * len(panels), 3.2 * len(layers)), layout="constrained")
    axes = fig.subplots(len(layers), len(panels), squeeze=False)
    for layer, row_axes in zip(layers, axes):
        for c, seq_len in enumerate(lengths):
            mine = sorted(
                (r for r in rows if r["layer"] == layer and r["seq_len"] == seq_len), key=lambda r: r["head_dim"]
            )
            dims = [r["head_dim"] for r in mine]
            for ax, (stat, title) in zip(row_axes, panels):
                ax.errorbar(
                    dims,
                    [r[stat] for r in mine],
                    [r[f"{stat}_se"] for r in mine],
                    fmt="o-",
                    color=f"C{c}",
                    capsize=2,
                    label=f"T {seq_len}",
                )
                extra = {"share": "floor", "rel_err": "underflow"}.get(stat)
                if extra:
                    ax.plot(dims, [r[extra] for r in mine], ":" if stat == "share" else "--", color=f"C{c}")
                if stat == "log2_rms_scaled":
                    ax.axhline(E4M3.min_exponent, color="k", ls="--", lw=0.8)
                ax.set_xscale("log", base=2)
                ax.set_title(f"{layer}: {title}", fontsize=9)
                ax.set_xlabel("head dim")
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


if __name__ == "__main__":  # the old command, which sweeps and pages name: python -m readback.cli.bias_shapes
    import runpy

    runpy.run_module("readback.cli.bias_shapes", run_name="__main__", alter_sys=True)
