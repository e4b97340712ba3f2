"""What the bias meter switches: the backward under each policy, and under the configured
policy with one read switched to exact (one READS entry, or one op's gradient roundings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from readback.numerics.spec import NumericsSpec
from readback.ops import read_rules
from readback.policy import POLICIES


@dataclass(frozen=True)
class Variant:
    """A backward to compare with the reference. ``policy`` None keeps the configured one;
    ``reads`` ``{op: {gradient: mode}}`` overrides entries of it; ``exact_bwd`` names the ops
    (``attention``, ``linear``) whose backward runs in FP32 with no gradient rounding."""

    name: str
    what: str
    policy: str | None = None
    reads: dict = field(default_factory=dict)
    exact_bwd: tuple[str, ...] = ()


def variants(numerics) -> list[Variant]:
    """Every policy; every read where the configured policy differs from ``exact``, switched to
    exact alone; each op's backward roundings (E5M2 of dO, dS, dY and the BF16 GEMM outputs)
    switched off alone; and everything exact at once (the meter's own zero)."""
    out = [Variant(p, f"backward under policy {p}", policy=p) for p in POLICIES]
    if numerics.policy not in POLICIES:  # a spec whose reads no named policy has (a test's planted read)
        out.insert(0, Variant(numerics.policy, "the configured backward"))
    configured, exact = numerics.spec.reads, read_rules("exact")
    for op, grads in configured.items():
        for gradient, mode in grads.items():
            if mode != exact[op][gradient]:
                out.append(
                    Variant(
                        f"exact_read.{op}.{gradient}",
                        f"{numerics.policy}, but {op} {gradient} reads {exact[op][gradient]!r} instead of {mode!r}",
                        reads={op: {gradient: exact[op][gradient]}},
                    )
                )
    rounded_bwd = [op for op in ("attention", "linear") if _rounds_backward(numerics, op)]
    for op in rounded_bwd:
        out.append(
            Variant(
                f"exact_bwd.{op}",
                f"{numerics.policy}, but the {op} backward in FP32 without gradient roundings",
                exact_bwd=(op,),
            )
        )
    out.append(
        Variant(
            "all_exact",
            "policy exact, every backward in FP32: the reference up to round-off",
            policy="exact",
            exact_bwd=tuple(rounded_bwd),
        )
    )
    return out


def _rounds_backward(numerics, op: str) -> bool:
    if op == "attention":
        return numerics.attention_bwd in ("fp8", "bf16")
    return numerics.precision == "fp8" and "fp8" in (
        numerics.linear_precision("dgrad"),
        numerics.linear_precision("wgrad"),
    )


def spec_of(variant: Variant, spec: NumericsSpec) -> NumericsSpec:
    """The spec ``variant``'s backward runs under, made from the run's ``spec`` (a new one: no
    table of the ops or of the policies changes)."""
    policy = variant.policy or spec.policy
    if variant.policy:
        spec = spec.with_reads(policy, read_rules(policy))
    if variant.reads:
        unknown = [(op, g) for op, grads in variant.reads.items() for g in grads if g not in spec.reads.get(op, {})]
        if unknown:
            raise ValueError(f"no such reads {unknown}; valid: {read_rules(policy)}")
        reads = {op: {**grads, **variant.reads.get(op, {})} for op, grads in spec.reads.items()}
        spec = spec.with_reads(f"{policy} with {variant.reads}", reads)
    for op in variant.exact_bwd:
        spec = spec.with_exact_backward(op)
    return spec


def applied(numerics, variant: Variant):
    """Run the block's backward as ``variant`` says; the run's own spec after."""
    return numerics.using(spec_of(variant, numerics.spec))
