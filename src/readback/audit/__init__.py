"""Read-rule audit of single ops, no training: ``python -m readback.audit [--json PATH] [--seed N]``.

For every audited op the forward runs with FP8 rounding (E4M3 forward, E5M2 gradients), the
backward with a random upstream gradient, and each gradient is compared with candidate gradients
computed by hand from each value it could have read (rounded, original, fresh, none). The value
whose candidate matches is what the gradient READ; the reference gradient (plain autograd over a
straight-through replay of the executed forward) classified the same way is what the rule WANTS.
Candidates that agree within the tolerance are reported as indistinguishable, never guessed.

The audited ops are a registry of functions returning rows (``AUDITS``): plain PyTorch ops with a
rounding inserted (``torch_ops``), readback's own ops under every policy (``readback_ops``; the
linear under the block recipes, ``block_ops``), and
Transformer Engine's on CUDA (``te``). The audit reports; it does not fail on a differing row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from readback.audit import block_ops, readback_attention, readback_ops, te, torch_ops
from readback.audit.core import TOL, Row, format_table
from readback.audit.harness import Setup
from readback.stopping import ends_on_ctrl_c

AUDITS = {**torch_ops.AUDITS, **readback_ops.AUDITS, **readback_attention.AUDITS, **block_ops.AUDITS}

__all__ = ["AUDITS", "Row", "Setup", "format_table", "main", "run_audit"]


def run_audit(seed: int = 0, te_rows: bool = True) -> tuple[list[Row], list[str]]:
    """Every audited op's rows, and the notes (skipped parts, READS tables that disagree)."""
    setup = Setup(seed=seed)
    rows = [row for fn in AUDITS.values() for row in fn(setup)]
    notes = []
    if te_rows:
        reason = te.unavailable()
        if reason is None:
            rows += [row for fn in te.AUDITS.values() for row in fn(setup)]
        else:
            notes.append(reason)
    for row in rows:
        if row.declared is not None and row.declared != row.reads:
            notes.append(
                f"{row.op} [{row.policy}] {row.gradient}: READS declares {row.declared!r}, "
                f"the backward reads {row.reads!r}"
            )
    return rows, notes


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m readback.audit",
        description="Which value each FP8 backward reads, op by op, against the reference rule.",
    )
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the rows as a JSON list to PATH")
    parser.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the random inputs (default 0)")
    return parser


@ends_on_ctrl_c("python -m readback.audit")
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
