"""``readback.convert(..., backend="te")``: Transformer Engine's modules for a model's linears and
norms (CUDA and transformer_engine only), with the recipe built from readback's precision.

``te.Linear``, ``te.LayerNorm`` and ``te.RMSNorm`` are created with the shapes of the modules
they replace and the same values copied in (exactly: same dtype). Each linear enters TE's FP8
autocast for its own forward, so the rest of the model runs as before. The attention core is not
swapped (TE's ``DotProductAttention`` takes other layouts); the policy applies to readback's ops
only, and TE's linears read what TE reads (the FP8 copies they saved).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from readback.backends.converted import eps_of
from readback.backends.te.facts import installed_te_version
from readback.backends.te.parts import _te as te_modules
from readback.backends.te.parts import check_available, fp8_autocast, make_recipe
from readback.backends.te.recipe import te_recipe_plan
from readback.errors import ConfigError
from readback.numerics.state import Numerics


def te_recipe(numerics: Numerics) -> Any:
    """TE's recipe object for ``numerics``' recipe (None without FP8), from the mapping a
    ``backend=te`` run uses (``te_recipe.te_recipe_plan``): the same refusals, the same pins."""
    if numerics.precision != "fp8":
        return None
    if set(numerics.spec.accumulation) != {"native"}:
        raise ConfigError(
            "precision.accumulation",
            numerics.spec.accumulation,
            "native with backend=te (Transformer Engine's GPU accumulates as it does)",
        )
    return make_recipe(te_recipe_plan(numerics.recipe, numerics.rounding), installed_te_version())


class TEConverter:
    """Makes TE modules from torch ones, for ``convert``."""

    def __init__(self, numerics: Numerics, device: torch.device):
        check_available()
        if torch.device(device).type != "cuda":
            raise ConfigError("backend", "te", "a model on a CUDA device (model.cuda() before converting)")
        self.te, _ = te_modules()
        self.recipe, self.device = te_recipe(numerics), torch.device(device)
        recipe = self.recipe

        class FP8Linear(self.te.Linear):  # type: ignore[name-defined]  # TE's class, imported at run time
            """``te.Linear`` that enters TE's FP8 autocast around its own forward."""

            def forward(self, x):
                with fp8_autocast(enabled=recipe is not None, recipe=recipe):
                    return super().forward(x)

        self.linear_class = FP8Linear

    def linear_from(self, module: nn.Linear, name: str) -> nn.Module:
        new = self.linear_class(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            params_dtype=module.weight.dtype,
            device=self.device,
        )
        return _copied(module, new)

    def norm_from(self, module: Any, name: str, center: bool) -> nn.Module:
        cls = self.te.LayerNorm if center else self.te.RMSNorm
        new = cls(module.weight.shape[0], eps=eps_of(module), params_dtype=module.weight.dtype, device=self.device)
        return _copied(module, new)

    def describe(self, kind: str) -> str:
        return {
            "linear": "transformer_engine.pytorch.Linear (FP8 autocast)",
            "layer_norm": "transformer_engine.pytorch.LayerNorm",
            "rms_norm": "transformer_engine.pytorch.RMSNorm",
        }[kind]


def _copied(old: Any, new: Any) -> nn.Module:
    """``new`` holding ``old``'s weight and bias values (a missing bias stays TE's zeros); both
    are modules with a ``weight`` (and maybe a ``bias``)."""
    with torch.no_grad():
        new.weight.copy_(old.weight)
        if getattr(old, "bias", None) is not None:
            new.bias.copy_(old.bias)
    return new
