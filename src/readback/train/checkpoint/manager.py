"""The checkpoint component: what a checkpoint holds, saved every ``trainer.ckpt_every`` steps, and
the run resumed from the newest intact one. Which directory that is, and what becomes of damaged
ones, is :mod:`~readback.train.checkpoint.dirs`'s; how the files are written and read,
:mod:`~readback.train.checkpoint.io`'s; the model's, the optimizer's and the random generators'
state, :mod:`~readback.train.checkpoint.states`'.

Schema (format :data:`~readback.train.checkpoint.dirs.CHECKPOINT_FORMAT`), one DCP directory per
checkpoint, every rank writing its part::

    model, optimizer    sharded tensors (FSDP2: each rank its shards; DDP: one copy, the
                        writing spread over the ranks), keyed by parameter name
    shared              a blob, written by rank 0: format, step, world_size, config,
                        wandb_run_id and the components the same on every rank (schedule,
                        divergence, progress)
    rank<r>             a blob, written by rank r: data position, numerics (FP8 scaling
                        states, random streams), RNG states

DCP reshards model and optimizer on load to any world size; a rank that the checkpoint has no
``rank<r>`` for takes rank 0's. The components are torch's ``Stateful`` (``state_dict``/
``load_state_dict``): the manager knows their names, not their insides. Rank 0 decides whether
and from where to resume and tells the others, so every rank raises the same ``ConfigError``.

``trainer.ckpt_async``: the state is copied when the save starts and written by a background
thread (``dcp.async_save``, over a process group of its own); the commit waits for the next save
or the end of the run (:meth:`CheckpointManager.wait`).

A save that a file system error stops (a full disk: ``ENOSPC``), at once or, asynchronous, at
that wait, becomes one line (``ConfigError``): the step, the cause and the newest intact
checkpoint, once rank 0 has removed the half-written temporary directory; the trainer then
writes ``summary.json`` (``status: failed``) into the room that freed.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from readback.errors import ConfigError, StateChanged
from readback.train.checkpoint import io as checkpoint_io
from readback.train.checkpoint.dirs import (
    CHECKPOINT_FORMAT,
    checkpoint_dir,
    commit_checkpoint,
    newest_intact,
    remove_stale_temp_files,
    temp_checkpoint_path,
)
from readback.train.checkpoint.resumption import resume_plan
from readback.train.checkpoint.states import ModelState, OptimizerState, to_cpu
from readback.train.checkpoint.writer_lock import RunDirTaken, WriterLock
from readback.train.distributed import DistEnv, barrier, broadcast_object
from readback.train.settings import Config, plain_config

log = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores a run's model and optimizer and its ``shared`` and ``per_rank`` components."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        env: DistEnv,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful],
        owner: WriterLock | None = None,
    ) -> None:
        t = cfg.trainer
        self.run_dir, self.cfg, self.env = Path(run_dir), cfg, env
        self.dir = checkpoint_dir(run_dir)
        self.every, self.keep_last, self.asynchronous = t.ckpt_every, t.keep_last, t.ckpt_async
        self.tensors = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
        self.shared, self.per_rank = dict(shared), dict(per_rank)
        self.owner = owner  # rank 0's lock of run_dir: a save starts and commits only while it holds it
        self.last_path: str | None = None
        self.pending: tuple[int, Future | None] | None = None  # the save not yet committed
        # async saves talk over their own group: their collectives run beside the training's
        self.group = dist.new_group(backend="gloo") if self.asynchronous and env.distributed else None

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def save(self, step: int, *, wandb_run_id: str | None) -> None:
        """Write the checkpoint of ``step`` on every rank; committed at once, or with
        ``trainer.ckpt_async`` by the next :meth:`wait` (the next save waits for this one)."""
        self.wait()
        self._check_owner()
        env = self.env
        state: dict[str, Any] = {
            **self.tensors,
            f"rank{env.rank}": checkpoint_io.pack(to_cpu({k: c.state_dict() for k, c in self.per_rank.items()})),
        }
        if env.is_main:
            shared = {k: c.state_dict() for k, c in self.shared.items()}
            meta: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": env.world_size}
            meta |= {"config": plain_config(self.cfg), "wandb_run_id": wandb_run_id}
            state["shared"] = checkpoint_io.pack(to_cpu({**meta, **shared}))
        tmp = temp_checkpoint_path(self.dir, step)
        try:
            future = checkpoint_io.save(
                state, tmp, distributed=env.distributed, process_group=self.group, asynchronous=self.asynchronous
            )
        except BaseException as e:  # DCP's CheckpointException is no Exception
            self._failed(step, e)
        self.pending = (step, future)
        if not self.asynchronous:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight: every rank's shards and the index written, rank 0 commits."""
        if self.pending is None:
            return
        (step, future), self.pending = self.pending, None
        self._check_owner()
        try:
            if future is not None:
                future.result()
            if self.env.is_main:
                self.last_path = str(commit_checkpoint(self.dir, step, self.keep_last))
        except BaseException as e:
            self._failed(step, e)
        barrier(self.env)

    def _check_owner(self) -> None:
        """``RunDirTaken`` on every rank (none left waiting in a collective) unless rank 0 still
        holds the run directory."""
        lost = None
        if self.owner is not None:
            try:
                self.owner.check()
            except RunDirTaken as e:
                lost = (e.key, e.value, e.valid)
        lost = broadcast_object(lost, self.env)
        if lost is not None:
            raise RunDirTaken(*lost)

    def _failed(self, step: int, error: BaseException) -> NoReturn:
        """Re-raise ``error``, a failed save of ``step``; one with a file system error behind it
        as one line, once rank 0 has removed what it wrote."""
        cause = checkpoint_io.os_error_of(error)
        if cause is None:
            raise error
        if self.env.is_main:
            shutil.rmtree(temp_checkpoint_path(self.dir, step), ignore_errors=True)
        raise ConfigError(
            "hydra.run.dir",
            str(self.run_dir),
            f"a directory the checkpoint of step {step} can be saved in: saving it failed "
            f"({' '.join(str(cause).split())}); the newest intact checkpoint is {newest_intact(self.dir)}",
        ) from error

    def resume(self) -> tuple[int, str | None]:
        """Load the checkpoint :func:`resume_plan` picks into the components: ``(step, wandb id)``,
        ``(0, None)`` for a fresh start. Also removes what interrupted writes left."""
        env = self.env
        decision: tuple[str, Any] | None = None
        if env.is_main:
            try:
                found = resume_plan(self.run_dir, self.cfg)
                decision = ("load", (str(found[0]), found[1]["world_size"])) if found else ("fresh", None)
            except ConfigError as e:
                decision = ("error", (e.key, e.value, e.valid))
            for directory in (self.run_dir, self.dir):
                for p in remove_stale_temp_files(directory):
                    log.info("removed %s, left by an interrupted write", p)
        decision = broadcast_object(decision, env)
        if decision[0] == "error":
            raise ConfigError(*decision[1])
        if decision[0] == "fresh":
            if env.is_main and self.cfg.trainer.resume:
                log.info("trainer.resume=true but no checkpoint in %s; starting from step 0", self.dir)
            return 0, None
        path, saved_world = Path(decision[1][0]), decision[1][1]
        try:
            shared = self._load(path, saved_world)
        except ConfigError:
            raise
        except Exception as e:
            first = " ".join(str(e).split())[:300]
            raise ConfigError(
                "trainer.resume",
                True,
                f"a checkpoint this config can load; {path} does not "
                f"({type(e).__name__}: {first}); resume it with the config "
                f"it was trained with, or use a new hydra.run.dir",
            ) from e
        if env.is_main:
            log.info("resumed from %s (step %d)", path, shared["step"])
        return int(shared["step"]), shared["wandb_run_id"]

    def _load(self, path: Path, saved_world: int) -> dict[str, Any]:
        env = self.env
        if saved_world != env.world_size and env.is_main:
            log.warning(
                "resuming a %d-process checkpoint with %d processes: same global batch and data order, "
                "but RNG and FP8 scaling states of missing ranks come from rank 0 (not bit-exact)",
                saved_world,
                env.world_size,
            )
        mine = f"rank{env.rank if env.rank < saved_world else 0}"
        state: dict[str, Any] = {**self.tensors, "shared": None, mine: None}
        checkpoint_io.load(state, path, distributed=env.distributed)
        shared, own = checkpoint_io.unpack(state["shared"], path), checkpoint_io.unpack(state[mine], path)
        for key, component in self.shared.items():
            component.load_state_dict(shared[key])
        for key, component in self.per_rank.items():
            try:
                component.load_state_dict(own[key])
            except StateChanged as changed:  # saved under another config: refused, or afresh with the override
                if not self.cfg.trainer.resume_changed_config:
                    raise
                if env.is_main:
                    log.warning("%s: %s (trainer.resume_changed_config=true)", key, changed.afresh)
        return shared


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A whole checkpoint, unsharded, in this process (for programs that read a run): its shared
    state, ``model`` and ``optimizer`` (full state dicts keyed by parameter name) and ``ranks``
    (each rank's state). A crafted checkpoint raises a one-line ``ConfigError``, unread."""
    state = checkpoint_io.read(path)
    shared = checkpoint_io.unpack(state.pop("shared"), path)
    ranks = [checkpoint_io.unpack(state.pop(f"rank{r}"), path) for r in range(shared["world_size"])]
    return {**shared, **state, "ranks": ranks}
