"""The meter ladder's decision (``docs/results/d_term/preregistration_parts_ladder.md``) from the
folder ``sweeps/parts_ladder.sh`` wrote: each cell's contrasts, and the calls as pre-registered.

    python -m readback.cli.decide parts_ladder LADDER [--out DIR]

A cell is one ``bias.json`` at ``LADDER/<checkpoint>/bias/T<T>-<rounding>-<label>/``; its
contrasts are the ``--parts`` meter's (``reuse_vs_fresh@<b>``, ``interaction.<b>``, ...), read on
the ``total`` group. ``--out`` writes ``decision.md`` and ``decision.json`` there.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

PARTS = ("qkv", "probs", "grad_output", "grad_scores", "gemms")
WIDENED = 3.0  # 2 SE widened 1.5x: the debiased SE's under-coverage where the bias is not zero
LONGEST, SHORT = 4096, 512
REUSE_EFFECTS = ("reuse_vs_fresh@fp8", "reuse_vs_control@fp8")
_CELL = re.compile(r"T(\d+)-(nearest|stochastic)-(.+)")


def read_cells(
    ladder: Path, contrasts: tuple[str, ...] = ("reuse_vs_", "interaction", "d_2x2")
) -> list[dict[str, Any]]:
    """Every metered cell: checkpoint, T, rounding, label, batches and ``{contrast: total stats}``
    of the contrasts whose names start with one of ``contrasts``."""
    cells = []
    for path in sorted(ladder.glob("*/bias/*/bias.json")):
        match = _CELL.fullmatch(path.parent.name)
        if match is None:
            continue
        data = json.loads(path.read_text())
        stats = {  # a statistic its batches could not give is written as null: NaN here
            name: {k: math.nan if v is None else v for k, v in groups["total"].items()}
            for name, groups in data["stats"].items()
            if name.startswith(contrasts)
        }
        cells.append(
            {
                "checkpoint": path.parent.parent.parent.name,
                "T": int(match[1]),
                "rounding": match[2],
                "label": match[3],
                "batches": data["batches"],
                "cpu": data.get("cpu"),
                "stats": stats,
            }
        )
    return cells


def detected(stats: dict[str, float] | None) -> bool:
    """``debiased_sq >= 3 x debiased_sq_se`` (False where it was not measured)."""
    if stats is None or math.isnan(stats["debiased_sq_se"]):
        return False
    return stats["debiased_sq"] >= WIDENED * stats["debiased_sq_se"]


def grows(big: dict[str, float] | None, small: dict[str, float] | None) -> bool:
    """``debiased_sq`` larger by at least 3 x the two cells' combined SE."""
    if big is None or small is None:
        return False
    se = math.hypot(big["debiased_sq_se"], small["debiased_sq_se"])
    return big["debiased_sq"] - small["debiased_sq"] >= WIDENED * se


def find_cell(cells: list[dict], checkpoint: str, t: int, rounding: str, labels=("all", "fp8_end")) -> dict | None:
    found = [c for c in cells if (c["checkpoint"], c["T"], c["rounding"]) == (checkpoint, t, rounding)]
    found = [c for c in found if c["label"] in labels]
    return found[0] if found else None


def decide(ladder: Path) -> dict[str, Any]:
    cells = read_cells(ladder)
    longest = [c for c in cells if c["T"] == LONGEST]
    reuse_seen = [
        f"{c['checkpoint']} {c['rounding']} {c['label']}: {name}"
        for c in longest
        for name in REUSE_EFFECTS
        if detected(c["stats"].get(name))
    ]
    called, growth = {}, {}
    for part in PARTS:
        evidence = []
        for checkpoint in ("d2", "d8"):
            for rounding in ("nearest", "stochastic"):
                cell = find_cell(cells, checkpoint, LONGEST, rounding)
                at_depth2 = find_cell(cells, "d2", LONGEST, rounding, ("all",))
                if cell is None or not detected(cell["stats"].get(f"interaction.fp8-{part}")):
                    continue
                from_fp8 = cell["stats"][f"interaction.fp8-{part}"]["projection"]
                from_bf16 = (at_depth2 or {"stats": {}})["stats"].get(f"interaction.bf16+{part}")
                if from_bf16 is not None and from_fp8 * from_bf16["projection"] > 0:
                    evidence.append(
                        {"checkpoint": checkpoint, "rounding": rounding, **cell["stats"][f"interaction.fp8-{part}"]}
                    )
        if evidence:
            called[part] = max(e["debiased_sq"] for e in evidence)
        name = f"interaction.fp8-{part}"
        growth[part] = {
            "with_T": any(
                grows(_stat(cells, "d2", LONGEST, r, name), _stat(cells, "d2", SHORT, r, name))
                for r in ("nearest", "stochastic")
            ),
            "with_depth": any(
                grows(_stat(cells, "d8", LONGEST, r, name), _stat(cells, "d2", LONGEST, r, name))
                for r in ("nearest", "stochastic")
            ),
        }
    ranked = sorted(called, key=lambda part: called[part], reverse=True)
    if not reuse_seen:
        call = "no reuse effect detected at this shape: no part called, no loss test"
    elif ranked:
        call = "carried by " + ", ".join(ranked)
    elif any(
        detected(c["stats"].get("reuse_vs_fresh@fp8")) and not detected(c["stats"].get("reuse_vs_fresh@bf16"))
        for c in longest
    ):
        call = "a joint cause: the parts together remove what none removes alone"
    else:
        call = "the fix acts through none of the parts"
    loss_test = [p for p in ranked if growth[p]["with_T"] or growth[p]["with_depth"]]
    return {
        "call": call,
        "reuse_effect_detected_in": reuse_seen,
        "parts_called": ranked,
        "growth": growth,
        "loss_test_arms": [f"fp8-{p}" for p in loss_test],
        "cells": cells,
    }


def _stat(cells: list[dict], checkpoint: str, t: int, rounding: str, name: str) -> dict | None:
    cell = find_cell(cells, checkpoint, t, rounding, ("all",))
    return None if cell is None else cell["stats"].get(name)


def _pm(s: dict[str, float], key: str, digits: int) -> str:
    return f"{s[key]:.{digits}g} ± {s[key + '_se']:.2g}"


def report(decision: dict[str, Any]) -> str:
    lines = [
        "# The meter ladder's decision (preregistration_parts_ladder.md)",
        "",
        f"**Call: {decision['call']}.**",
        "",
        f"Reuse effect detected at T {LONGEST} in: {', '.join(decision['reuse_effect_detected_in']) or 'no cell'}.",
        f"Loss test arms: {', '.join(decision['loss_test_arms']) or 'none (no called part grows with T or depth)'}.",
        "",
        "| checkpoint | T | rounding | cell | batches | CPU | contrast | debiased bias² | projection | floor "
        "| largest per batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in decision["cells"]:
        for name, s in c["stats"].items():
            mark = " (detected)" if detected(s) else ""
            lines.append(
                f"| {c['checkpoint']} | {c['T']} | {c['rounding']} | {c['label']} | {c['batches']} | {c['cpu']} "
                f"| {name}{mark} | "
                f"{_pm(s, 'debiased_sq', 3)} | {_pm(s, 'projection', 3)} | {s['floor']:.3g} | {s['rel_err_max']:.3g} |"
            )
    return "\n".join(lines)
