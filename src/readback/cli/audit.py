"""``python -m readback.cli.audit [--json PATH] [--seed N]``: the read-rule audit of single ops
(:mod:`readback.audit`), its table printed and, with ``--json``, its rows written."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from readback.audit import format_table, run_audit
from readback.audit.core import TOL
from readback.stopping import ends_on_ctrl_c


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m readback.cli.audit",
        description="Which value each FP8 backward reads, op by op, against the reference rule.",
    )
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the rows as a JSON list to PATH")
    parser.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the random inputs (default 0)")
    return parser


@ends_on_ctrl_c("python -m readback.cli.audit")
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        parser.error(f"argument --json: cannot write {str(args.json)!r} (not a file in an existing directory)")

    start = time.perf_counter()
    rows, notes = run_audit(args.seed)
    print(format_table(rows))
    print()
    for note in notes:
        print(note)
    differs = sum(row.ok is False for row in rows)
    ties = sum(row.ok is None for row in rows)
    print(
        f"{len(rows)} rows: {len(rows) - differs - ties} ok, {differs} differ from the rule, "
        f"{ties} indistinguishable (tolerance {TOL:g}; {time.perf_counter() - start:.1f} s)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_json() for row in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
