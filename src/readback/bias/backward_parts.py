"""The reuse against each part of the attention backward, in one meter: the backwards between
Transformer Engine's FP8 one and its BF16 one, each part of the one switched to the other's alone,
and the policies under each (``python -m readback.cli.bias CHECKPOINT --parts``).

A backward is named by its end and the part it switches: ``fp8`` and ``bf16`` the two ends,
``fp8-<part>`` the FP8 backward with ``<part>`` as the BF16 one has it, ``bf16+<part>`` the BF16
backward with ``<part>`` put back as the FP8 one has it (leave-one-out from both ends, so that a
joint cause shows). Both ends spell their reads out part by part (``attention.bwd_reads`` stays
``forward``): ``bf16`` is ``bwd_reads=te``'s backward bit for bit.

Under each backward ``b`` the meter runs ``reuse_rounded``, ``fresh_reround`` and
``no_saved_copy`` (the control); per batch, ``reuse_vs_fresh@b = e_reuse@b - e_fresh@b`` (what
reading O8 for D costs against a fresh draw, the study's contrast) and ``reuse_vs_control@b =
e_reuse@b - e_control@b`` (against D = rowsum(P * dP): no fresh draw's noise), and each part's
**interaction** with the reuse, the reuse effect that the part's FP8 form adds over its BF16 form:
``interaction.fp8-<part> = reuse_vs_fresh@fp8 - reuse_vs_fresh@fp8-<part>``,
``interaction.bf16+<part> = reuse_vs_fresh@bf16+<part> - reuse_vs_fresh@bf16``, and
``interaction_vs_control.<b>`` likewise of ``reuse_vs_control``. D's own inputs run as a 2 x 2,
{O8, O} (``reuse_rounded``, ``original``) x {dO8, dO} (``fp8``, ``fp8-grad_output_in_d``):
``d_2x2 = (e_reuse - e_original)@fp8 - (e_reuse - e_original)@fp8-grad_output_in_d``. Named
on request, ``bf16+qkv+probs`` puts both of TE's own reads back (the BF16 backward of
``attention.bwd_reads=forward``), and ``te_reads@<policy> = e_policy@bf16 - e_policy@bf16+qkv+probs``
is what those reads (the unrounded Q, K, V and the rebuilt P) cost each policy's gradient. Each
contrast is paired within the batch, so the statistics of :mod:`readback.bias.estimators` (bias,
projection, debiased squared bias, SEs) apply to it as to an error.
"""

from __future__ import annotations

from typing import Any

from readback.bias.variants import Variant

# a part -> (its attention setting, its value in TE's FP8 backward, in its BF16 backward)
PARTS: dict[str, tuple[str, Any, Any]] = {
    "qkv": ("bwd_qkv", "forward", "original"),  # (a) what dQ, dK, dP read of Q, K, V
    "probs": ("bwd_probs", "forward", "rebuilt"),  # (b) what dV, dS read of P
    "grad_output": ("round_grad_output", True, False),  # (c) dO rounded to E5M2
    "grad_scores": ("round_grad_scores", True, False),  # (d) dS rounded to E5M2
    "gemms": ("bwd_precision", "fp8", "bf16"),  # (e) the GEMMs
}
D_PART = ("round_grad_output_in_d", True, False)  # the dO that D reads: D's own inputs' 2 x 2
# TE's BF16 backward with both of its own reads, (a) and (b), put back as the forward had them: a BF16
# backward of the forward's Q8, K8, V8 and P8 (``attention.bwd_reads=forward``); named on request only
FORWARD_READS = "bf16+qkv+probs"
POLICIES = ("reuse_rounded", "fresh_reround", "no_saved_copy")


def backward(name: str) -> dict[str, Any]:
    """The attention settings of backward ``name`` (one of :func:`backwards`); the dO that D reads
    rounds as dO does unless the name sets it apart."""
    if name not in (*backwards(), FORWARD_READS):
        raise ValueError(f"no backward {name!r}; valid: {[*backwards(), FORWARD_READS]}")
    end, *parts = name.replace("+", "-").split("-")
    values = {field: bf16 if end == "bf16" else fp8 for field, fp8, bf16 in PARTS.values()}
    for part in parts:
        field, fp8, bf16 = {**PARTS, "grad_output_in_d": D_PART}[part]
        values[field] = fp8 if end == "bf16" else bf16
    return {"bwd_reads": "forward", "round_grad_output_in_d": None, **values}


def backwards() -> list[str]:
    """Every backward ``--parts`` may name, the two ends first."""
    return ["fp8", "bf16", *(f"fp8-{p}" for p in PARTS), *(f"bf16+{p}" for p in PARTS), "fp8-grad_output_in_d"]


def part_variants(names: list[str] | None = None) -> list[Variant]:
    """The variants of the backwards ``names`` (default all; both ends always): ``reuse_rounded``,
    ``fresh_reround`` and ``no_saved_copy`` under each, and ``original`` under ``fp8`` and
    ``fp8-grad_output_in_d`` where the 2 x 2 is asked for."""
    names = list(dict.fromkeys(["fp8", "bf16", *(names or backwards())]))
    out = []
    for b in names:
        policies = list(POLICIES)
        if b in ("fp8", "fp8-grad_output_in_d") and "fp8-grad_output_in_d" in names:
            policies.append("original")
        what = f"the attention backward {b}"
        out += [Variant(f"{p}@{b}", f"policy {p}, {what}", policy=p, backward=backward(b)) for p in policies]
    return out


def part_contrasts(errors: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The reuse effect under each backward, each part's interaction and D's 2 x 2, per batch
    (``errors``: ``{variant: [{parameter: e_b}]}`` of :func:`part_variants`' variants)."""

    def diff(a: list[dict], b: list[dict]) -> list[dict]:
        return [{n: x[n] - y[n] for n in x} for x, y in zip(a, b)]

    measured = [name.partition("@")[2] for name in errors if name.startswith("reuse_rounded@")]
    out: dict[str, list[dict]] = {}
    for comparator, label in (("fresh_reround", "fresh"), ("no_saved_copy", "control")):
        effect = {b: diff(errors[f"reuse_rounded@{b}"], errors[f"{comparator}@{b}"]) for b in measured}
        out |= {f"reuse_vs_{label}@{b}": e for b, e in effect.items()}
        name = "interaction" if label == "fresh" else "interaction_vs_control"
        for b in measured:
            if b.startswith("fp8-"):
                out[f"{name}.{b}"] = diff(effect["fp8"], effect[b])
            elif b.startswith("bf16+"):
                out[f"{name}.{b}"] = diff(effect[b], effect["bf16"])
    if f"reuse_rounded@{FORWARD_READS}" in errors:  # what TE's reads cost each policy's gradient
        out |= {f"te_reads@{p}": diff(errors[f"{p}@bf16"], errors[f"{p}@{FORWARD_READS}"]) for p in POLICIES}
    if "original@fp8-grad_output_in_d" in errors:
        with_d8, with_d = ("fp8", "fp8-grad_output_in_d")
        out["d_2x2"] = diff(
            diff(errors[f"reuse_rounded@{with_d8}"], errors[f"original@{with_d8}"]),
            diff(errors[f"reuse_rounded@{with_d}"], errors[f"original@{with_d}"]),
        )
    return out
