"""What ``backend=te`` runs for a config: Transformer Engine recipe, switches and site owners.

A pure function of the config and a Transformer Engine version string: it never imports
Transformer Engine, so it is tested on any machine, and validation can call it before a run
starts. ``readback.backends.te`` turns the plan into modules.

The study's axes map onto TE where TE has a switch for them:

* ``reuse_rounded`` (D-term reads O8): ``DelayedScaling(fp8_dpa=True)``; TE's FP8 attention
  saves ``out_fp8`` for its backward. ``NVTE_FP8_DPA_BWD=1`` (FP8 backward) or ``0`` (BF16
  backward that still reads the dequantised O8): the ``reuse_rounded_bf16_bwd`` experiment.
* ``original`` (D-term reads the high-precision O): ``Float8CurrentScaling(fp8_dpa=True)`` with
  ``NVTE_DPA_FP8CS_O_in_F16=1``; with ``=0`` current scaling is another ``reuse_rounded``.
* ``fresh_reround``, ``no_saved_copy``, ``exact``: no TE switch. The attention core is readback's
  op, and so is the output projection, which takes the core's O8 as is (the very copy the
  D-term policy is about); every other GEMM and norm stays TE.
* ``precision=bf16``: TE modules without FP8 (``bf16_baseline``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from readback.errors import ConfigError, choose, require

# precision.recipe -> Transformer Engine recipe class. ``mxfp8`` exists only for backend=te.
RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling"}
ATTENTION_CORES = ("auto", "readback")

MIN_TE = (1, 13)
# First Transformer Engine release with each feature.
SINCE = {
    "MXFP8BlockScaling": (2, 0),
    "Float8CurrentScaling": (2, 2),
    "current_scaling_fp8_dpa": (2, 8),  # FP8 attention under Float8CurrentScaling
    "override_linear_precision_removed": (2, 0),
}
# Read by Transformer Engine when it is imported, not when attention runs.
IMPORT_TIME_ENV = ("NVTE_DPA_FP8CS_O_in_F16",)


@dataclass(frozen=True)
class TEPlan:
    """``recipe`` (a class of ``transformer_engine.common.recipe``) with ``recipe_kwargs``
    (``fp8_format`` as a ``Format`` member's name), or ``None`` under ``precision=bf16``;
    ``env``: the variables to set before Transformer Engine is imported; ``attention_core``:
    ``te`` or ``readback``; ``sites``: which implementation runs each site."""

    te_version: str | None
    fp8: bool
    recipe: str | None
    recipe_kwargs: dict[str, Any]
    env: dict[str, str]
    attention_core: str
    sites: dict[str, str]
    readback_recipe: str | None = None  # per-tensor recipe of the readback ops under this plan
    bf16_layers: tuple[str, ...] = field(default=())  # site prefixes whose GEMMs run without FP8

    @property
    def te_attention(self) -> bool:
        return self.attention_core == "te"

    @property
    def lm_head_bf16(self) -> bool:
        return _lm_head_bf16(self.fp8, self.bf16_layers)


def _lm_head_bf16(fp8: bool, bf16_layers: tuple[str, ...]) -> bool:
    return not fp8 or any("lm_head".startswith(prefix) for prefix in bf16_layers)


def installed_te_version() -> str | None:
    """The installed Transformer Engine's version, read from package metadata (no import)."""
    module = sys.modules.get("transformer_engine")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch", "transformer_engine_cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_tuple(version: str | None) -> tuple[int, int, int] | None:
    """``"2.8.0+cu12"`` -> ``(2, 8, 0)``; ``None`` for an unknown or missing version."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def _te_name(version: str | None) -> str:
    return f"Transformer Engine {version}" if version else "Transformer Engine (not installed here; 2.x assumed)"


_INSTALLED = object()


def te_plan(cfg: DictConfig | Mapping, te_version: str | None | object = _INSTALLED) -> TEPlan:
    """The plan for ``cfg`` under ``te_version`` (default: the installed version, or 2.x when
    none is installed). Raises ``ConfigError`` for what this TE cannot run as configured:
    fields TE removed set to non-default values, stochastic rounding, recipes or switches newer
    than the installed TE."""
    cfg = OmegaConf.structured(cfg)  # a typed Config, a DictConfig or a mapping
    version = installed_te_version() if te_version is _INSTALLED else te_version
    vt, te_name = version_tuple(version), _te_name(version)
    if vt is not None and vt[:2] < MIN_TE:
        raise ConfigError("backend", "te", f"Transformer Engine >= {'.'.join(map(str, MIN_TE))} ({te_name} is installed)")

    p, policy, bwd = cfg.precision, cfg.policy.name, cfg.attention.bwd_precision
    backend = cfg.get("backend") or {}
    core_choice = choose("backend.attention_core", backend.get("attention_core", "auto"), ATTENTION_CORES)
    fp8_mha = backend.get("fp8_mha", False)
    require(isinstance(fp8_mha, bool), "backend.fp8_mha", fp8_mha, "true or false")
    fp8 = p.name == "fp8"
    recipe_key = None
    if fp8:
        recipe_key = choose("precision.recipe", p.recipe, RECIPES)
        rounding = p.get("rounding", "nearest")
        require(rounding == "nearest", "precision.rounding", rounding,
                "nearest (backend=te: Transformer Engine rounds to nearest and no library rounds to FP8 "
                "stochastically; use backend=emulated for stochastic rounding)")
        _refuse_unsupported_fields(p, recipe_key, vt, te_name)
        since = SINCE.get(RECIPES[recipe_key])
        if vt is not None and since is not None and vt[:2] < since:
            raise ConfigError("precision.recipe", recipe_key,
                              f"delayed ({te_name} has no {RECIPES[recipe_key]}; it needs >= {since[0]}.{since[1]})")

    attention = None if core_choice == "readback" else _te_attention(fp8, recipe_key, policy, bwd)
    if attention is not None and recipe_key == "current" and vt is not None and vt[:2] < SINCE["current_scaling_fp8_dpa"]:
        raise ConfigError("precision.recipe", recipe_key,
                          f"delayed, or backend.attention_core=readback ({te_name} has no FP8 attention under "
                          f"current scaling; it needs >= 2.8)")
    if fp8_mha and (attention is None or not fp8):
        raise ConfigError("backend.fp8_mha", fp8_mha,
                          "false (fp8_mha needs precision=fp8 and Transformer Engine's attention core, which this "
                          "experiment does not run)")
    env, attention_label = attention if attention is not None else ({}, "readback.ops.attention")
    fp8_dpa = fp8 and attention is not None

    recipe, kwargs = None, {}
    if fp8:
        recipe = RECIPES[recipe_key]
        fmt = str(p.fp8_format).upper()
        if recipe_key == "delayed":
            kwargs = dict(margin=p.margin, fp8_format=fmt, amax_history_len=p.amax_history_len,
                          amax_compute_algo=str(p.amax_compute_algo), fp8_dpa=fp8_dpa, fp8_mha=fp8_mha)
            override = tuple(bool(b) for b in p.get("override_linear_precision", (False,) * 3))
            if any(override):  # only reached on TE 1.x, with (False, False, True)
                kwargs["override_linear_precision"] = override
        elif recipe_key == "current":
            kwargs = dict(fp8_format=fmt, fp8_dpa=fp8_dpa, fp8_mha=fp8_mha)
        else:
            kwargs = dict(fp8_format=fmt)
            if p.margin:
                kwargs["margin"] = p.margin

    bf16_layers = tuple(p.get("bf16_layers", ()) or ()) if fp8 else ()
    sites = _sites(cfg, attention is not None, attention_label, fp8, bf16_layers)
    readback_recipe = None if not fp8 else ("current" if recipe_key == "mxfp8" else recipe_key)
    return TEPlan(version, fp8, recipe, kwargs, env, "te" if attention is not None else "readback", sites,
                  readback_recipe, bf16_layers)


def _refuse_unsupported_fields(p, recipe_key: str, vt: tuple[int, int, int] | None, te_name: str) -> None:
    """Fields of readback's recipe that this Transformer Engine does not have, when they are set
    to anything but their default: refused, never dropped."""
    interval = p.get("interval", 1)
    if recipe_key == "delayed" and interval != 1:
        raise ConfigError("precision.interval", interval,
                          f"1 ({te_name} has no DelayedScaling.interval: TE's PyTorch modules never used it "
                          f"and 2.x removed it; use backend=emulated to study interval)")
    override = [bool(b) for b in p.get("override_linear_precision", (False,) * 3)]
    if any(override):
        removed = vt is None or vt[:2] >= SINCE["override_linear_precision_removed"]
        if recipe_key != "delayed" or removed:
            raise ConfigError("precision.override_linear_precision", override,
                              f"[false, false, false] ({te_name} has no override_linear_precision: it was removed "
                              f"in 2.0; use backend=emulated for high-precision GEMMs)")
        if override != [False, False, True]:
            raise ConfigError("precision.override_linear_precision", override,
                              f"[false, false, false] or [false, false, true] ({te_name} overrides only the wgrad GEMM)")
    if recipe_key == "current" and p.get("margin", 0) != 0:
        raise ConfigError("precision.margin", p.margin,
                          f"0 ({te_name}'s Float8CurrentScaling has no margin; use backend=emulated for a margin "
                          f"under current scaling)")


def _te_attention(fp8: bool, recipe: str | None, policy: str, bwd: str) -> tuple[dict[str, str], str] | None:
    """``(env, label)`` when a Transformer Engine switch reproduces the policy's attention
    backward reads, else ``None`` (readback's core runs)."""
    if bwd not in ("fp8", "bf16"):
        return None  # TE's attention backward is FP8 or BF16
    if not fp8:
        # BF16 kernels compute D = rowsum(dO * O) from the BF16 O the projection multiplied.
        return ({}, "te.DotProductAttention(bf16)") if policy in ("exact", "reuse_rounded") else None
    dpa_bwd = "1" if bwd == "fp8" else "0"
    if recipe == "delayed" and policy == "reuse_rounded":
        return ({"NVTE_FP8_DPA_BWD": dpa_bwd},
                f"te.DotProductAttention(fp8_dpa; DelayedScaling; NVTE_FP8_DPA_BWD={dpa_bwd})")
    if recipe == "current" and policy in ("reuse_rounded", "original"):
        o_in_f16 = "1" if policy == "original" else "0"
        return ({"NVTE_FP8_DPA_BWD": dpa_bwd, "NVTE_DPA_FP8CS_O_in_F16": o_in_f16},
                f"te.DotProductAttention(fp8_dpa; Float8CurrentScaling; NVTE_FP8_DPA_BWD={dpa_bwd}; "
                f"NVTE_DPA_FP8CS_O_in_F16={o_in_f16})")
    return None


def _sites(cfg, te_attention: bool, attention_label: str, fp8: bool, bf16_layers: tuple[str, ...]) -> dict[str, str]:
    tied = bool(cfg.model.get("tied", True))
    head_bf16 = _lm_head_bf16(fp8, bf16_layers)
    if tied:
        lm_head = "torch BF16 matmul (tied embedding)" if head_bf16 else "readback.ops.linear (tied embedding)"
    else:
        lm_head = "te.Linear (FP8 off)" if head_bf16 and fp8 else "te.Linear"
    return {
        "embedding": "torch.nn.functional.embedding",
        "linear": "te.Linear",
        "attn_proj": "te.Linear" if te_attention else "readback.ops.linear (multiplies the core's O8 as is)",
        "attention_core": attention_label,
        "norm": "te.RMSNorm",
        "qk_norm": "te.RMSNorm (frozen gain)",
        "activation": "readback.ops.activation.xielu",
        "lm_head": lm_head,
    }


def site_implementations(cfg: DictConfig | Mapping, te_version: str | None | object = _INSTALLED) -> dict[str, str]:
    """``{site: implementation}`` of a ``backend=te`` run, for the run's summary."""
    return dict(te_plan(cfg, te_version).sites)
