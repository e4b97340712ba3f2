"""``run_dir/summary.json``: the one file that says how a run ended (absent while it runs)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from readback.outputs import SUMMARY_KEYS, check_declared, in_summary_order
from readback.train.checkpoint import RunDirTaken, WriterLock, atomic_write_text
from readback.train.checkpoint.dirs import refuse_non_file
from readback.train.divergence import DivergenceDetector
from readback.train.records.metrics import json_safe, write_refused
from readback.train.records.metrics_processor import MetricsProcessor

log = logging.getLogger(__name__)


def summary_path(run_dir: Path) -> Path:
    return Path(run_dir) / "summary.json"


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Atomically write ``summary`` (strict JSON: non-finite numbers as ``null``), each key one
    ``readback.outputs.SUMMARY_KEYS`` declares."""
    check_declared(summary, SUMMARY_KEYS)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(summary_path(run_dir), json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")


def run_summary(
    status: str,
    *,
    step: int,
    results: MetricsProcessor,
    detector: DivergenceDetector,
    site_implementations: dict[str, str] | None,
    experiment: str,
) -> dict[str, Any]:
    """A run's ``summary.json`` (``status``: completed, diverged or failed), in the order
    ``readback.outputs.SUMMARY_KEYS`` gives; ``results``: the losses, sizes and times so far."""
    return in_summary_order(
        dict(
            status=status,
            final_loss=results.window.last_loss,
            val_loss=results.window.last_val_loss,
            steps=step,
            tokens=step * results.tokens_per_step,
            diverged_at_step=detector.diverged_at_step,
            divergence_reason=detector.reason,
            skipped_updates=detector.skipped,
            nonfinite_tensors=detector.nonfinite_tensors,
            wall_time_s=results.wall_time(),
            n_params=results.n_params,
            site_implementations=site_implementations,
            flops_per_token=results.flops_per_token,
            world_size=results.env.world_size,
            experiment=experiment,
        )
    )


class SummaryWriter:
    """Rank 0's summary of a run, written while ``owner`` (the run directory's lock) holds the
    directory; the other ranks' calls do nothing."""

    def __init__(self, run_dir: Path, *, is_main: bool, owner: WriterLock | None = None) -> None:
        self.run_dir, self.is_main, self.owner = Path(run_dir), is_main, owner

    def clear(self) -> None:
        """A resumed run is not over until it says so again."""
        if self.is_main:
            refuse_non_file(summary_path(self.run_dir))
            summary_path(self.run_dir).unlink(missing_ok=True)

    def write(self, summary: dict[str, Any]) -> None:
        """Write ``summary``; a file system that refuses it is one line (the checkpoints hold the run)."""
        if self.is_main:
            if self.owner is not None:
                self.owner.check()
            try:
                write_summary(self.run_dir, summary)
            except OSError as e:
                raise write_refused(summary_path(self.run_dir), "writing", e) from e

    def write_failed(self, summary: dict[str, Any], error: BaseException) -> None:
        """``status: failed`` with the error; a failure to write is logged, never raised over it."""
        if not self.is_main:
            return
        try:
            if self.owner is not None:
                self.owner.check()
            failed = {**summary, "status": "failed", "error": f"{type(error).__name__}: {error}"}
            write_summary(self.run_dir, in_summary_order(failed))
        except RunDirTaken:  # another run's directory now: no word of this one's failure there
            pass
        except Exception as write_error:
            log.error("could not write summary.json: %s", write_error)
