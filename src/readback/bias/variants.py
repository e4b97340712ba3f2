"""What the bias meter switches: the backward under each policy, and under the configured
policy with one read switched to exact (one READS entry, or one op's gradient roundings)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

from readback.ops import OPS, read_rules
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
    out = [Variant(p, f"backward under policy {p}", policy=p) for p in POLICIES if not p.startswith("_")]
    configured, exact = read_rules(numerics.policy), read_rules("exact")
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


@contextlib.contextmanager
def temporary_policy(name: str, base: str, reads: dict):
    """A policy ``name`` that reads like ``base`` except for ``reads`` ``{op: {gradient: mode}}``,
    registered in ``POLICIES`` and every op's ``READS`` while the block runs (the meter's
    single-read variants; tests plant wrong reads with it)."""
    unknown = [(op, g) for op, grads in reads.items() for g in grads if op not in OPS or g not in OPS[op].READS[base]]
    if unknown:
        raise ValueError(f"no such reads {unknown}; valid: {read_rules(base)}")
    POLICIES[name] = f"{base} with {reads}"
    for op, module in OPS.items():
        module.READS[name] = {**module.READS[base], **reads.get(op, {})}
    try:
        yield name
    finally:
        del POLICIES[name]
        for module in OPS.values():
            del module.READS[name]


@contextlib.contextmanager
def applied(numerics, variant: Variant):
    """Run the block's backward as ``variant`` says; the numerics are restored on exit."""
    saved = numerics.policy, numerics.attention_bwd, numerics.recipe
    policy = variant.policy or numerics.policy
    with contextlib.ExitStack() as stack:
        if variant.reads:
            policy = stack.enter_context(temporary_policy("_bias_variant", policy, variant.reads))
        numerics.policy = policy
        if "attention" in variant.exact_bwd:
            numerics.attention_bwd = "fp32"
        if "linear" in variant.exact_bwd:
            fprop = numerics.recipe.override_linear_precision[0]
            numerics.recipe = dataclasses.replace(numerics.recipe, override_linear_precision=(fprop, True, True))
        try:
            yield
        finally:
            numerics.policy, numerics.attention_bwd, numerics.recipe = saved
