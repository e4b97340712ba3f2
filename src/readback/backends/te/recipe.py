"""The one mapping of readback's recipe object onto a Transformer Engine recipe, for
``backend=te`` (``readback.backends.te.plan``) and ``convert(backend="te")``
(``readback.backends.te.convert``) alike, with its refusals: a setting this TE cannot run on this
GPU is refused in one line, never dropped. Like the plan, it never imports Transformer Engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from readback.backends.te.facts import (
    INTERVAL_REMOVED,
    OVERRIDE_LINEAR_PRECISION_REMOVED,
    SINCE,
    Hardware,
    fp8_block_scaling_refusal,
    fp8_gemm_refusal,
    installed_hardware,
    installed_te_version,
    mxfp8_refusal,
    nvfp4_refusal,
    version_tuple,
)
from readback.errors import ConfigError, require
from readback.numerics import RECIPES as RECIPE_CLASSES
from readback.numerics import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, ScalingRecipe

# precision.recipe -> Transformer Engine recipe class
RECIPES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "blockwise": "Float8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
# Read by TE at its import into Float8BlockScaling's QParams (common/recipe/__init__.py): no
# constructor argument sets them, so readback passes only what that environment gives.
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"
MIN_TE = (1, 13)
INSTALLED: Any = object()  # default: what this machine has


def _te_name(version: str | None) -> str:
    return f"Transformer Engine {version}" if version else "Transformer Engine (not installed here; 2.x assumed)"


@dataclass(frozen=True)
class TERecipe:
    """A Transformer Engine recipe as data: ``name``, a class of ``transformer_engine.common.
    recipe``, and its keyword arguments (``fp8_format`` as a ``Format`` member's name)."""

    name: str
    kwargs: dict[str, Any]

    def describe(self, only_true: tuple[str, ...] | None = None) -> str:
        """``Name(key=value, ...)``, the call that makes it; ``only_true``: just those of its
        switches that are on (a table's short form)."""
        kwargs = self.kwargs if only_true is None else {k: v for k, v in self.kwargs.items() if k in only_true and v}
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"

    def for_attention(self, fp8_dpa: bool, fp8_mha: bool, own_recipe: bool = False) -> TERecipe:
        """This recipe with TE's FP8 attention switches set (the per-tensor recipes have them).

        TE's ``MXFP8BlockScaling`` and ``NVFP4BlockScaling`` have them too, off by default and
        left so: TE leaves attention unquantised under them (pytorch/attention/
        dot_product_attention/utils.py ``get_attention_backend`` disables FusedAttention for
        NVFP4, v2.16 to 2.20) unless ``NVTE_DPA_FP8_RECIPE`` gives attention a recipe of its own
        (dot_product_attention.py, v2.8 to 2.20; ``own_recipe``), which reuses the linear
        recipe's ``fp8_dpa`` and ``fp8_mha``: then they are set here."""
        if "fp8_dpa" not in self.kwargs and not own_recipe:
            return self
        return TERecipe(self.name, {**self.kwargs, "fp8_dpa": fp8_dpa, "fp8_mha": fp8_mha})


def resolve_target(te_version: str | None, hardware: Hardware) -> tuple[str | None, Hardware, Any, str]:
    """``(version, hardware, version tuple, "TE <v> on <GPU>")``, defaults resolved; refuses a TE
    older than readback supports."""
    version = installed_te_version() if te_version is INSTALLED else te_version
    hw = installed_hardware() if hardware is INSTALLED else hardware
    vt = version_tuple(version)
    where = f"{_te_name(version)} on {hw.describe()}"
    if vt is not None and vt[:2] < MIN_TE:
        raise ConfigError("backend", "te", f"Transformer Engine >= {'.'.join(map(str, MIN_TE))} ({where})")
    return version, hw, vt, where


def te_recipe_plan(
    recipe: ScalingRecipe | None, rounding: str, te_version: str | None = INSTALLED, hardware: Hardware = INSTALLED
) -> TERecipe | None:
    """The one mapping of readback's recipe object (``Fp8Settings.scaling_recipe``, a run's
    ``Numerics.recipe``) with the forward's ``rounding`` onto a Transformer Engine recipe, for
    ``backend=te`` and for ``convert(backend="te")`` alike (``None`` without FP8; TE's FP8
    attention off, see ``TERecipe.for_attention``). Raises ``ConfigError`` (one line) for a
    setting this TE cannot run on this GPU, never dropping it."""
    if recipe is None:
        return None
    _, hw, vt, where = resolve_target(te_version, hardware)
    _check_fp8_recipe(recipe, rounding, vt, hw, where)
    return TERecipe(RECIPES[recipe.KEY], _recipe_kwargs(recipe, vt))


def _check_fp8_recipe(recipe: ScalingRecipe, rounding: str, vt, hw: Hardware, where: str) -> None:
    recipe_key = recipe.KEY
    require(
        rounding == "nearest",
        "precision.rounding",
        rounding,
        "nearest (backend=te: Transformer Engine rounds to nearest and no library rounds to FP8 "
        "stochastically; use backend=emulated for stochastic rounding)",
    )
    refuse_unsupported_fields(recipe, vt, where)
    since = SINCE.get(RECIPES[recipe_key])
    if vt is not None and since is not None and vt[:2] < since:
        raise ConfigError(
            "precision.recipe",
            recipe_key,
            f"delayed ({where} has no {RECIPES[recipe_key]}; it needs >= {since[0]}.{since[1]})",
        )
    if fp8_gemm_refusal(hw):
        raise ConfigError("precision", "fp8", f"bf16 ({where}: {fp8_gemm_refusal(hw)})")
    block_reason = _block_refusal(recipe, hw)
    if block_reason:
        others = ", ".join(k for k, cls in RECIPE_CLASSES.items() if k != recipe_key and _runs(cls(), vt, hw))
        raise ConfigError("precision.recipe", recipe_key, f"{others} ({where}: {block_reason})")
    if isinstance(recipe, Float8BlockScaling):
        _refuse_block_qparams(recipe, where)


def _block_refusal(recipe: ScalingRecipe, hw: Hardware) -> str | None:
    """Why this GPU cannot run a block recipe's GEMMs (``facts``), else None."""
    if isinstance(recipe, MXFP8BlockScaling):
        return mxfp8_refusal(hw)
    if isinstance(recipe, Float8BlockScaling):
        return fp8_block_scaling_refusal(hw, recipe.pow2_scales)
    if isinstance(recipe, NVFP4BlockScaling):
        return nvfp4_refusal(hw)
    return None


def _runs(recipe: ScalingRecipe, vt, hw: Hardware) -> bool:
    """Whether this TE has ``recipe``'s class and this GPU its GEMMs (a refusal's alternatives)."""
    since = SINCE.get(RECIPES[recipe.KEY])
    return (vt is None or since is None or vt[:2] >= since) and _block_refusal(recipe, hw) is None


def refuse_unsupported_fields(recipe: ScalingRecipe, vt: tuple[int, int, int] | None, where: str) -> None:
    """Fields of readback's recipe (the linears', or the attention core's own) that this
    Transformer Engine does not have, when they are set to anything but their default: refused,
    never dropped."""
    recipe_key = recipe.KEY
    if isinstance(recipe, DelayedScaling) and recipe.interval != 1:
        interval = recipe.interval
        state = (
            "has no DelayedScaling.interval"
            if vt is None or vt[:2] >= INTERVAL_REMOVED
            else "ignores DelayedScaling.interval (deprecated and unused; removed in 2.2)"
        )
        raise ConfigError(
            "precision.interval", interval, f"1 ({where} {state}; use backend=emulated to study interval)"
        )
    override = list(recipe.override_linear_precision)
    if any(override):
        removed = vt is None or vt[:2] >= OVERRIDE_LINEAR_PRECISION_REMOVED
        if recipe_key != "delayed" or removed:
            raise ConfigError(
                "precision.override_linear_precision",
                override,
                f"[false, false, false] ({where} has no override_linear_precision: it was removed "
                f"in 2.0; use backend=emulated for high-precision GEMMs)",
            )
        if override != [False, False, True]:
            raise ConfigError(
                "precision.override_linear_precision",
                override,
                f"[false, false, false] or [false, false, true] ({where} overrides only the wgrad GEMM)",
            )
    if recipe.backward_override is not None and vt is not None and vt[:2] < SINCE["backward_override"]:
        raise ConfigError(
            "precision.backward_override",
            recipe.backward_override,
            f"null ({where} has no backward_override: it needs >= 2.15; use backend=emulated)",
        )
    if recipe_key == "current" and recipe.margin != 0:
        raise ConfigError(
            "precision.margin",
            recipe.margin,
            f"0 ({where}: Float8CurrentScaling has no margin; use backend=emulated for a margin under current scaling)",
        )


def _refuse_block_qparams(recipe: Float8BlockScaling, where: str) -> None:
    """Float8BlockScaling's QParams are TE's import-time class attributes: readback runs only the
    ones TE's environment gives (power-of-two scales unless ``FP32_SCALES_ENV=1``, no epsilon)."""
    te_pow2 = os.environ.get(FP32_SCALES_ENV, "0") != "1"
    require(
        recipe.pow2_scales == te_pow2,
        "precision.pow2_scales",
        recipe.pow2_scales,
        f"{str(te_pow2).lower()} ({where} reads {FP32_SCALES_ENV} at import, "
        f"which is {os.environ.get(FP32_SCALES_ENV)!r} here; use backend=emulated for the other)",
    )
    require(
        recipe.amax_epsilon == 0.0,
        "precision.amax_epsilon",
        recipe.amax_epsilon,
        f"0 ({where}: Float8BlockScaling's amax_epsilon is a class attribute; use backend=emulated)",
    )


def _recipe_kwargs(recipe: ScalingRecipe, vt) -> dict[str, Any]:
    """TE's FP8 attention is off here (``fp8_dpa``, ``fp8_mha``); ``TERecipe.for_attention`` sets it."""
    fmt = recipe.fp8_format.name
    kwargs: dict[str, Any]
    if isinstance(recipe, DelayedScaling):
        kwargs = dict(
            margin=recipe.margin,
            fp8_format=fmt,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
            fp8_dpa=False,
            fp8_mha=False,
        )
        if any(recipe.override_linear_precision):  # only reached on TE 1.x, with (False, False, True)
            kwargs["override_linear_precision"] = recipe.override_linear_precision
    elif isinstance(recipe, MXFP8BlockScaling):
        kwargs = dict(fp8_format=fmt, **({"margin": recipe.margin} if recipe.margin else {}))
    elif isinstance(recipe, Float8BlockScaling):  # no FP8 attention switches: TE asserts them off
        kwargs = dict(
            fp8_format=fmt,
            x_block_scaling_dim=recipe.x_block_scaling_dim,
            w_block_scaling_dim=recipe.w_block_scaling_dim,
            grad_block_scaling_dim=recipe.grad_block_scaling_dim,
        )
    elif isinstance(recipe, NVFP4BlockScaling):  # fp8_dpa, fp8_mha: TE's False (TERecipe.for_attention)
        kwargs = dict(
            fp8_format=fmt,
            disable_rht=recipe.disable_rht,
            disable_stochastic_rounding=recipe.disable_stochastic_rounding,
            disable_2d_quantization=recipe.disable_2d_quantization,
        )
        # TE's defaults of these are environment variables read at import (NVTE_NVFP4_*), so every
        # one is passed: the three switches always, the fields readback does not model (TE's
        # defaults: off) where this TE has them.
        for field, off in (("row_scaled_activation", False), ("nvfp4_4over6", "none")):
            if vt is not None and vt[:2] >= SINCE[field]:
                kwargs[field] = off
    else:
        kwargs = dict(fp8_format=fmt, fp8_dpa=False, fp8_mha=False)
    if vt is not None and vt[:2] >= SINCE["backward_override"]:
        # The field's default is NVTE_BACKWARD_OVERRIDE read at import: pinned, so the
        # environment cannot change what te.Linear's backward reads.
        kwargs["backward_override"] = recipe.backward_override
    return kwargs
