"""Paired-seed comparison of a sweep's experiments with a control, per stress setting.

    python scripts/paired_seeds.py SWEEP_DIR [SWEEP_DIR ...] [--control no_saved_copy]

Runs with the same seed share initialisation, data order and validation batches, so the
difference of two runs of one seed cancels what the seed alone does. For each experiment and
each ``precision.site_margin`` the table gives, over the seeds both have, the mean paired
difference (experiment - control) of ``val_loss`` and ``final_loss`` with its standard error,
and beside it the unpaired difference of the means with its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from omegaconf import OmegaConf


def load(dirs: list[str]) -> list[dict]:
    runs = []
    for summary in sorted(p for d in dirs for p in Path(d).rglob("summary.json")):
        cfg = OmegaConf.load(summary.parent / ".hydra" / "config.yaml")
        s = json.loads(summary.read_text())
        margin = OmegaConf.to_container(cfg.precision).get("site_margin") or {}
        runs.append({"experiment": cfg.experiment, "seed": int(cfg.seed), "stress": json.dumps(margin, sort_keys=True),
                     "val_loss": s.get("val_loss"), "final_loss": s.get("final_loss"), "status": s.get("status")})
    return runs


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan)


def table(runs: list[dict], control: str) -> str:
    lines = ["| experiment - control | stress | pairs | metric | paired mean diff ± SE | paired z | unpaired diff ± SE |",
             "|---|---|---|---|---|---|---|"]
    by = {(r["experiment"], r["stress"], r["seed"]): r for r in runs}
    for exp, stress in sorted({(r["experiment"], r["stress"]) for r in runs if r["experiment"] != control}):
        seeds = sorted(s for e, st, s in by if e == exp and st == stress and (control, stress, s) in by)
        for metric in ("val_loss", "final_loss"):
            a = [by[(exp, stress, s)][metric] for s in seeds]
            b = [by[(control, stress, s)][metric] for s in seeds]
            if len(seeds) < 1 or None in a + b:
                continue
            diff, se = _mean_se([x - y for x, y in zip(a, b)])
            (ma, sa), (mb, sb) = _mean_se(a), _mean_se(b)
            z = diff / se if se and not math.isnan(se) else math.nan
            lines.append(f"| {exp} - {control} | {stress} | {len(seeds)} | {metric} | {diff:+.4f} ± {se:.4f} | "
                         f"{z:+.1f} | {ma - mb:+.4f} ± {math.hypot(sa, sb):.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--control", default="no_saved_copy")
    args = parser.parse_args()
    runs = load(args.dirs)
    print(table(runs, args.control))
    print()
    for r in sorted(runs, key=lambda r: (r["stress"], r["experiment"], r["seed"])):
        print(f"{r['experiment']:14s} seed {r['seed']} stress {r['stress']}: val {r['val_loss']:.4f} "
              f"final {r['final_loss']:.4f} ({r['status']})")


if __name__ == "__main__":
    main()
