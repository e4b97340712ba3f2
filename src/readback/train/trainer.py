"""The trainer: builds the components (data, model, optimizer, schedule, metrics, validator,
checkpoints, summary) from the builders it is given, and runs the steps.

Order of one optimizer step ``t`` (counted from 1):

1. ``accum`` micro-steps of forward + ``(loss / accum).backward()`` at ``lr = schedule(t)``, DDP
   ``no_sync`` on all but the last;
2. the step's loss is averaged over ranks (with it travels the preemption flag); an unusable FP32
   scale at a site fails the run first (``NumericsError`` names it); a NaN/Inf loss stops the run
   (``status: diverged``), the update not applied;
3. pre-clip gradient norm; non-finite gradients are not applied either: they stop the run like a
   NaN loss (``trainer.divergence.nonfinite_grads: stop``) or skip the update (``skip``);
   otherwise clip to ``grad_clip`` and ``optimizer.step()``; the schedule steps in both cases;
4. ``model.numerics.end_step()`` (also after a skipped update);
5. on log steps (multiples of ``log_every`` or ``eval_every``, probe steps and the last step): one
   record, ``val_loss`` on eval steps; then a checkpoint on checkpoint steps;
6. after a preemption signal or Ctrl-C (:mod:`readback.train.preemption`): a checkpoint, then
   :class:`~readback.train.preemption.Preempted` (no ``summary.json``: the run is not over); a
   second Ctrl-C raises it at once, without the checkpoint.

Reproducibility: a run is a function of its config. The seed fixes the initialisation, the data
order and every random stream of the numerics; a checkpoint holds everything else, so resuming
reproduces the uninterrupted run bit for bit (same world size, device and CPU kernels).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from readback.backends import site_implementations
from readback.errors import ConfigError
from readback.model import ActivationStats
from readback.probe import check_params
from readback.train.agreement import agree
from readback.train.checkpoint import CheckpointManager, RNGState, RunDirTaken, WriterLock
from readback.train.checkpoint.dirs import checkpoint_dir, list_checkpoints
from readback.train.compile_choice import CompiledStep
from readback.train.contract import Builders, check_model, with_vocabulary
from readback.train.distributed import DistEnv, all_reduce_mean, set_collective_timeout
from readback.train.divergence import DivergenceDetector
from readback.train.dry_run import check_memory
from readback.train.instruments import due_at, instruments
from readback.train.lost_ranks import lost_rank
from readback.train.optim import WSDSchedule, build_optimizer, build_scheduler, clip_gradients, nonfinite_grad_names
from readback.train.parallel import apply_parallelism, no_gradient_sync, whole_parameters
from readback.train.preemption import Preempted, PreemptionGuard
from readback.train.records.metrics_processor import MetricsProcessor
from readback.train.records.summary import SummaryWriter, run_summary
from readback.train.settings import Config
from readback.train.validator import Validator

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        env: DistEnv,
        accum: int,
        experiment: str,
        builders: Builders,
        guard: PreemptionGuard,
        writer: WriterLock | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.env, self.accum, self.experiment = cfg, Path(run_dir), env, accum, experiment
        self.builders, self.guard, self.writer = builders, guard, writer  # writer: rank 0's lock of run_dir
        self.steps = cfg.trainer.steps
        self.detector = DivergenceDetector(cfg.trainer.divergence)
        self.instruments = instruments(cfg.probe, env.distributed)
        self.summary = SummaryWriter(self.run_dir, is_main=env.is_main, owner=writer)
        tokens_per_step = cfg.model.global_batch * cfg.model.seq_len
        self.metrics = MetricsProcessor(env, tokens_per_step=tokens_per_step, t_start=time.time(), owner=writer)
        self.preempt = False  # a preemption signal reached some rank: checkpoint and stop after this step
        self.loop_started = False
        self.step = self.start = 0
        self.hosts: list[str] = []  # each rank's, once the ranks agree

    def _build(self) -> None:
        env = self.env
        self.stream = self.builders.stream(self.cfg, rank=env.rank, world_size=env.world_size)
        self.cfg = cfg = with_vocabulary(self.cfg, self.stream)
        self.hosts = agree(cfg, getattr(self.stream, "fingerprint", ""), env)  # before anything is built or written
        if env.device.type == "cuda":
            check_memory(cfg, self.builders, env.world_size)
        torch.manual_seed(cfg.seed)
        self.model = check_model(self.builders.model(cfg, str(env.device)))
        check_params(cfg.probe, self.model)  # the names its patterns match exist once it is built
        self.metrics.n_params = int(self.model.n_params())
        self.forward = apply_parallelism(self.model, env, cfg.trainer.parallel)  # before the optimizer: FSDP shards
        self.compiled = CompiledStep(self.forward, cfg.trainer.compile, cfg.model.name, self.steps, env)
        self.activation_stats = ActivationStats(self.model)  # forward hooks: FSDP keeps the modules
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.optimizer = build_optimizer(self.model, cfg.trainer.optim)
        schedule = WSDSchedule.from_config(cfg.trainer.optim, peak=cfg.model.lr, steps=self.steps)
        self.scheduler = build_scheduler(self.optimizer, schedule)
        self.metrics.flops_per_token = float(self.model.flops_per_token())
        self.validator = Validator(self.stream, cfg.trainer.eval_batches, env, lockstep=cfg.trainer.parallel == "fsdp")
        self.checkpoints = CheckpointManager(
            self.run_dir,
            cfg,
            env,
            model=self.model,
            optimizer=self.optimizer,
            shared={"schedule": self.scheduler, "divergence": self.detector, "progress": self.metrics},
            per_rank={"data": self.stream, "numerics": self.model.numerics, "rng": RNGState()},
            owner=self.writer,
        )

    def train(self) -> dict[str, Any]:
        env = self.env
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._build()
            start, wandb_id = self.checkpoints.resume()
            self.step = self.start = start
            self.metrics.open_logger(self.cfg, self.run_dir, resume_step=start, wandb_run_id=wandb_id)
            self.summary.clear()
            self.metrics.log_start(self.experiment, steps=self.steps, accum=self.accum, mode=self.compiled.describe())
            status = self._loop(start)
            self.checkpoints.wait()  # an asynchronous save still in flight
        except Preempted as p:
            if env.is_main:
                log.warning("%s; no summary.json: the run is not over", p)
            self.metrics.close_logger_failed(preempting=True)
            raise
        except BaseException as e:
            if self.guard.interrupted:  # a second Ctrl-C, wherever it landed (a save may wrap it)
                self.metrics.close_logger_failed(preempting=True)
                found = list_checkpoints(checkpoint_dir(self.run_dir))  # the newest complete one stays
                raise Preempted(signal.SIGINT, self.step, str(found[-1][1]) if found else None, at_once=True) from None
            if not isinstance(e, (Exception, KeyboardInterrupt)):
                raise
            lost = lost_rank(
                e, self.env, self.step, self.step > self.start, self.cfg.trainer.timeouts, self.hosts, self.run_dir
            )
            # failed: e.g. the data ran out mid-run; but no word into a directory another run holds now
            if (self.loop_started or not isinstance(e, ConfigError)) and not isinstance(e, RunDirTaken):
                self.summary.write_failed(self._summary("failed"), lost or e)
            self.metrics.close_logger_failed()
            if lost is not None:
                raise lost from None
            raise
        finally:
            self.metrics.close(trained_to=self.step)
        summary = self._summary(status)
        self.summary.write(summary)
        self.metrics.logger.summary(summary)
        self.metrics.logger.close(exit_code=0)
        return summary

    def _train_step(self, step: int, track_stats: bool) -> tuple[float, float]:
        """Forward/backward over ``accum`` micro-batches, then the pre-clip gradient norm (and the
        clip): ``(loss, grad norm)``. With ``track_stats`` the model measures its activation
        statistics in the last micro-batch only. The instruments due at this step measure its
        first micro-batch (``readback.train.instruments``)."""
        dev = self.env.device
        loss_sum = torch.zeros((), device=dev)
        for micro in range(self.accum):
            x, y = self.stream.next_batch()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            before, taped = due_at(step, self.instruments) if micro == 0 else ([], None)
            for instrument in before:
                with whole_parameters(self.forward):
                    instrument.measure(self.model, x, y, self.stream)
            last = micro == self.accum - 1
            measured = track_stats and last  # activation and mechanism statistics: the training pass only
            with self.activation_stats.measuring(measured), self.model.numerics.measuring(measured):
                if taped is not None:
                    loss = taped.train(self.model, x, y, self.accum)
                else:
                    with nullcontext() if last else no_gradient_sync(self.forward, self.env):
                        loss = self._forward_of(measured, step)(x, y)
                        (loss / self.accum).backward()
            if taped is not None:
                taped.measure(self.model, x, y, self.stream)
            loss_sum += loss.detach().float()
        signalled = torch.tensor(float(self.guard.requested is not None), device=dev)
        mean_loss, preempt = all_reduce_mean(torch.stack([loss_sum / self.accum, signalled]), self.env)
        gnorm = clip_gradients(self.params, self.cfg.trainer.optim.grad_clip).to(dev)
        loss_v, gnorm_v, preempt_v = torch.stack([mean_loss, gnorm, preempt]).tolist()
        self.preempt = self.preempt or preempt_v > 0
        return loss_v, gnorm_v

    def _forward_of(self, track_stats: bool, step: int):
        """The compiled forward, once a step has created every rounding site (a compiled backward
        can only update sites that exist), except where statistics are measured: their hooks and
        records run eagerly."""
        if self.compiled.forward is None or track_stats or not self.model.numerics.sites:
            return self.forward
        return self.compiled.at(step)

    def _apply_update(self, step: int, loss: float, gnorm: float) -> bool:
        """Step the optimizer unless the loss or the gradients are not finite; ``False``: stop.
        An unusable scale raises first (``NumericsError``): a run it broke fails, not diverges."""
        self.model.numerics.check_scales()
        if self.detector.check_loss(step, loss):
            grads = nonfinite_grad_names(self.named_params) if not math.isfinite(gnorm) else []
            self.detector.record_nonfinite_tensors(["loss"] + [f"{n}.grad" for n in grads])
            return False
        if math.isfinite(gnorm):
            self.optimizer.step()
        else:
            names = nonfinite_grad_names(self.named_params)
            if self.detector.check_grads(step, names):
                return False
            if self.env.is_main:
                log.warning("step %d: non-finite gradients in %s; update skipped", step, ", ".join(names))
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.model.numerics.end_step()
        return True

    def _stop_nonfinite(self, step: int, t0: float, loss: float, lr: float, gnorm: float) -> None:
        """The step's loss or gradients are not finite: drop its update, log it, stop."""
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.close_diverged(loss, time.perf_counter() - t0)
        self.metrics.log({**self._record(step, loss, lr, gnorm), "diverged": True})
        if self.env.is_main:
            log.error("stopping: %s; non-finite: %s", self.detector.reason, ", ".join(self.detector.nonfinite_tensors))

    def _record(self, step: int, loss: float, lr: float, gnorm: float) -> dict[str, Any]:
        """The record of ``step``, with the activation statistics and instruments' results measured
        since the last one (each recorded once)."""
        measured = self.activation_stats.pop()
        for instrument in self.instruments:
            measured |= instrument.pop()
        return self.metrics.record(step, loss, lr, gnorm, self.model, len(self.detector.skipped), measured)

    def _loop(self, start: int) -> str:
        env, m, t = self.env, self.metrics, self.cfg.trainer
        if t.progress:
            m.open_progress_bar(self.steps, start, self.experiment)
        last_saved, stopped = start, False
        self.model.train()
        self.loop_started = True
        for step in range(start + 1, self.steps + 1):
            t0 = time.perf_counter()
            is_eval = step % t.eval_every == 0 or step == self.steps
            is_log = step % t.log_every == 0 or is_eval or any(i.due(step) for i in self.instruments)
            lr = float(self.scheduler.get_last_lr()[0])  # a float: the schedule is a LambdaLR
            loss, gnorm = self._train_step(step, track_stats=is_log)
            self.step = step
            if not self._apply_update(step, loss, gnorm):
                self._stop_nonfinite(step, t0, loss, lr, gnorm)
                return "diverged"
            m.step_done(loss, time.perf_counter() - t0)
            self.compiled.step_done(step, time.perf_counter() - t0, env.is_main)
            if step == start + 1:
                set_collective_timeout(env, t.timeouts.step_s)
            if is_log:
                window_loss = m.window.mean_loss()
                if self.detector.observe_logged(step, window_loss):
                    stopped = is_eval = True
                    if env.is_main:
                        log.error("stopping: %s", self.detector.reason)
                rec = self._record(step, window_loss, lr, gnorm)
                if is_eval:
                    rec["val_loss"] = m.window.last_val_loss = self.validator.evaluate(self.model)
                m.log(rec, window_loss=window_loss)
            if self.checkpoints.due(step, self.steps) or stopped:
                self._save()
                last_saved = step
            if stopped:
                break
            if self.preempt or (not env.distributed and self.guard.requested is not None):
                if step == self.steps:  # the run is over anyway
                    break
                if last_saved != step:
                    self._save()
                signum = self.guard.requested or int(signal.SIGTERM)  # the signal reached another rank
                self.checkpoints.wait()
                raise Preempted(signum, step, self.checkpoints.last_path if env.is_main else None)
        if last_saved != self.step:
            self._save()
        return "diverged" if self.detector.diverged else "completed"

    def _save(self) -> None:
        self.checkpoints.save(self.step, wandb_run_id=self.metrics.logger.wandb_run_id)

    def _summary(self, status: str) -> dict[str, Any]:
        return run_summary(
            status,
            step=self.step,
            results=self.metrics,
            detector=self.detector,
            site_implementations=site_implementations(self.cfg),
            experiment=self.experiment,
        )
