"""Reading a wandb project's runs into :class:`~readback.analysis.load.Runs` (:func:`load_wandb`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from readback.analysis.load import Runs
from readback.analysis.records import runs_from_records


def load_wandb(
    project: str,
    entity: str | None = None,
    filters: dict[str, Any] | None = None,
    *,
    keys: Sequence[str] | None = None,
    timeout: int = 60,
) -> Runs:
    """The runs of a wandb project as :class:`Runs` (the same tables as :func:`load_runs`).

    ``filters`` is wandb's MongoDB-style run filter, e.g.
    ``{"config.experiment": {"$in": ["reuse_rounded", "no_saved_copy"]}}``; ``keys`` globs
    select metric keys. Needs the ``wandb`` package, network access and a login (``wandb login``
    or ``WANDB_API_KEY``). Full-resolution history is read with ``run.scan_history()``.
    Runs still going are ``running``; crashed or killed ones ``failed``.
    """
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError("load_wandb needs the wandb package (pip install wandb)") from e
    path = f"{entity}/{project}" if entity else project
    try:
        api = wandb.Api(timeout=timeout)
        wruns = list(api.runs(path, filters=filters or {}))
    except Exception as e:
        raise RuntimeError(
            f"could not list the wandb runs of {path!r} ({type(e).__name__}: {e}); "
            "this needs network access and a wandb login (wandb login, or WANDB_API_KEY)"
        ) from e
    states = {"running": "running", "crashed": "failed", "failed": "failed", "killed": "failed"}
    entries = []
    for r in wruns:
        try:
            cfg = _unwrap_config(dict(r.config))
            summ = {k: v for k, v in dict(r.summary).items() if not str(k).startswith("_")}
            records = [dict(h) for h in r.scan_history()]
        except Exception as e:
            raise RuntimeError(f"could not read wandb run {r.path} ({type(e).__name__}: {e})") from e
        finished = "status" in summ and r.state == "finished"
        entries.append(
            dict(
                run_id="/".join(r.path),
                config=cfg,
                summary=summ if finished else None,
                records=records,
                path=None,
                status_without_summary=states.get(r.state, "failed"),
            )
        )
    return runs_from_records(entries, keys=keys)


def _unwrap_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """wandb may store config values as ``{"value": ..., "desc": ...}``; return plain values."""
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and set(v) <= {"value", "desc"} and "value" in v:
            v = v["value"]
        out[k] = v
    return out
