"""``python -m readback.cli.bias_onset SWEEP_DIR --out DIR [--measured 'bias/dose/margin*' bias/width]``:
the command line of :mod:`readback.bias.onset`, whose docstring says what it writes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from readback.bias import onset as library
from readback.bias.attribution import D_READ
from readback.bias.onset import onset_rows, plot, to_markdown
from readback.bias.report import write_table
from readback.stopping import ends_on_ctrl_c


@ends_on_ctrl_c("python -m readback.cli.bias_onset")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m readback.cli.bias_onset", description=str(library.__doc__).split("\n\n")[1]
    )
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--measured",
        nargs="+",
        default=["bias/dose/margin*", "bias/width"],
        help="globs of the meter's folders, relative to each run (bias/dose/margin* bias/width)",
    )
    parser.add_argument("--read", default=D_READ, help=f"the contribution to tabulate ({D_READ})")
    args = parser.parse_args(argv)
    rows = onset_rows(args.sweep, args.measured, args.read)
    if not rows:
        parser.exit(2, f"{parser.prog}: error: no run under {args.sweep} has {' or '.join(args.measured)}/bias.json\n")
    tree = {"read": args.read, "measured": args.measured, "rows": rows}
    write_table(args.out, "onset", tree, to_markdown(rows, args.read), lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
