"""What a checkpoint holds and how a run resumes from one; the file handling is :mod:`checkpoint`.

Schema (format :data:`~readback.train.checkpoint.CHECKPOINT_FORMAT`), one file per checkpoint,
written by rank 0 after gathering every rank's part::

    format, step, world_size, config, wandb_run_id,
    <shared>: model, optimizer, schedule, divergence, progress   (the same on every rank)
    ranks: [{<per rank>: data, numerics, rng}, ...]               (one entry per rank)

The components are ``Stateful`` (``state_dict``/``load_state_dict``): the manager knows their
names, not their insides. Model and optimizer states are full (unsharded) and keyed by parameter
name (``torch.distributed.checkpoint.state_dict``): the same file for DDP, FSDP and one process,
loadable at any world size; every rank joins the gathering, rank 0 writes. Rank 0 decides whether
and from where to resume and tells the others, so every rank raises the same ``ConfigError``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from readback.errors import ConfigError
from readback.train.checkpoint import (
    CHECKPOINT_FORMAT,
    checkpoint_dir,
    load_checkpoint,
    remove_stale_temp_files,
    resume_plan,
    save_checkpoint,
)
from readback.train.distributed import (
    DistEnv,
    barrier,
    broadcast_object,
    gather_objects,
)

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ModelState:
    """The model's full state dict on rank 0 (FSDP shards gathered), loaded into any sharding."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=_FULL)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class OptimizerState:
    """The optimizer's full state, keyed by parameter name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as plain containers for wandb and checkpoints (unresolved if it cannot resolve)."""
    cfg = OmegaConf.structured(cfg)  # the typed Config, or a DictConfig in tests
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


class CheckpointManager:
    """Saves and restores the ``shared`` and ``per_rank`` components of a run."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        env: DistEnv,
        *,
        shared: Mapping[str, Stateful],
        per_rank: Mapping[str, Stateful],
    ) -> None:
        t = cfg.trainer
        self.run_dir, self.cfg, self.env = Path(run_dir), cfg, env
        self.dir = checkpoint_dir(run_dir)
        self.every, self.keep_last = t.ckpt_every, t.keep_last
        self.shared, self.per_rank = dict(shared), dict(per_rank)
        self.last_path: str | None = None

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def save(self, step: int, *, wandb_run_id: str | None) -> None:
        env = self.env
        ranks = gather_objects(to_cpu({k: c.state_dict() for k, c in self.per_rank.items()}), env)
        shared = {k: c.state_dict() for k, c in self.shared.items()}  # every rank: FSDP gathers
        if env.is_main:
            state = {
                "format": CHECKPOINT_FORMAT,
                "step": step,
                "world_size": env.world_size,
                "config": plain_config(self.cfg),
                "wandb_run_id": wandb_run_id,
                **shared,
                "ranks": ranks,
            }
            self.last_path = str(save_checkpoint(state, self.dir, step, self.keep_last))
        barrier(env)

    def resume(self) -> tuple[int, str | None]:
        """Load the checkpoint :func:`resume_plan` picks into the components: ``(step, wandb id)``,
        ``(0, None)`` for a fresh start. Also removes the temp files of interrupted writes."""
        env = self.env
        found = None
        decision: tuple[str, Any] | None = None
        if env.is_main:
            try:
                found = resume_plan(self.run_dir, self.cfg)
                decision = ("load", str(found[0])) if found else ("fresh", None)
            except ConfigError as e:
                decision = ("error", (e.key, e.value, e.valid))
        decision = broadcast_object(decision, env)
        if decision[0] == "error":
            raise ConfigError(*decision[1])
        if env.is_main:
            for directory in (self.run_dir, self.dir):
                for p in remove_stale_temp_files(directory):
                    log.info("removed %s, left by an interrupted write", p)
        if decision[0] == "fresh":
            if env.is_main and self.cfg.trainer.resume:
                log.info("trainer.resume=true but no checkpoint in %s; starting from step 0", self.dir)
            return 0, None
        path = decision[1]
        state = found[1] if found is not None else load_checkpoint(Path(path))
        try:
            self._load(state)
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
            log.info("resumed from %s (step %d)", path, state["step"])
        return int(state["step"]), state["wandb_run_id"]

    def _load(self, state: dict[str, Any]) -> None:
        env = self.env
        if state["world_size"] != env.world_size and env.is_main:
            log.warning(
                "resuming a %d-process checkpoint with %d processes: same global batch and data order, "
                "but RNG and FP8 scaling states of missing ranks come from rank 0 (not bit-exact)",
                state["world_size"],
                env.world_size,
            )
        for key, component in self.shared.items():
            component.load_state_dict(state[key])
        mine = state["ranks"][env.rank if env.rank < len(state["ranks"]) else 0]
        for key, component in self.per_rank.items():
            component.load_state_dict(mine[key])
