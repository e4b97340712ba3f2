"""``python -m readback.analysis SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--x tokens|step]``

Loads every run under the sweep directories, writes ``loss.png``, ``grad_error.png``,
``kurtosis.png``, ``attn_rowsum.png``, ``final_loss.md`` (and ``.csv``) and ``runs.csv`` to
``DIR`` (default ``<first SWEEP_DIR>/analysis``) and prints the final-loss table. Exit code 2,
with one line on stderr, when a directory is missing or holds no runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m readback.analysis", description=__doc__.split("\n\n")[1])
    parser.add_argument("sweep_dirs", nargs="+", metavar="SWEEP_DIR", help="a sweep (or run) directory")
    parser.add_argument("--out", default=None, help="output directory (default: SWEEP_DIR/analysis)")
    parser.add_argument("--x", choices=("tokens", "step"), default="tokens", help="x axis of the curves")
    parser.add_argument("--band", choices=("minmax", "std", "none"), default="minmax",
                        help="band over seeds around the mean")
    args = parser.parse_args(argv)

    os.environ.setdefault("MPLBACKEND", "Agg")
    from readback.analysis import final_loss_table, format_final_loss_table, load_runs, write_report

    for d in args.sweep_dirs:
        if not Path(d).is_dir():
            print(f"error: no such sweep directory: {d}", file=sys.stderr)
            return 2
    runs = load_runs(*args.sweep_dirs)
    if not len(runs):
        print(f"error: no runs (directories with summary.json or metrics.jsonl) under {', '.join(args.sweep_dirs)}",
              file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.sweep_dirs[0]) / "analysis"
    paths = write_report(runs, out, x=args.x, band=None if args.band == "none" else args.band)
    print(format_final_loss_table(final_loss_table(runs)))
    print(f"{len(runs)} runs; wrote {', '.join(sorted(p.name for p in paths.values()))} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
