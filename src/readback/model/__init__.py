"""The FOG model family and its construction from a composed config."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from readback.model.fog import FOG, FOGConfig, rounding_sites
from readback.numerics import CurrentScaling, DelayedScaling
from readback.ops.context import Numerics

__all__ = ["FOG", "FOGConfig", "build_model", "build_numerics", "rounding_sites"]


def build_numerics(cfg: DictConfig) -> Numerics:
    """The run's ``Numerics`` from the ``precision``, ``policy`` and ``attention`` groups."""
    p = cfg.precision
    recipe = None
    if p.name == "fp8":
        common = dict(margin=p.margin, fp8_format=p.fp8_format, override_linear_precision=tuple(p.override_linear_precision))
        if p.recipe == "delayed":
            recipe = DelayedScaling(interval=p.interval, amax_history_len=p.amax_history_len,
                                    amax_compute_algo=p.amax_compute_algo, **common)
        else:
            recipe = CurrentScaling(**common)
    return Numerics(
        precision=p.name,
        recipe=recipe,
        policy=cfg.policy.name,
        attention_bwd=cfg.attention.bwd_precision,
        rounding=p.rounding if p.name == "fp8" else "nearest",
        seed=cfg.seed,
        bf16_sites=tuple(p.bf16_layers) if p.name == "fp8" else (),
        site_margin=dict(p.site_margin or {}) if p.name == "fp8" else {},
    )


def build_model(cfg: DictConfig, device: str | torch.device = "cpu") -> FOG:
    """FOG of size ``cfg.model`` on ``device`` (``meta`` builds shapes only), with its Numerics.

    ``backend=te`` builds Transformer Engine modules (CUDA only); on ``meta`` (dry runs) the
    emulated FOG stands in: it has the same parameters and FLOPs.
    """
    if cfg.backend.name == "te" and torch.device(device).type != "meta":
        from readback.backends.te import build_te_model

        return build_te_model(cfg, device)
    m = cfg.model
    fog_cfg = FOGConfig(
        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_groups=m.n_kv_groups,
        ffn_dim=m.ffn_dim, vocab_size=m.vocab_size, seq_len=m.seq_len, tied=m.tied,
    )
    with torch.device(device):
        return FOG(fog_cfg, build_numerics(cfg))
