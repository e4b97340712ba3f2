"""The tables of a set of runs (:class:`Runs`), built by
:func:`readback.analysis.records.runs_from_records` from per-run records that
:func:`readback.analysis.files.load_runs` (sweep directories) and
:func:`readback.analysis.remote.load_wandb` (a wandb project) read.

Both return a :class:`Runs` with two pandas DataFrames:

``runs.summary``: one row per run, index ``run`` (the run id: the run directory relative to the
sweep directory it was found under, prefixed with that sweep directory's name when several are
loaded; the wandb run path for wandb runs). Columns:

* ``experiment``, ``seed``, ``model``, ``precision``, ``rounding`` (``precision.rounding``),
  ``policy``, ``bwd_precision`` (``attention.bwd_precision``), ``bwd_reads``
  (``attention.bwd_reads``; ``forward`` for a run saved before the key): from the run's config;
* ``group``: what curves and tables aggregate over seeds: the experiment, followed by
  ``[key=value, ...]`` for every override and study axis (but the seed) that takes more than
  one value among the loaded runs of that experiment (:mod:`readback.analysis.groups`; the keys
  are ``Runs.group_keys``), e.g. ``reuse_rounded [trainer.optim.lr=0.03]``;
* ``status``: ``completed`` | ``diverged`` | ``failed`` from ``summary.json``; a run without
  one is ``running`` when a file of it changed within ``running_within_s`` seconds, else
  ``failed`` (killed without a word: out of memory, time limit, preemption);
* ``final_loss``, ``val_loss``, ``steps``, ``tokens``, ``diverged_at_step``, ``wall_time_s``,
  ``n_params``, ``error``: from ``summary.json``; where it is missing, ``final_loss``,
  ``val_loss``, ``steps`` and ``tokens`` come from the last logged records;
* ``diverged``: ``status == "diverged"`` or a ``diverged_at_step``;
* ``last_step``: the last step in ``metrics.jsonl``; ``bad_lines``: unreadable lines in it;
  ``overrides``: the run's Hydra overrides (``k=v,...``); ``command``, ``machine``, ``cpu`` and
  ``code``: what started it, where, on which CPU kind (model and ISA: runs of one test share one,
  as kinds differ in bits) and at which commit (``launch.json``); ``path``: the run directory
  (``None`` for wandb runs).

``runs.metrics``: the long table of every logged number, one row per (run, step, key):
columns ``run``, ``experiment``, ``group``, ``seed``, ``step``, ``tokens`` (of that record),
``key``, ``value`` (float; null -> NaN, booleans -> 0/1, strings dropped). A step logged twice
(a resumed run) keeps its last record. ``runs.wide()`` pivots it to one column per key.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from readback.analysis.groups import CONFIG_AXES
from readback.outputs import SUMMARY_KEYS

# The keys of summary.json (readback.outputs.SUMMARY_KEYS says what each is) that a run's row
# leaves in the file: the experiment is a config axis, the rest say more than a table's column.
SUMMARY_LEFT_OUT = frozenset(
    {
        "divergence_reason",
        "skipped_updates",
        "nonfinite_tensors",
        "site_implementations",
        "flops_per_token",
        "world_size",
        "experiment",
        "memory_gb",
        "te_plan",
    }
)
# The keys a run's row keeps, in summary.json's order.
SUMMARY_FIELDS = tuple(key for key in SUMMARY_KEYS if key not in SUMMARY_LEFT_OUT)
SUMMARY_COLUMNS = (
    *CONFIG_AXES,
    "group",
    *SUMMARY_FIELDS,
    "diverged",
    "last_step",
    "bad_lines",
    "overrides",
    "command",
    "machine",
    "cpu",
    "code",
    "path",
)
METRIC_COLUMNS = ("run", "experiment", "group", "seed", "step", "tokens", "key", "value")


@dataclass
class Runs:
    """Runs of one or more sweeps: ``summary`` (one row per run) and ``metrics`` (long)."""

    summary: pd.DataFrame = field(default_factory=lambda: _empty_summary())
    metrics: pd.DataFrame = field(default_factory=lambda: empty_metrics())
    #: The settings that split experiments into groups (:mod:`readback.analysis.groups`).
    group_keys: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.summary)

    def __repr__(self) -> str:
        counts = self.summary["status"].value_counts().to_dict() if len(self) else {}
        return f"Runs({len(self)} runs, {len(self.metrics)} metric rows, groups={self.groups}, status={counts})"

    @property
    def groups(self) -> list[str]:
        """The groups: the study's experiments in :data:`STUDY_ORDER`, then the others by name."""
        return sorted(dict.fromkeys(self.summary["group"]), key=_study_key) if len(self) else []

    @property
    def experiments(self) -> list[str]:
        return sorted(dict.fromkeys(self.summary["experiment"]), key=_study_key) if len(self) else []

    def keys(self, pattern: str = "*") -> list[str]:
        """The logged metric keys matching a glob pattern, sorted naturally (layer 2 before 10)."""
        keys = self.metrics["key"].unique() if len(self.metrics) else []
        return sorted((str(k) for k in keys if fnmatch.fnmatchcase(str(k), pattern)), key=natural_key)

    def curve(self, key: str) -> pd.DataFrame:
        """The long rows of one key with finite values: run, experiment, group, seed, step,
        tokens, value."""
        m = self.metrics
        rows = m[m["key"] == key]
        rows = rows[np.isfinite(rows["value"].to_numpy(dtype=float))]
        return rows.drop(columns="key").reset_index(drop=True)

    def wide(self, keys: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per (run, step), one column per key (``keys`` globs select; default all), plus
        ``experiment``, ``group``, ``seed`` and ``tokens`` columns."""
        m = self.metrics
        if keys is not None:
            pats = list(keys)
            names = {str(k) for k in m["key"].unique()}
            chosen = {k for k in names if any(fnmatch.fnmatchcase(k, p) for p in pats)}
            m = m[m["key"].astype(str).isin(chosen)]
        if not len(m):
            return pd.DataFrame(index=pd.MultiIndex.from_arrays([[], []], names=["run", "step"]))
        m = m.assign(run=m["run"].astype(str), key=m["key"].astype(str))
        table = m.pivot_table(index=["run", "step"], columns="key", values="value", aggfunc="last", dropna=False)
        table.columns.name = None
        info = m.groupby(["run", "step"], observed=True)[["experiment", "group", "seed", "tokens"]].last()
        info = info.assign(experiment=info["experiment"].astype(str), group=info["group"].astype(str))
        return info.join(table[sorted(table.columns, key=natural_key)])

    def select(
        self,
        *,
        groups: Iterable[str] | None = None,
        experiments: Iterable[str] | None = None,
        status: Iterable[str] | None = None,
    ) -> Runs:
        """The runs of the given groups / experiments / statuses (each ``None``: all)."""
        s = self.summary
        keep = pd.Series(True, index=s.index)
        if groups is not None:
            keep &= s["group"].isin(list(groups))
        if experiments is not None:
            keep &= s["experiment"].isin(list(experiments))
        if status is not None:
            keep &= s["status"].isin(list(status))
        ids = set(s.index[keep])
        m = self.metrics
        return Runs(s[keep].copy(), m[m["run"].astype(str).isin(ids)].reset_index(drop=True), list(self.group_keys))


#: The study's experiments, in the order tables and legends list them.
STUDY_ORDER = (
    "reuse_rounded",
    "fresh_reround",
    "no_saved_copy",
    "reuse_rounded_bf16_bwd",
    "original_bf16_bwd",
    "bf16_baseline",
)


def _study_key(group: str) -> tuple[int, list[Any]]:
    exp = str(group).split(" [", 1)[0]
    rank = STUDY_ORDER.index(exp) if exp in STUDY_ORDER else len(STUDY_ORDER)
    return rank, natural_key(str(group))


def natural_key(text: str) -> list[Any]:
    """Sort key that orders embedded numbers numerically (``layers.2`` before ``layers.10``)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(text))]


def _empty_summary() -> pd.DataFrame:
    df = pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    df.index.name = "run"
    return df


def empty_metrics() -> pd.DataFrame:
    """The long table without rows, its columns typed as a loaded one's."""
    dtypes = {"step": "int64", "tokens": float, "value": float}
    return pd.DataFrame({c: pd.Series(dtype=dtypes.get(c, object)) for c in METRIC_COLUMNS})
