"""What Transformer Engine's attention core runs under ``backend=te``: its per-tensor recipe (the
linears', or ``attention.recipe`` through ``NVTE_DPA_FP8_RECIPE``), the switches that
make it read what the policy's D-term reads, what each attention gradient then reads, and the
refusals of what this TE and GPU cannot run. Pure, like ``te_plan``, which calls it.

What TE saves for its attention backward is pytorch/attention/dot_product_attention/backends.py
``FusedAttnFunc.forward`` (v2.8; the same in 2.20): FP8 backward: Q8, K8, V8 and O8, or the F16 O
under current scaling with ``NVTE_DPA_FP8CS_O_in_F16=1``; BF16 backward (``NVTE_FP8_DPA_BWD=0``):
the original BF16 Q, K, V and, as O, the dequantised O8 under delayed scaling, the F16 O under
current scaling whatever O_in_F16 says; so only ``attention.bwd_reads=te`` maps an FP8 forward's
BF16 backward onto TE. Where no switch reproduces the policy's read, readback's attention core
runs, under the same attention recipe.

``NVTE_DPA_FP8_RECIPE`` (dot_product_attention.py ``init_fp8_metadata``, v2.8 to 2.20) gives
attention a recipe of its own under another linear recipe (``facts.DPA_RECIPE_SWITCH``): a
``DelayedScaling`` with ``NVTE_DPA_FP8DS_AMAX_HISTLEN`` (default 1), ``NVTE_DPA_FP8DS_AMAX_ALGO``
(``most_recent``), ``NVTE_DPA_FP8DS_REDUCE_AMAX`` (1) and no margin; or a
``Float8CurrentScaling`` for Q, K, V, O, dO, dQ, dK, dV, with the S (P) and dP (dS) quantizers
under a ``DelayedScaling`` (the linear one under delayed linears, else one from the same
variables); both in the linear recipe's ``fp8_format``, but ``NVTE_DPA_FP8_FORMAT`` (HYBRID)
under NVFP4. All are read when TE is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from readback.backends.settings import ModelSettings
from readback.backends.te.facts import SINCE, Hardware, dpa_recipe_refusal, fp8_attention_refusal, te_attention_reads
from readback.backends.te.recipe import RECIPES, refuse_unsupported_fields
from readback.errors import ConfigError
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import Fp8Settings
from readback.numerics.spec import DPA_DELAYED_ALGO, DPA_DELAYED_HISTORY_LEN
from readback.ops.attention import READ_OPERANDS, TE_D_READS

PER_TENSOR = ("delayed", "current")
# Read by Transformer Engine when it is imported, not when attention runs (module-level os.getenv:
# NVTE_DPA_FP8CS_O_in_F16 in pytorch/attention/dot_product_attention/backends.py v2.8, the others
# in .../dot_product_attention.py v2.8), with TE's defaults.
IMPORT_TIME_ENV = {
    "NVTE_DPA_FP8CS_O_in_F16": "1",
    "NVTE_DPA_FP8_RECIPE": "",
    "NVTE_DPA_FP8_FORMAT": "HYBRID",
    "NVTE_DPA_FP8DS_AMAX_HISTLEN": str(DPA_DELAYED_HISTORY_LEN),
    "NVTE_DPA_FP8DS_AMAX_ALGO": DPA_DELAYED_ALGO,
    "NVTE_DPA_FP8DS_REDUCE_AMAX": "1",
}


@dataclass(frozen=True)
class TEAttention:
    """TE's attention core in a plan. ``kind``: its per-tensor recipe (``delayed``, ``current``;
    None: BF16); ``own_recipe``: another than the linears' (``NVTE_DPA_FP8_RECIPE``); ``env``: its
    variables; ``label``: the site's implementation, with the D read; ``reads``:
    ``{"attention_core.<gradient>": what it reads}``."""

    kind: str | None
    own_recipe: bool
    env: dict[str, str]
    label: str
    reads: dict[str, str]


def attention_kind(p8: Fp8Settings, group: AttentionSettings) -> str | None:
    """The per-tensor recipe TE's FP8 attention would run: ``attention.recipe``, else the linears'
    where it is per tensor; None under a block recipe (TE leaves attention unquantised)."""
    if group.recipe is not None:
        return group.recipe
    return p8.recipe if p8.recipe in PER_TENSOR else None


def te_attention(p8: Fp8Settings | None, policy: str, group: AttentionSettings, vt) -> TEAttention | None:
    """TE's attention core where one of its switches reproduces the policy's D-term read under the
    attention's recipe (the ``attention`` group), else ``None`` (readback's core runs it)."""
    bwd, bwd_reads = group.bwd_precision, group.bwd_reads
    if bwd not in ("fp8", "bf16") or group.parts_set_apart():
        return None  # TE's attention backward is FP8 or BF16, each whole: no switch sets a part apart
    if p8 is None:  # BF16 kernels compute D = rowsum(dO * O) from the BF16 O the projection multiplied
        if policy not in ("exact", "reuse_rounded"):
            return None
        reads = te_attention_reads("O (BF16, as the projection multiplied it)", "")
        return TEAttention(None, False, {}, "te.DotProductAttention(bf16)", _gradient_reads(reads))
    if bwd == "bf16" and bwd_reads != "te":
        return None  # a BF16 backward reading Q8, K8, V8: no TE switch
    kind = attention_kind(p8, group)
    found = TE_D_READS.get((kind, bwd, policy)) if kind is not None else None
    if kind is None or found is None:
        return None
    o_read, switches = found
    own = kind != p8.recipe
    recipe = RECIPES[kind] + (f" by NVTE_DPA_FP8_RECIPE under {RECIPES[p8.recipe]}" if own else "")
    words = [recipe, *(f"{k}={v}" for k, v in switches.items()), f"D reads {o_read}"]
    label = "te.DotProductAttention(fp8_dpa; " + "; ".join(words) + ")"
    reads = _gradient_reads(te_attention_reads(o_read, "8" if bwd == "fp8" else ""))
    return TEAttention(kind, own, {**switches, **_recipe_env(p8, group, kind, own, vt)}, label, reads)


def _recipe_env(p8: Fp8Settings, group: AttentionSettings, kind: str, own: bool, vt) -> dict[str, str]:
    """``NVTE_DPA_FP8_RECIPE`` and the variables of the recipe it makes, pinned where TE reads them
    (>= 2.8) so that the environment cannot change the attention's recipe: empty (the linears')
    unless the attention has its own; then its DelayedScaling's history and algorithm from the
    precision group. The DelayedScaling of a current-scaling attention's S and dP, unless it is
    the linears', takes TE's defaults, pinned too: the emulation's P and dS take them
    (``numerics.spec.DELAYED_UNDER_CURRENT``)."""
    if vt is not None and vt[:2] < SINCE["NVTE_DPA_FP8_RECIPE"]:
        return {}
    env = {"NVTE_DPA_FP8_RECIPE": RECIPES[kind] if own else ""}
    if own and p8.recipe == "nvfp4":
        env["NVTE_DPA_FP8_FORMAT"] = group.format(p8).name
    if own and kind == "delayed":
        history, algo = str(p8.amax_history_len), p8.amax_compute_algo
    elif kind == "current" and p8.recipe != "delayed":
        history, algo = IMPORT_TIME_ENV["NVTE_DPA_FP8DS_AMAX_HISTLEN"], IMPORT_TIME_ENV["NVTE_DPA_FP8DS_AMAX_ALGO"]
    else:
        return env  # the linears' DelayedScaling, S and dP included
    return env | {
        "NVTE_DPA_FP8DS_AMAX_HISTLEN": history,
        "NVTE_DPA_FP8DS_AMAX_ALGO": algo,
        "NVTE_DPA_FP8DS_REDUCE_AMAX": "1",  # readback reduces every amax over ranks
    }


def _gradient_reads(reads: dict[str, str]) -> dict[str, str]:
    """``{"attention_core.<gradient>": what it reads}`` from what TE reads of each forward value."""
    return {f"attention_core.{g}": reads[x] for g, x in READ_OPERANDS.items()}


def check_te_attention(
    cfg: ModelSettings, p8: Fp8Settings, attention: TEAttention, fp8_mha: bool, vt, hw: Hardware, where: str
) -> None:
    """Refuse, in one line, what TE's FP8 attention cannot train here: an attention recipe of its
    own on a TE or under a linear recipe that has none (``facts.dpa_recipe_refusal``), or with
    fields TE's attention recipe lacks; and what this GPU and shape cannot run
    (``facts.fp8_attention_refusal``)."""
    group = cfg.attention
    key, value = ("attention.recipe", group.recipe) if attention.own_recipe else ("precision.recipe", p8.recipe)
    if attention.own_recipe:
        reason = dpa_recipe_refusal(vt, RECIPES[p8.recipe])
        if reason is not None:
            raise ConfigError(key, value, f"null, or backend.attention_core=readback ({where}: {reason})")
        own = group.scaling_recipe(p8)
        assert own is not None
        refuse_unsupported_fields(own, vt, where)
        if attention.kind == "delayed" and p8.margin != 0:
            raise ConfigError(
                "precision.margin",
                p8.margin,
                f"0 with attention.recipe=delayed under precision.recipe={p8.recipe} ({where} builds "
                f"the attention's DelayedScaling without a margin; use backend=emulated)",
            )
        if fp8_mha:
            raise ConfigError(
                "backend.fp8_mha",
                fp8_mha,
                f"false ({where}: with attention.recipe the core's O8 is of another recipe than the projection's)",
            )
    if attention.kind == "current" and vt is not None and vt[:2] < SINCE["current_scaling_fp8_dpa"]:
        raise ConfigError(
            key,
            value,
            f"delayed, or backend.attention_core=readback ({where} has no FP8 attention under current "
            "scaling; it needs >= 2.8)",
        )
    m = cfg.model
    assert attention.kind is not None
    refusal = fp8_attention_refusal(vt, hw, attention.kind, m.d_model // m.n_heads, m.seq_len)
    if refusal is None:
        return
    setting, reason = refusal
    setting = key if setting == "precision.recipe" else setting
    values = {"backend.attention_core": "auto", key: value, "model.n_heads": m.n_heads, "model.seq_len": m.seq_len}
    fix = {
        "backend.attention_core": "readback",
        key: "delayed, or backend.attention_core=readback",
        "model.n_heads": "d_model / 128 (head dim 128), or backend.attention_core=readback",
        "model.seq_len": "a multiple of 128, or backend.attention_core=readback",
    }
    raise ConfigError(setting, values[setting], f"{fix[setting]} ({where}: {reason})")


def projection_label(attention: TEAttention | None, fp8_mha: bool, readback_linear: str) -> str:
    """The output projection's implementation: readback's linear after readback's core (it
    multiplies the core's O8 as is), else ``te.Linear``, which re-quantises the dequantised O8
    of a delayed-scaling attention, quantises the F16 O of a current-scaling one itself, or with
    ``fp8_mha`` multiplies the core's O8."""
    if attention is None:
        return readback_linear + " (multiplies the core's O8 as is)"
    if fp8_mha:
        return "te.Linear (multiplies the core's O8: fp8_output=True)"
    if attention.kind == "delayed":
        return "te.Linear (O rounded twice: re-quantises the core's dequantised O8 with its own scale)"
    return "te.Linear" + (" (quantises the core's F16 O itself)" if attention.kind == "current" else "")
