"""The bias meter on one checkpoint under each scaling recipe: where each recipe's backward departs
from the gradient of its own executed forward, read by read (``docs/results/recipes/``).

    python scripts/recipe_meters.py CHECKPOINT_OR_RUN_DIR --out DIR [--batches 8] [--recipes a,b]

For each recipe of ``RECIPES`` it runs ``python -m readback.cli.bias`` with ``--precision`` set to that
recipe (the checkpoint's weights; fresh block or current scales; the run's own amax history
under its own recipe), into ``DIR/<recipe>/``, then gathers ``DIR/recipes.json``,
``DIR/recipes.md`` and ``DIR/recipes.png``: per recipe, the configured backward's gradient error
per batch and bias (with its floor) over all parameters and on the QKV gradients, and each
read's contribution (the configured backward minus that read switched to exact, paired within
the batch) as its debiased squared bias and projection with their SEs. A recipe already metered
in DIR is not run again.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from readback.stopping import ends_on_ctrl_c

RECIPES: dict[str, list[str]] = {  # name (its folder) -> the precision keys it sets
    "delayed": ["recipe=delayed"],
    "current": ["recipe=current"],
    "blockwise": ["recipe=blockwise"],  # power-of-two scales, TE's default
    "blockwise-fp32": ["recipe=blockwise", "pow2_scales=false"],
    "mxfp8": ["recipe=mxfp8"],
    "nvfp4": ["recipe=nvfp4"],
    "nvfp4-no-rht": ["recipe=nvfp4", "disable_rht=true"],
    "nvfp4-no-sr": ["recipe=nvfp4", "disable_stochastic_rounding=true"],
    "nvfp4-1d-weights": ["recipe=nvfp4", "disable_2d_quantization=true"],
}
READS = (
    "contrib.exact_read.linear.wgrad",
    "contrib.exact_read.linear.dgrad",
    "contrib.exact_bwd.linear",
    "contrib.exact_read.attention.D",
    "contrib.exact_bwd.attention",
)
GROUPS = ("total", "layers.0.attn.qkv")


def meter(checkpoint: Path, out: Path, batches: int, recipes: list[str]) -> dict[str, dict]:
    """Each recipe's ``bias.json``, metering the ones not yet in ``out``."""
    from readback.cli.bias import main as bias_main

    found = {}
    for name in recipes:
        where = out / name
        if not (where / "bias.json").exists():
            flags = [f for key in RECIPES[name] for f in ("--precision", key)]
            bias_main([str(checkpoint), "--batches", str(batches), "--out", str(where), "--show", "total", *flags])
        found[name] = json.loads((where / "bias.json").read_text())
    return found


def table(metered: dict[str, dict]) -> dict[str, dict]:
    """Per recipe: the configured backward's figures and each read's contribution, per group."""
    rows = {}
    for name, bias in metered.items():
        stats = bias["stats"]
        configured = stats[bias["policy"]]
        row = {
            g: {k: configured[g][k] for k in ("rel_err", "bias", "bias_se", "floor", "debiased_sq", "debiased_sq_se")}
            for g in GROUPS
        }
        for read in READS:
            if read in stats:
                row |= {
                    f"{read}/{g}": {
                        k: stats[read][g][k] for k in ("debiased_sq", "debiased_sq_se", "projection", "projection_se")
                    }
                    for g in GROUPS
                }
        rows[name] = row | {"batches": bias["batches"], "reads": bias["variants"]}
    return rows


def _num(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _pm(figures: dict, key: str, spec: str = ".2e") -> str:
    """``value ± SE`` of ``figures[key]`` (the SE left out where there is none: one batch)."""
    value, se = figures.get(key), figures.get(f"{key}_se")
    text = _num(value, "+" + spec)
    return text if _num(se, spec) == "n/a" or text == "n/a" else f"{text} ± {_num(se, spec)}"


def markdown(rows: dict[str, dict]) -> str:
    lines = [
        "| recipe | rel. error per batch | bias / floor (total) | debiased bias² (total) | QKV: bias / floor |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t, q = r["total"], r["layers.0.attn.qkv"]
        lines.append(
            f"| {name} | {_num(t['rel_err'])} | {_num(t['bias'])} / {_num(t['floor'])} | {_pm(t, 'debiased_sq')} "
            f"| {_num(q['bias'])} / {_num(q['floor'])} |"
        )
    lines += ["", "| recipe | read | group | debiased bias² | projection |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        for read in READS:
            for g in GROUPS:
                f = r.get(f"{read}/{g}")
                if f is not None:
                    lines.append(
                        f"| {name} | {read.removeprefix('contrib.')} | {g} | {_pm(f, 'debiased_sq')} "
                        f"| {_pm(f, 'projection', '.4f')} |"
                    )
    return "\n".join(lines) + "\n"


def figure(rows: dict[str, dict], path: Path) -> None:
    """Each read's debiased squared bias on all parameters, per recipe, with 2 SE bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(READS)
    for j, read in enumerate(READS):
        xs, ys, es = [], [], []
        for i, r in enumerate(rows.values()):
            f = r.get(f"{read}/total")
            if f is not None and f["debiased_sq"] is not None:
                xs.append(i + (j - len(READS) / 2) * width)
                ys.append(f["debiased_sq"])
                es.append(2 * (f["debiased_sq_se"] or 0.0))
        ax.bar(xs, ys, width, yerr=es, label=read.removeprefix("contrib."), capsize=2)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(range(len(rows)), list(rows), rotation=25, ha="right")
    ax.set_ylabel("debiased bias², all parameters")
    ax.set_title("each read's contribution to the gradient's bias (2 SE bars)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@ends_on_ctrl_c("scripts/recipe_meters.py")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES")
    args = parser.parse_args()
    names = [n.strip() for n in args.recipes.split(",")]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; valid: {list(RECIPES)}")
    rows = table(meter(args.checkpoint, args.out, args.batches, names))
    (args.out / "recipes.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "recipes.md").write_text(markdown(rows))
    figure(rows, args.out / "recipes.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
