"""What ``backend=te`` runs for a config: Transformer Engine recipe, switches and site owners.

A pure function of the config, a Transformer Engine version string and the GPU (capability,
cuDNN): it never imports Transformer Engine, so it is tested on any machine, and validation calls
it before a run starts. ``readback.backends.te.parts`` turns the plan into modules; what TE can run
is ``readback.backends.te.facts``; the recipe, with its refusals, ``readback.backends.te.recipe``;
what each linear GEMM reads under it, ``readback.backends.te.linear``; the attention core,
``readback.backends.te.attention``.

The study's axes map onto TE where TE has a switch for them:

* ``reuse_rounded`` (D-term reads O8): ``DelayedScaling(fp8_dpa=True)``; TE's FP8 attention
  saves ``out_fp8`` for its backward. ``NVTE_FP8_DPA_BWD=1`` (FP8 backward) or ``0`` (BF16
  backward reading the dequantised O8 for D, the original BF16 Q, K, V and dO, and P rebuilt from
  Q, K with the FP8 forward's softmax statistics): ``reuse_rounded_bf16_bwd``, whose
  ``attention.bwd_reads=te`` makes readback's op read the same (a BF16 backward that reads the
  forward's Q8, K8, V8, ``bwd_reads=forward``, has no TE switch: readback's core runs it).
  Under current scaling, ``NVTE_DPA_FP8CS_O_in_F16=0`` with the FP8 backward.
* ``original`` (D-term reads the high-precision O): ``Float8CurrentScaling(fp8_dpa=True)``; its
  FP8 backward reads the F16 O with ``NVTE_DPA_FP8CS_O_in_F16=1``, its BF16 backward (with
  ``attention.bwd_reads=te``, the original Q, K, V) always does.
* ``fresh_reround``, ``no_saved_copy``, ``exact``: no TE switch. The attention core is readback's
  op, and so is the output projection, which takes the core's O8 as is (the very copy the
  D-term policy is about); every other GEMM and norm stays TE.
* ``precision=bf16``: TE modules without FP8 (``bf16_baseline``).

The attention's recipe is the linears' (``NVTE_DPA_FP8_RECIPE`` pinned empty), or
``attention.recipe`` through ``NVTE_DPA_FP8_RECIPE``: the rows above then hold for that
recipe under any linear recipe TE switches it under; where they do not, readback's core runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from readback.backends.emulated import READBACK_SITES, attention_core_label, lm_head_in_bf16
from readback.backends.emulated import accumulations as readback_accumulations
from readback.backends.emulated import attention_reads as readback_attention_reads
from readback.backends.settings import ATTENTION_CORES, ModelSettings, TeBackend
from readback.backends.te.attention import IMPORT_TIME_ENV, check_te_attention, projection_label, te_attention
from readback.backends.te.facts import SINCE, Hardware
from readback.backends.te.linear import linear_label
from readback.backends.te.recipe import INSTALLED, TERecipe, resolve_target, te_recipe_plan
from readback.errors import ConfigError, choose, require
from readback.numerics.precision_settings import fp8_settings

__all__ = ["IMPORT_TIME_ENV", "PINNED_BACKEND", "TEPlan", "site_implementations", "te_plan"]
# One attention kernel per experiment: cuDNN's fused attention (the only FP8 one), never a
# silent switch to flash attention (utils.py v2.8 reads these on every call).
PINNED_BACKEND = {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"}


@dataclass(frozen=True)
class TEPlan:
    """``te_recipe``: the Transformer Engine recipe to make (``recipe``, a class of
    ``transformer_engine.common.recipe``, with ``recipe_kwargs``), or ``None`` under ``precision=bf16``;
    ``env``: the variables to set before Transformer Engine is imported; ``attention_core``:
    ``te`` or ``readback``; ``fp8_output``: the core hands its FP8 O8 to the projection
    (``forward(fp8_output=True)``); ``sites``: which implementation ran each site and which
    value each attention gradient read."""

    te_version: str | None
    hardware: Hardware
    fp8: bool
    te_recipe: TERecipe | None
    env: dict[str, str]
    attention_core: str
    sites: dict[str, str]
    bf16_layers: tuple[str, ...]  # site prefixes whose GEMMs run without FP8
    fp8_output: bool

    @property
    def recipe(self) -> str | None:
        return self.te_recipe.name if self.te_recipe is not None else None

    @property
    def recipe_kwargs(self) -> dict[str, Any]:
        return self.te_recipe.kwargs if self.te_recipe is not None else {}

    @property
    def te_attention(self) -> bool:
        return self.attention_core == "te"

    @property
    def lm_head_bf16(self) -> bool:
        return lm_head_in_bf16(self.fp8, self.bf16_layers)


def te_plan(cfg: ModelSettings, te_version: str | None = INSTALLED, hardware: Hardware = INSTALLED) -> TEPlan:
    """The plan for ``cfg`` under ``te_version`` on ``hardware`` (defaults: what this machine
    has; no TE means 2.x, no GPU means the checks that need one are not made). Raises
    ``ConfigError`` (one line naming the TE version, the GPU and the setting) for what this TE
    cannot run on this GPU as configured, instead of failing inside TE."""
    version, hw, vt, where = resolve_target(te_version, hardware)

    p, policy = cfg.precision, cfg.policy
    te_backend = cfg.backend if isinstance(cfg.backend, TeBackend) else None
    core_choice = choose("backend.attention_core", te_backend.attention_core if te_backend else "auto", ATTENTION_CORES)
    fp8_mha = te_backend.fp8_mha if te_backend else False
    require(isinstance(fp8_mha, bool), "backend.fp8_mha", fp8_mha, "true or false")
    p8 = fp8_settings(p)
    scaling = p8.scaling_recipe() if p8 is not None else None
    recipe = te_recipe_plan(scaling, p8.rounding, version, hw) if p8 is not None else None
    fp8 = p8 is not None

    attention = None if core_choice == "readback" else te_attention(p8, policy, cfg.attention, vt)
    if attention is not None and p8 is not None:
        check_te_attention(cfg, p8, attention, fp8_mha, vt, hw, where)
    if fp8_mha and (attention is None or not fp8):
        raise ConfigError(
            "backend.fp8_mha",
            fp8_mha,
            "false (fp8_mha needs precision=fp8 and Transformer Engine's attention core, which this "
            "experiment does not run)",
        )
    if fp8_mha and vt is not None and vt[:2] < SINCE["fp8_output"]:
        raise ConfigError(
            "backend.fp8_mha",
            fp8_mha,
            f"false (readback hands the O8 over with "
            f"DotProductAttention.forward(fp8_output=True), which {where} lacks: it needs >= 2.8)",
        )
    if attention is not None:
        env, attention_label, attention_reads = {**attention.env, **PINNED_BACKEND}, attention.label, attention.reads
    else:
        env, attention_label, attention_reads = (
            {},
            attention_core_label(cfg.numerics, on_cuda=True),  # TE runs on CUDA only
            readback_attention_reads(cfg.numerics),
        )

    if recipe is not None:
        own = attention is not None and attention.own_recipe
        recipe = recipe.for_attention(fp8_dpa=attention is not None, fp8_mha=fp8_mha, own_recipe=own)
    bf16_layers = tuple(p8.bf16_layers) if p8 is not None else ()
    proj = projection_label(attention, fp8_mha, READBACK_SITES["attn_proj"])
    sites = {**_sites(cfg, attention_label, proj, fp8, bf16_layers, linear_label(policy, scaling)), **attention_reads}
    if fp8:  # TE's own GEMM accumulation, Hopper's (the config refuses any other); cuDNN's attention unmodelled
        sites |= readback_accumulations("hopper", None)
        if attention is not None:
            sites["attention_core.accumulation"] = "cuDNN's own (not modelled)"
    return TEPlan(
        version,
        hw,
        fp8,
        recipe,
        env,
        "te" if attention is not None else "readback",
        sites,
        bf16_layers,
        fp8_mha,
    )


def _sites(
    cfg: ModelSettings, attention_label: str, proj: str, fp8: bool, bf16_layers: tuple[str, ...], linear: str
) -> dict[str, str]:
    tied = cfg.model.tied
    head_bf16 = lm_head_in_bf16(fp8, bf16_layers)
    if tied:
        lm_head = "torch BF16 matmul (tied embedding)" if head_bf16 else READBACK_SITES["lm_head"] + " (tied embedding)"
    else:
        lm_head = "te.Linear (FP8 off)" if head_bf16 and fp8 else "te.Linear"
    return {
        **READBACK_SITES,
        "linear": linear,
        "attn_proj": proj,
        "attention_core": attention_label,
        "norm": "te.RMSNorm",
        "qk_norm": "te.RMSNorm (frozen gain)",
        "lm_head": lm_head,
    }


def site_implementations(
    cfg: ModelSettings, te_version: str | None = INSTALLED, hardware: Hardware = INSTALLED
) -> dict[str, str]:
    """``{site: implementation}`` of a ``backend=te`` run, for the run's summary."""
    return dict(te_plan(cfg, te_version, hardware).sites)
