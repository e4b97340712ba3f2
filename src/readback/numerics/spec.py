"""The numerics spec: how a run rounds, resolved once from its config and frozen.

Like Transformer Engine's recipe dataclasses, a spec is data whose field names are the user's
vocabulary; the run's mutable state (sites, counters, random streams, the tape) lives elsewhere
and reads it. A backward that reads differently (a bias-meter variant, the reference replay) is
a new spec, made with ``dataclasses.replace`` or the ``with_*`` helpers, never an edit of this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from readback.numerics.accumulation import MODES as ACCUMULATION_MODES
from readback.numerics.gemm import BF16_GEMMS, GEMM_PRECISIONS
from readback.numerics.rounding import ROUNDINGS
from readback.numerics.scaling import CurrentScaling, DelayedScaling, ScalingRecipe
from readback.numerics.spike import AmaxSpike

PRECISIONS = ("fp8", "bf16", "off")
ATTENTION_BWD_PRECISIONS = GEMM_PRECISIONS[:3]  # what a run may choose: fp8, bf16, fp32 (fp64 is the "off" spec's)
# attention.bwd_reads: which operands the attention backward reads besides the policy's D read;
# ops.attention.BWD_READS says what each reads ("te": Transformer Engine's BF16 backward's).
ATTENTION_BWD_READS = ("forward", "te")
# The parts of the attention backward that attention.bwd_reads and bwd_precision set together, each
# a setting of its own too: what dQ, dK, dP read of Q, K, V (bwd_qkv); what dV, dS read of P
# (bwd_probs); and which gradients the backward rounds to its FP8 format before their GEMMs.
ATTENTION_BWD_QKV = ("forward", "original")  # forward: what the FP8 forward multiplied (Q8, K8, V8)
ATTENTION_BWD_PROBS = ("forward", "rebuilt")
# attention.kernel: readback's ops (PyTorch, tiled by a Python loop), one Triton kernel of the same
# roundings (readback.kernels), or auto: the kernel on CUDA where it runs the spec, else the ops
# (ops.attention_triton.runs decides, on the tensors' device).
ATTENTION_KERNELS = ("auto", "ops", "triton")  # forward: the forward's P8 (dV) and P (dS)
# grad_output_in_d: the dO that D = rowsum(dO * O) reads, apart from the dO of the dV and dP GEMMs
ATTENTION_BWD_ROUNDED = ("grad_output", "grad_scores", "grad_output_in_d")
# The sites an attention core rounds at, ``<op>.q``, ... (``ops.attention.SITES``); every model names
# its attention op ``<module>.core`` (FOG: ``layers.<i>.attn.core``; ``readback.convert``: the SDPA
# caller's name plus ``.core``), so a site is the core's by its name alone (``is_attention_site``).
ATTENTION_SITES = ("q", "k", "v", "probs", "output", "grad_output", "grad_scores")
# precision.attention_recipe: the per-tensor recipes an attention core may take apart from the
# linears' (Transformer Engine's NVTE_DPA_FP8_RECIPE); TE's MXFP8 attention is not emulated.
ATTENTION_RECIPES: dict[str, type[ScalingRecipe]] = {r.KEY: r for r in (DelayedScaling, CurrentScaling)}
# A current-scaling attention core scales its P and dS (TE's S and dP quantizers) with a
# DelayedScaling all the same (TE 2.8 to 2.20, dot_product_attention.py ``init_fp8_metadata``): the
# linears' under delayed linears, else one in the attention's format with the history and algorithm
# of NVTE_DPA_FP8DS_AMAX_HISTLEN and NVTE_DPA_FP8DS_AMAX_ALGO at TE's defaults, and no margin.
DELAYED_UNDER_CURRENT = ("probs", "grad_scores")
DPA_DELAYED_HISTORY_LEN, DPA_DELAYED_ALGO = 1, "most_recent"
GEMMS = ("fprop", "dgrad", "wgrad")
# precision.accumulation: each device's own (native), IEEE FP32 everywhere, or Hopper's recipe,
# which Transformer Engine and torch._scaled_mm's defaults give: fast fprop, split dgrad and wgrad.
ACCUMULATIONS = {
    "native": ("native",) * 3,
    "ieee": ("ieee",) * 3,
    "hopper": ("fast", "split", "split"),
}

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


def resolve_accumulation(name: str, gemms: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """``(fprop, dgrad, wgrad)`` accumulations of ``precision.accumulation`` with its per-GEMM
    overrides (``{gemm: fast | split | ieee}``)."""
    if name not in ACCUMULATIONS:
        raise ValueError(f"accumulation={name!r}; valid: {list(ACCUMULATIONS)}")
    resolved = dict(zip(GEMMS, ACCUMULATIONS[name]))
    for gemm, mode in (gemms or {}).items():
        if gemm not in GEMMS or mode not in ACCUMULATION_MODES:
            raise ValueError(f"accumulation of {gemm!r}: {mode!r}; valid: {{{', '.join(GEMMS)}}}: {ACCUMULATION_MODES}")
        resolved[gemm] = mode
    fprop, dgrad, wgrad = (resolved[g] for g in GEMMS)
    return fprop, dgrad, wgrad


def frozen_reads(reads: Mapping[str, Mapping[str, str]]) -> Reads:
    """A read-only copy of ``{op: {gradient: mode}}``."""
    return MappingProxyType({op: MappingProxyType(dict(grads)) for op, grads in reads.items()})


@dataclass(frozen=True)
class NumericsSpec:
    """``precision``: ``fp8`` (``recipe`` required), ``bf16`` (every site rounds to BF16, no
    scaling) or ``off`` (no rounding, FP64 GEMMs: gradcheck and references). ``policy`` names
    the saved-activation policy that ``reads`` (``{op: {gradient: mode}}``) were resolved from.
    ``attention_bwd_precision``: the attention backward's GEMM precision as it runs (a BF16 run's FP8
    choice runs in BF16, an ``off`` run's in FP64). ``rounding``: the forward's roundings
    (``nearest`` or ``stochastic``; always ``nearest`` without FP8). ``bf16_sites``: name prefixes of sites kept in BF16
    under FP8 (the study's LM head). ``site_margin``: ``((site pattern, k), ...)``, an extra margin
    at the FP8 sites a pattern matches, dividing their scale by ``2**k`` wherever it is used.
    ``accumulation``: how the FP8 GEMMs of a linear's ``(fprop, dgrad, wgrad)`` add their products
    (``resolve_accumulation``; ``native`` is each device's own, resolved by ``gemm.matmul``).
    ``bf16_gemm``: the kernel of every BF16 GEMM off CUDA (``gemm.bf16_mm``: ``fp32`` or ``native``).
    ``amax_spike``: an amax multiplied by ``2**k`` at one step at the sites a pattern matches
    (``readback.numerics.spike``; delayed scaling only), or None. ``attention_bwd_reads``: the
    attention backward's flavour (``ATTENTION_BWD_READS``), already laid into ``reads``; kept so
    that a backward under another policy (a bias-meter variant) reads in the same flavour;
    ``attention_bwd_qkv`` and ``attention_bwd_probs`` likewise, a part of the flavour set apart
    (``ATTENTION_BWD_QKV``, ``ATTENTION_BWD_PROBS``; None: the flavour's). ``attention_bwd_rounds``:
    ``((gradient, rounds), ...)`` of ``ATTENTION_BWD_ROUNDED`` set apart from the backward's own
    rule (an FP8 backward rounds dO and dS to its format, the others neither:
    ``attention_rounds``). A
    flavour other than ``forward`` reads operands that are no FP8 codes: no FP8 backward.
    ``attention_recipe``: the attention core's own per-tensor recipe (``ATTENTION_RECIPES``;
    ``precision.attention_recipe``, TE's ``NVTE_DPA_FP8_RECIPE``), which its sites
    (``is_attention_site``) take instead of ``recipe``; None: ``recipe``'s (per tensor from their
    own amax under a block recipe, ``BlockScalingRecipe``). ``attention_kernel``: which core
    runs the attention (``ATTENTION_KERNELS``)."""

    precision: str
    recipe: ScalingRecipe | None
    policy: str
    reads: Reads
    attention_bwd_precision: str = "fp8"
    rounding: str = "nearest"
    bf16_sites: tuple[str, ...] = ()
    site_margin: tuple[tuple[str, int], ...] = field(default=())
    accumulation: tuple[str, str, str] = ("native", "native", "native")
    bf16_gemm: str = BF16_GEMMS[0]
    amax_spike: AmaxSpike | None = None
    attention_bwd_reads: str = ATTENTION_BWD_READS[0]
    attention_recipe: ScalingRecipe | None = None
    attention_bwd_qkv: str | None = None
    attention_bwd_probs: str | None = None
    attention_bwd_rounds: tuple[tuple[str, bool], ...] = ()
    attention_kernel: str = ATTENTION_KERNELS[0]

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}; valid: {list(PRECISIONS)}")
        if self.precision == "fp8" and self.recipe is None:
            raise ValueError("an fp8 spec needs a recipe")
        if self.attention_recipe is not None and (
            self.precision != "fp8" or type(self.attention_recipe) not in ATTENTION_RECIPES.values()
        ):
            raise ValueError(
                f"attention_recipe={self.attention_recipe!r}: an fp8 spec's, one of {list(ATTENTION_RECIPES)}"
            )
        histories = [r for r in (self.recipe, self.attention_recipe) if isinstance(r, DelayedScaling)]
        if self.amax_spike is not None and not histories:
            raise ValueError("an amax spike needs delayed scaling: only an amax history holds it")
        if self.attention_bwd_reads != "forward" and self.attention_bwd_precision == "fp8":
            raise ValueError(f"attention_bwd_reads={self.attention_bwd_reads!r} needs a bf16, fp32 or fp64 backward")
        for key, value, valid in (
            ("attention_bwd_precision", self.attention_bwd_precision, GEMM_PRECISIONS),
            ("rounding", self.rounding, ROUNDINGS),
            ("bf16_gemm", self.bf16_gemm, BF16_GEMMS),
            ("attention_bwd_reads", self.attention_bwd_reads, ATTENTION_BWD_READS),
            ("attention_bwd_qkv", self.attention_bwd_qkv, (None, *ATTENTION_BWD_QKV)),
            ("attention_bwd_probs", self.attention_bwd_probs, (None, *ATTENTION_BWD_PROBS)),
            ("attention_kernel", self.attention_kernel, ATTENTION_KERNELS),
        ):
            if value not in valid:
                raise ValueError(f"{key}={value!r}; valid: {list(valid)}")
        if len(self.accumulation) != 3 or not set(self.accumulation) <= {"native", *ACCUMULATION_MODES}:
            valid = ("native", *ACCUMULATION_MODES)
            raise ValueError(f"accumulation={self.accumulation!r}: (fprop, dgrad, wgrad), each one of {valid}")
        object.__setattr__(self, "accumulation", tuple(self.accumulation))
        object.__setattr__(self, "reads", frozen_reads(self.reads))
        object.__setattr__(self, "bf16_sites", tuple(self.bf16_sites))
        object.__setattr__(self, "site_margin", tuple((str(p), int(k)) for p, k in self.site_margin))
        rounds = tuple((str(g), bool(r)) for g, r in self.attention_bwd_rounds)
        if not {g for g, _ in rounds} <= set(ATTENTION_BWD_ROUNDED):
            raise ValueError(f"attention_bwd_rounds={rounds!r}: gradients of {ATTENTION_BWD_ROUNDED}")
        object.__setattr__(self, "attention_bwd_rounds", rounds)

    def __deepcopy__(self, memo: dict[int, object]) -> NumericsSpec:
        return self  # immutable: a copied model shares its spec

    def __reduce__(self) -> tuple[type[NumericsSpec], tuple[object, ...]]:
        plain = {op: dict(grads) for op, grads in self.reads.items()}  # a mappingproxy does not pickle
        return NumericsSpec, (
            self.precision,
            self.recipe,
            self.policy,
            plain,
            self.attention_bwd_precision,
            self.rounding,
            self.bf16_sites,
            self.site_margin,
            self.accumulation,
            self.bf16_gemm,
            self.amax_spike,
            self.attention_bwd_reads,
            self.attention_recipe,
            self.attention_bwd_qkv,
            self.attention_bwd_probs,
            self.attention_bwd_rounds,
            self.attention_kernel,
        )

    def read(self, op: str, gradient: str) -> str:
        """Which value ``op``'s ``gradient`` reads: ``rounded``, ``original``, ``fresh`` or ``none``."""
        return self.reads[op][gradient]

    def linear_precision(self, gemm: str) -> str:
        """GEMM precision of a linear's ``fprop``, ``dgrad`` or ``wgrad``: ``fp32`` where
        ``override_linear_precision`` says so, ``bf16`` for the backward's under a
        ``backward_override`` (TE runs them in the activations' dtype)."""
        if self.precision == "off":
            return "fp64"
        if self.precision != "fp8" or self.recipe is None:
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
            raise ValueError(f"site {name}: a {self.precision} spec has no recipe")
        if attention and isinstance(recipe, CurrentScaling) and name.rpartition(".")[2] in DELAYED_UNDER_CURRENT:
            if isinstance(self.recipe, DelayedScaling):
                return self.recipe
            history, algo = DPA_DELAYED_HISTORY_LEN, DPA_DELAYED_ALGO
            return DelayedScaling(fp8_format=recipe.fp8_format, amax_history_len=history, amax_compute_algo=algo)
        return recipe

    def attention_rounds(self, gradient: str) -> bool:
        """Whether the attention backward rounds ``gradient`` (``grad_output``: dO, ``grad_scores``:
        dS) to its FP8 format before the GEMMs that read it: as ``attention_bwd_rounds`` says, else
        under an FP8 backward; ``grad_output_in_d``, whether D reads dO8, else as ``grad_output``."""
        rounds = dict(self.attention_bwd_rounds)
        if gradient == "grad_output_in_d" and gradient not in rounds:
            return self.attention_rounds("grad_output")
        return rounds.get(gradient, self.attention_bwd_precision == "fp8")

    def is_bf16_site(self, name: str) -> bool:
        """Whether site ``name`` rounds to BF16 (the one rule: a BF16 run, or a ``bf16_sites`` prefix)."""
        return self.precision == "bf16" or (self.precision == "fp8" and in_bf16_layers(name, self.bf16_sites))

    def with_reads(self, policy: str, reads: Mapping[str, Mapping[str, str]]) -> NumericsSpec:
        """This spec reading as ``reads`` says, under the label ``policy``."""
        return replace(self, policy=policy, reads=reads)

    def with_exact_backward(self, op: str) -> NumericsSpec:
        """This spec with ``op``'s (``attention`` or ``linear``) backward GEMMs in FP32, no gradient roundings."""
        if op == "attention":
            return replace(self, attention_bwd_precision="fp32", attention_bwd_rounds=())
        assert self.recipe is not None  # only FP8 linears round their backward
        fprop = self.recipe.override_linear_precision[0]
        return replace(self, recipe=replace(self.recipe, override_linear_precision=(fprop, True, True)))
