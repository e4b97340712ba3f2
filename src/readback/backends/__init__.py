"""Backends: the parts the one FOG (``readback.model.fog``) is built from.

``emulated``: readback's ops in PyTorch (CPU or GPU). ``te``: Transformer Engine modules where
TE can run the experiment, readback's ops elsewhere (CUDA only). ``build_model`` builds a run's
model with its backend's parts.

Nothing here imports Transformer Engine: ``readback.backends.te.parts`` imports it when a model is
built, after the run's TE environment variables are set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from readback.backends.settings import BACKENDS, ModelSettings
from readback.model import FOG, fog_config
from readback.numerics.state import Numerics
from readback.ops import numerics_spec

if TYPE_CHECKING:
    from readback.backends.hf import HFCausalLM


def build_model(cfg: ModelSettings, device: str | torch.device = "cpu") -> FOG | HFCausalLM:
    """FOG of size ``cfg.model`` on ``device`` with the parts of ``cfg.backend.name``
    (``model=hf``: a transformers model converted to those parts).

    ``device="meta"`` (shapes only, for dry runs) always builds readback's parts: they have the
    same trainable parameters and FLOPs as Transformer Engine's and need no GPU or TE.
    Raises ``ConfigError`` (one line) when ``backend=te`` cannot run ``cfg`` here.
    """
    if cfg.model.name == "hf":  # a transformers model, converted (readback.backends.hf)
        from readback.backends.hf import build_hf_model

        return build_hf_model(cfg, device)
    if cfg.backend.name == "te" and torch.device(device).type != "meta":
        from readback.backends.te.parts import build_te_model

        return build_te_model(cfg, device)
    with torch.device(device):
        return FOG(fog_config(cfg.model), Numerics(numerics_spec(cfg.numerics), seed=cfg.seed))


def site_implementations(cfg: ModelSettings) -> dict[str, str]:
    """``{site: implementation}`` for the run's summary: which code ran each site
    (``linear``, ``attn_proj``, ``attention_core``, ``norm``, ``qk_norm``, ``activation``,
    ``embedding``, ``lm_head``) under ``cfg.backend.name``, and which value each attention
    gradient read (``attention_core.<gradient>``)."""
    if cfg.model.name == "hf":
        from readback.backends.hf import site_implementations as hf_sites

        return hf_sites(cfg)
    if cfg.backend.name == "te":
        from readback.backends.te.plan import site_implementations as te_sites

        return te_sites(cfg)
    from readback.backends.emulated import site_implementations as emulated_sites

    return emulated_sites(cfg)


def check_available(cfg: ModelSettings) -> None:
    """Raise ``ConfigError`` when ``cfg.backend`` cannot run on this machine, or (``te``) when
    the installed Transformer Engine cannot run ``cfg`` on this GPU as configured."""
    if cfg.backend.name == "te":
        from readback.backends.te.parts import check_available as te_check
        from readback.backends.te.plan import te_plan

        te_check()
        te_plan(cfg)


__all__ = ["BACKENDS", "build_model", "check_available", "site_implementations"]
