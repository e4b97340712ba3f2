"""From training steps to records: the loss and throughput window between two log steps, MFU,
the model's statistics, the progress (a live bar on a terminal, plain lines in a log file), and
the run-level results a summary reports."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from readback.progress import Off, Progress, progress
from readback.train.checkpoint import RunDirTaken, WriterLock, checkpoint_dir, list_checkpoints
from readback.train.checkpoint.log_gap import missing_records
from readback.train.contract import TrainableModel
from readback.train.distributed import DistEnv
from readback.train.records.launches import close_launch
from readback.train.records.metrics import MetricsLogger, build_metrics_logger, peak_bf16_flops
from readback.train.settings import Config, plain_config

log = logging.getLogger(__name__)


class Window:
    """Train-loss and throughput accumulators between two log steps, plus run-level results."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.count = 0
        self.tokens = 0
        self.time_s = 0.0
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.wall_time_s = 0.0  # wall time of earlier sessions (from the checkpoint)
        self.last_logged_step = 0  # the newest step with a record: a resumed log must hold it

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        self.loss_sum += loss
        self.count += 1
        self.tokens += tokens
        self.time_s += seconds

    def mean_loss(self) -> float:
        return self.loss_sum / self.count if self.count else math.nan

    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    def reset(self) -> None:
        self.loss_sum, self.count, self.tokens, self.time_s = 0.0, 0, 0, 0.0


class MetricsProcessor:
    """Builds one record per log step and sends it to the :class:`MetricsLogger`; its state (the
    window and the wall time so far) rides along in checkpoints."""

    def __init__(self, env: DistEnv, *, tokens_per_step: int, t_start: float, owner: WriterLock | None = None) -> None:
        self.env, self.tokens_per_step, self.owner = env, tokens_per_step, owner  # owner: rank 0's lock
        self.n_params: int | None = None  # these two set once the model is built
        self.flops_per_token: float | None = None
        self.window = Window()
        self.logger = MetricsLogger()
        self.run_dir: Path | None = None  # set once the launch is recorded (open_logger)
        self.pbar: Progress = Off()
        self.t_start = t_start
        self.peak_flops = peak_bf16_flops(torch.cuda.get_device_name(env.device)) if env.device.type == "cuda" else None

    def open_logger(self, cfg: Config, run_dir: Path, *, resume_step: int, wandb_run_id: str | None) -> None:
        """The rank's logger (:func:`~readback.train.records.metrics.build_metrics_logger`), its records
        cut back to ``resume_step``."""
        self.run_dir = Path(run_dir)
        self.logger = build_metrics_logger(
            cfg.logger,
            run_dir,
            is_main=self.env.is_main,
            resume_step=resume_step,
            config=plain_config(cfg),
            wandb_run_id=wandb_run_id,
            owner=self.owner,
        )
        if self.logger.jsonl is not None and self.logger.jsonl.last_step < self.window.last_logged_step:
            self._warn_log_gap(run_dir, resume_step, self.logger.jsonl.last_step)

    def _warn_log_gap(self, run_dir: Path, resume_step: int, last: int) -> None:
        """The log lacks records that the run it resumes wrote (``trainer.log_gap=warn``): name
        them, and the checkpoint from which ``rewind`` would log them again. The run goes on; what
        is gone stays gone (:mod:`~readback.train.checkpoint.log_gap`)."""
        covered = [p for s, p in list_checkpoints(checkpoint_dir(run_dir)) if s <= last]
        rewind = (
            f"trainer.log_gap=rewind logs them again from {covered[-1]}, the newest checkpoint the log covers, "
            "the newer ones moved aside"
            if covered
            else "no checkpoint the log covers is left, from which trainer.log_gap=rewind could log them again"
        )
        gap = missing_records(last, resume_step, self.window.last_logged_step)
        log.warning("%s, and this run goes on without them (%s)", gap, rewind)

    def log_start(self, experiment: str, *, steps: int, accum: int, mode: str) -> None:
        """The run's start line; ``mode``: compiled or eager, and why (``train.compile_choice``)."""
        if self.env.is_main:
            log.info(
                "%s: %s params, %.4g FLOPs/token, %d steps x %d tokens, accum %d, world %d, %s, "
                "%d intra-op threads, %s",
                experiment,
                f"{self.n_params:,}",
                self.flops_per_token,
                steps,
                self.tokens_per_step,
                accum,
                self.env.world_size,
                self.env.device,
                torch.get_num_threads(),
                mode,
            )

    def open_progress_bar(self, total: int, initial: int, desc: str) -> None:
        """Rank 0's progress on stderr: tqdm's bar on a terminal, else a line every 5 % of the steps."""
        if self.env.is_main:
            self.pbar = progress(total, initial, desc)

    def step_done(self, loss: float, seconds: float) -> None:
        self.window.add(loss, self.tokens_per_step, seconds)
        w = self.window  # since the last log step
        self.pbar.set_postfix(loss=f"{w.mean_loss():.4f}", tok_s=f"{w.tokens_per_s():.0f}")
        self.pbar.update(1)

    def record(
        self,
        step: int,
        loss: float,
        lr: float,
        gnorm: float,
        model: TrainableModel,
        skipped: int,
        extra: dict[str, float],
    ) -> dict[str, Any]:
        """The record of ``step``: the window's loss, the numerics' counts, and ``extra`` (activation
        statistics, probe)."""
        tps = self.window.tokens_per_s()
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens": step * self.tokens_per_step,
            "grad_norm": gnorm,
            "tokens_per_s": tps,
            "skipped_updates": skipped,
        }
        if self.peak_flops and self.flops_per_token:
            rec["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.env.world_size)
            rec["mem_gib"] = torch.cuda.max_memory_allocated(self.env.device) / 2**30
        rec.update({f"fp8_saturation/{site}": int(n) for site, n in model.numerics.saturation_counts().items()})
        rec.update({f"fp8_underflow/{site}": f for site, f in model.numerics.underflow_fractions().items()})
        rec.update({k: float(v) for k, v in model.numerics.pop_observations().items()})  # e.g. attn_rowsum/z/<layer>
        rec.update(extra)
        return rec

    def close_diverged(self, loss: float, seconds: float) -> None:
        """Close the window at a step whose loss or gradients are not finite (its update dropped):
        its own loss is the run's final loss when finite, else there is none. Its record follows,
        marked ``diverged``."""
        self.window.add(loss, self.tokens_per_step, seconds)
        self.window.last_loss = loss if math.isfinite(loss) else None

    def close_logger_failed(self, preempting: bool = False) -> None:
        """Close the logger of a run that raised (preempted: wandb marks it for the requeue)."""
        if preempting:
            self.logger.mark_preempting()
        self.logger.close(exit_code=1)

    def log(self, rec: dict[str, Any], *, window_loss: float | None = None) -> None:
        """Write ``rec``; with ``window_loss`` the window closes (it becomes the last logged loss)."""
        self.logger.log(rec)
        self.window.last_logged_step = rec["step"]
        if window_loss is not None:
            self.window.last_loss = window_loss
            self.window.reset()

    def wall_time(self) -> float:
        return self.window.wall_time_s + (time.time() - self.t_start)

    def close(self, trained_to: int) -> None:
        """Close the progress bar and, on rank 0, mark this launch in ``launch.json`` as ended at
        step ``trained_to`` (nothing where no launch was recorded: the run stopped before, or where
        another run holds the directory now, or where the disk refuses the write: the launch then
        reads as one killed outright, and the run's own error is the line the user sees)."""
        self.pbar.close()
        if not self.env.is_main or self.run_dir is None:
            return
        try:
            if self.owner is not None:
                self.owner.check()
            close_launch(self.run_dir, to_step=trained_to)
        except RunDirTaken:
            pass
        except OSError as e:
            log.debug("launch.json not updated with the launch's last step %d: %s", trained_to, e)

    def state_dict(self) -> dict[str, Any]:
        return {**vars(self.window), "wall_time_s": self.wall_time()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self.window).update(state)
