"""Which runs are seeds of one configuration: the groups that curves and tables average over.

A group is an experiment plus every setting that varies among that experiment's runs except the
seed: each Hydra override of a run (``.hydra/overrides.yaml``, or ``launch.overrides`` in a
wandb config) whose value differs between runs, and each of the study's config axes
(:data:`CONFIG_AXES`) that differs. A sweep over ``trainer.optim.lr=1e-3,3e-2`` with 2 seeds is
2 groups per experiment, ``reuse_rounded [trainer.optim.lr=0.001]`` and ``... [trainer.optim.lr=0.03]``,
never one row pooling a healthy and a diverged learning rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from readback.overrides import STUDY_AXES, config_value, is_setting

#: Config axes read from each run (column name -> dotted config key).
CONFIG_AXES: dict[str, str] = {"experiment": "experiment", "seed": "seed", **STUDY_AXES}
#: An axis's value in a run saved before its key existed (the behaviour the run had).
AXIS_DEFAULTS: dict[str, str] = {"bwd_reads": "forward"}
#: Axes that split an experiment into several groups when they vary within it.
GROUP_AXES = tuple(STUDY_AXES)


def setting(override: Mapping[str, str], cfg: Mapping[str, Any], key: str) -> str:
    """A run's value of ``key``: its override, else its config value (``model`` -> ``model.name``),
    else ``default``."""
    if key in override:
        return str(override[key])
    value = config_value(cfg, key)
    if isinstance(value, Mapping):
        value = value.get("name")
    return "default" if value is None else str(value)


def assign_groups(
    summary: pd.DataFrame, overrides: Mapping[str, Mapping[str, str]], configs: Mapping[str, Mapping[str, Any]]
) -> tuple[pd.Series, list[str]]:
    """The group of every run of ``summary`` and the keys that split groups (in order).

    ``overrides`` and ``configs``: run id -> the run's override map / config. A run lacking an
    axis (no config) gets no tag for it.
    """
    groups = pd.Series(index=summary.index, dtype=object)
    used: list[str] = []
    for exp, sub in summary.groupby("experiment", sort=False):
        runs = list(sub.index)
        keys = sorted({k for r in runs for k in overrides.get(r, {}) if is_setting(k)})
        varying = [k for k in keys if len({setting(overrides.get(r, {}), configs.get(r, {}), k) for r in runs}) > 1]
        covered = set(varying)
        axes = [a for a in GROUP_AXES if CONFIG_AXES[a] not in covered and sub[a].dropna().astype(str).nunique() > 1]
        for r in runs:
            tags = [f"{k}={setting(overrides.get(r, {}), configs.get(r, {}), k)}" for k in varying]
            tags += [f"{a}={sub.at[r, a]}" for a in axes if sub.at[r, a] is not None and not pd.isna(sub.at[r, a])]
            groups[r] = f"{exp} [{', '.join(tags)}]" if tags else str(exp)
        used += [k for k in [*varying, *axes] if k not in used]
    return groups, used


def group_settings(group: str) -> str:
    """The ``[...]`` part of a group name ('' for a plain experiment)."""
    return group.split(" [", 1)[1][:-1] if " [" in group else ""


def group_experiment(group: str) -> str:
    return str(group).split(" [", 1)[0]
