"""``backend=te``: the parts of the one FOG (``readback.model.fog``) from Transformer Engine.

``te.Linear`` for the GEMMs, ``te.RMSNorm`` for FOG's post-norms (a norm *after* each sub-block,
so RMSNorm + Linear, not LayerNormLinear) and for the QK-norm (frozen gains), and
``te.DotProductAttention`` where a TE switch reproduces the policy's attention backward reads
(``readback.backends.te.plan`` decides, without importing TE). Elsewhere the attention core and
the output projection that multiplies its O8 are readback's ops, so the O8 the D-term policy is
about is exactly the copy the projection multiplied. xIELU is readback's op (TE has no xIELU).
readback's modules run in FP32 inside TE's autocasts (``_in_fp32``).

Transformer Engine is imported only by ``build_te_model``, after the plan's environment
variables are set (TE reads ``NVTE_DPA_FP8CS_O_in_F16`` at import). Parameters are FP32 master
weights; the forward runs under ``torch.autocast(bfloat16)`` and TE's FP8 autocast
(``te.autocast``, or ``te.fp8_autocast`` before it existed). TE keeps the FP8 scaling state of
its modules (scales, amax histories) in their ``state_dict`` under ``_extra_state``, so the
model's checkpoint carries it; ``model.numerics`` holds the state of the sites readback owns
(the attention core and its projection when they are readback's, a tied FP8 LM head).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from readback.backends.settings import ModelSettings
from readback.backends.te.plan import IMPORT_TIME_ENV, TEPlan, site_implementations, te_plan
from readback.backends.te.recipe import RECIPES, TERecipe
from readback.errors import ConfigError
from readback.model import FOG, fog_config
from readback.model.fog import XIELU, AttentionCore, FOGConfig, Linear, Parts
from readback.numerics.spec import in_bf16_layers
from readback.numerics.state import Numerics
from readback.ops import numerics_spec
from readback.ops.linear import linear

UNAVAILABLE = (
    "needs CUDA and transformer_engine (container/, or pip install --no-build-isolation -e .[gpu]); "
    "use backend=emulated on this machine"
)

__all__ = ["TEParts", "apply_te_env", "build_te_model", "check_available", "site_implementations", "te_plan"]


def check_available() -> None:
    """Raise the one-line ``ConfigError`` unless this machine has CUDA and Transformer Engine.
    Imports nothing from TE; what this TE cannot run on this GPU is ``te_plan``'s to refuse."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("backend", "te", UNAVAILABLE)


def apply_te_env(env: Mapping[str, str]) -> None:
    """Set the plan's Transformer Engine variables. A variable TE reads at import cannot change
    once TE is imported: that raises ``ConfigError`` (run such experiments in fresh processes)."""
    imported = any(name == "transformer_engine" or name.startswith("transformer_engine.") for name in sys.modules)
    for key, value in env.items():
        current = os.environ.get(key, IMPORT_TIME_ENV.get(key))  # unset: TE's default
        if imported and key in IMPORT_TIME_ENV and current != value:
            raise ConfigError(
                key,
                value,
                f"{current} (Transformer Engine is already imported in this process and read "
                f"{key} at import; run this experiment in a fresh process)",
            )
        os.environ[key] = value


_TE = None


def _te() -> tuple[Any, Any]:
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, imported once."""
    global _TE
    if _TE is None:
        try:
            import transformer_engine.pytorch as te_pytorch
            from transformer_engine.common import recipe as te_recipe
        except Exception as error:  # a missing or broken install, or CUDA libraries it cannot load
            reason = " ".join(str(error).split())[:200]
            raise ConfigError(
                "backend", "te", f"{UNAVAILABLE} (importing transformer_engine failed: {reason})"
            ) from error
        _TE = (te_pytorch, te_recipe)
    return _TE


def make_recipe(recipe: TERecipe | None, te_version: str | None = None):
    """The Transformer Engine recipe object of ``recipe`` (``None`` without FP8)."""
    if recipe is None:
        return None
    _, recipes = _te()
    recipe_class = getattr(recipes, recipe.name, None)
    if recipe_class is None:  # a TE whose version the plan could not tell
        key = next(k for k, v in RECIPES.items() if v == recipe.name)
        raise ConfigError("precision.recipe", key, f"delayed (Transformer Engine {te_version} has no {recipe.name})")
    kwargs = dict(recipe.kwargs)
    kwargs["fp8_format"] = getattr(recipes.Format, kwargs["fp8_format"])
    if "override_linear_precision" in kwargs:  # TE 1.x only, which wants its named tuple
        named = getattr(recipes, "_OverrideLinearPrecision", None)
        if named is not None:
            kwargs["override_linear_precision"] = named(*kwargs["override_linear_precision"])
    return recipe_class(**kwargs)


def fp8_autocast(enabled: bool, recipe=None, group=None):
    """TE's FP8 context: ``te.autocast`` where it exists, else ``te.fp8_autocast``."""
    te, _ = _te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


@functools.cache
def _in_fp32(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls``, a readback op module, run inside TE's BF16 autocast: FP32 inputs, autocast off
    (readback's ops choose their own precisions). Parameter names are ``cls``'s."""

    class InFP32(cls):  # type: ignore[valid-type,misc]  # one subclass per op module class
        def forward(self, *tensors, **kwargs):
            with torch.autocast(tensors[0].device.type, enabled=False):
                return super().forward(*(t.float() for t in tensors), **kwargs)

    InFP32.__name__ = InFP32.__qualname__ = f"{cls.__name__}InFP32"
    return InFP32


def _te_classes(plan: TEPlan):
    """The TE modules the parts use, subclassed for FOG's calling conventions."""
    te, _ = _te()

    class TELinear(te.Linear):  # type: ignore[name-defined]  # TE's class, imported at run time
        """``te.Linear`` without bias; with ``readback_fp8_off`` (``precision.bf16_layers``) its
        GEMMs run in BF16."""

        def __init__(self, d_in, d_out, std, fp8_off, device):
            super().__init__(d_in, d_out, bias=False, device=device)
            with torch.no_grad():
                nn.init.normal_(self.weight, std=std)
            self.readback_fp8_off = fp8_off

        def forward(self, x):
            if self.readback_fp8_off:
                with fp8_autocast(enabled=False):
                    return super().forward(x)
            return super().forward(x)

    class TEQKNorm(te.RMSNorm):  # type: ignore[name-defined]  # TE's class, imported at run time
        """The frozen QK-norm; returns FP32 so that RoPE is computed in FP32."""

        def forward(self, x):
            return super().forward(x.contiguous()).float()

    class TEAttentionCore(te.DotProductAttention):  # type: ignore[name-defined]  # TE's class, imported at run time
        """(B, heads, T, hd) in, ``(o, None)`` out: TE hands over no readback O8 copy (with
        ``fp8_output`` the projection multiplies TE's own FP8 ``o``)."""

        def forward(self, q, k, v):
            q, k, v = (t.transpose(1, 2).to(torch.bfloat16).contiguous() for t in (q, k, v))
            kwargs = {"fp8_output": True} if plan.fp8_output else {}
            return super().forward(q, k, v, **kwargs), None

    return te.RMSNorm, TELinear, TEQKNorm, TEAttentionCore


class TEParts(Parts):
    """FOG's parts under ``plan``: TE's linears, norms and (where the plan says) attention core;
    readback's ops, in FP32, for the rest. ``forward_context`` enters TE's autocasts."""

    def __init__(self, numerics: Numerics, plan: TEPlan, device: torch.device):
        super().__init__(numerics)
        self.plan, self.device = plan, torch.device(device)
        self.rms_norm, self.te_linear, self.qk_norm, self.te_core = _te_classes(plan)
        self.recipe = make_recipe(plan.te_recipe, plan.te_version)
        # Read by TE when attention runs: re-set on every forward, so that another model built in
        # the same process with other switches cannot change what this one runs.
        self.runtime_env = {k: v for k, v in plan.env.items() if k not in IMPORT_TIME_ENV}

    def linear(self, d_in, d_out, name, std):
        if name.endswith(".attn.proj") and not self.plan.te_attention:  # multiplies the core's O8 as is
            return _in_fp32(Linear)(d_in, d_out, name, self.numerics, std)
        fp8_off = self.plan.fp8 and in_bf16_layers(name, self.plan.bf16_layers)
        return self.te_linear(d_in, d_out, std, fp8_off, self.device)

    def norm(self, dim, gain, name, eps, frozen=False):
        module = (self.qk_norm if frozen else self.rms_norm)(dim, eps=eps, device=self.device)
        with torch.no_grad():
            module.weight.fill_(gain)
        module.weight.requires_grad_(not frozen)
        return module

    def attention_core(self, cfg: FOGConfig, name, index):
        if not self.plan.te_attention:
            return _in_fp32(AttentionCore)(cfg, name, self.numerics)
        return self.te_core(
            cfg.n_heads,
            cfg.head_dim,
            num_gqa_groups=cfg.n_kv_groups,
            attention_dropout=0.0,
            attn_mask_type="causal",
            qkv_format="bshd",
            softmax_scale=cfg.softmax_scale,
            layer_number=index + 1,
        )

    def activation(self):
        return _in_fp32(XIELU)(self.numerics)

    def tied_head(self, x, embedding):
        if self.plan.lm_head_bf16:
            return F.linear(x.to(torch.bfloat16), embedding.to(torch.bfloat16))
        with torch.autocast(x.device.type, enabled=False):
            return linear(x.float(), embedding, self.numerics, "lm_head")

    @property
    def residual_dtype(self):
        return torch.float32  # the FP32 residual stream; activations are BF16 under autocast

    @contextlib.contextmanager
    def forward_context(self):
        os.environ.update(self.runtime_env)
        with torch.autocast(self.device.type, dtype=torch.bfloat16), self._fp8_context():
            yield

    def _fp8_context(self):
        if not self.plan.fp8:
            return contextlib.nullcontext()
        group = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD
        return fp8_autocast(enabled=True, recipe=self.recipe, group=group)


def readback_numerics(cfg: ModelSettings) -> Numerics:
    """The run's Numerics, the recipe object TE's recipe is made from; readback's ops read it for
    the sites they own (per tensor under MXFP8: ``numerics.MXFP8BlockScaling``)."""
    return Numerics(numerics_spec(cfg.numerics), seed=cfg.seed)


def build_te_model(cfg: ModelSettings, device: str | torch.device = "cuda") -> FOG:
    """The FOG of ``cfg.model`` on Transformer Engine's parts, on a CUDA ``device``.
    Raises ``ConfigError`` (one line) when TE or CUDA is missing or cannot run ``cfg`` here."""
    check_available()
    plan = te_plan(cfg)
    apply_te_env(plan.env)
    _te()
    numerics = readback_numerics(cfg)
    with torch.device(device):
        return FOG(fog_config(cfg.model), numerics, TEParts(numerics, plan, torch.device(device)))
