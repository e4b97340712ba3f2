"""What ``backend=te`` runs for a config: Transformer Engine recipe, switches and site owners.

A pure function of the config, a Transformer Engine version string and the GPU (capability,
cuDNN): it never imports Transformer Engine, so it is tested on any machine, and validation calls
it before a run starts. ``readback.backends.te`` turns the plan into modules; what TE can run
is ``readback.backends.te_facts``; the recipe, with its refusals, ``readback.backends.te_recipe``;
what each linear GEMM reads under it, ``readback.backends.te_linear``.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from readback.backends.emulated import READBACK_SITES, lm_head_in_bf16
from readback.backends.emulated import accumulations as readback_accumulations
from readback.backends.emulated import attention_reads as readback_attention_reads
from readback.backends.precision import fp8_settings
from readback.backends.settings import ATTENTION_CORES, ModelSettings, TeBackend
from readback.backends.te_facts import SINCE, Hardware, fp8_attention_refusal, te_attention_reads
from readback.backends.te_linear import linear_label
from readback.backends.te_recipe import INSTALLED, RECIPES, TERecipe, resolve_target, te_recipe_plan
from readback.errors import ConfigError, choose, require
from readback.ops.attention import READ_OPERANDS

# Read by Transformer Engine when it is imported, not when attention runs (pytorch/attention/
# dot_product_attention/backends.py v2.8: a module-level os.getenv).
IMPORT_TIME_ENV = ("NVTE_DPA_FP8CS_O_in_F16",)
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

    p, policy, bwd, bwd_reads = cfg.precision, cfg.policy.name, cfg.attention.bwd_precision, cfg.attention.bwd_reads
    te_backend = cfg.backend if isinstance(cfg.backend, TeBackend) else None
    core_choice = choose("backend.attention_core", te_backend.attention_core if te_backend else "auto", ATTENTION_CORES)
    fp8_mha = te_backend.fp8_mha if te_backend else False
    require(isinstance(fp8_mha, bool), "backend.fp8_mha", fp8_mha, "true or false")
    p8 = fp8_settings(p)
    scaling = p8.scaling_recipe() if p8 is not None else None
    recipe = te_recipe_plan(scaling, p8.rounding, version, hw) if p8 is not None else None
    fp8 = p8 is not None
    recipe_key = p8.recipe if p8 is not None else None

    attention = None if core_choice == "readback" else _te_attention(fp8, recipe_key, policy, bwd, bwd_reads)
    if attention is not None and recipe_key is not None:  # fp8
        _check_fp8_attention(cfg, recipe_key, vt, hw, where)
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
    env, attention_label, attention_reads = (
        attention
        if attention is not None
        else ({}, READBACK_SITES["attention_core"], readback_attention_reads(policy, bwd_reads))
    )
    if attention is not None:
        env = {**env, **PINNED_BACKEND}

    if recipe is not None:
        recipe = recipe.for_attention(fp8_dpa=attention is not None, fp8_mha=fp8_mha)
    bf16_layers = tuple(p8.bf16_layers) if p8 is not None else ()
    proj = _projection_label(attention is not None, recipe_key, fp8_mha)
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


def _check_fp8_attention(cfg: ModelSettings, recipe_key: str, vt, hw: Hardware, where: str) -> None:
    """Refuse what TE's FP8 attention cannot train here (``te_facts.fp8_attention_refusal``)."""
    if recipe_key == "current" and vt is not None and vt[:2] < SINCE["current_scaling_fp8_dpa"]:
        raise ConfigError(
            "precision.recipe",
            recipe_key,
            f"delayed, or backend.attention_core=readback ({where} has "
            f"no FP8 attention under current scaling; it needs >= 2.8)",
        )
    m = cfg.model
    refusal = fp8_attention_refusal(vt, hw, recipe_key, m.d_model // m.n_heads, m.seq_len)
    if refusal is None:
        return
    key, reason = refusal
    value = {
        "backend.attention_core": "auto",
        "precision.recipe": recipe_key,
        "model.n_heads": m.n_heads,
        "model.seq_len": m.seq_len,
    }[key]
    fix = {
        "backend.attention_core": "readback",
        "precision.recipe": "delayed, or backend.attention_core=readback",
        "model.n_heads": "d_model / 128 (head dim 128), or backend.attention_core=readback",
        "model.seq_len": "a multiple of 128, or backend.attention_core=readback",
    }[key]
    raise ConfigError(key, value, f"{fix} ({where}: {reason})")


def _te_attention(fp8: bool, recipe: str | None, policy: str, bwd: str, bwd_reads: str):
    """``(env, label, reads)`` when a Transformer Engine switch reproduces the policy's D-term
    read, else ``None`` (readback's core runs). What TE saves for its backward is pytorch/
    attention/dot_product_attention/backends.py ``FusedAttnFunc.forward`` (v2.8; the same in 2.20):
    FP8 backward: Q8, K8, V8 and O8, or the F16 O under current scaling with O_in_F16=1; BF16
    backward (``NVTE_FP8_DPA_BWD=0``): the original BF16 Q, K, V and, as O, the dequantised O8
    under delayed scaling, the F16 O under current scaling whatever O_in_F16 says; so only
    ``attention.bwd_reads=te`` maps an FP8 forward's BF16 backward onto TE."""
    if bwd not in ("fp8", "bf16"):
        return None  # TE's attention backward is FP8 or BF16
    if fp8 and bwd == "bf16" and bwd_reads != "te":
        return None  # a BF16 backward reading Q8, K8, V8: no TE switch
    if not fp8:
        # BF16 kernels compute D = rowsum(dO * O) from the BF16 O the projection multiplied.
        if policy not in ("exact", "reuse_rounded"):
            return None
        return (
            {},
            "te.DotProductAttention(bf16)",
            _gradient_reads(te_attention_reads("O (BF16, as the projection multiplied it)", "")),
        )
    dpa_bwd = "1" if bwd == "fp8" else "0"
    if recipe == "delayed" and policy == "reuse_rounded":
        o_read = "O8 (the core's output_fp8)" if bwd == "fp8" else "O8 dequantised to BF16"
        env = {"NVTE_FP8_DPA_BWD": dpa_bwd}
    elif recipe == "current" and bwd == "fp8" and policy in ("reuse_rounded", "original"):
        o_in_f16 = "1" if policy == "original" else "0"
        o_read = "original O (F16)" if policy == "original" else "O8 (quantised by the core's O quantizer)"
        env = {"NVTE_FP8_DPA_BWD": dpa_bwd, "NVTE_DPA_FP8CS_O_in_F16": o_in_f16}
    elif recipe == "current" and bwd == "bf16" and policy == "original":
        o_read, env = "original O (F16)", {"NVTE_FP8_DPA_BWD": dpa_bwd}
    else:
        return None
    label = f"te.DotProductAttention(fp8_dpa; {RECIPES[recipe]}; " + "; ".join(f"{k}={v}" for k, v in env.items()) + ")"
    return env, label, _gradient_reads(te_attention_reads(o_read, "8" if bwd == "fp8" else ""))


def _gradient_reads(reads: dict[str, str]) -> dict[str, str]:
    """``{"attention_core.<gradient>": what it reads}`` from what TE reads of each forward value."""
    return {f"attention_core.{g}": reads[x] for g, x in READ_OPERANDS.items()}


def _projection_label(te_attention: bool, recipe_key: str | None, fp8_mha: bool) -> str:
    if not te_attention:
        return READBACK_SITES["attn_proj"] + " (multiplies the core's O8 as is)"
    if fp8_mha:
        return "te.Linear (multiplies the core's O8: fp8_output=True)"
    if recipe_key == "delayed":
        return "te.Linear (O rounded twice: re-quantises the core's dequantised O8 with its own scale)"
    return "te.Linear" + (" (quantises the core's F16 O itself)" if recipe_key == "current" else "")


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
