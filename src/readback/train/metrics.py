"""Metrics sinks: ``metrics.jsonl`` (always, rank 0) and Weights & Biases (best effort).

The JSONL file is the record of a run; wandb gets the same dicts. Nothing wandb does -- no
network, no API key, a rejected key, a crash of its service -- may stop training or lose a local
line: :class:`WandbLogger` tries the requested mode, falls back to offline mode into the run
directory, and finally to a no-op, and it disables itself after the first failing ``log`` call.

Non-finite numbers are written to the JSONL file as ``null`` (strict JSON).
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from readback.train.checkpoint import atomic_write_text

log = logging.getLogger(__name__)

# Dense BF16 tensor-core peak FLOP/s per device, matched by substring of the device name.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense BF16 peak of a CUDA device by name (``None`` when unknown: no MFU is logged)."""
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return peak
    return None


def json_safe(value: Any) -> Any:
    """A JSON-serialisable copy of ``value``: tensors and NumPy scalars as numbers, NaN/Inf as None."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (crash mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class JsonlWriter:
    """Appends one JSON object per line to ``path``, flushed after every record."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = None

    def truncate_after(self, step: int) -> None:
        """Keep only records with ``step <= step`` (and drop torn lines): resume without duplicates."""
        self.close()
        if not self.path.exists():
            return
        keep = [r for r in read_jsonl(self.path) if isinstance(r.get("step"), int) and r["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: Mapping[str, Any]) -> None:
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._f.write(json.dumps(json_safe(dict(record)), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _have_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    for candidate in (os.environ.get("NETRC"), "~/.netrc", "~/_netrc"):
        if not candidate:
            continue
        path = Path(candidate).expanduser()
        try:
            if path.is_file() and netrc.netrc(str(path)).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def resolve_wandb_mode(mode: str | None) -> str:
    """``online`` | ``offline`` | ``disabled``: ``WANDB_MODE``/``WANDB_DISABLED`` win, then the config;
    ``auto`` is online when an API key is configured, else offline."""
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    chosen = env or (mode or "auto").lower()
    if chosen == "dryrun":
        chosen = "offline"
    if chosen == "auto":
        chosen = "online" if _have_wandb_key() else "offline"
    if chosen not in ("online", "offline", "disabled"):
        log.warning("unknown wandb mode %r; using offline", chosen)
        chosen = "offline"
    return chosen


def new_wandb_run_id() -> str:
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger:
    """Best-effort wandb run. ``self.mode`` ends up ``online``, ``offline`` or ``noop``."""

    def __init__(
        self,
        *,
        run_dir: Path,
        project: str = "readback",
        entity: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        mode: str = "auto",
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
        init_timeout: float = 60.0,
    ):
        self.run_id = run_id or new_wandb_run_id()
        self.mode = "noop"
        self._run = None
        self._warned = False
        wanted = resolve_wandb_mode(mode)
        if wanted == "disabled":
            return
        try:
            import wandb
        except Exception as e:  # noqa: BLE001
            log.warning("wandb unavailable (%s); metrics go to metrics.jsonl only", e)
            return
        attempts = [wanted] + (["offline"] if wanted == "online" else [])
        for attempt in attempts:
            try:
                self._run = wandb.init(
                    project=project,
                    entity=entity,
                    name=name,
                    tags=list(tags or []),
                    config=config,
                    dir=str(run_dir),
                    id=self.run_id,
                    resume="allow",
                    mode=attempt,
                    settings=wandb.Settings(init_timeout=float(init_timeout), silent=True),
                )
                self.mode = attempt
                break
            except Exception as e:  # noqa: BLE001 - any wandb failure must not stop training
                log.warning("wandb.init in %s mode failed (%s: %s)", attempt, type(e).__name__, e)
                self._run = None
                try:  # a failed init keeps the run id taken in this process: release it for the next try
                    wandb.teardown()
                except Exception:  # noqa: BLE001
                    pass
        if self._run is None:
            log.warning("wandb disabled for this run; metrics go to metrics.jsonl only")

    def log(self, record: Mapping[str, Any], step: int) -> None:
        if self._run is None:
            return
        try:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        try:
            for k, v in values.items():
                self._run.summary[k] = v
        except Exception as e:  # noqa: BLE001
            self._fail("summary", e)

    def mark_preempting(self) -> None:
        """Tell wandb the run stops for a preemption (it is resumed later under the same id)."""
        if self._run is None:
            return
        try:
            self._run.mark_preempting()
        except Exception as e:  # noqa: BLE001
            log.debug("wandb mark_preempting failed: %s", e)

    def _fail(self, what: str, e: Exception) -> None:
        if not self._warned:
            log.warning("wandb %s failed (%s: %s); wandb disabled, metrics.jsonl continues", what, type(e).__name__, e)
            self._warned = True
        self._close_quietly(exit_code=1)

    def _close_quietly(self, exit_code: int = 0) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            log.warning("wandb finish failed (%s: %s)", type(e).__name__, e)

    def finish(self, exit_code: int = 0) -> None:
        self._close_quietly(exit_code)


class MetricsLogger:
    """Writes each record to ``metrics.jsonl`` and to wandb (if any). Inactive off rank 0."""

    def __init__(self, jsonl: JsonlWriter | None = None, wandb_logger: WandbLogger | None = None):
        self.jsonl = jsonl
        self.wandb = wandb_logger

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.run_id if self.wandb is not None else None

    def log(self, record: Mapping[str, Any]) -> None:
        record = json_safe(dict(record))
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.wandb is not None:
            self.wandb.summary(json_safe(dict(values)))

    def mark_preempting(self) -> None:
        if self.wandb is not None:
            self.wandb.mark_preempting()

    def close(self, exit_code: int = 0) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code)


def build_metrics_logger(
    logger_cfg: Any,
    run_dir: Path,
    *,
    is_main: bool,
    resume_step: int,
    run_name: str,
    config: dict[str, Any] | None,
    wandb_run_id: str | None,
) -> MetricsLogger:
    """The rank's logger: rank 0 gets ``metrics.jsonl`` (cut back to ``resume_step``) and, with
    ``logger.name=wandb``, a :class:`WandbLogger`; other ranks get an inactive logger."""
    if not is_main:
        return MetricsLogger()
    jsonl = JsonlWriter(Path(run_dir) / "metrics.jsonl")
    jsonl.truncate_after(resume_step)
    name = str(_get(logger_cfg, "name", "none"))
    wb = None
    if name == "wandb":
        wb = WandbLogger(
            run_dir=Path(run_dir),
            project=_get(logger_cfg, "project", "readback"),
            entity=_get(logger_cfg, "entity", None),
            name=run_name,
            tags=list(_get(logger_cfg, "tags", []) or []),
            mode=_get(logger_cfg, "mode", "auto"),
            config=config,
            run_id=wandb_run_id,
            init_timeout=float(_get(logger_cfg, "init_timeout", 60.0)),
        )
    elif name != "none":
        log.warning("unknown logger %r; writing metrics.jsonl only", name)
    return MetricsLogger(jsonl, wb)


def _get(cfg: Any, key: str, default: Any) -> Any:
    if cfg is None:
        return default
    try:
        value = cfg.get(key, default)
    except Exception:  # noqa: BLE001
        value = getattr(cfg, key, default)
    return default if value is None and default is not None else value
