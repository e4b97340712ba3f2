"""Backends: ``emulated`` (readback's ops in PyTorch, CPU or GPU) and ``te`` (Transformer Engine
modules where TE can express the experiment, readback's ops elsewhere; CUDA only).

Nothing here imports Transformer Engine: ``readback.backends.te`` imports it when a model is
built, after the run's TE environment variables are set.
"""

from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

BACKENDS = ("emulated", "te")


def site_implementations(cfg: DictConfig | Mapping) -> dict[str, str]:
    """``{site: implementation}`` for the run's summary: which code ran each site
    (``linear``, ``attn_proj``, ``attention_core``, ``norm``, ``qk_norm``, ``activation``,
    ``embedding``, ``lm_head``) under ``cfg.backend.name``."""
    cfg = OmegaConf.structured(cfg)  # a typed Config, a DictConfig or a mapping
    name = cfg.backend.name
    if name == "te":
        from readback.backends.te_plan import site_implementations as te_sites

        return te_sites(cfg)
    from readback.backends.emulated import site_implementations as emulated_sites

    return emulated_sites(cfg)


def check_available(cfg: DictConfig | Mapping) -> None:
    """Raise ``ConfigError`` when ``cfg.backend`` cannot run on this machine, or (``te``) when
    the installed Transformer Engine cannot run ``cfg`` as configured."""
    cfg = OmegaConf.structured(cfg)  # a typed Config, a DictConfig or a mapping
    if cfg.backend.name == "te":
        from readback.backends.te import check_available as te_check
        from readback.backends.te_plan import te_plan

        te_check(cfg)
        te_plan(cfg)


__all__ = ["BACKENDS", "check_available", "site_implementations"]
