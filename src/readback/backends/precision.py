"""The ``precision`` and ``attention`` groups' schemas: the numerics of a run, as Hydra composes
them and as ``readback.convert`` accepts them from Python (one set of types, ranges and error words
for both); ``spec_of``, a run's ``NumericsSpec`` from them and its policy, in one step.

It sits with the backends because ``readback.convert`` checks its arguments with it;
``readback.config`` registers it with the other groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from readback.errors import ConfigError, require
from readback.fields import Checked, integer, items, number, one_of
from readback.numerics import (
    AMAX_COMPUTE_ALGOS,
    BACKWARD_OVERRIDES,
    RECIPES,
    ROUNDINGS,
    DelayedScaling,
    Float8BlockScaling,
    Format,
    FP8Format,
    NVFP4BlockScaling,
    ScalingRecipe,
)
from readback.numerics.gemm import BF16_GEMMS
from readback.numerics.spec import (
    ACCUMULATIONS,
    ATTENTION_BWD_PRECISIONS,
    ATTENTION_BWD_PROBS,
    ATTENTION_BWD_QKV,
    ATTENTION_BWD_READS,
    ATTENTION_KERNELS,
    ATTENTION_RECIPES,
    PRECISIONS,
    NumericsSpec,
    resolve_accumulation,
)
from readback.numerics.spike import AmaxSpike
from readback.ops import numerics_spec
from readback.ops.attention import READS

# The recipe fields' defaults: Transformer Engine's default recipe, as numerics.scaling declares
# it, and its Float8BlockScaling and NVFP4BlockScaling for the fields only those recipes have.
TE_DEFAULT = DelayedScaling()
BLOCKWISE = Float8BlockScaling()
NVFP4 = NVFP4BlockScaling()


@dataclass
class Precision(Checked):
    KEY = "precision"
    name: str = one_of(PRECISIONS[:2])  # "off" is for reference computations, not runs
    # The BF16 GEMMs (bf16_layers, a BF16 attention backward) off CUDA: fp32 (an FP32 GEMM of the
    # BF16 values, rounded once to BF16: FP32 speed on any CPU) | native (torch's BF16 GEMM).
    bf16_gemm: str = one_of(BF16_GEMMS, default=BF16_GEMMS[0])


@dataclass
class Fp8Precision(Precision):
    """The FP8 settings, in Transformer Engine's recipe vocabulary. ``recipe`` names the recipe's
    class (``numerics.RECIPES``) and the recipe fields follow, with the recipes' defaults
    (``fp8_format`` null: the recipe's own, as in TE); ``scaling_recipe`` makes the one recipe
    object that the emulation and the TE mapping read."""

    recipe: str = one_of(RECIPES, default=TE_DEFAULT.KEY)
    # HYBRID: E4M3 fwd, E5M2 bwd; null: the recipe's default (HYBRID per tensor, E4M3 by blocks, as TE)
    fp8_format: str | None = one_of((f.name for f in Format), default=None)
    margin: int = integer(minimum=0, default=TE_DEFAULT.margin)
    interval: int = integer(default=TE_DEFAULT.interval)  # delayed: recompute the scale every `interval` steps
    amax_history_len: int = integer(default=TE_DEFAULT.amax_history_len)
    amax_compute_algo: str = one_of(AMAX_COMPUTE_ALGOS, default=TE_DEFAULT.amax_compute_algo)
    override_linear_precision: list[bool] = items(  # (fprop, dgrad, wgrad): true = high precision
        "three booleans [fprop, dgrad, wgrad]", lambda v: len(v) == 3, list(TE_DEFAULT.override_linear_precision)
    )
    # null | dequantized (backward GEMMs in BF16 on the forward's dequantised copies) | high_precision
    # (on the original input and weight); neither rounds dY. Not under delayed scaling.
    backward_override: str | None = one_of(BACKWARD_OVERRIDES, default=None)
    # blockwise (Float8BlockScaling): 1 = 1x128 lines, 2 = 128x128 blocks (at most one tensor)
    x_block_scaling_dim: int = one_of((1, 2), default=BLOCKWISE.x_block_scaling_dim)
    w_block_scaling_dim: int = one_of((1, 2), default=BLOCKWISE.w_block_scaling_dim)
    grad_block_scaling_dim: int = one_of((1, 2), default=BLOCKWISE.grad_block_scaling_dim)
    pow2_scales: bool = BLOCKWISE.pow2_scales  # blockwise: power-of-two scales (TE's QParams.power_2_scale)
    amax_epsilon: float = number(0, default=BLOCKWISE.amax_epsilon)  # blockwise: each block's amax at least this
    # nvfp4 (NVFP4BlockScaling): TE's switches of its Hadamard transform (the wgrad copies of X and
    # dY), stochastic rounding (dY's copies) and 16x16 weight blocks
    disable_rht: bool = NVFP4.disable_rht
    disable_stochastic_rounding: bool = NVFP4.disable_stochastic_rounding
    disable_2d_quantization: bool = NVFP4.disable_2d_quantization
    rounding: str = one_of(ROUNDINGS, default="nearest")  # the forward's roundings: nearest | stochastic
    # Sites kept in BF16 (name prefixes), checked against the model's layers in config.cross_group.
    bf16_layers: list[str] = dataclasses.field(default_factory=list)
    # Extra margin per site pattern, e.g. {attn.core.output: 14}: scale / 2**k at matched sites
    # (untyped: Hydra replaces the whole mapping).
    site_margin: Any = None
    # The linears' FP8 GEMMs: native (the device's own: IEEE FP32 on the CPU, torch._scaled_mm's
    # split on CUDA) | ieee | hopper (an H100's tensor cores, bit for bit: fast fprop, split dgrad
    # and wgrad); accumulation_gemms overrides it per GEMM, e.g. {dgrad: fast}: fast | split | ieee.
    accumulation: str = one_of(ACCUMULATIONS, default="native")
    accumulation_gemms: Any = None
    # An injected amax spike, e.g. {site: attn.core.output, step: 1000, k: 12}: the amax of step
    # 1000 at matched sites x 2**k as it enters the history (delayed only), so the scale of steps
    # 1001 .. 1000 + amax_history_len is lowered by it (untyped, as site_margin; see amax_spike_of).
    amax_spike: Any = None

    def scaling_recipe(self) -> ScalingRecipe:
        """The one recipe object of these settings: ``precision.recipe``'s class with the fields
        it has (a field of another recipe is not read)."""
        cls = RECIPES[self.recipe]
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(cls)}
        fields["override_linear_precision"] = tuple(fields["override_linear_precision"])
        fields["fp8_format"] = self.format()
        return cls(**fields)

    def format(self) -> Format:
        """``fp8_format``, or the recipe's default where it is null."""
        return Format.parse(self.fp8_format) if self.fp8_format else RECIPES[self.recipe].fp8_format

    def check(self) -> None:
        fmt = self.format()
        strictest = min((fmt.fwd, fmt.bwd), key=lambda f: f.zero_margin)
        sites = "all sites" if fmt.fwd is fmt.bwd else "the forward sites: activations and weights"
        require(
            self.margin < strictest.zero_margin,
            self.key("margin"),
            self.margin,
            f"an integer in [0, {strictest.zero_margin - 1}] for the {strictest} sites ({sites}): "
            + underflow_words(strictest),
        )
        self._check_recipe_fields()
        amax_spike_of(self.amax_spike)
        try:
            resolve_accumulation(self.accumulation, dict(self.accumulation_gemms or {}))
        except (ValueError, TypeError):
            raise ConfigError(
                self.key("accumulation_gemms"),
                self.accumulation_gemms,
                "null or a mapping {fprop | dgrad | wgrad: fast | split | ieee}, e.g. {dgrad: fast}",
            ) from None

    def _check_recipe_fields(self) -> None:
        """The recipes' own rules (``numerics.scaling``), as refusals of the keys that break them."""
        require(
            self.backward_override is None or self.recipe != "delayed",
            self.key("backward_override"),
            self.backward_override,
            "null under precision.recipe=delayed (Transformer Engine: delayed scaling allows only None)",
        )
        if self.recipe == "nvfp4":
            fmt = self.format().name
            require(fmt == "E4M3", self.key("fp8_format"), fmt, "E4M3 or null under precision.recipe=nvfp4 (scales)")
        if self.recipe in ("blockwise", "nvfp4"):
            no_margin = f"0 under precision.recipe={self.recipe} (no margin)"
            require(self.margin == 0, self.key("margin"), self.margin, no_margin)
        if self.recipe != "blockwise":
            return
        dims = [self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim]
        require(
            dims.count(2) <= 1,
            "precision.[x, w, grad]_block_scaling_dim",
            dims,
            "at most one 2 (Transformer Engine: no GEMM of two 128x128-block operands)",
        )


def amax_spike_of(value: Any) -> AmaxSpike | None:
    """``precision.amax_spike`` as the spec's ``AmaxSpike`` (None for null), its shape and ranges
    checked; the rules against the model and the run are ``config.cross_group``'s."""
    if value is None:
        return None
    shape = "null or {site: PATTERN, step: STEP, k: K}, e.g. {site: attn.core.output, step: 1000, k: 12}"
    require(isinstance(value, Mapping) and set(value) == {"site", "step", "k"}, "precision.amax_spike", value, shape)
    require(isinstance(value["site"], str), "precision.amax_spike.site", value["site"], "a site pattern (a glob)")
    for key in ("step", "k"):
        number = value[key]
        valid = isinstance(number, int) and not isinstance(number, bool) and number >= 1
        require(valid, f"precision.amax_spike.{key}", number, "an integer >= 1")
    return AmaxSpike(value["site"], value["step"], value["k"])


def underflow_words(fmt: FP8Format) -> str:
    """Why margins from ``fmt.zero_margin`` on are refused, in the words of a refusal."""
    k = fmt.zero_margin
    return (
        f"from margin {k} on, the amax scales to {fmt.max:g} x 2^-{k}, below half {fmt}'s smallest "
        f"subnormal (2^{fmt.min_exponent - fmt.mantissa_bits}), and rounds to zero"
    )


@dataclass
class Attention(Checked):
    """The attention core's own settings: its backward's GEMM precision, what that backward reads
    besides the policy's D read (``ops.attention.BWD_READS``), and its FP8 recipe."""

    KEY = "attention"
    bwd_precision: str = one_of(ATTENTION_BWD_PRECISIONS)
    bwd_reads: str = one_of(ATTENTION_BWD_READS)
    recipe: str | None = one_of(
        ATTENTION_RECIPES,
        default=None,
        note="no mxfp8: how TE's MXFP8 attention rounds P and dP is inside cuDNN, not in TE's source",
    )
    # The backward's parts, each apart from what bwd_reads and bwd_precision give (null): dQ's, dK's, dP's
    # read of Q, K, V; dV's, dS's of P; dO's and dS's E5M2 rounding, and that of the dO D reads.
    bwd_qkv: str | None = one_of(ATTENTION_BWD_QKV, default=None)
    bwd_probs: str | None = one_of(ATTENTION_BWD_PROBS, default=None)
    round_grad_output: bool | None = None
    round_grad_scores: bool | None = None
    round_grad_output_in_d: bool | None = None
    # the core that runs it: ops (PyTorch, tiled in Python) | triton (readback.kernels) | auto
    # (triton where it runs, on CUDA with triton installed, and runs these settings; else ops)
    kernel: str = one_of(ATTENTION_KERNELS, default="auto")

    def parts_set_apart(self) -> dict[str, Any]:
        """The parts of the backward set apart from its flavour and precision (keys not null)."""
        keys = ("bwd_qkv", "bwd_probs", "round_grad_output", "round_grad_scores", "round_grad_output_in_d")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def check_against(self, precision: Precision, policy: str) -> None:
        """The rules with the other groups: ``recipe`` and the parts are an FP8 run's; ``bwd_reads=te``
        reads as TE's BF16 backward after an FP8 forward; ``exact`` reads the forward's operands."""
        fp8 = precision.name == "fp8"
        require(self.recipe is None or fp8, self.key("recipe"), self.recipe, "null under precision=bf16 (no FP8 core)")
        for key, value in self.parts_set_apart().items():
            require(fp8, self.key(key), value, "null under precision=bf16 (no FP8 forward to read apart from)")
            require(policy != "exact", self.key(key), value, "null with policy=exact (it reads the forward's operands)")
        in_d, no_o = self.round_grad_output_in_d, READS.get(policy, {}).get("D") == "none"  # D = rowsum(P * dP)
        require(
            in_d is None or not no_o, self.key("round_grad_output_in_d"), in_d, f"null: policy={policy}'s D reads no O"
        )
        if self.bwd_reads == "forward":
            return
        why = (
            (self.bwd_precision != "bf16", f"with bwd_precision={self.bwd_precision}: te is a BF16 backward's reads"),
            (not fp8, "with precision=bf16: without FP8 the originals are what the forward multiplied"),
            (policy == "exact", "with policy=exact, which reads what the forward multiplied"),
        )
        reason = next((text for bad, text in why if bad), None)
        require(reason is None, self.key("bwd_reads"), self.bwd_reads, f"forward ({reason})")

    def scaling_recipe(self, p: Fp8Precision) -> ScalingRecipe | None:
        """The core's own recipe object (None without ``recipe``): its class with the fields of the
        precision group ``p`` it has, but for the linears' own (``override_linear_precision``,
        ``backward_override``), which keep their defaults, in ``format(p)``."""
        if self.recipe is None:
            return None
        cls = ATTENTION_RECIPES[self.recipe]
        linear_only = ("override_linear_precision", "backward_override")
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(cls) if f.name not in linear_only}
        return cls(**{**fields, "fp8_format": self.format(p)})

    def format(self, p: Fp8Precision) -> Format:
        """The core's format: the linears' (``p.format()``), which TE's attention recipe reuses, but
        HYBRID under NVFP4, whose ``fp8_format`` is its block scales' (E4M3 only): TE's attention
        there takes ``NVTE_DPA_FP8_FORMAT``, HYBRID by default."""
        return Format.HYBRID if self.recipe and p.recipe == "nvfp4" else p.format()


def fp8_settings(p: Precision) -> Fp8Precision | None:
    """``p``'s FP8 settings, ``None`` without FP8; a ``TypeError`` for an untyped FP8 group (a
    composed ``DictConfig`` not yet built into the schema's dataclasses by ``readback.config``)."""
    if isinstance(p, Fp8Precision):
        return p
    if p.name == "fp8":
        raise TypeError(f"precision=fp8 as {type(p).__name__}: build the typed config (readback.config.typed)")
    return None


def spec_of(precision: Precision, policy: str, attention: Attention) -> NumericsSpec:
    """The run's ``NumericsSpec`` from the ``precision`` and ``attention`` groups and ``policy``
    (``Numerics(spec, seed=...)`` runs it)."""
    p = fp8_settings(precision)
    if p is None:
        return numerics_spec(
            precision=precision.name,
            policy=policy,
            attention_bwd_precision=attention.bwd_precision,
            attention_bwd_reads=attention.bwd_reads,
            bf16_gemm=precision.bf16_gemm,
            attention_kernel=attention.kernel,
        )
    return numerics_spec(
        precision=p.name,
        recipe=p.scaling_recipe(),
        policy=policy,
        attention_bwd_precision=attention.bwd_precision,
        attention_bwd_reads=attention.bwd_reads,
        attention_recipe=attention.scaling_recipe(p),
        attention_bwd_qkv=attention.bwd_qkv,
        attention_bwd_probs=attention.bwd_probs,
        attention_round_grad_output=attention.round_grad_output,
        attention_round_grad_scores=attention.round_grad_scores,
        attention_round_grad_output_in_d=attention.round_grad_output_in_d,
        rounding=p.rounding,
        bf16_sites=tuple(p.bf16_layers),
        site_margin=dict(p.site_margin or {}),
        accumulation=p.accumulation,
        accumulation_gemms=dict(p.accumulation_gemms or {}),
        bf16_gemm=p.bf16_gemm,
        amax_spike=amax_spike_of(p.amax_spike),
        attention_kernel=attention.kernel,
    )
