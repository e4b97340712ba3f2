"""The ``precision`` group's schema: how a run rounds, as Hydra composes it and as
``readback.convert`` accepts it from Python (one set of types, ranges and error words for both).
``Fp8Settings.scaling_recipe`` makes the one recipe object the emulation and the TE mapping read.
``numerics.settings.NumericsSettings`` holds it with the attention group and the policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from readback.errors import ConfigError, require
from readback.fields import Checked, integer, items, number, one_of
from readback.numerics.accumulation import MODES as ACCUMULATION_MODES
from readback.numerics.formats import Format, FP8Format
from readback.numerics.gemm import BF16_GEMMS
from readback.numerics.rounding import ROUNDINGS
from readback.numerics.scaling import (
    AMAX_COMPUTE_ALGOS,
    BACKWARD_OVERRIDES,
    RECIPES,
    BlockScalingRecipe,
    DelayedScaling,
    Float8BlockScaling,
    NVFP4BlockScaling,
    ScalingRecipe,
)
from readback.numerics.spike import AmaxSpike

# "off": no rounding and FP64 GEMMs, for references (gradcheck, the probe's), never a run's setting
PRECISIONS = ("fp8", "bf16", "off")
GEMMS = ("fprop", "dgrad", "wgrad")
# precision.accumulation: each device's own (native), IEEE FP32 everywhere, or Hopper's recipe,
# which Transformer Engine and torch._scaled_mm's defaults give: fast fprop, split dgrad and wgrad.
ACCUMULATIONS = {
    "native": ("native",) * 3,
    "ieee": ("ieee",) * 3,
    "hopper": ("fast", "split", "split"),
}

# The recipe fields' defaults: Transformer Engine's default recipe, as numerics.scaling declares
# it, and its Float8BlockScaling and NVFP4BlockScaling for the fields only those recipes have.
TE_DEFAULT = DelayedScaling()
BLOCKWISE = Float8BlockScaling()
NVFP4 = NVFP4BlockScaling()


@dataclass
class PrecisionSettings(Checked):
    KEY = "precision"
    name: str = one_of(PRECISIONS[:2])  # "off" is for reference computations, not runs (REFERENCE)
    # The BF16 GEMMs (bf16_layers, a BF16 attention backward) off CUDA: fp32 (an FP32 GEMM of the
    # BF16 values, rounded once to BF16: FP32 speed on any CPU) | native (torch's BF16 GEMM).
    bf16_gemm: str = one_of(BF16_GEMMS, default=BF16_GEMMS[0])


@dataclass
class Fp8Settings(PrecisionSettings):
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
        if issubclass(RECIPES[self.recipe], BlockScalingRecipe):  # its quantisers round to nearest, as TE's
            why = f"nearest under precision.recipe={self.recipe} (its block quantisers round to nearest)"
            require(self.rounding == "nearest", self.key("rounding"), self.rounding, why)
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


def fp8_settings_of(recipe: ScalingRecipe, **values: Any) -> Fp8Settings:
    """The FP8 settings whose ``scaling_recipe()`` is ``recipe`` (its class's key and its fields),
    with ``values`` for the fields no recipe has (``rounding``, ``accumulation``, ...): for code
    that starts from a recipe object (the audits, the tests) rather than from a config."""
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    fields |= {
        "override_linear_precision": list(recipe.override_linear_precision),
        "fp8_format": recipe.fp8_format.name,
    }
    return Fp8Settings(name="fp8", recipe=recipe.KEY, **{**fields, **values})


@dataclass
class ReferencePrecision(PrecisionSettings):
    """No rounding and FP64 GEMMs: the precision of reference computations (gradcheck, the
    probe's, ``readback.convert(precision="off")``); no config composes it."""

    name: str = "off"


REFERENCE = ReferencePrecision()


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


def fp8_settings(p: PrecisionSettings) -> Fp8Settings | None:
    """``p``'s FP8 settings, ``None`` without FP8; a ``TypeError`` for an untyped FP8 group (a
    composed ``DictConfig`` not yet built into the schema's dataclasses by ``readback.config``)."""
    if isinstance(p, Fp8Settings):
        return p
    if p.name == "fp8":
        raise TypeError(f"precision=fp8 as {type(p).__name__}: build the typed config (readback.config.typed)")
    return None
