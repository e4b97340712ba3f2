"""``backend=emulated``: every site is a readback op (``readback.model.fog.Parts``), on CPU or GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from readback.backends.attention_kernel import kernel_to_run
from readback.backends.settings import ModelSettings
from readback.numerics.precision_settings import GEMMS, resolve_accumulation
from readback.numerics.settings import NumericsSettings
from readback.numerics.spec import in_bf16_layers
from readback.ops import read_rules
from readback.ops.attention import READ_OPERANDS

# FOG's sites, in model order, and readback's code that runs each; backend=te and model=hf name
# theirs where they run something else.
READBACK_SITES = {
    "embedding": "torch.nn.functional.embedding",
    "linear": "readback.ops.linear",
    "attn_proj": "readback.ops.linear",
    "attention_core": "readback.ops.attention",
    "norm": "readback.ops.norm",
    "qk_norm": "readback.ops.norm (frozen gain)",
    "activation": "readback.ops.activation.xielu",
    "lm_head": "readback.ops.linear",
}
_READ_LABELS = {
    "rounded": "rounded {}",
    "original": "original {}",
    "fresh": "a fresh rounding of {}",
    "none": "no {}: D = rowsum(P * dP)",
    "rebuilt": "{} rebuilt from the original Q, K with the FP8 forward's LSE",
}


def attention_reads(settings: NumericsSettings) -> dict[str, str]:
    """``{"attention_core.<gradient>": what it reads}`` of readback's attention op under the
    settings' policy and attention group (the backward's flavour and the parts it sets apart)."""
    reads = read_rules(settings.policy, settings.attention)["attention"]
    return {f"attention_core.{g}": _READ_LABELS[reads[g]].format(x) for g, x in READ_OPERANDS.items()}


def attention_core_label(settings: NumericsSettings, on_cuda: bool | None = None) -> str:
    """readback's attention op, on the Triton kernel where ``attention.kernel`` runs it (on CUDA
    where ``on_cuda``; None: as on this machine), with ``attention.recipe`` where it gives it its
    own recipe."""
    kernel = " on readback.kernels (Triton)" if kernel_to_run(settings, on_cuda) == "triton" else ""
    recipe = settings.attention.recipe
    own = f" (attention.recipe={recipe})" if recipe else ""
    return READBACK_SITES["attention_core"] + kernel + own


def lm_head_in_bf16(fp8: bool, bf16_layers: Sequence[str]) -> bool:
    """The LM head runs in BF16 without FP8, or where ``precision.bf16_layers`` names it."""
    return not fp8 or in_bf16_layers("lm_head", tuple(bf16_layers))


def site_implementations(cfg: ModelSettings) -> dict[str, str]:
    """``{site: implementation}`` of a ``backend=emulated`` run, for the run's summary."""
    p = cfg.numerics.fp8
    head_bf16 = lm_head_in_bf16(p is not None, p.bf16_layers if p is not None else ())
    tied = " (tied embedding)" if cfg.model.tied else ""
    return {
        **READBACK_SITES,
        "attention_core": attention_core_label(cfg.numerics),
        "lm_head": READBACK_SITES["lm_head"] + tied + (" in BF16" if head_bf16 else ""),
        **attention_reads(cfg.numerics),
        **({} if p is None else accumulations(p.accumulation, p.accumulation_gemms)),
    }


def accumulations(name: str, gemms: Mapping[str, str] | None) -> dict[str, str]:
    """How the FP8 GEMMs add their products: the linears' per GEMM (``native`` is IEEE FP32 on
    the CPU and split accumulation where ``torch._scaled_mm`` runs), attention's always in IEEE
    FP32 (nothing is known of cuDNN's FP8 attention accumulation, so none is modelled)."""
    resolved = resolve_accumulation(name, dict(gemms or {}))
    return {
        "linear.accumulation": " ".join(f"{g}={mode}" for g, mode in zip(GEMMS, resolved)),
        "attention_core.accumulation": "ieee",
    }
