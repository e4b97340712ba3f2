"""The one FOG model, the parts it is built from, and its activation statistics.

``readback.backends.build_model`` builds it for a run; this package imports no backend.
"""

from __future__ import annotations

from readback.model.fog import FOG, FOGConfig, Parts, rounding_sites
from readback.model.stats import ActivationStats, kurtosis

__all__ = ["FOG", "ActivationStats", "FOGConfig", "Parts", "fog_config", "kurtosis", "rounding_sites"]


def fog_config(model_cfg) -> FOGConfig:
    """The ``FOGConfig`` of a run's ``model`` group."""
    return FOGConfig(**model_cfg.sizes(), tied=model_cfg.tied)
