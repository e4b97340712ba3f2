"""``python -m readback.cli.decide NAME SWEEP [--out DIR]``

A pre-registered test's decision (:mod:`readback.analysis.decisions`): the calls its page fixed,
made on the runs under SWEEP, printed in Markdown and, with ``--out``, written to
``DIR/decision.md`` and ``DIR/decision.json``. ``python -m readback.cli.decide NAME --help`` says
what NAME reads and calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from readback.analysis.decisions import DECISIONS
from readback.stopping import ends_on_ctrl_c

PROG = "python -m readback.cli.decide"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1])
    names = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, module in DECISIONS.items():
        text = str(module.__doc__)
        one = names.add_parser(
            name,
            help=" ".join(text.split("\n\n")[0].split()),
            description=text,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        one.add_argument("sweep", type=Path, metavar="SWEEP")
        one.add_argument("--out", type=Path, help="write decision.md and decision.json here")
    return parser


@ends_on_ctrl_c(PROG)
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    module = DECISIONS[args.name]
    with ends_on_ctrl_c(f"{PROG} {args.name}", "nothing was written"):
        decision = module.decide(args.sweep)
    text = module.report(decision).rstrip("\n") + "\n"
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decision.md").write_text(text)
        (args.out / "decision.json").write_text(json.dumps(decision, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
