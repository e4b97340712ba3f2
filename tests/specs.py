"""The one way the tests build a ``NumericsSpec``: from a recipe object and the settings that
differ from the defaults, through the settings a config would hold (``ops.numerics_spec``)."""

from __future__ import annotations

from typing import Any

from readback.numerics import DelayedScaling, ScalingRecipe
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import REFERENCE, PrecisionSettings, fp8_settings_of
from readback.numerics.settings import NumericsSettings
from readback.numerics.spec import NumericsSpec
from readback.ops import numerics_spec

ATTENTION_DEFAULTS = {"bwd_precision": "fp8", "bwd_reads": "forward"}


def make_spec(
    precision: str = "fp8",
    recipe: ScalingRecipe | None = None,
    policy: str = "exact",
    *,
    attention: dict[str, Any] | None = None,
    **fields: Any,
) -> NumericsSpec:
    """The spec of ``precision`` (``fp8``, ``bf16`` or ``off``) under ``policy``: FP8 with
    ``recipe`` (default ``DelayedScaling()``) and the precision group's other ``fields``
    (``rounding``, ``bf16_layers``, ``site_margin``, ...); ``attention`` the attention group's
    settings apart from an FP8 backward reading the forward's operands. The settings are not
    checked against each other (``NumericsSettings.check``): a test may build what no config can."""
    if precision == "fp8":
        group: PrecisionSettings = fp8_settings_of(recipe or DelayedScaling(), **fields)
    else:
        assert recipe is None, "a recipe is an FP8 run's"
        group = REFERENCE if precision == "off" else PrecisionSettings(name=precision, **fields)
    settings = AttentionSettings(**{**ATTENTION_DEFAULTS, **(attention or {})})
    return numerics_spec(NumericsSettings(group, settings, policy))
