"""What Transformer Engine (TE) can run, by TE version, GPU and cuDNN: facts of TE's source.

Pure data and checks (no TE, no GPU needed). Each fact names the TE file and release it was
read from; ``readback.backends.te.plan`` refuses, in one line, what they rule out, so a run
never fails inside TE. Paths are relative to TE's ``transformer_engine/``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

Version = tuple[int, int, int]

# First TE release with each feature (common/recipe/__init__.py; pytorch/...):
SINCE = {
    "MXFP8BlockScaling": (2, 0),  # common/recipe/__init__.py, v2.0
    "Float8BlockScaling": (2, 3),  # common/recipe/__init__.py: absent in v2.2, present in v2.3
    "Float8CurrentScaling": (2, 2),  # common/recipe/__init__.py: absent in v2.1, present in v2.2
    # pytorch/attention/dot_product_attention/backends.py: NVTE_DPA_FP8CS_O_in_F16 first in v2.8
    "current_scaling_fp8_dpa": (2, 8),
    # .../dot_product_attention.py v2.8: DotProductAttention.forward(..., fp8_output=False); absent in v2.7
    "fp8_output": (2, 8),
    "save_original_input": (2, 6),  # pytorch/module/linear.py v2.6: Linear(save_original_input=False)
    "backward_override": (2, 15),  # common/recipe/__init__.py v2.15: backward_override / NVTE_BACKWARD_OVERRIDE
    "NVFP4BlockScaling": (2, 8),  # common/recipe/__init__.py: absent in v2.7, present in v2.8
    # common/recipe/__init__.py, NVFP4BlockScaling's fields defaulting to environment variables read
    # at import: row_scaled_activation (NVTE_NVFP4_ROW_SCALED_ACTIVATION) first in v2.16,
    # nvfp4_4over6 (NVTE_NVFP4_4OVER6) first in v2.17
    "row_scaled_activation": (2, 16),
    "nvfp4_4over6": (2, 17),
    # pytorch/attention/dot_product_attention/dot_product_attention.py: NVTE_DPA_FP8_RECIPE (and its
    # NVTE_DPA_FP8_FORMAT, NVTE_DPA_FP8DS_*) first in v2.8, absent in v2.7
    "NVTE_DPA_FP8_RECIPE": (2, 8),
}
# The linear recipes under which NVTE_DPA_FP8_RECIPE gives DotProductAttention a recipe of its own,
# from the first release that does (dot_product_attention.py ``init_fp8_metadata``: v2.8 switches
# under DelayedScaling, Float8CurrentScaling and NVFP4BlockScaling, and asserts every other recipe's
# fp8_dpa off; v2.15 adds MXFP8BlockScaling; through 2.20 no branch names Float8BlockScaling, whose
# recipe asserts fp8_dpa off, common/recipe/__init__.py).
DPA_RECIPE_SWITCH = {
    "DelayedScaling": (2, 8),
    "Float8CurrentScaling": (2, 8),
    "NVFP4BlockScaling": (2, 8),
    "MXFP8BlockScaling": (2, 15),
}
# common/recipe/__init__.py: v1.13 has override_linear_precision, v2.0 has not.
OVERRIDE_LINEAR_PRECISION_REMOVED = (2, 0)
# common/recipe/__init__.py: ``interval: int = -1``, "deprecated and unused" when set, through
# v2.1; the field is gone in v2.2.
INTERVAL_REMOVED = (2, 2)


@dataclass(frozen=True)
class Hardware:
    """The GPU's compute capability and the cuDNN runtime's version; ``None``: not known here
    (planning on a machine without the GPU), and the checks that need it are not made."""

    capability: tuple[int, int] | None = None
    cudnn: Version | None = None

    def describe(self) -> str:
        sm = f"sm{self.capability[0]}{self.capability[1]}" if self.capability else "an unknown GPU"
        return sm + (f", cuDNN {'.'.join(map(str, self.cudnn))}" if self.cudnn else "")


# What a plan assumes where it cannot look (a dry run on a machine without Transformer Engine or
# its GPU, planning a cluster job): the release the facts here were read from, and a Hopper GPU
# (H100, H200) with a cuDNN above every cuDNN bound below (>= 9.2.1, not 9.10.0, >= 9.7).
PLANNING_TE = "2.8.0"
PLANNING_GPU = Hardware((9, 0), (9, 13, 0))
PLANNING_GPU_NAME = "sm90 (H100, H200)"


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


def installed_hardware() -> Hardware:
    """This machine's GPU capability and cuDNN version (the one torch loads; in the NVIDIA
    PyTorch containers TE uses the same library), or an unknown ``Hardware`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return Hardware()
    return Hardware(torch.cuda.get_device_capability(), cudnn_version(torch.backends.cudnn.version()))


def version_tuple(version: str | None) -> tuple[int, int, int] | None:
    """``"2.8.0+cu12"`` -> ``(2, 8, 0)``; ``None`` for an unknown or missing version."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def cudnn_version(encoded: int | None) -> Version | None:
    """cuDNN's integer version (``91002``: 9.10.2, as torch and TE report it) as a tuple."""
    if not encoded:
        return None
    return (
        (encoded // 10000, encoded % 10000 // 100, encoded % 100)
        if encoded >= 9000
        else (encoded // 1000, encoded % 1000 // 100, encoded % 100)
    )  # cuDNN 8: 8906 is 8.9.6


def fp8_gemm_refusal(hw: Hardware) -> str | None:
    """pytorch/fp8.py v2.8 ``check_fp8_support`` (pytorch/quantization.py in 2.20): FP8 needs sm89+."""
    if hw.capability is not None and hw.capability < (8, 9):
        return "FP8 needs sm89 or newer"
    return None


def mxfp8_refusal(hw: Hardware) -> str | None:
    """pytorch/fp8.py v2.8 ``check_mxfp8_support`` (same in 2.20): sm100 up to, not including, sm120."""
    if hw.capability is not None and not (10, 0) <= hw.capability < (12, 0):
        return "MXFP8BlockScaling needs sm100 (and is not supported on sm120 yet)"
    return None


def nvfp4_refusal(hw: Hardware) -> str | None:
    """pytorch/fp8.py v2.8 ``check_nvfp4_support`` (pytorch/quantization.py ``_compute_nvfp4_support``
    in 2.20), asserted when the autocast is entered: "Device compute capability 10.0 or higher
    required for NVFP4 execution" (sm120 passes the check)."""
    if hw.capability is not None and hw.capability < (10, 0):
        return "NVFP4BlockScaling needs sm100 or newer"
    return None


def fp8_block_scaling_refusal(hw: Hardware, pow2_scales: bool) -> str | None:
    """pytorch/quantization.py v2.20 ``_compute_fp8_block_scaling_support``: sm90+ (and CUDA >= 12.9,
    not checked here); on sm100+ TE emulates the recipe with MXFP8 (pytorch/csrc/extensions/gemm.cpp),
    and its quantisers refuse FP32 scales there (common/transpose/quantize_transpose_vector_blockwise.cu
    and ``..._square_blockwise.cu``: "requires using power of two scaling factors")."""
    if hw.capability is not None and hw.capability < (9, 0):
        return "Float8BlockScaling needs sm90 or newer (and CUDA >= 12.9)"
    if hw.capability is not None and hw.capability >= (10, 0) and not pow2_scales:
        return "Float8BlockScaling runs as MXFP8 on sm100 and newer, which needs power-of-two scales"
    return None


def fp8_attention_refusal(
    te: Version | None, hw: Hardware, recipe: str, head_dim: int, seq_len: int
) -> tuple[str, str] | None:
    """``(setting, reason)`` when TE would find no backend for FP8 ``DotProductAttention``
    training of this shape (``fp8_dpa``, causal, bshd, no bias), else ``None``.

    Flash and unfused attention are disabled for FP8 (pytorch/attention/dot_product_attention/
    utils.py ``get_attention_backend``, v2.8), so only cuDNN's FP8 fused attention can run it, and
    common/fused_attn/fused_attn.cpp ``nvte_get_fused_attn_backend`` (v2.8 to 2.20) allows it
    only on sm90+, cuDNN != 9.10.0, and either cuDNN >= 9.2.1 with head dim 128 and sequence a
    multiple of 128 (below sm100), or cuDNN >= 9.7 with head dim a multiple of 16 and at most
    128 on sm100+, at most 256 on sm90 (training: exactly 128 from TE 2.8 on; v2.7 allowed <= 256).
    """
    cap, cudnn = hw.capability, hw.cudnn
    if cap is not None and cap < (9, 0):
        return "backend.attention_core", "FP8 attention needs sm90 or newer (sm89 has FP8 GEMMs only)"
    if recipe == "current":
        # utils.py v2.8: "Disabling FusedAttention for FP8 current scaling on arch < sm100";
        # v2.9 on also "... with cuDNN < 9.14.0".
        if cap is not None and cap < (10, 0):
            return "precision.recipe", "FP8 attention under current scaling needs sm100 or newer"
        if cudnn is not None and te is not None and te[:2] >= (2, 9) and cudnn < (9, 14, 0):
            return "precision.recipe", "FP8 attention under current scaling needs cuDNN >= 9.14.0"
    if (cudnn is not None and cudnn < (9, 2, 1)) or cudnn == (9, 10, 0):
        return "backend.attention_core", "FP8 attention needs cuDNN >= 9.2.1 and not 9.10.0"
    if cap is None:
        return None
    sm = f"sm{cap[0]}{cap[1]}"
    if cap < (10, 0):
        widest = 128 if te is None or te[:2] >= (2, 8) else 256
        d128 = head_dim == 128 and seq_len % 128 == 0  # needs cuDNN >= 9.2.1, checked above
        any_d = head_dim % 16 == 0 and (head_dim == 128 if widest == 128 else head_dim <= 256)
    else:
        d128, any_d = False, head_dim % 16 == 0 and head_dim <= 128
    if d128 or (any_d and (cudnn is None or cudnn >= (9, 7, 0))):
        return None
    if cap < (10, 0) and widest == 128:
        return "model.n_heads", f"FP8 attention training on {sm} needs head dim 128 (this model's is {head_dim})"
    if cap >= (10, 0):
        setting = "backend.attention_core" if any_d else "model.n_heads"
        return setting, f"FP8 attention on {sm} needs cuDNN >= 9.7 and head dim % 16 == 0, <= 128 (head dim {head_dim})"
    setting = "model.seq_len" if head_dim == 128 else "model.n_heads"
    return setting, (
        f"FP8 attention of head dim {head_dim}, sequence {seq_len} on {sm} needs head dim 128 and "
        f"sequence % 128 == 0, or cuDNN >= 9.7 and head dim % 16 == 0"
    )


def te_attention_reads(o_read: str, qkv: str) -> dict[str, str]:
    """What TE's attention backward reads of each forward value (backends.py
    ``FusedAttnFunc.forward``, v2.8 and 2.20): O as given; Q, K, V rounded (``qkv="8"``, FP8
    backward) or the original BF16 ones (BF16 backward); P recomputed by cuDNN from them and the
    saved softmax statistics."""
    qkv_read = "rounded {}8" if qkv else "original {} (BF16)"
    return {"O": o_read, **{x: qkv_read.format(x) for x in "QKV"}, "P": f"P recomputed from Q{qkv}, K{qkv} (cuDNN)"}


def dpa_recipe_refusal(te: Version | None, linear: str) -> str | None:
    """Why this TE cannot give ``DotProductAttention`` its own recipe (``NVTE_DPA_FP8_RECIPE``)
    under the linear recipe ``linear`` (a TE class name), else ``None`` (``DPA_RECIPE_SWITCH``)."""
    since = DPA_RECIPE_SWITCH.get(linear)
    if since is None:
        return f"no FP8 attention under {linear}, which asserts fp8_dpa off"
    if te is not None and te[:2] < since:
        return f"NVTE_DPA_FP8_RECIPE, attention's own recipe under {linear}, needs >= {since[0]}.{since[1]}"
    return None
