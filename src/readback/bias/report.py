"""The bias meter's outputs: JSON, a Markdown table and a plot."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from readback.bias.meter import BiasResult


def _pm(value: float, se: float, digits: int = 4) -> str:
    return f"{value:.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")


def to_markdown(result: BiasResult, groups: list[str] | None = None) -> str:
    """One row per (variant, group): relative bias ± SE and its floor, cosine with the exact
    gradient ± SE, the projection ± SE, the debiased squared bias ± SE, the per-batch relative
    error; then O's rounding per attention layer. ``groups`` defaults to every group."""
    groups = groups or result.groups
    margins = ", ".join(f"{p}={k}" for p, k in result.site_margin.items()) or "none"
    lines = [
        f"Bias meter: policy {result.policy}, {result.batches} batches, "
        f"{result.seconds_per_batch:.2f} s a batch = {result.steps_per_batch:.1f} plain training steps; "
        f"site margins {margins}.",
        "",
        "| variant | group | bias / mean exact gradient | floor | cosine with it | projection "
        "| debiased bias² | rel. error per batch | its largest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, stats in result.stats.items():
        for group in groups:
            s = stats[group]
            lines.append(
                f"| {variant} | {group} | {_pm(s['bias'], s['bias_se'])} | {s['floor']:.4f} | "
                f"{_pm(s['cosine'], s['cosine_se'], 3)} | {_pm(s['projection'], s['projection_se'])} | "
                f"{_pm(s['debiased_sq'], s['debiased_sq_se'], 5)} | {s['rel_err']:.4f} | {s['rel_err_max']:.4f} |"
            )
    if result.o_rounding:
        lines += [
            "",
            "O's rounding in the executed forwards (underflow pooled over batches, the rest their mean):",
            "",
            "| layer | margin | log2 O8 scale | underflow | rel. rounding error | amax / rms | log2(rms * scale) |",
            "|---|---|---|---|---|---|---|",
        ]
        for layer, o in result.o_rounding.items():
            lines.append(
                f"| {layer} | {o['margin']} | {o['log2_scale']:.2f} | {o['underflow']:.4f} | "
                f"{o['rel_err']:.4f} | {o['amax_to_rms']:.2f} | {o['log2_rms_scaled']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: BiasResult, path: str | Path | None = None):
    """Bias of the total gradient per variant (bars with SE), and a variant x group map of the bias."""
    import numpy as np
    from matplotlib.figure import Figure

    names = list(result.stats)
    fig = Figure(figsize=(12, 4 + 0.25 * len(names)))
    bars, grid = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    totals = [result.stats[n]["total"] for n in names]
    bars.barh(
        names,
        [t["bias"] for t in totals],
        xerr=[0 if math.isnan(t["bias_se"]) else t["bias_se"] for t in totals],
        color=["tab:red" if t["cosine"] < 0 else "tab:blue" for t in totals],
    )
    bars.invert_yaxis()
    bars.set_xlabel("|mean error| / |mean exact gradient| (total; red: cosine < 0)")
    values = np.array([[max(result.stats[n][g]["bias"], 1e-12) for g in result.groups] for n in names])
    image = grid.imshow(np.log10(values), aspect="auto", cmap="viridis")
    grid.set_xticks(range(len(result.groups)), result.groups, rotation=60, ha="right", fontsize=7)
    grid.set_yticks(range(len(names)), names, fontsize=7)
    fig.colorbar(image, ax=grid, label="log10 relative bias")
    fig.suptitle(f"bias meter, policy {result.policy}, {result.batches} batches")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _finite(tree):
    """NaN (a standard error of one batch) as null, so the JSON is standard."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_finite(v) for v in tree]
    return None if isinstance(tree, float) and math.isnan(tree) else tree


def write_json(path: Path, tree: dict) -> None:
    """``tree`` as standard JSON at ``path`` (NaN as null)."""
    path.write_text(json.dumps(_finite(tree), indent=1, allow_nan=False) + "\n")


def write_table(out: Path, stem: str, tree: dict, text: str, draw: Callable[[Path], object]) -> None:
    """A table over many measurements: ``<stem>.json`` (``tree``), ``<stem>.md`` (``text``, also
    printed) and ``<stem>.png`` (``draw(path)``) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", tree)
    (out / f"{stem}.md").write_text(text)
    draw(out / f"{stem}.png")
    print(text)


def write(result: BiasResult, out: str | Path) -> dict[str, Path]:
    """``bias.json``, ``bias.md`` and ``bias.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bias.json", "markdown": out / "bias.md", "plot": out / "bias.png"}
    write_json(paths["json"], result.to_json())
    paths["markdown"].write_text(to_markdown(result))
    plot(result, paths["plot"])
    return paths
