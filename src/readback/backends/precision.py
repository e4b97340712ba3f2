"""The ``precision`` group's schema: the numerics of a run, as Hydra composes them and as
``readback.convert`` accepts them from Python (one set of types, ranges and error words for both);
``build_numerics``, a run's ``Numerics`` from its checked config.

It sits with the backends because the recipes it names are Transformer Engine's
(``backends.te_recipe.RECIPES``); ``readback.config.schema`` registers it with the other groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from readback.backends.te_recipe import RECIPES
from readback.errors import ConfigError
from readback.fields import Checked, integer, items, one_of
from readback.numerics import AMAX_COMPUTE_ALGOS, ROUNDINGS, CurrentScaling, DelayedScaling, Format
from readback.numerics.spec import ACCUMULATIONS, PRECISIONS, resolve_accumulation
from readback.ops import Numerics, numerics_for


@dataclass
class Precision(Checked):
    KEY = "precision"
    name: str = one_of(PRECISIONS[:2])  # "off" is for reference computations, not runs


@dataclass
class Fp8Precision(Precision):
    recipe: str = one_of(RECIPES)
    fp8_format: str = one_of(f.name for f in Format)
    margin: int = integer(minimum=0)
    interval: int = integer()
    amax_history_len: int = integer()
    amax_compute_algo: str = one_of(AMAX_COMPUTE_ALGOS)
    override_linear_precision: list[bool] = items("three booleans [fprop, dgrad, wgrad]", lambda v: len(v) == 3)
    rounding: str = one_of(ROUNDINGS)
    bf16_layers: list[str] = MISSING  # checked against the model's layers in Config.check
    site_margin: Any = None  # {site pattern: k} (untyped: Hydra replaces the whole mapping); checked in Config.check
    accumulation: str = one_of(ACCUMULATIONS)
    accumulation_gemms: Any = None  # {fprop | dgrad | wgrad: fast | split | ieee}, over accumulation's

    def check(self) -> None:
        try:
            resolve_accumulation(self.accumulation, dict(self.accumulation_gemms or {}))
        except (ValueError, TypeError):
            raise ConfigError(
                self.key("accumulation_gemms"),
                self.accumulation_gemms,
                "null or a mapping {fprop | dgrad | wgrad: fast | split | ieee}, e.g. {dgrad: fast}",
            ) from None


def build_numerics(cfg: Any) -> Numerics:
    """The run's ``Numerics`` from the ``precision``, ``policy`` and ``attention`` groups and ``seed``."""
    p = cfg.precision
    recipe: DelayedScaling | CurrentScaling | None = None
    if p.name == "fp8":
        common = dict(
            margin=p.margin, fp8_format=p.fp8_format, override_linear_precision=tuple(p.override_linear_precision)
        )
        if p.recipe == "delayed":
            recipe = DelayedScaling(
                interval=p.interval,
                amax_history_len=p.amax_history_len,
                amax_compute_algo=p.amax_compute_algo,
                **common,
            )
        else:
            recipe = CurrentScaling(**common)
    fp8 = p.name == "fp8"
    return numerics_for(
        precision=p.name,
        recipe=recipe,
        policy=cfg.policy.name,
        attention_bwd=cfg.attention.bwd_precision,
        rounding=p.rounding if fp8 else "nearest",
        seed=cfg.seed,
        bf16_sites=tuple(p.bf16_layers) if fp8 else (),
        site_margin=dict(p.site_margin or {}) if fp8 else {},
        # a run saved before precision.accumulation existed (readback.bias loads its config) ran natively
        accumulation=getattr(p, "accumulation", "native") if fp8 else "native",
        accumulation_gemms=dict(getattr(p, "accumulation_gemms", None) or {}) if fp8 else None,
    )
