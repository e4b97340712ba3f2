"""What the bias meter switches: the backward under each policy, and under the configured
policy with one read switched to exact (one READS entry, one op's gradient roundings, or one
kind of the linears' backward GEMMs accumulating in IEEE FP32 instead of the tensor core's way)."""

from __future__ import annotations

from dataclasses import dataclass, field

from readback.numerics.precision_settings import GEMMS
from readback.numerics.spec import NumericsSpec
from readback.ops import read_rules
from readback.policy import POLICIES


@dataclass(frozen=True)
class Variant:
    """A backward to compare with the reference. ``policy`` None keeps the configured one;
    ``reads`` ``{op: {gradient: mode}}`` overrides entries of it; ``exact_bwd`` names the ops
    (``attention``, ``linear``) whose backward runs in FP32 with no gradient rounding;
    ``accumulation`` ``{gemm: mode}`` overrides how the linears' ``dgrad``/``wgrad`` GEMMs add;
    ``backward`` ``{attention setting: value}`` replaces the attention backward's precision, flavour and
    parts (``readback.bias.backward_parts``)."""

    name: str
    what: str
    policy: str | None = None
    reads: dict = field(default_factory=dict)
    exact_bwd: tuple[str, ...] = ()
    accumulation: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)


def variants(numerics) -> list[Variant]:
    """Every policy (in the run's attention-backward flavour); every read where the configured
    backward differs from ``exact``, switched to exact alone (under ``attention.bwd_reads=te``,
    D, dQ, dK, dP, dV and dS each: O8, the original K, Q, V and the rebuilt P one at a time);
    each op's backward roundings (E5M2 of dO, dS, dY and the BF16 GEMM outputs) switched off
    alone; each backward GEMM kind of the linears that accumulates like a tensor core (``fast``,
    ``split``) switched to IEEE FP32 alone; and everything exact at once (the
    meter's own zero). The forward GEMMs' accumulation is part of the executed forward, so no
    variant switches it (the reference replays its outputs)."""
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
    for gemm in ("dgrad", "wgrad"):
        mode = numerics.linear_accumulation(gemm)
        if numerics.precision == "fp8" and numerics.linear_precision(gemm) == "fp8" and mode in ("fast", "split"):
            out.append(
                Variant(
                    f"ieee_acc.{gemm}",
                    f"{numerics.policy}, but the linears' {gemm} GEMMs accumulate in IEEE FP32 instead of {mode!r}",
                    accumulation={gemm: "ieee"},
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
        return numerics.bwd_gemm_precision in ("fp8", "bf16")
    return numerics.precision == "fp8" and "fp8" in (
        numerics.linear_precision("dgrad"),
        numerics.linear_precision("wgrad"),
    )


def variant_spec(variant: Variant, spec: NumericsSpec) -> NumericsSpec:
    """The spec ``variant``'s backward runs under, made from the run's ``spec`` (a new one: no
    table of the ops or of the policies changes)."""
    policy = variant.policy or spec.policy
    if variant.backward:
        spec = spec.with_attention(**variant.backward)
    if variant.policy or variant.backward:  # in the run's (or the variant's) attention-backward flavour
        spec = spec.with_reads(policy, read_rules(policy, spec.attention, spec.recipe))
    if variant.reads:
        unknown = [(op, g) for op, grads in variant.reads.items() for g in grads if g not in spec.reads.get(op, {})]
        if unknown:
            raise ValueError(f"no such reads {unknown}; valid: {read_rules(policy)}")
        reads = {op: {**grads, **variant.reads.get(op, {})} for op, grads in spec.reads.items()}
        spec = spec.with_reads(f"{policy} with {variant.reads}", reads)
    for op in variant.exact_bwd:
        spec = spec.with_exact_backward(op)
    if variant.accumulation:
        if not set(variant.accumulation) <= {"dgrad", "wgrad"}:
            raise ValueError(f"accumulation {variant.accumulation}: only the backward's dgrad and wgrad can switch")
        spec = spec.with_precision(accumulation_gemms={**dict(zip(GEMMS, spec.accumulation)), **variant.accumulation})
    return spec


def applied(numerics, variant: Variant):
    """Run the block's backward as ``variant`` says; the run's own spec after."""
    return numerics.using(variant_spec(variant, numerics.spec))
