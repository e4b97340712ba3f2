"""The numerics spec: how a run rounds, resolved once from its config and frozen.

Like Transformer Engine's recipe dataclasses, a spec is data whose field names are the user's
vocabulary; the run's mutable state (sites, counters, random streams, the tape) lives elsewhere
and reads it. A backward that reads differently (a bias-meter variant, the reference replay) is
a new spec, made with the ``with_*`` helpers, never an edit of this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from readback.numerics.attention_settings import BWD_ROUNDED, AttentionSettings
from readback.numerics.precision_settings import (
    GEMMS,
    Fp8Settings,
    PrecisionSettings,
    amax_spike_of,
    resolve_accumulation,
)
from readback.numerics.scaling import CurrentScaling, DelayedScaling, ScalingRecipe
from readback.numerics.settings import NumericsSettings
from readback.numerics.spike import AmaxSpike

# The sites an attention core rounds at, ``<op>.q``, ... (``ops.attention.SITES``); every model names
# its attention op ``<module>.core`` (FOG: ``layers.<i>.attn.core``; ``readback.convert``: the SDPA
# caller's name plus ``.core``), so a site is the core's by its name alone (``is_attention_site``).
ATTENTION_SITES = ("q", "k", "v", "probs", "output", "grad_output", "grad_scores")
# A current-scaling attention core scales its P and dS (TE's S and dP quantizers) with a
# DelayedScaling all the same (TE 2.8 to 2.20, dot_product_attention.py ``init_fp8_metadata``): the
# linears' under delayed linears, else one in the attention's format with the history and algorithm
# of NVTE_DPA_FP8DS_AMAX_HISTLEN and NVTE_DPA_FP8DS_AMAX_ALGO at TE's defaults, and no margin.
DELAYED_UNDER_CURRENT = ("probs", "grad_scores")
DPA_DELAYED_HISTORY_LEN, DPA_DELAYED_ALGO = 1, "most_recent"

Reads = Mapping[str, Mapping[str, str]]  # op -> gradient -> read mode


def in_bf16_layers(name: str, bf16_layers: tuple[str, ...] | list[str]) -> bool:
    """The one rule of ``precision.bf16_layers``: a site or module is kept in BF16 when its name
    starts with one of the listed prefixes (``lm_head``, ``layers.0.mlp``, ...)."""
    return name.startswith(tuple(bf16_layers))


def is_attention_site(name: str) -> bool:
    """Whether site ``name`` is an attention core's (``<...>.core.<one of ATTENTION_SITES>``): the
    sites ``NumericsSpec.attention_recipe`` scales. By name, so that a site made from a checkpoint
    before its op runs gets the same state."""
    owner, _, site = name.rpartition(".")
    return site in ATTENTION_SITES and (owner == "core" or owner.endswith(".core"))


def frozen_reads(reads: Mapping[str, Mapping[str, str]]) -> Reads:
    """A read-only copy of ``{op: {gradient: mode}}``."""
    return MappingProxyType({op: MappingProxyType(dict(grads)) for op, grads in reads.items()})


@dataclass(frozen=True)
class NumericsSpec:
    """A run's ``settings`` (``NumericsSettings``: the precision and attention groups and the
    policy, nested: ``spec.attention.bwd_precision``) and ``reads`` (``{op: {gradient: mode}}``),
    resolved from the ops' tables under them by ``ops.numerics_spec``; what the settings come to
    as the run runs them are the properties below. ``policy`` may also be a label of reads no
    named policy has (a bias-meter variant's, a test's planted read: ``with_reads``)."""

    settings: NumericsSettings
    reads: Reads

    def __post_init__(self) -> None:
        object.__setattr__(self, "reads", frozen_reads(self.reads))
        assert self.attention.bwd_reads == "forward" or self.bwd_gemm_precision != "fp8", "ops read FP8 codes"

    def __deepcopy__(self, memo: dict[int, object]) -> NumericsSpec:
        return self  # immutable: a copied model shares its spec

    def __reduce__(self) -> tuple[type[NumericsSpec], tuple[object, ...]]:
        plain = {op: dict(grads) for op, grads in self.reads.items()}  # a mappingproxy does not pickle
        return NumericsSpec, (self.settings, plain)

    @property
    def precision(self) -> PrecisionSettings:
        return self.settings.precision

    @property
    def attention(self) -> AttentionSettings:
        return self.settings.attention

    @property
    def policy(self) -> str:
        return self.settings.policy

    @property
    def fp8(self) -> Fp8Settings | None:
        return self.settings.fp8

    @cached_property
    def recipe(self) -> ScalingRecipe | None:
        """The linears' recipe object; None without FP8."""
        return self.settings.recipe()

    @cached_property
    def attention_recipe(self) -> ScalingRecipe | None:
        """The attention core's own recipe object (``attention.recipe``), which its sites
        (``is_attention_site``) take instead of ``recipe``; None: ``recipe``'s."""
        return self.attention.scaling_recipe(self.fp8) if self.fp8 else None

    @property
    def rounding(self) -> str:
        """The forward's roundings: ``precision.rounding`` under FP8, else ``nearest``."""
        return self.fp8.rounding if self.fp8 else "nearest"

    @property
    def bwd_gemm_precision(self) -> str:
        """The attention backward's GEMM precision as it runs: ``attention.bwd_precision``, but a
        BF16 run's FP8 choice in BF16 and a reference's (``REFERENCE``) in FP64."""
        if self.precision.name == "off":
            return "fp64"
        fp8_in_bf16 = self.precision.name == "bf16" and self.attention.bwd_precision == "fp8"
        return "bf16" if fp8_in_bf16 else self.attention.bwd_precision

    @cached_property
    def accumulation(self) -> tuple[str, str, str]:
        """How the FP8 GEMMs of a linear's ``(fprop, dgrad, wgrad)`` add their products
        (``resolve_accumulation``; ``native`` is each device's own, resolved by ``gemm.matmul``)."""
        if self.fp8 is None:
            return resolve_accumulation("native")
        return resolve_accumulation(self.fp8.accumulation, dict(self.fp8.accumulation_gemms or {}))

    @property
    def bf16_sites(self) -> tuple[str, ...]:
        """Name prefixes of the sites kept in BF16 under FP8 (``precision.bf16_layers``)."""
        return tuple(self.fp8.bf16_layers) if self.fp8 else ()

    @cached_property
    def site_margin(self) -> tuple[tuple[str, int], ...]:
        """``((site pattern, k), ...)``: an extra margin at the FP8 sites a pattern matches, dividing
        their scale by ``2**k`` wherever it is used (``precision.site_margin``)."""
        margins = dict(self.fp8.site_margin or {}) if self.fp8 else {}
        return tuple((str(pattern), int(k)) for pattern, k in margins.items())

    @cached_property
    def amax_spike(self) -> AmaxSpike | None:
        """An amax multiplied by ``2**k`` at one step at the sites a pattern matches (delayed
        scaling only: ``readback.numerics.spike``), or None."""
        return amax_spike_of(self.fp8.amax_spike) if self.fp8 else None

    @property
    def bf16_gemm(self) -> str:
        """The kernel of every BF16 GEMM off CUDA (``gemm.bf16_mm``: ``fp32`` or ``native``)."""
        return self.precision.bf16_gemm

    def read(self, op: str, gradient: str) -> str:
        """Which value ``op``'s ``gradient`` reads: ``rounded``, ``original``, ``fresh`` or ``none``."""
        return self.reads[op][gradient]

    def linear_precision(self, gemm: str) -> str:
        """GEMM precision of a linear's ``fprop``, ``dgrad`` or ``wgrad``: ``fp32`` where
        ``override_linear_precision`` says so, ``bf16`` for the backward's under a
        ``backward_override`` (TE runs them in the activations' dtype)."""
        if self.precision.name == "off":
            return "fp64"
        if self.recipe is None:
            return "fp8"
        if self.recipe.override_linear_precision[GEMMS.index(gemm)]:
            return "fp32"
        return "bf16" if gemm != "fprop" and self.recipe.backward_override is not None else "fp8"

    def linear_accumulation(self, gemm: str) -> str:
        """How a linear's ``fprop``, ``dgrad`` or ``wgrad`` FP8 GEMM accumulates (``gemm.matmul``)."""
        return self.accumulation[GEMMS.index(gemm)]

    def linear_gemm(self, gemm: str) -> tuple[str, str, str]:
        """``gemm.matmul``'s ``(precision, accumulation, bf16_gemm)`` for a linear's ``fprop``,
        ``dgrad`` or ``wgrad``."""
        return self.linear_precision(gemm), self.linear_accumulation(gemm), self.bf16_gemm

    def recipe_for(self, name: str) -> ScalingRecipe:
        """The recipe whose format and scaling state FP8 site ``name`` takes: ``attention_recipe``
        at an attention core's sites (``is_attention_site``) where there is one, else ``recipe``;
        but a DelayedScaling at a current-scaling core's P and dS (``DELAYED_UNDER_CURRENT``)."""
        attention = is_attention_site(name)
        recipe = self.attention_recipe if self.attention_recipe and attention else self.recipe
        if recipe is None:
            raise ValueError(f"site {name}: a {self.precision.name} spec has no recipe")
        if attention and isinstance(recipe, CurrentScaling) and name.rpartition(".")[2] in DELAYED_UNDER_CURRENT:
            if isinstance(self.recipe, DelayedScaling):
                return self.recipe
            history, algo = DPA_DELAYED_HISTORY_LEN, DPA_DELAYED_ALGO
            return DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=history, amax_compute_algo=algo)
        return recipe

    def attention_rounds(self, gradient: str) -> bool:
        """Whether the attention backward rounds ``gradient`` (``grad_output``: dO, ``grad_scores``:
        dS) to its FP8 format before the GEMMs that read it: as ``attention.round_<gradient>``
        says, else under an FP8 backward; ``grad_output_in_d``, whether D reads dO8, else as
        ``grad_output``."""
        assert gradient in BWD_ROUNDED, gradient
        rounds: bool | None = getattr(self.attention, f"round_{gradient}")
        if rounds is None and gradient == "grad_output_in_d":
            return self.attention_rounds("grad_output")
        return self.bwd_gemm_precision == "fp8" if rounds is None else rounds

    def is_bf16_site(self, name: str) -> bool:
        """Whether site ``name`` rounds to BF16 (the one rule: a BF16 run, or a ``bf16_sites`` prefix)."""
        return self.precision.name == "bf16" or (self.fp8 is not None and in_bf16_layers(name, self.bf16_sites))

    def with_reads(self, policy: str, reads: Mapping[str, Mapping[str, str]]) -> NumericsSpec:
        """This spec reading as ``reads`` says, under the label ``policy``."""
        return NumericsSpec(replace(self.settings, policy=policy), reads)

    def with_attention(self, **values: Any) -> NumericsSpec:
        """This spec with the attention settings ``values`` (its reads as they are)."""
        return NumericsSpec(replace(self.settings, attention=replace(self.attention, **values)), self.reads)

    def with_precision(self, **values: Any) -> NumericsSpec:
        """This spec with the precision settings ``values`` (its reads as they are)."""
        return NumericsSpec(replace(self.settings, precision=replace(self.precision, **values)), self.reads)

    def with_exact_backward(self, op: str) -> NumericsSpec:
        """This spec with ``op``'s (``attention`` or ``linear``) backward GEMMs in FP32, no gradient roundings."""
        if op == "attention":
            return self.with_attention(bwd_precision="fp32", **{f"round_{g}": None for g in BWD_ROUNDED})
        assert self.fp8 is not None  # only FP8 linears round their backward
        return self.with_precision(override_linear_precision=[self.fp8.override_linear_precision[0], True, True])
