"""Hydra overrides as data: what a run's command line set, and which keys name a configuration.

Shared by the wandb run names (:mod:`readback.train.records.tracking`) and the analysis groups
(:mod:`readback.analysis.groups`), so a wandb group and an analysis group are the same runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: Keys that never tell two configurations apart: the seed (what a group averages over), the
#: experiment (named separately), the sweep preset, and how a run resumes, reports and logs.
NOT_A_SETTING = ("seed", "experiment", "sweep", "trainer.resume", "trainer.progress", "trainer.device")
NOT_A_SETTING_PREFIX = ("logger", "hydra")
#: The study's axes: name -> dotted config key. Each run's wandb tags and the analysis tables'
#: columns (which split an experiment into groups when they vary) are these.
STUDY_AXES = {
    "model": "model.name",
    "precision": "precision.name",
    "rounding": "precision.rounding",
    "policy": "policy.name",
    "bwd_precision": "attention.bwd_precision",
    "bwd_reads": "attention.bwd_reads",
}


def override_map(overrides: Sequence[str] | None) -> dict[str, str]:
    """``key -> value`` of a run's overrides, ``+``/``~`` dropped (``+experiment=x`` -> ``experiment``)."""
    out = {}
    for o in overrides or []:
        key, sep, value = str(o).partition("=")
        if sep:
            out[key.lstrip("+~")] = value
    return out


def is_setting(key: str) -> bool:
    """Whether an override key can tell two configurations apart (see :data:`NOT_A_SETTING`)."""
    return key not in NOT_A_SETTING and key.split(".", 1)[0] not in NOT_A_SETTING_PREFIX


def swept_keys(overrides: Sequence[str]) -> list[str]:
    """The keys a sweep's command line varies (``k=a,b``, ``k=range(...)``, ...), in order."""
    if not overrides:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:
        return []
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def config_value(cfg: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``"precision.rounding"``) of a nested config mapping, or None."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
