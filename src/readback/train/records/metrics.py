"""Metrics sinks: ``metrics.jsonl`` (always, rank 0) and Weights & Biases (best effort).

The JSONL file is the record of a run; wandb gets the same dicts. Nothing wandb does -- no
network, no API key, a rejected key, a crash of its service -- may stop training or lose a local
line (:class:`~readback.train.records.tracking.WandbLogger`). Rank 0 also writes ``launch.json``: the
run's overrides, sweep, Slurm job id and host (:func:`~readback.train.records.identity.launch_context`),
and the history of every launch of the run (:mod:`~readback.train.records.launches`).

Non-finite numbers are written to the JSONL file as ``null`` (strict JSON).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from readback.jsonl import read_jsonl
from readback.train.checkpoint import atomic_write_text
from readback.train.records.identity import launch_context, run_identity
from readback.train.records.launches import record_launch
from readback.train.records.tracking import WandbLogger
from readback.train.settings import Logger
from readback.train.settings import WandbLogger as WandbSettings

log = logging.getLogger(__name__)

# Dense BF16 tensor-core peak FLOP/s per device, matched by substring of the device name: NVIDIA's
# datasheet figures (H200 and H100 SXM: 989 TFLOP/s dense, 1,979 with sparsity; A100: 312).
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


class JsonlWriter:
    """Appends one JSON object per line to ``path``, flushed after every record."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO | None = None

    def truncate_after(self, step: int) -> None:
        """Make the log consistent with a resume from ``step``: the records of steps up to it, each
        step once (its last record: a step logged twice, by a run that resumed without this or by
        two writers, counts once), no torn line; the resumed run appends the rest."""
        self.close()
        if not self.path.exists():
            return
        keep: dict[int, dict[str, Any]] = {}
        for r in read_jsonl(self.path):
            if isinstance(r.get("step"), int) and r["step"] <= step:
                keep[r["step"]] = r
        atomic_write_text(self.path, "".join(json.dumps(keep[s]) + "\n" for s in sorted(keep)))

    def write(self, record: Mapping[str, Any]) -> None:
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across writes; close() closes it
        self._f.write(json.dumps(json_safe(dict(record)), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


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
    logger_cfg: Logger,
    run_dir: Path,
    *,
    is_main: bool,
    resume_step: int,
    config: dict[str, Any],
    wandb_run_id: str | None,
) -> MetricsLogger:
    """The rank's logger: rank 0 writes ``launch.json``, gets ``metrics.jsonl`` (cut back to
    ``resume_step``) and, with ``logger.name=wandb``, a wandb run; other ranks get an inactive
    logger."""
    if not is_main:
        return MetricsLogger()
    launch = launch_context(Path(run_dir))
    record_launch(Path(run_dir), launch, from_step=resume_step)
    jsonl = JsonlWriter(Path(run_dir) / "metrics.jsonl")
    jsonl.truncate_after(resume_step)
    wb = None
    if isinstance(logger_cfg, WandbSettings):
        identity = run_identity(
            config, launch, user_tags=list(logger_cfg.tags), group=logger_cfg.group, job_type=logger_cfg.job_type
        )
        wb = WandbLogger(
            run_dir=Path(run_dir),
            identity=identity,
            project=logger_cfg.project,
            entity=logger_cfg.entity,
            mode=logger_cfg.mode,
            run_id=wandb_run_id,
            init_timeout=logger_cfg.init_timeout,
        )
    return MetricsLogger(jsonl, wb)
