"""``python -m readback.cli.bias_attribution LABEL=BIAS_JSON [LABEL=BIAS_JSON ...] --out DIR
[--groups total,*.attn.qkv] [--contributions GLOBS] [--reference contrib.exact_read.attention.D]``:
the command line of :mod:`readback.bias.attribution`, whose docstring says what it writes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from readback.bias import attribution as library
from readback.bias.attribution import D_READ, attribution, plot, to_markdown
from readback.bias.report import write_table
from readback.stopping import ends_on_ctrl_c


@ends_on_ctrl_c("python -m readback.cli.bias_attribution")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m readback.cli.bias_attribution", description=str(library.__doc__).split("\n\n")[2]
    )
    parser.add_argument("measured", nargs="+", metavar="LABEL=BIAS_JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", default="total,*.attn.qkv", help="comma-separated globs of gradient groups")
    parser.add_argument("--contributions", default="*", help="comma-separated globs of contributions (no contrib.)")
    parser.add_argument("--reference", default=D_READ, help=f"the contribution the others are compared with ({D_READ})")
    args = parser.parse_args(argv)
    measured = {}
    for item in args.measured:
        label, sep, path = item.partition("=")
        if not (label and sep and Path(path).is_file()):
            parser.exit(2, f"{parser.prog}: error: {item!r} is not LABEL=BIAS_JSON of an existing file\n")
        measured[label] = json.loads(Path(path).read_text())
    table = attribution(measured, args.groups.split(","), args.reference, tuple(args.contributions.split(",")))
    write_table(args.out, "attribution", table, to_markdown(table, args.reference), lambda path: plot(table, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
