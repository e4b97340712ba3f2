"""The audit's one idea: which candidate value explains a gradient.

An op's gradient is compared with candidate gradients computed by hand (float64) from each value
the backward could have read: ``rounded``, ``original``, ``fresh``, ``none``. The reference
gradient (plain autograd over the executed forward, every rounding pinned) is classified the same
way, which gives the rule. One gradient can depend on several reads at once (attention's ``dQ``
depends on the P that ``dS`` reads and on the O that the D-term reads); then candidates are keyed
by a tuple of read modes, one per gradient, and each component is reported on its own row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch

# Relative distance below which two gradients are "the same read". The audited backward GEMMs run
# in FP32 (candidates in FP64), so matches sit near 1e-7 while different reads of an FP8-rounded
# tensor sit near 1e-2.
TOL = 1e-4

Key = tuple[str, ...]


@dataclass
class Row:
    """One audited (op, gradient): what it reads, what the rule wants, and how far it is off."""

    op: str
    gradient: str
    reads: str
    expected: str
    ok: bool | None  # None: the candidates cannot be told apart
    rel_err: float
    policy: str | None = None
    declared: str | None = None  # the op's own READS table entry, where it has one
    separation: float | None = None  # distance from the op's read to the nearest other read
    distances: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.ok is None:  # the tie, on whichever side it is
            return self.reads if self.reads.startswith("indistinguishable") else self.expected
        return "ok" if self.ok else "DIFFERS"

    def to_json(self) -> dict:
        row = asdict(self)
        row["rel_err"] = self.rel_err if math.isfinite(self.rel_err) else None  # strict JSON
        if row["policy"] is None:
            del row["policy"]
        if row["declared"] is None:
            del row["declared"]
        return row


def distance(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """``||a - b|| / max(||a||, ||b||)`` in float64 (0 for two zero tensors); with ``scale``,
    ``||a - b|| / scale`` (for quantities whose exact value is zero)."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if scale is None:
        scale = max(a.norm().item(), b.norm().item())
    return (a - b).norm().item() / scale if scale > 0 else 0.0


def match(
    grad: torch.Tensor, candidates: dict[Key, torch.Tensor], tol: float = TOL, scale: float | None = None
) -> list[Key]:
    """The candidates that explain ``grad``: every one within ``tol`` of it, plus every one within
    ``tol`` of the best of those (candidates too close to each other are a tie, not a finding).
    Empty when none is within ``tol``."""
    dist = {key: distance(grad, value, scale) for key, value in candidates.items()}
    best = min(dist, key=dist.__getitem__)
    if dist[best] > tol:
        return []
    return [key for key in candidates if dist[key] <= tol or distance(candidates[key], candidates[best], scale) <= tol]


def separation(
    candidates: dict[Key, torch.Tensor], matches: list[Key], component: int, scale: float | None = None
) -> float | None:
    """How far the matched candidates are from every candidate with another read for this
    gradient: the margin that makes the finding a finding (None when nothing matched)."""
    if not matches:
        return None
    mode = {key[component] for key in matches}
    others = [key for key in candidates if key[component] not in mode]
    if not others:
        return None
    return min(distance(candidates[a], candidates[b], scale) for a in matches for b in others)


def read_of(matches: list[Key], component: int) -> str:
    """The read mode of one gradient (tuple component) given the matching candidates."""
    modes = list(dict.fromkeys(key[component] for key in matches))
    if not modes:
        return "unmatched"
    if len(modes) == 1:
        return modes[0]
    return f"indistinguishable ({' = '.join(modes)})"


def _agreement(reads: str, expected: str) -> bool | None:
    def modes(label: str) -> set[str]:
        if label.startswith("indistinguishable ("):
            return set(label[len("indistinguishable (") : -1].split(" = "))
        return {label}

    if "unmatched" in (reads, expected):
        return False
    if reads == expected and not reads.startswith("indistinguishable"):
        return True
    return None if modes(reads) & modes(expected) else False


def audit(
    op: str,
    gradients: str | tuple[str, ...],
    got: torch.Tensor,
    reference: torch.Tensor,
    candidates: dict,
    *,
    policy: str | None = None,
    declared: Mapping[str, str] | None = None,
    tol: float = TOL,
    scale: float | None = None,
    rel_err: float | None = None,
) -> list[Row]:
    """Rows for the gradient(s) ``gradients`` of ``op``: ``got`` (the op's) and ``reference``
    classified against ``candidates`` (keys: a read mode, or a tuple of read modes, one per
    gradient). ``declared`` is the op's READS entry per gradient, reported alongside. ``scale``
    makes distances absolute (see ``distance``); ``rel_err`` overrides ``got`` vs ``reference``
    when the classified quantity is not the gradient itself."""
    names = (gradients,) if isinstance(gradients, str) else tuple(gradients)
    candidates = {(k,) if isinstance(k, str) else tuple(k): v for k, v in candidates.items()}
    op_matches, ref_matches = match(got, candidates, tol, scale), match(reference, candidates, tol, scale)
    rel_err = distance_to(got, reference) if rel_err is None else rel_err
    distances = {",".join(key): distance(got, value, scale) for key, value in candidates.items()}
    rows = []
    for i, name in enumerate(names):
        reads, expected = read_of(op_matches, i), read_of(ref_matches, i)
        rows.append(
            Row(
                op,
                name,
                reads,
                expected,
                _agreement(reads, expected),
                rel_err,
                policy,
                (declared or {}).get(name),
                separation(candidates, op_matches, i, scale),
                distances,
            )
        )
    return rows


def distance_to(got: torch.Tensor, reference: torch.Tensor) -> float:
    """``||got - reference|| / ||reference||``, the table's rel. error."""
    got, reference = got.detach().to(torch.float64), reference.detach().to(torch.float64)
    norm = reference.norm().item()
    return (got - reference).norm().item() / norm if norm > 0 else math.inf


def cat(*tensors: torch.Tensor) -> torch.Tensor:
    """Several gradients as one flat vector (float64), to classify them together."""
    return torch.cat([t.detach().to(torch.float64).flatten() for t in tensors])


COLUMNS = ("op", "gradient", "reads", "rule wants", "verdict", "rel. error")


def format_table(rows: list[Row]) -> str:
    """A plain-text table, one line per row."""
    cells = [COLUMNS] + [
        (
            row.op if row.policy is None else f"{row.op} [{row.policy}]",
            row.gradient,
            row.reads,
            row.expected,
            row.verdict,
            f"{row.rel_err:.2e}",
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
