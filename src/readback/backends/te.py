"""``backend=te``: the FOG model with Transformer Engine modules where TE can express the run.

``te.Linear`` for the GEMMs, ``te.RMSNorm`` for FOG's post-norms (a norm *after* each sub-block,
so RMSNorm + Linear, not LayerNormLinear) and for the QK-norm (frozen gains), and
``te.DotProductAttention`` where a TE switch reproduces the policy's attention backward reads
(``readback.backends.te_plan`` decides, without importing TE). Elsewhere the attention core and
the output projection that multiplies its O8 are readback's ops, so the O8 the D-term policy is
about is exactly the copy the projection multiplied. xIELU is readback's op (TE has no xIELU).

Transformer Engine is imported only by ``build_te_model``, after the plan's environment
variables are set (TE reads ``NVTE_DPA_FP8CS_O_in_F16`` at import). Parameters are FP32 master
weights; the forward runs under ``torch.autocast(bfloat16)`` and TE's FP8 autocast
(``te.autocast``, or ``te.fp8_autocast`` before it existed). TE keeps the FP8 scaling state of
its modules (scales, amax histories) in their ``state_dict`` under ``_extra_state``, so the
model's checkpoint carries it; ``model.numerics`` holds the state of the sites readback owns.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from readback.backends.te_plan import IMPORT_TIME_ENV, RECIPES, TEPlan, site_implementations, te_plan
from readback.errors import ConfigError
from readback.model.fog import XIELU, FOGConfig, kurtosis, rope
from readback.model.fog import Linear as ReadbackLinear
from readback.ops.attention import attention
from readback.ops.context import Numerics
from readback.ops.linear import linear

UNAVAILABLE = "needs CUDA and transformer_engine (pip install -e .[gpu]); use backend=emulated on this machine"
# What Transformer Engine assumes when an import-time variable is unset.
_IMPORT_TIME_DEFAULTS = {"NVTE_DPA_FP8CS_O_in_F16": "1"}

__all__ = [
    "TEFOG",
    "TENumerics",
    "apply_te_env",
    "build_te_model",
    "check_available",
    "site_implementations",
    "te_plan",
]


def _as_config(cfg: DictConfig | Mapping) -> DictConfig:
    return OmegaConf.structured(cfg)  # a typed Config, a DictConfig or a mapping


def check_available(cfg: DictConfig | Mapping | None = None) -> None:
    """Raise the one-line ``ConfigError`` unless this machine has CUDA and Transformer Engine
    (and, for ``precision=fp8``, an FP8-capable GPU). Imports nothing from TE."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("backend", "te", UNAVAILABLE)
    if cfg is not None and _as_config(cfg).precision.name == "fp8":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name()
            raise ConfigError("backend", "te", f"an FP8 GPU (sm_89+) for precision=fp8; {name} is sm_{major}{minor}: "
                                               f"use precision=bf16 or backend=emulated")


def apply_te_env(env: Mapping[str, str]) -> None:
    """Set the plan's Transformer Engine variables. A variable TE reads at import cannot change
    once TE is imported: that raises ``ConfigError`` (run such experiments in fresh processes)."""
    imported = any(name == "transformer_engine" or name.startswith("transformer_engine.") for name in sys.modules)
    for key, value in env.items():
        current = os.environ.get(key, _IMPORT_TIME_DEFAULTS.get(key))
        if imported and key in IMPORT_TIME_ENV and current != value:
            raise ConfigError(key, value, f"{current} (Transformer Engine is already imported in this process and read "
                                          f"{key} at import; run this experiment in a fresh process)")
        os.environ[key] = value


_TE = None


def _te():
    """``(transformer_engine.pytorch, transformer_engine.common.recipe)``, imported once."""
    global _TE
    if _TE is None:
        try:
            import transformer_engine.pytorch as te_pytorch
            from transformer_engine.common import recipe as te_recipe
        except Exception as error:  # a missing or broken install, or CUDA libraries it cannot load
            reason = " ".join(str(error).split())[:200]
            raise ConfigError("backend", "te", f"{UNAVAILABLE} (importing transformer_engine failed: {reason})") from error
        _TE = (te_pytorch, te_recipe)
    return _TE


def make_recipe(plan: TEPlan):
    """The Transformer Engine recipe object of ``plan`` (``None`` without FP8)."""
    if plan.recipe is None:
        return None
    _, recipes = _te()
    recipe_class = getattr(recipes, plan.recipe, None)
    if recipe_class is None:  # a TE whose version the plan could not tell
        key = next(k for k, v in RECIPES.items() if v == plan.recipe)
        raise ConfigError("precision.recipe", key, f"delayed (Transformer Engine {plan.te_version} has no {plan.recipe})")
    kwargs = dict(plan.recipe_kwargs)
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


def _te_linear(d_in: int, d_out: int, std: float, device, fp8_off: bool) -> nn.Module:
    te, _ = _te()
    module = te.Linear(d_in, d_out, bias=False, device=device)
    with torch.no_grad():
        nn.init.normal_(module.weight, std=std)
    module.readback_fp8_off = fp8_off  # a site of precision.bf16_layers: its GEMMs run in BF16
    return module


def _call_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if getattr(module, "readback_fp8_off", False):
        with fp8_autocast(enabled=False):
            return module(x)
    return module(x)


def _te_rms_norm(dim: int, gain: float, eps: float, device, frozen: bool = False) -> nn.Module:
    te, _ = _te()
    module = te.RMSNorm(dim, eps=eps, device=device)
    with torch.no_grad():
        module.weight.fill_(gain)
    module.weight.requires_grad_(not frozen)
    return module


def _rope_bshd(x: torch.Tensor, base: float) -> torch.Tensor:
    """fog's RoPE (FP32) on a (B, T, heads, hd) tensor, returned in ``x``'s dtype."""
    return rope(x.transpose(1, 2).float(), base).transpose(1, 2).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, plan: TEPlan, numerics: Numerics, device):
        super().__init__()
        te, _ = _te()
        self.cfg, self.name, self.numerics = cfg, f"layers.{index}.attn", numerics
        hd, fp8_off = cfg.head_dim, self._bf16(plan)
        self.qkv = _te_linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_groups) * hd, cfg.init_std, device,
                              fp8_off(f"{self.name}.qkv"))
        self.q_norm = _te_rms_norm(hd, 1.0, cfg.norm_eps, device, frozen=True)
        self.k_norm = _te_rms_norm(hd, 1.0, cfg.norm_eps, device, frozen=True)
        if plan.te_attention:
            self.core = te.DotProductAttention(
                cfg.n_heads, hd, num_gqa_groups=cfg.n_kv_groups, attention_dropout=0.0, attn_mask_type="causal",
                qkv_format="bshd", softmax_scale=cfg.softmax_scale, layer_number=index + 1,
            )
            self.proj = _te_linear(cfg.n_heads * hd, cfg.d_model, cfg.init_std, device, fp8_off(f"{self.name}.proj"))
        else:  # readback's core; its projection multiplies the core's O8 as is (x_q)
            self.core = None
            self.proj = ReadbackLinear(cfg.n_heads * hd, cfg.d_model, f"{self.name}.proj", numerics, cfg.init_std)

    @staticmethod
    def _bf16(plan: TEPlan):
        return lambda name: name.startswith(plan.bf16_layers) if plan.bf16_layers else False

    def forward(self, x):
        cfg, (batch, seq) = self.cfg, x.shape[:2]
        hd, heads, groups = cfg.head_dim, cfg.n_heads, cfg.n_kv_groups
        q, k, v = _call_linear(self.qkv, x).split([heads * hd, groups * hd, groups * hd], dim=-1)
        q = self.q_norm(q.reshape(batch, seq, heads, hd).contiguous())
        k = self.k_norm(k.reshape(batch, seq, groups, hd).contiguous())
        v = v.reshape(batch, seq, groups, hd)
        q, k = _rope_bshd(q, cfg.rope_base), _rope_bshd(k, cfg.rope_base)
        if self.core is not None:
            o = self.core(*(t.to(torch.bfloat16).contiguous() for t in (q, k, v)))  # (B, T, H*hd)
            return _call_linear(self.proj, o), o
        with torch.autocast(x.device.type, enabled=False):  # readback's ops choose their own precisions
            o, oq = attention(*(t.transpose(1, 2).float() for t in (q, k, v)), self.numerics,
                              f"{self.name}.core", cfg.softmax_scale)
            return self.proj(o, x_q=oq), o


class _MLP(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, plan: TEPlan, numerics: Numerics, device):
        super().__init__()
        name, off = f"layers.{index}.mlp", _Attention._bf16(plan)
        self.up = _te_linear(cfg.d_model, cfg.ffn_dim, cfg.init_std, device, off(f"{name}.up"))
        self.act = XIELU(numerics)
        self.down = _te_linear(cfg.ffn_dim, cfg.d_model, cfg.init_std, device, off(f"{name}.down"))

    def forward(self, x):
        return _call_linear(self.down, self.act(_call_linear(self.up, x).float()))


class _Block(nn.Module):
    def __init__(self, cfg: FOGConfig, index: int, plan: TEPlan, numerics: Numerics, device):
        super().__init__()
        gain = 1 / math.sqrt(cfg.n_layers)
        self.attn = _Attention(cfg, index, plan, numerics, device)
        self.attn_norm = _te_rms_norm(cfg.d_model, gain, cfg.norm_eps, device)
        self.mlp = _MLP(cfg, index, plan, numerics, device)
        self.mlp_norm = _te_rms_norm(cfg.d_model, gain, cfg.norm_eps, device)

    def forward(self, x, stats: dict | None = None):
        attn_out, core_out = self.attn(x)
        x = x + self.attn_norm(attn_out)  # FP32 residual stream, as in the emulated FOG
        if stats is not None:
            stats.setdefault("attn_out", []).append(kurtosis(core_out))
            stats.setdefault("ffn_in", []).append(kurtosis(x))
        return x + self.mlp_norm(self.mlp(x))


class TENumerics:
    """``model.numerics`` of a TE model: readback's ``Numerics`` for the sites readback's ops own
    (the attention core and its projection when they are readback's, a tied FP8 LM head).

    Transformer Engine owns the scaling state of its modules and keeps it in the modules'
    ``state_dict`` (``_extra_state``), so ``end_step``/``state_dict`` here cover readback's sites
    only, and ``saturation_counts`` reports readback's sites only (TE counts none). Note that TE
    updates delayed-scaling state after every forward (each micro-batch), readback once per step.
    """

    def __init__(self, readback: Numerics, plan: TEPlan):
        self.readback, self.plan = readback, plan

    def end_step(self) -> None:
        self.readback.end_step()

    def state_dict(self) -> dict:
        return {"readback": self.readback.state_dict(), "te_version": self.plan.te_version}

    def load_state_dict(self, state: dict) -> None:
        self.readback.load_state_dict(state["readback"] if "readback" in state else state)

    def saturation_counts(self) -> dict[str, int]:
        counts = getattr(self.readback, "saturation_counts", None)
        return dict(counts()) if counts is not None else {}

    def pop_observations(self) -> dict[str, float]:
        return self.readback.pop_observations()

    def __getattr__(self, name: str):
        if name in ("readback", "plan"):
            raise AttributeError(name)
        return getattr(self.readback, name)


class TEFOG(nn.Module):
    """FOG on Transformer Engine modules; the interface of ``readback.model.fog.FOG``."""

    def __init__(self, cfg: FOGConfig, plan: TEPlan, numerics: Numerics, device):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.numerics = TENumerics(numerics, plan)
        self._recipe = make_recipe(plan)
        # Read by TE when attention runs: re-set on every forward, so that another model built in
        # the same process with other switches cannot change what this one runs.
        self._runtime_env = {k: v for k, v in plan.env.items() if k not in IMPORT_TIME_ENV}
        self.embedding = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, device=device))
        nn.init.normal_(self.embedding, std=cfg.init_std)
        self.layers = nn.ModuleList(_Block(cfg, i, plan, numerics, device) for i in range(cfg.n_layers))
        self.lm_head = None if cfg.tied else _te_linear(cfg.d_model, cfg.vocab_size, cfg.init_std, device,
                                                        fp8_off=plan.fp8 and plan.lm_head_bf16)
        self.track_stats = False
        self._stats: dict[str, float] = {}

    def _fp8_context(self):
        if not self.plan.fp8:
            return contextlib.nullcontext()
        group = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            group = torch.distributed.group.WORLD
        return fp8_autocast(enabled=True, recipe=self._recipe, group=group)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (FP32) of ``idx`` against ``targets``, both (B, T)."""
        os.environ.update(self._runtime_env)
        with torch.autocast(idx.device.type, dtype=torch.bfloat16), self._fp8_context():
            x = F.embedding(idx, self.embedding).float() * self.cfg.embedding_multiplier
            stats = {} if self.track_stats else None
            for block in self.layers:
                x = block(x, stats)
            if stats is not None:
                self._stats = {f"kurtosis/{k}_max": max(v) for k, v in stats.items()}
            logits = self._head(x)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return _call_linear(self.lm_head, x)
        if self.plan.lm_head_bf16:
            return F.linear(x.to(torch.bfloat16), self.embedding.to(torch.bfloat16))
        with torch.autocast(x.device.type, enabled=False):
            return linear(x.float(), self.embedding, self.numerics.readback, "lm_head")

    def activation_stats(self) -> dict[str, float]:
        """Kurtosis maxima over layers from the last forward run with ``track_stats`` on."""
        return dict(self._stats)

    def n_params(self) -> int:
        """Trainable parameters (the frozen QK-norm gains are buffers in the emulated FOG)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def flops_per_token(self) -> float:
        """As ``FOG.flops_per_token``: 6 per GEMM weight (the tied LM head included), plus the
        causal attention score and value products."""
        te, _ = _te()
        cfg = self.cfg
        gemm_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, (te.Linear, ReadbackLinear)))
        gemm_weights += self.embedding.numel() if self.lm_head is None else 0
        return 6 * gemm_weights + 6 * cfg.n_layers * cfg.seq_len * cfg.n_heads * cfg.head_dim


def _fog_config(cfg: DictConfig) -> FOGConfig:
    m = cfg.model
    return FOGConfig(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_groups=m.n_kv_groups,
                     ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, seq_len=m.seq_len, tied=m.tied)


def _readback_numerics(cfg: DictConfig, plan: TEPlan) -> Numerics:
    """readback's Numerics for the sites its ops own; per-tensor current scaling under mxfp8."""
    from readback.model import build_numerics

    if plan.fp8 and cfg.precision.recipe != plan.readback_recipe:
        cfg = OmegaConf.merge(cfg, {"precision": {"recipe": plan.readback_recipe}})
    return build_numerics(cfg)


def build_te_model(cfg: DictConfig | Mapping, device: str | torch.device = "cuda") -> nn.Module:
    """The FOG of ``cfg.model`` on Transformer Engine modules, on a CUDA ``device``.

    ``device="meta"`` (shapes only, for dry runs) returns the emulated FOG on ``meta``: it has the
    same parameter shapes, parameter count and FLOPs per token, and needs no GPU or TE.
    Raises ``ConfigError`` (one line) when TE or CUDA is missing or cannot run ``cfg``.
    """
    cfg = _as_config(cfg)
    plan = te_plan(cfg)
    fog_cfg = _fog_config(cfg)
    if torch.device(device).type == "meta":
        from readback.model import build_numerics
        from readback.model.fog import FOG

        with torch.device("meta"):
            return FOG(fog_cfg, build_numerics(cfg))
    check_available(cfg)
    apply_te_env(plan.env)
    _te()
    numerics = _readback_numerics(cfg, plan)
    with torch.device(device):
        return TEFOG(fog_cfg, plan, numerics, torch.device(device))
