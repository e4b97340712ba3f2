"""Autograd ops whose every backward read is declared in a ``READS`` table next to the backward.

Import the functions from their modules: ``readback.ops.linear.linear``,
``readback.ops.norm.rms_norm``, ``readback.ops.attention.attention``, ``readback.ops.activation.xielu``.
``numerics_for`` makes a run's ``Numerics`` with the ops' read rules resolved for its policy.
"""

from typing import Any

from readback.numerics import DelayedScaling, ScalingRecipe
from readback.numerics.gemm import BF16_GEMMS
from readback.numerics.site import Site
from readback.numerics.spec import (
    ATTENTION_BWD_PRECISIONS,
    ATTENTION_BWD_READS,
    PRECISIONS,
    NumericsSpec,
    resolve_accumulation,
)
from readback.numerics.spike import AmaxSpike
from readback.numerics.state import Numerics
from readback.ops import activation, attention, linear, norm
from readback.policy import POLICIES

# Every op module (with its READS table), by the name policy tables and the audit use.
OPS = {"linear": linear, "rms_norm": norm, "attention": attention, "xielu": activation}


def read_rules(
    policy: str, attention_bwd_reads: str = "forward", recipe: ScalingRecipe | None = None
) -> dict[str, dict[str, str]]:
    """``{op: {gradient: read mode}}`` of every op under ``policy``, with the attention backward's
    flavour (``attention.BWD_READS``) laid over attention's row and the reads ``recipe`` sets
    (``linear.recipe_reads``: a block recipe's own copies, a backward_override's) over the
    linear's. ``exact`` takes neither: it is every gradient reading what its forward used,
    whatever the backward reads otherwise."""
    rules = {name: dict(op.READS[policy]) for name, op in OPS.items()}
    if policy != "exact":
        rules["attention"] |= attention.BWD_READS[attention_bwd_reads]
        rules["linear"] |= linear.recipe_reads(recipe)
    return rules


def numerics_spec(
    precision: str = "fp8",
    recipe: ScalingRecipe | None = None,
    policy: str = "exact",
    attention_bwd_precision: str = "fp8",
    rounding: str = "nearest",
    bf16_sites: tuple[str, ...] = (),
    site_margin: dict[str, int] | None = None,
    accumulation: str = "native",
    accumulation_gemms: dict[str, str] | None = None,
    bf16_gemm: str = BF16_GEMMS[0],
    amax_spike: AmaxSpike | None = None,
    attention_bwd_reads: str = ATTENTION_BWD_READS[0],
    attention_recipe: ScalingRecipe | None = None,
) -> NumericsSpec:
    """The spec of a run: ``policy``'s reads resolved from the ops' tables, the choices made
    concrete (an FP8 run without a recipe gets ``DelayedScaling()``; a BF16 run's FP8 attention
    backward runs in BF16, an ``off`` run's in FP64; only FP8 rounds stochastically; the linears'
    accumulation, ``spec.resolve_accumulation``, applies to FP8 GEMMs only; ``attention_bwd_reads``
    lays the attention backward's flavour over the policy's reads; ``attention_recipe``, the
    attention core's own per-tensor recipe, is an FP8 run's only)."""
    for key, value, valid in (
        ("precision", precision, PRECISIONS),
        ("policy", policy, POLICIES),
        ("attention_bwd_precision", attention_bwd_precision, ATTENTION_BWD_PRECISIONS),
        ("attention_bwd_reads", attention_bwd_reads, ATTENTION_BWD_READS),
    ):
        if value not in valid:
            raise ValueError(f"{key}={value!r}; valid: {list(valid)}")
    recipe = DelayedScaling() if precision == "fp8" and recipe is None else recipe
    return NumericsSpec(
        precision=precision,
        recipe=recipe,
        policy=policy,
        reads=read_rules(policy, attention_bwd_reads, recipe if precision == "fp8" else None),
        attention_bwd_precision={
            "fp8": attention_bwd_precision,
            "bf16": "bf16" if attention_bwd_precision == "fp8" else attention_bwd_precision,
            "off": "fp64",
        }[precision],
        rounding=rounding if precision == "fp8" else "nearest",
        bf16_sites=bf16_sites,
        site_margin=tuple((site_margin or {}).items()),
        accumulation=resolve_accumulation(accumulation, accumulation_gemms),
        bf16_gemm=bf16_gemm,
        amax_spike=amax_spike,
        attention_bwd_reads=attention_bwd_reads,
        attention_recipe=attention_recipe if precision == "fp8" else None,
    )


def numerics_for(*args: Any, seed: int = 0, **kwargs: Any) -> Numerics:
    """A run's ``Numerics``: ``numerics_spec(*args, **kwargs)`` and the random streams of ``seed``."""
    return Numerics(numerics_spec(*args, **kwargs), seed=seed)


__all__ = [
    "ATTENTION_BWD_PRECISIONS",
    "ATTENTION_BWD_READS",
    "OPS",
    "PRECISIONS",
    "Numerics",
    "NumericsSpec",
    "Site",
    "numerics_for",
    "numerics_spec",
    "read_rules",
]
