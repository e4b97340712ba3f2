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
    "policy": "policy",
    "bwd_precision": "attention.bwd_precision",
    "bwd_reads": "attention.bwd_reads",
}


#: Config keys renamed since runs were first recorded: old dotted key -> new. A saved config or a
#: record from before is read through it (``with_current_keys``, ``config_value``); a command line
#: that still says the old key is refused with the new one (``readback.config``).
RENAMED_KEYS = {"policy.name": "policy", "precision.attention_recipe": "attention.recipe"}


def with_current_keys(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A config saved before a rename (``RENAMED_KEYS``) with its values under today's keys (a copy;
    one saved since is returned as it was)."""
    out = {group: dict(node) if isinstance(node, Mapping) else node for group, node in saved.items()}
    for old, new in RENAMED_KEYS.items():
        old_group, old_key = old.split(".")
        node = out.get(old_group)
        if not isinstance(node, dict) or old_key not in node:
            continue
        value = node.pop(old_key)
        new_group, _, new_key = new.partition(".")
        if new_key:
            out.setdefault(new_group, {})[new_key] = value
        else:
            out[new_group] = value
    return out


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
    """The value at ``dotted`` (``"precision.rounding"``) of a nested config mapping, or None; in a
    config saved before a rename, the value of the key's old spelling (``RENAMED_KEYS``)."""
    old = next((o for o, new in RENAMED_KEYS.items() if new == dotted), None)
    found = _value_at(cfg, old) if old else None
    return found if found is not None else _value_at(cfg, dotted)


def _value_at(cfg: Mapping[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
