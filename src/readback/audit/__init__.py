"""Read-rule audit of single ops, no training: ``python -m readback.cli.audit [--json PATH] [--seed N]``.

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

from readback.audit import block_ops, readback_attention, readback_ops, te, torch_ops
from readback.audit.core import Row, format_table
from readback.audit.harness import Setup

AUDITS = {**torch_ops.AUDITS, **readback_ops.AUDITS, **readback_attention.AUDITS, **block_ops.AUDITS}

__all__ = ["AUDITS", "Row", "Setup", "format_table", "run_audit"]


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
