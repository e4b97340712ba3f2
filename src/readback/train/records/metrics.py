"""Metrics sinks: ``metrics.jsonl`` (always, rank 0) and Weights & Biases (best effort).

The JSONL file is the record of a run; wandb gets the same dicts. Nothing wandb does -- no
network, no API key, a rejected key, a crash of its service -- may stop training or lose a local
line (:class:`~readback.train.records.tracking.WandbLogger`). Rank 0 also writes ``launch.json``: the
run's overrides, sweep, Slurm job id and host (:func:`~readback.train.records.identity.launch_context`),
and the history of every launch of the run (:mod:`~readback.train.records.launches`).

Non-finite numbers are written to the JSONL file as ``null`` (strict JSON).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from readback.errors import ConfigError
from readback.jsonl import read_jsonl
from readback.outputs import METRIC_FAMILIES, check_declared
from readback.train.checkpoint import WriterLock, atomic_write_text, checkpoint_dir
from readback.train.checkpoint.dirs import newest_intact, refuse_non_file
from readback.train.records.identity import launch_context, run_identity
from readback.train.records.launches import LAUNCH_FILE, record_launch
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


def write_refused(path: Path, what: str, error: OSError) -> ConfigError:
    """The one line of a run's record that the file system refused (a full disk, a quota, an I/O
    error): the cause, the file and the newest intact checkpoint, which a resume continues from."""
    newest = newest_intact(checkpoint_dir(path.parent))
    return ConfigError(
        "hydra.run.dir",
        str(path.parent),
        f"a directory {path.name} can be written in: {what} {path} failed "
        f"({' '.join(str(error).split())}); the newest intact checkpoint is {newest}",
    )


class JsonlWriter:
    """Appends one JSON object per line to ``path``, each written through at once; with an
    ``owner`` (the run directory's lock), only while this run still holds the directory.

    A write that the file system refuses (a full disk, a quota, an I/O error) is one line
    (``ConfigError``) naming the cause, the file and the newest intact checkpoint: what the run
    resumes from once there is room again, the log cut back to that checkpoint's step. Nothing is
    buffered, so nothing fails again when the file is closed."""

    def __init__(self, path: Path, owner: WriterLock | None = None):
        self.path, self.owner = Path(path), owner
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: BinaryIO | None = None
        self.last_step = 0  # the newest step with a record, once truncate_after has read the log

    def _check_owner(self) -> None:
        if self.owner is not None:
            self.owner.check()

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """A file system error while doing ``what`` as one line (see the class docstring)."""
        try:
            yield
        except OSError as e:
            self.close()
            raise write_refused(self.path, what, e) from e

    def truncate_after(self, step: int) -> None:
        """Make the log consistent with a resume from ``step``: the records of steps up to it, each
        step once (its last record: a step logged twice, by a run that resumed without this or by
        two writers, counts once), no torn line; the resumed run appends the rest."""
        self.close()
        refuse_non_file(self.path)
        if not self.path.exists():
            return
        self._check_owner()
        keep: dict[int, dict[str, Any]] = {}
        with self._writing(f"cutting back to step {step}"):
            for r in read_jsonl(self.path):
                if isinstance(r.get("step"), int) and r["step"] <= step:
                    keep[r["step"]] = r
            atomic_write_text(self.path, "".join(json.dumps(keep[s]) + "\n" for s in sorted(keep)))
        self.last_step = max(keep, default=0)

    def write(self, record: Mapping[str, Any]) -> None:
        self._check_owner()
        line = memoryview((json.dumps(json_safe(dict(record)), allow_nan=False) + "\n").encode())
        with self._writing(f"writing the record of step {record.get('step')} to"):
            if self._f is not None and not self._still_at_path(self._f):
                log.warning(
                    "%s was removed or replaced while this run wrote it: its records before step %s are not in "
                    "the new file (a resume names them and the checkpoint that logs them again)",
                    self.path,
                    record.get("step"),
                )
                self.close()
            if self._f is None:
                self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115 - kept open across writes; close() closes it
            while line:
                line = line[self._f.write(line) :]

    def _still_at_path(self, f: BinaryIO) -> bool:
        """Whether the open log is still the file at :attr:`path` (one stat a record): records
        written into a removed file would be lost without a word."""
        try:
            here, there = os.fstat(f.fileno()), os.stat(self.path)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            with contextlib.suppress(OSError):  # unbuffered: nothing of the log is left to write
                f.close()


class MetricsLogger:
    """Writes each record to ``metrics.jsonl`` and to wandb (if any). Inactive off rank 0."""

    def __init__(self, jsonl: JsonlWriter | None = None, wandb_logger: WandbLogger | None = None):
        self.jsonl = jsonl
        self.wandb = wandb_logger

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.run_id if self.wandb is not None else None

    def log(self, record: Mapping[str, Any]) -> None:
        """Write ``record``, each of its families one ``readback.outputs.METRIC_FAMILIES`` declares."""
        check_declared(record, METRIC_FAMILIES)
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
    owner: WriterLock | None = None,
) -> MetricsLogger:
    """The rank's logger: rank 0 writes ``launch.json``, gets ``metrics.jsonl`` (cut back to
    ``resume_step``; written while ``owner`` holds the run directory) and, with
    ``logger.name=wandb``, a wandb run; other ranks get an inactive logger."""
    if not is_main:
        return MetricsLogger()
    if owner is not None:
        owner.check()
    jsonl = JsonlWriter(Path(run_dir) / "metrics.jsonl", owner)
    jsonl.truncate_after(resume_step)
    launch, launch_path = launch_context(Path(run_dir)), Path(run_dir) / LAUNCH_FILE
    refuse_non_file(launch_path)
    try:
        record_launch(Path(run_dir), json_safe(launch), from_step=resume_step)
    except OSError as e:
        raise write_refused(launch_path, "writing", e) from e
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
