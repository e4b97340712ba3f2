"""The training loop: builds the pieces (data, model, optimizer, schedule, checkpoints, metrics,
divergence detector, process group) and wires them; each concern lives in its own module.

Order of one optimizer step ``t`` (counted from 1):

1. ``lr = schedule(t)``; ``accum`` micro-steps of forward + ``(loss / accum).backward()``, DDP
   ``no_sync`` on all but the last;
2. the step's loss is averaged over ranks (with it travels the preemption flag); a NaN/Inf loss
   stops the run (``status: diverged``), the update not applied;
3. pre-clip gradient norm; non-finite gradients are not applied either: they stop the run like a
   NaN loss (``trainer.divergence.nonfinite_grads: stop``) or skip the update (``skip``);
   otherwise clip to ``grad_clip`` and ``optimizer.step()``;
4. ``model.numerics.end_step()`` (also after a skipped update);
5. on log steps (multiples of ``log_every`` or ``eval_every``, and the last step): one record in
   ``metrics.jsonl``/wandb, ``val_loss`` on eval steps; then a checkpoint on checkpoint steps;
6. after a preemption signal (:mod:`readback.train.preemption`): a checkpoint, then
   :class:`~readback.train.preemption.Preempted` (no ``summary.json``: the run is not over).

Reproducibility: a run is a function of its config. The seed fixes the initialisation, the data
order (the stream's state is its position) and every random stream of the numerics (seeded from
(seed, site, stream, step): nothing to save but the step; probe repeats use salted streams). A
checkpoint holds everything else: model, optimizer, schedule, step, data position, scaling
states (amax histories, scales) and the counts and moments not yet logged, the global RNG
states, the divergence detector, the loss window and the wandb run id. Resuming from it
reproduces the uninterrupted run bit for bit (same world size and device).
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
from omegaconf import DictConfig, OmegaConf

from readback.backends import site_implementations
from readback.errors import ConfigError
from readback.model import ActivationStats
from readback.probe import GradientProbe
from readback.train.checkpoint import (
    atomic_write_text,
    checkpoint_dir,
    load_checkpoint,
    remove_stale_temp_files,
    resume_plan,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from readback.train.distributed import (
    DistEnv,
    all_reduce_mean,
    barrier,
    broadcast_object,
    cleanup,
    gather_objects,
    init_distributed,
    resolve_device,
    world_from_env,
)
from readback.train.divergence import DivergenceDetector
from readback.train.instruments import Instruments
from readback.train.metrics import MetricsLogger, build_metrics_logger, json_safe, peak_bf16_flops
from readback.train.optim import build_optimizer, clip_grads_, grad_norm, nonfinite_grad_names, set_lr
from readback.train.preemption import Preempted, PreemptionGuard
from readback.train.schedule import WSDSchedule

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train (or, with ``trainer.dry_run``, size) the configured model; return the summary.

    Rank 0 writes ``run_dir/metrics.jsonl``, ``run_dir/checkpoints/`` and ``run_dir/summary.json``.
    Raises :class:`~readback.errors.ConfigError` for trainer-level runtime misconfiguration
    (before anything is written, except for an error the data raises mid-run, which also writes
    ``status: "failed"``); any other exception writes ``status: "failed"`` and re-raises. A
    preemption signal raises :class:`~readback.train.preemption.Preempted` after a checkpoint.
    """
    run_dir = Path(run_dir)
    experiment = cfg.experiment
    rank, world, local = world_from_env()
    accum = accumulation_steps(cfg, world)
    if cfg.trainer.dry_run:
        return _dry_run(cfg, run_dir, experiment, rank)
    resolve_device(cfg.trainer.device, local)  # a bad device is a config error, raised early
    env = init_distributed(cfg.trainer.device)
    det_before = torch.are_deterministic_algorithms_enabled()
    warn_before = torch.is_deterministic_algorithms_warn_only_enabled()
    if env.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    signals = cfg.trainer.preempt_signals
    try:
        with PreemptionGuard(signals) as guard:
            return _Trainer(cfg, run_dir, env, accum, experiment, guard).train()
    finally:
        torch.use_deterministic_algorithms(det_before, warn_only=warn_before)
        cleanup(env)


def accumulation_steps(cfg: DictConfig, world_size: int) -> int:
    """``global_batch / (micro_batch * world_size)``; a ``ConfigError`` unless it divides."""
    gb, mb = cfg.model.global_batch, cfg.trainer.micro_batch
    per_step = mb * world_size
    if gb % per_step:
        raise ConfigError(
            "model.global_batch",
            gb,
            f"a positive multiple of trainer.micro_batch x world size = {mb} x {world_size} = {per_step}",
        )
    return gb // per_step


def _summary_path(run_dir: Path) -> Path:
    return run_dir / "summary.json"


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    import json

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(_summary_path(run_dir), json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")


def _set_vocab_from_stream(cfg: DictConfig, stream: Any) -> None:
    cfg.model.vocab_size = stream.vocab_size


def _build_stream(cfg: DictConfig, *, rank: int, world_size: int) -> Any:
    from readback.data import build_data

    return build_data(
        cfg.data,
        seq_len=cfg.model.seq_len,
        micro_batch=cfg.trainer.micro_batch,
        seed=cfg.seed,
        rank=rank,
        world_size=world_size,
    )


def _dry_run(cfg: DictConfig, run_dir: Path, experiment: str, rank: int) -> dict[str, Any]:
    """Build the model on the meta device, print its size, write ``status: dry_run``."""
    t0 = time.time()
    if cfg.model.vocab_size is None:
        _set_vocab_from_stream(cfg, _build_stream(cfg, rank=0, world_size=1))
    from readback.backends import build_model

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, "meta")
    n_params, fpt = int(model.n_params()), float(model.flops_per_token())
    summary = {
        "status": "dry_run",
        "experiment": experiment,
        "n_params": n_params,
        "flops_per_token": fpt,
        "final_loss": None,
        "val_loss": None,
        "steps": 0,
        "tokens": 0,
        "diverged_at_step": None,
        "wall_time_s": time.time() - t0,
    }
    if rank == 0:
        print(f"{experiment}: {n_params:,} parameters, {fpt:.4g} FLOPs per token (dry run, no weights allocated)")
        write_summary(run_dir, summary)
    return summary


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as plain containers for wandb and checkpoints (unresolved if it cannot resolve)."""
    cfg = OmegaConf.structured(cfg)  # the typed Config, or a DictConfig in tests
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - e.g. an interpolation that needs Hydra's runtime
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


class _Window:
    """Train-loss and throughput accumulators between two log steps, plus run-level results."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.count = 0
        self.tokens = 0
        self.time_s = 0.0
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.wall_time_s = 0.0  # wall time of earlier sessions (from the checkpoint)

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

    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


class _Trainer:
    def __init__(self, cfg: DictConfig, run_dir: Path, env: DistEnv, accum: int, experiment: str,
                 guard: PreemptionGuard | None = None):
        self.cfg, self.run_dir, self.env, self.accum, self.experiment = cfg, run_dir, env, accum, experiment
        self.guard = guard if guard is not None else PreemptionGuard(())
        self.preempt = False  # a preemption signal reached some rank: checkpoint and stop after this step
        self.loop_started = False
        t = cfg.trainer
        self.steps = t.steps
        self.seq_len = cfg.model.seq_len
        self.global_batch = cfg.model.global_batch
        self.tokens_per_step = self.global_batch * self.seq_len
        self.log_every = t.log_every
        self.eval_every = t.eval_every
        self.eval_batches = t.eval_batches
        self.ckpt_every = t.ckpt_every
        self.keep_last = t.keep_last
        self.grad_clip = t.optim.grad_clip
        self.ckpt_dir = checkpoint_dir(run_dir)
        self.t_start = time.time()
        self.step = 0
        self.n_params: int | None = None
        self.flops_per_token: float | None = None
        self.window = _Window()
        self.detector = DivergenceDetector.from_config(t.divergence)
        self.logger: MetricsLogger = MetricsLogger()
        self.pbar: Any = None
        self.peak_flops: float | None = None
        self.probe = GradientProbe.from_config(cfg.probe)
        self.probe_metrics: dict[str, float] = {}
        self.instruments = Instruments(cfg)

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        cfg, env = self.cfg, self.env
        self.stream = _build_stream(cfg, rank=env.rank, world_size=env.world_size)
        if cfg.model.vocab_size is None:
            _set_vocab_from_stream(cfg, self.stream)
        from readback.backends import build_model

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg, str(env.device))
        self.activation_stats = ActivationStats(self.model)
        self.n_params = int(self.model.n_params())
        self.flops_per_token = float(self.model.flops_per_token())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.schedule = WSDSchedule.from_config(cfg.trainer.optim, peak=cfg.model.lr, steps=self.steps)
        self.optimizer = build_optimizer(self.model, cfg.trainer.optim, self.schedule(1))
        if env.device.type == "cuda":
            self.peak_flops = peak_bf16_flops(torch.cuda.get_device_name(env.device))

    def _resume(self) -> tuple[int, str | None]:
        """Load the checkpoint :func:`resume_plan` picks; ``(step, wandb id)``. Rank 0 decides
        and tells the others (a ``ConfigError`` is raised on every rank)."""
        env = self.env
        found, decision = None, None
        if env.is_main:
            try:
                found = resume_plan(self.run_dir, self.cfg)
                decision = ("load", str(found[0])) if found else ("fresh", None)
            except ConfigError as e:
                decision = ("error", (e.key, e.value, e.valid))
        decision = broadcast_object(decision, env)
        if decision[0] == "error":
            raise ConfigError(*decision[1])
        if decision[0] == "fresh":
            if env.is_main and self.cfg.trainer.resume:
                log.info("trainer.resume=true but no checkpoint in %s; starting from step 0", self.ckpt_dir)
            return 0, None
        path = decision[1]
        state = found[1] if found is not None else load_checkpoint(Path(path))
        try:
            return self._load_state(path, state)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a checkpoint of another model, recipe or data
            first = " ".join(str(e).split())[:300]
            raise ConfigError("trainer.resume", True, f"a checkpoint this config can load; {path} does not "
                                                      f"({type(e).__name__}: {first}); resume it with the config "
                                                      f"it was trained with, or use a new hydra.run.dir") from e

    def _load_state(self, path: str, state: dict[str, Any]) -> tuple[int, str | None]:
        env = self.env
        saved_world = int(state["world_size"])
        if saved_world != env.world_size and env.is_main:
            log.warning(
                "resuming a %d-process checkpoint with %d processes: same global batch and data order, "
                "but RNG and FP8 scaling states of missing ranks come from rank 0 (not bit-exact)",
                saved_world, env.world_size,
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.detector.load_state_dict(state["divergence"])
        self.window.load_state_dict(state["progress"])
        mine = state["ranks"][env.rank if env.rank < len(state["ranks"]) else 0]
        self.stream.load_state_dict(mine["data"])
        self.model.numerics.load_state_dict(mine["numerics"])
        set_rng_state(mine["rng"])
        if env.is_main:
            log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"]), state.get("wandb_run_id")

    def _save_checkpoint(self) -> None:
        env = self.env
        numerics = self.model.numerics
        mine = _to_cpu({
            "data": self.stream.state_dict(),
            "numerics": numerics.state_dict(),
            "rng": rng_state(),
        })
        ranks = gather_objects(mine, env)
        if env.is_main:
            window = self.window.state_dict()
            window["wall_time_s"] = self._wall_time()
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "schedule": {"step": self.step, **vars(self.schedule)},
                "world_size": env.world_size,
                "ranks": ranks,
                "divergence": self.detector.state_dict(),
                "progress": window,
                "wandb_run_id": self.logger.wandb_run_id,
                "config": plain_config(self.cfg),
            }
            self.last_checkpoint = str(save_checkpoint(state, self.ckpt_dir, self.step, self.keep_last))
        barrier(env)

    # ------------------------------------------------------------------ steps
    def _train_step(self, step: int, track_stats: bool) -> tuple[float, float, torch.Tensor]:
        """Forward/backward over ``accum`` micro-batches; ``(loss, grad norm, grad norm tensor)``.

        With ``track_stats`` the activation statistics and attention's mechanism statistics are
        measured in the last micro-batch only (they cost a device sync per layer). On probe steps
        the first micro-batch is measured by the probe before it trains.
        """
        lr = self.schedule(step)
        set_lr(self.optimizer, lr)
        dev = self.env.device
        loss_sum = torch.zeros((), device=dev)
        for micro in range(self.accum):
            x, y = self.stream.next_batch()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            if micro == 0 and self.probe.due(step):
                self.probe_metrics = self.probe.measure(self.model, x, y)
            if micro == 0:
                self.instruments.measure(step, self.model, self.stream)
            last = micro == self.accum - 1
            self.activation_stats.active = self.model.numerics.mechanism = bool(track_stats and last)
            sync = self.ddp_model.no_sync() if self.env.distributed and not last else nullcontext()
            with sync:
                loss = self.ddp_model(x, y)
                (loss / self.accum).backward()
            loss_sum += loss.detach().float()
        self.activation_stats.active = self.model.numerics.mechanism = False
        signalled = torch.tensor(float(self.guard.requested is not None), device=dev)
        mean_loss, preempt = all_reduce_mean(torch.stack([loss_sum / self.accum, signalled]), self.env)
        gnorm = grad_norm(self.params).to(dev)
        loss_v, gnorm_v, preempt_v = torch.stack([mean_loss, gnorm, preempt]).tolist()
        self.preempt = self.preempt or preempt_v > 0
        return loss_v, gnorm_v, gnorm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the ``eval_batches`` validation batches (the same on every rank).

        Batch ``i`` is evaluated on rank ``i % world_size``; the per-batch losses are summed over
        ranks, so every rank gets the same mean, equal to the single-process one up to round-off.
        Evaluation leaves no trace in training: ``model.numerics`` (amax histories, random
        streams) is restored to its state before the evaluation forwards.
        """
        env = self.env
        was_training = self.model.training
        self.model.eval()
        dev = env.device
        totals = torch.zeros(2, dtype=torch.float64, device=dev)  # (sum of losses, batches)
        with self.model.numerics.isolated():
            for i, (x, y) in enumerate(self.stream.val_batches(self.eval_batches)):
                if i % env.world_size == env.rank:
                    totals[0] += self.model(x.to(dev), y.to(dev)).double()
                    totals[1] += 1
        self.model.train(was_training)
        totals = all_reduce_mean(totals, env) * env.world_size
        return float(totals[0] / totals[1].clamp_min(1))

    def _record(self, step: int, loss: float, lr: float, gnorm: float) -> dict[str, Any]:
        tps = self.window.tokens_per_s()
        rec: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens": step * self.tokens_per_step,
            "grad_norm": gnorm,
            "tokens_per_s": tps,
            "skipped_updates": len(self.detector.skipped),
        }
        if self.peak_flops and self.flops_per_token:
            rec["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.env.world_size)
            rec["mem_gib"] = torch.cuda.max_memory_allocated(self.env.device) / 2**30
        numerics = self.model.numerics
        rec.update(self.activation_stats.pop())
        saturation = getattr(numerics, "saturation_counts", None)
        if saturation is not None:
            rec.update({f"fp8_saturation/{site}": int(n) for site, n in saturation().items()})
        observations = getattr(numerics, "pop_observations", None)
        if observations is not None:  # e.g. attn_rowsum/{mean,z}/<layer>, accumulated since the last record
            rec.update({k: float(v) for k, v in observations().items()})
        rec.update(self.instruments.metrics(numerics))  # fp8_underflow/..., grad_bias/...
        rec.update(self.probe_metrics)
        self.probe_metrics = {}
        return rec

    def _wall_time(self) -> float:
        return self.window.wall_time_s + (time.time() - self.t_start)

    # ------------------------------------------------------------------ main
    def train(self) -> dict[str, Any]:
        env = self.env
        self.last_checkpoint: str | None = None
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._build()
            start, wandb_id = self._resume()
            self.step = start
            if env.is_main:  # the run is not over until it says so again; a killed save left a temp file
                _summary_path(self.run_dir).unlink(missing_ok=True)
                for directory in (self.run_dir, self.ckpt_dir):
                    for p in remove_stale_temp_files(directory):
                        log.info("removed %s, left by an interrupted write", p)
            self.logger = build_metrics_logger(
                self.cfg.logger,
                self.run_dir,
                is_main=env.is_main,
                resume_step=start,
                config=plain_config(self.cfg),
                wandb_run_id=wandb_id,
            )
            if env.distributed:
                from torch.nn.parallel import DistributedDataParallel as DDP

                ids = [env.device] if env.device.type == "cuda" else None
                self.ddp_model = DDP(self.model, device_ids=ids)
            else:
                self.ddp_model = self.model
            if env.is_main:
                log.info(
                    "%s: %s params, %.4g FLOPs/token, %d steps x %d tokens, accum %d, world %d, %s",
                    self.experiment, f"{self.n_params:,}", self.flops_per_token, self.steps,
                    self.tokens_per_step, self.accum, env.world_size, env.device,
                )
            status = self._loop(start)
        except Preempted as p:
            if env.is_main:
                log.warning("%s; no summary.json: the requeued job resumes and writes it", p)
            self.logger.mark_preempting()
            self.logger.close(exit_code=1)
            raise
        except ConfigError as e:
            if self.loop_started:  # e.g. the data ran out mid-run: the run failed
                self._write_failed_summary(e)
            self.logger.close(exit_code=1)
            raise
        except (Exception, KeyboardInterrupt) as e:
            self._write_failed_summary(e)
            self.logger.close(exit_code=1)
            raise
        finally:
            if self.pbar is not None:
                self.pbar.close()
        summary = self._summary(status)
        if env.is_main:
            write_summary(self.run_dir, summary)
            self.logger.summary(summary)
        self.logger.close(exit_code=0)
        return summary

    def _write_failed_summary(self, error: BaseException) -> None:
        if not self.env.is_main:
            return
        summary = self._summary("failed")
        summary["error"] = f"{type(error).__name__}: {error}"
        try:
            write_summary(self.run_dir, summary)
        except Exception as write_error:  # noqa: BLE001
            log.error("could not write summary.json: %s", write_error)

    def _stop_nonfinite(self, step: int, t0: float, loss: float, lr: float, gnorm: float) -> None:
        """The step's loss or gradients are not finite: drop its update, log it, stop."""
        self.optimizer.zero_grad(set_to_none=True)
        self.window.add(loss, self.tokens_per_step, time.perf_counter() - t0)
        self.window.last_loss = loss if math.isfinite(loss) else None
        rec = self._record(step, loss, lr, gnorm)
        rec["diverged"] = True
        self.logger.log(rec)
        if self.env.is_main:
            log.error("stopping: %s; non-finite: %s", self.detector.reason, ", ".join(self.detector.nonfinite_tensors))

    def _loop(self, start: int) -> str:
        env, model = self.env, self.model
        if env.is_main and self.cfg.trainer.progress:
            from tqdm import tqdm

            self.pbar = tqdm(total=self.steps, initial=start, desc=self.experiment, dynamic_ncols=True)
        last_saved = start
        nonfinite_stop = stopped = False
        model.train()
        self.loop_started = True
        for step in range(start + 1, self.steps + 1):
            t0 = time.perf_counter()
            is_eval = step % self.eval_every == 0 or step == self.steps
            is_log = step % self.log_every == 0 or is_eval or self.probe.due(step) or self.instruments.due(step)
            loss, gnorm, gnorm_t = self._train_step(step, track_stats=is_log)
            lr = self.schedule(step)
            self.step = step
            if self.detector.check_loss(step, loss):
                grads = nonfinite_grad_names(self.named_params) if not math.isfinite(gnorm) else []
                self.detector.record_nonfinite_tensors(["loss"] + [f"{n}.grad" for n in grads])
                self._stop_nonfinite(step, t0, loss, lr, gnorm)
                nonfinite_stop = True
                break
            if math.isfinite(gnorm):
                clip_grads_(self.params, self.grad_clip, gnorm_t)
                self.optimizer.step()
            else:
                names = nonfinite_grad_names(self.named_params)
                if self.detector.check_grads(step, names):
                    self._stop_nonfinite(step, t0, loss, lr, gnorm)
                    nonfinite_stop = True
                    break
                if env.is_main:
                    log.warning("step %d: non-finite gradients in %s; update skipped", step, ", ".join(names))
            self.optimizer.zero_grad(set_to_none=True)
            model.numerics.end_step()
            self.window.add(loss, self.tokens_per_step, time.perf_counter() - t0)
            if self.pbar is not None:
                self.pbar.update(1)

            if is_log:
                window_loss = self.window.mean_loss()
                if self.detector.observe_logged(step, window_loss):
                    stopped = is_eval = True
                    if env.is_main:
                        log.error("stopping: %s", self.detector.reason)
                rec = self._record(step, window_loss, lr, gnorm)
                if is_eval:
                    rec["val_loss"] = self.window.last_val_loss = self.evaluate()
                self.window.last_loss = window_loss
                self.logger.log(rec)
                if self.pbar is not None:
                    self.pbar.set_postfix(loss=f"{window_loss:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
                self.window.reset()
            if step % self.ckpt_every == 0 or step == self.steps or stopped:
                self._save_checkpoint()
                last_saved = step
            if stopped:
                break
            if self.preempt or (not env.distributed and self.guard.requested is not None):
                if step == self.steps:  # the run is over anyway
                    break
                if last_saved != step:
                    self._save_checkpoint()
                signum = self.guard.requested or int(signal.SIGTERM)  # the signal reached another rank
                raise Preempted(signum, step, self.last_checkpoint if env.is_main else None)
        if not nonfinite_stop and last_saved != self.step:
            self._save_checkpoint()
        return "diverged" if self.detector.diverged else "completed"

    def _summary(self, status: str) -> dict[str, Any]:
        return {
            "status": status,
            "final_loss": self.window.last_loss,
            "val_loss": self.window.last_val_loss,
            "steps": self.step,
            "tokens": self.step * self.tokens_per_step,
            "diverged_at_step": self.detector.diverged_at_step,
            "divergence_reason": self.detector.reason,
            "skipped_updates": self.detector.skipped,
            "nonfinite_tensors": self.detector.nonfinite_tensors,
            "wall_time_s": self._wall_time(),
            "n_params": self.n_params,
            "site_implementations": site_implementations(self.cfg) if hasattr(self.cfg, "backend") else None,
            "flops_per_token": self.flops_per_token,
            "world_size": self.env.world_size,
            "experiment": self.experiment,
        }
