"""Reading sweep directories: every run directory below them, its config, overrides, launch
record, ``metrics.jsonl`` and ``summary.json`` (:func:`load_runs`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from readback.analysis.load import Runs, natural_key
from readback.analysis.records import runs_from_records
from readback.jsonl import read_jsonl_counted

log = logging.getLogger(__name__)


def find_run_dirs(*roots: str | os.PathLike) -> list[Path]:
    """Every directory under ``roots`` (a root itself included) holding ``summary.json`` or
    ``metrics.jsonl``; what lies below a run directory (checkpoints, wandb) is not searched."""
    found: list[Path] = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"no such sweep directory: {root}")
        for here, dirs, files in os.walk(root):
            if "summary.json" in files or "metrics.jsonl" in files:
                found.append(Path(here))
                dirs[:] = []
            else:
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(dict.fromkeys(found), key=lambda p: natural_key(str(p)))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        log.warning("unreadable %s (%s); treated as missing", path, e)
        return None
    return obj if isinstance(obj, dict) else None


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        return None
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        log.warning("unreadable %s (%s); treated as missing", path, e)
        return None


def _read_config(run_dir: Path) -> dict[str, Any]:
    cfg = _read_yaml(run_dir / ".hydra" / "config.yaml")
    return cfg if isinstance(cfg, dict) else {}


def _newest_mtime(run_dir: Path) -> float:
    times = [run_dir.stat().st_mtime]
    for name in ("metrics.jsonl", "summary.json", "train.log"):
        p = run_dir / name
        if p.exists():
            times.append(p.stat().st_mtime)
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir():
        times.append(ckpt.stat().st_mtime)
    return max(times)


def load_runs(
    *sweep_dirs: str | os.PathLike, keys: Sequence[str] | None = None, running_within_s: float = 900.0
) -> Runs:
    """Every run under ``sweep_dirs`` (see the module docstring for the tables).

    ``keys``: glob patterns of the metric keys to keep (default all; e.g.
    ``["loss", "val_loss", "grad_error/*/total"]`` keeps a large sweep small).
    ``running_within_s``: a run without ``summary.json`` whose files changed this recently is
    ``running``, otherwise ``failed``.
    """
    if not sweep_dirs:
        raise ValueError("load_runs needs at least one sweep directory")
    roots = [Path(d) for d in sweep_dirs]
    prefix = len(roots) > 1
    entries = []
    now = time.time()
    for root in roots:
        for run_dir in find_run_dirs(root):
            rel = run_dir.relative_to(root).as_posix()
            run_id = rel if rel != "." else run_dir.name
            if prefix:
                run_id = f"{root.name}/{run_id}" if rel != "." else run_dir.name
            records, bad = read_jsonl_counted(run_dir / "metrics.jsonl")
            summary = _read_json(run_dir / "summary.json")
            fallback = "running" if now - _newest_mtime(run_dir) < running_within_s else "failed"
            entries.append(
                dict(
                    run_id=run_id,
                    config=_read_config(run_dir),
                    summary=summary,
                    records=records,
                    path=str(run_dir),
                    bad_lines=bad,
                    status_without_summary=fallback,
                    path_parts=rel.split("/"),
                    overrides=_read_yaml(run_dir / ".hydra" / "overrides.yaml"),
                    launch=_read_json(run_dir / "launch.json"),
                )
            )
    seen: dict[str, int] = {}
    for e in entries:  # the same run id twice (two sweep dirs of the same name): make unique
        n = seen.get(e["run_id"], 0)
        seen[e["run_id"]] = n + 1
        if n:
            e["run_id"] = f"{e['run_id']}#{n}"
    return runs_from_records(entries, keys=keys)
