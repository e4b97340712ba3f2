"""``python -m readback.cli.bias_shapes SWEEP_DIR --out DIR [--measured bias/width] [--read READ] [--seeds 2,3]``:
the command line of :mod:`readback.bias.shapes`, whose docstring says what it writes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from readback.bias import shapes as library
from readback.bias.attribution import D_READ
from readback.bias.report import write_table
from readback.bias.shapes import length_contrasts, measured_runs, plot, pool, run_point, to_markdown
from readback.stopping import ends_on_ctrl_c


def seed_list(text: str) -> list[int]:
    """``--seeds 2,3``: a comma-separated list of integers."""
    return [int(seed) for seed in text.split(",")]


@ends_on_ctrl_c("python -m readback.cli.bias_shapes")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m readback.cli.bias_shapes", description=str(library.__doc__).split("\n\n")[1]
    )
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--measured", default="bias/width", help="where in each run the meter wrote (bias/width)")
    parser.add_argument("--read", default=D_READ, help=f"the contribution to tabulate ({D_READ})")
    parser.add_argument(
        "--seeds", type=seed_list, help="only these seeds, e.g. 2,3 (a test on runs made after a trend was seen)"
    )
    args = parser.parse_args(argv)
    runs = measured_runs(args.sweep, args.measured)
    points = [run_point(run, args.measured, args.read) for run in runs]
    if args.seeds:
        points = [p for p in points if p["seed"] in args.seeds]
    if not points:
        seeds_text = f" of seeds {','.join(map(str, args.seeds))}" if args.seeds else ""
        parser.exit(2, f"{parser.prog}: error: no run{seeds_text} under {args.sweep} has {args.measured}/bias.json\n")
    rows = pool(points)
    tree = {"read": args.read, "rows": rows, "length_contrasts": length_contrasts(rows), "runs": points}
    write_table(args.out, "shapes", tree, to_markdown(rows, points, args.read), lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
