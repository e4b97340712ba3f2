"""What TE's own reads cost the gradient at the 390M's attention shape: the meter cells of
``docs/results/d_term/preregistration_bf16_fix_cost.md`` from the folder
``sweeps/bf16_fix_cost_meters.sh`` wrote, with the calls as pre-registered.

    python -m readback.cli.decide te_reads_meter LADDER [--out DIR]

A cell is one ``bias.json`` at ``LADDER/<checkpoint>/bias/T<T>-<rounding>-te_reads/``, the
``--parts bf16,bf16+qkv+probs`` meter; its contrasts ``te_reads@<policy>`` (e_policy under TE's BF16
backward minus under the BF16 backward of the forward's operands), read on the ``total`` group with
the parts ladder's lines (detected: debiased squared bias >= 3 SE; grows: a difference >= 3 x the
two cells' combined SE). ``--out`` writes ``decision.md`` and ``decision.json`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from readback.analysis.decisions.common import figure
from readback.analysis.decisions.parts_ladder import LONGEST, SHORT, detected, find_cell, grows, read_cells

POLICIES = ("reuse_rounded", "no_saved_copy", "fresh_reround")  # D from O8, D = rowsum(P dP), a fresh draw
ROUNDINGS = ("nearest", "stochastic")


def _stat(cells: list[dict], checkpoint: str, t: int, rounding: str, name: str) -> dict | None:
    cell = find_cell(cells, checkpoint, t, rounding, ("te_reads",))
    return None if cell is None else cell["stats"].get(name)


def decide(ladder: Path) -> dict[str, Any]:
    cells = read_cells(ladder, ("te_reads@",))
    calls = {}
    for policy in POLICIES:
        name = f"te_reads@{policy}"
        seen = [
            f"{c['checkpoint']} T {c['T']} {c['rounding']}"
            for c in cells
            if c["T"] == LONGEST and detected(c["stats"].get(name))
        ]
        calls[policy] = {
            "detected_at_longest_T_in": seen,
            "grows_with_T": [
                r for r in ROUNDINGS if grows(_stat(cells, "d2", LONGEST, r, name), _stat(cells, "d2", SHORT, r, name))
            ],
            "grows_with_depth": [
                r
                for r in ROUNDINGS
                if grows(_stat(cells, "d8", LONGEST, r, name), _stat(cells, "d2", LONGEST, r, name))
            ],
        }
    return {"calls": calls, "cells": cells}


def _pm(s: dict[str, float], key: str) -> str:
    return figure(s[key], s[f"{key}_se"])


def report(decision: dict[str, Any]) -> str:
    lines = ["# What TE's reads cost the gradient at the 390M's attention shape", ""]
    for policy, c in decision["calls"].items():
        lines.append(
            f"* te_reads@{policy}: detected at T {LONGEST} in {', '.join(c['detected_at_longest_T_in']) or 'no cell'}; "
            f"grows with T under {', '.join(c['grows_with_T']) or 'neither rounding'}; "
            f"with depth under {', '.join(c['grows_with_depth']) or 'neither rounding'}."
        )
    lines += [
        "",
        "| checkpoint | T | rounding | batches | CPU | contrast | debiased bias² | projection | floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in decision["cells"]:
        for name, s in c["stats"].items():
            mark = " (detected)" if detected(s) else ""
            lines.append(
                f"| {c['checkpoint']} | {c['T']} | {c['rounding']} | {c['batches']} | {c['cpu']} | {name}{mark} "
                f"| {_pm(s, 'debiased_sq')} | {_pm(s, 'projection')} | {s['floor']:.2g} |"
            )
    return "\n".join(lines) + "\n"
