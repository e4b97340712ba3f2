"""The audit's verdicts on readback's FOG, next to the declared ``READS`` tables.

On the FOG's executed forward (current scaling, every site FP8) a saved tensor that is the FP8
copy the forward multiplied re-rounds to itself: storing it as E4M3 is free. So a gradient whose
declared read is ``rounded`` must find its saved tensor free, and one whose read is ``original``
must not. Saved tensors are matched to ``(op, gradient)`` by module and graph node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from readback.audit_model.core import AuditRow
from readback.ops import read_rules

_LINEAR = re.compile(r"(\.(qkv|proj|up|down)|<root>)/MmBackward0\.(self|mat2)$")
_ATTENTION = re.compile(r"layers\.\d+\.attn\.core/(BmmBackward0\.(self|mat2)|SoftmaxBackward0\.result)$")
_NORM = re.compile(r"layers\.\d+\.(attn|mlp)_norm/MulBackward0\.self$")


def fog_reads(rows: list[AuditRow]) -> list[tuple[AuditRow, str, str]]:
    """``(row, op, gradient)`` for each saved tensor that a declared read names."""
    out: list[tuple[AuditRow, str, str]] = []
    bmm_seen: dict[str, int] = {}
    mul_seen: dict[str, int] = {}
    for row in rows:
        module = row.name.split("/")[0]
        if m := _LINEAR.search(row.name):
            out.append((row, "linear", "wgrad" if m.group(3) == "self" else "dgrad"))
        elif _ATTENTION.search(row.name):
            if "Softmax" in row.name:
                out.append((row, "attention", "dS"))
            else:  # first product Q K^T (dK reads Q, dQ reads K), then P V (dV reads P, dP reads V)
                n = bmm_seen[module] = bmm_seen.get(module, -1) + 1
                first = row.name.endswith(".self")
                out.append((row, "attention", [["dQ", "dK"], ["dP", "dV"]][n // 2][first]))
        elif _NORM.search(row.name):
            n = mul_seen[module] = mul_seen.get(module, -1) + 1
            if n == 1:  # x * inv_rms first, then normalized * gain: the gain's gradient reads normalized
                out.append((row, "rms_norm", "gain"))
    return out


def compare_reads(
    rows: list[AuditRow], policy: str = "exact", reads: Mapping[str, Mapping[str, str]] | None = None
) -> list[dict]:
    """Each matched saved tensor: the declared read under ``policy`` (or ``reads``, ``{op:
    {gradient: mode}}``), the audit's verdict for its E4M3 storage, and whether they agree
    (``rounded`` <-> free, ``original`` <-> not free)."""
    declared = read_rules(policy) if reads is None else reads
    out = []
    for row, op, gradient in fog_reads(rows):
        mode, free = declared[op][gradient], row.verdicts["e4m3"] == "free"
        out.append(
            {
                "saved": row.name,
                "op": op,
                "gradient": gradient,
                "declared": mode,
                "e4m3": row.verdicts["e4m3"],
                "agrees": free == (mode == "rounded"),
            }
        )
    return out
