"""Per-run records (config, ``summary.json``, ``metrics.jsonl`` records, launch) to the two frames
of :class:`~readback.analysis.load.Runs`, whose columns :mod:`readback.analysis.load` describes."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from readback.analysis.groups import AXIS_DEFAULTS, CONFIG_AXES, assign_groups
from readback.analysis.load import METRIC_COLUMNS, SUMMARY_COLUMNS, SUMMARY_FIELDS, Runs, empty_metrics
from readback.overrides import config_value, override_map

# Record fields that are not metrics.
_INDEX_FIELDS = ("step", "tokens")


def runs_from_records(entries: Iterable[Mapping[str, Any]], keys: Sequence[str] | None = None) -> Runs:
    """Build :class:`Runs` from per-run dicts with ``run_id``, ``config`` (nested dict),
    ``summary`` (dict or ``None``), ``records`` (list of metric dicts) and optionally ``path``,
    ``bad_lines``, ``status_without_summary`` (default ``failed``), ``path_parts`` (used to
    guess experiment and seed when the config lacks them), ``overrides`` (the run's Hydra
    overrides; default ``config["launch"]["overrides"]``) and ``launch`` (``launch.json``; default
    ``config["launch"]``). Shared by the local and wandb loaders.
    """
    rows: list[dict[str, Any]] = []
    frames: list[pd.DataFrame] = []
    overrides, configs = {}, {}
    for e in entries:
        row, long = _one_run(e, keys)
        rows.append(row)
        launch = e.get("launch") or (e.get("config") or {}).get("launch") or {}
        overrides[row["run"]] = override_map(e.get("overrides") or launch.get("overrides"))
        configs[row["run"]] = e.get("config") or {}
        row["overrides"] = ",".join(f"{k}={v}" for k, v in sorted(overrides[row["run"]].items()))
        row["command"] = _command(launch)
        row["machine"] = _machine(launch)
        row["cpu"] = _cpu(launch)
        row["code"] = _code(launch)
        if len(long):
            frames.append(long)
    if not rows:
        return Runs()
    summary = pd.DataFrame(rows).set_index("run")
    summary["group"], group_keys = assign_groups(summary, overrides, configs)
    summary = summary[[c for c in SUMMARY_COLUMNS if c in summary.columns]]
    for col in ("final_loss", "val_loss", "wall_time_s"):
        summary[col] = pd.to_numeric(summary[col], errors="coerce").astype(float)
    for col in ("seed", "steps", "tokens", "diverged_at_step", "n_params", "last_step"):
        summary[col] = pd.to_numeric(summary[col], errors="coerce").astype("Int64")
    summary["diverged"] = summary["diverged"].astype(bool)
    summary["bad_lines"] = summary["bad_lines"].astype(int)
    if frames:
        metrics = pd.concat(frames, ignore_index=True)
        metrics["group"] = metrics["run"].map(summary["group"])
        metrics = metrics[list(METRIC_COLUMNS)]
        for col in ("run", "experiment", "group", "key"):
            metrics[col] = metrics[col].astype("category")
        metrics["seed"] = pd.to_numeric(metrics["seed"], errors="coerce").astype("Int64")
    else:
        metrics = empty_metrics()
    return Runs(summary, metrics, group_keys)


def _command(launch: Mapping[str, Any]) -> str | None:
    """The command that started the run (its sweep's, for a sweep), as one shell line."""
    import shlex

    argv = launch.get("argv")
    return (
        "python " + shlex.join(["train.py" if str(a).endswith("train.py") else str(a) for a in argv]) if argv else None
    )


def _machine(launch: Mapping[str, Any]) -> str | None:
    """Where the run ran, in one line: host, CPUs, GPUs, platform, torch and Python versions."""
    if not launch.get("host"):
        return None
    gpus = ", ".join(launch.get("gpus") or []) or "no GPU"
    return (
        f"{launch['host']}: {launch.get('cpus')} CPUs, {gpus}; {launch.get('platform')}; "
        f"torch {launch.get('torch')}, Python {launch.get('python')}"
    )


def _cpu(launch: Mapping[str, Any]) -> str | None:
    """The CPU kind, model and ISA (e.g. ``AMD EPYC, AVX512``): kinds differ in a run's bits."""
    if not launch.get("cpu_model"):
        return None
    return f"{launch['cpu_model']}, {launch.get('cpu_capability')}"


def _code(launch: Mapping[str, Any]) -> str | None:
    """The commit the run's code was at, marked where its tracked files had changes."""
    code = launch.get("code") or {}
    if not code.get("commit"):
        return None
    return code["commit"][:12] + (" with uncommitted changes" if code.get("dirty") else "")


def _number(value: Any) -> float:
    """A metric value as float: bool -> 0/1, null or text -> NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan


def _one_run(e: Mapping[str, Any], keys: Sequence[str] | None) -> tuple[dict[str, Any], pd.DataFrame]:
    run_id = str(e["run_id"])
    cfg = e.get("config") or {}
    summary = e.get("summary")
    records = list(e.get("records") or [])
    parts = list(e.get("path_parts") or [])
    row: dict[str, Any] = {"run": run_id}
    for col, dotted in CONFIG_AXES.items():
        row[col] = config_value(cfg, dotted)
        if row[col] is None and cfg:
            row[col] = AXIS_DEFAULTS.get(col)
    if row["experiment"] is None and summary is not None:
        row["experiment"] = summary.get("experiment")
    if row["seed"] is None:  # the sweep's subdir: <experiment>/<overrides with seed=N> (or seed<N>)
        for i, part in enumerate(parts):
            m = re.search(r"(?:^|,)seed=?(\d+)(?:,|$)", part)
            if m:
                row["seed"] = int(m.group(1))
                if row["experiment"] is None and i > 0:
                    row["experiment"] = parts[i - 1]
                break
    if row["experiment"] is None:
        row["experiment"] = "custom"
    row["experiment"] = str(row["experiment"])

    # metrics: last record per step; numeric values only
    by_step: dict[float, dict[str, Any]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool) or not math.isfinite(step):
            continue
        by_step[int(step)] = rec
    steps = sorted(by_step)
    long = pd.DataFrame(columns=list(METRIC_COLUMNS))
    if steps:
        recs = [by_step[s] for s in steps]
        names = list(dict.fromkeys(k for r in recs for k in r if k not in _INDEX_FIELDS and not str(k).startswith("_")))
        names = [k for k in names if any(isinstance(r.get(k), (bool, int, float)) for r in recs)]
        if keys is not None:
            names = [k for k in names if any(fnmatch.fnmatchcase(k, p) for p in keys)]
        tokens = np.array([_number(r.get("tokens")) for r in recs])
        cols = {k: np.array([_number(r.get(k)) for r in recs]) for k in names}
        n = len(recs)
        if names:
            values = np.concatenate([cols[k] for k in names])
            long = pd.DataFrame(
                {
                    "run": run_id,
                    "experiment": row["experiment"],
                    "seed": row["seed"],
                    "step": np.tile(np.array(steps, dtype=np.int64), len(names)),
                    "tokens": np.tile(tokens, len(names)),
                    "key": np.repeat(np.array(names, dtype=object), n),
                    "value": values,
                }
            )
            # a key absent from a record is not a logged NaN: drop those rows
            present = np.concatenate([[k in r for r in recs] for k in names])
            long = long[present].reset_index(drop=True)
    last = by_step[steps[-1]] if steps else {}
    losses = [by_step[s].get("loss") for s in steps]
    vals = [by_step[s].get("val_loss") for s in steps if by_step[s].get("val_loss") is not None]

    s = summary or {}
    row.update({key: s.get(key) for key in SUMMARY_FIELDS})
    if summary is None:
        row["status"] = e.get("status_without_summary", "failed")
    if "final_loss" not in s:
        row["final_loss"] = losses[-1] if losses else None
    if "val_loss" not in s:
        row["val_loss"] = vals[-1] if vals else None
    if row["steps"] is None:
        row["steps"] = int(steps[-1]) if steps else None
    if row["tokens"] is None:
        row["tokens"] = last.get("tokens")
    row["diverged"] = row["status"] == "diverged" or row["diverged_at_step"] is not None
    row["last_step"] = int(steps[-1]) if steps else None
    row["bad_lines"] = int(e.get("bad_lines", 0) or 0)
    row["path"] = e.get("path")
    return row, long
