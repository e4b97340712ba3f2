"""The ``trainer`` and ``logger`` groups' schemas, and :class:`Config`, the typed configuration
of one run that ``readback.config.validate`` builds and every component reads its group from.

``readback.config`` composes it (Hydra's ``ConfigStore``) and checks the rules between groups
(``readback.config.cross_group``) once each group has checked its own ranges.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from readback.backends.precision import Attention, Policy, Precision
from readback.backends.settings import Backend
from readback.data.settings import Data
from readback.errors import ConfigError
from readback.fields import Checked, integer, items, number, one_of
from readback.model.settings import Model
from readback.probe.settings import Probe

DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("ddp", "fsdp")  # readback.train.parallel: DDP, or FSDP2's fully_shard
NONFINITE_GRADS = ("stop", "skip")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class Logger(Checked):
    KEY = "logger"
    name: str = one_of(LOGGERS)


@dataclass
class WandbLogger(Logger):
    project: str = MISSING
    entity: str | None = None
    mode: str = one_of(WANDB_MODES)
    tags: list[str] = MISSING
    init_timeout: float = number(0, low_open=True)
    group: str | None = MISSING  # null: named by readback.train.tracking
    job_type: str = MISSING


@dataclass
class Optim(Checked):
    KEY = "trainer.optim"
    betas: list[float] = items("two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v))
    eps: float = number(0, low_open=True)
    weight_decay: float = number(0)
    grad_clip: float = number(0)
    warmup_steps: int = integer(minimum=0)
    cooldown_frac: float = number(0, 1)
    min_lr: float = number(0)  # <= model.lr, checked in config.cross_group


@dataclass
class Divergence(Checked):
    KEY = "trainer.divergence"
    factor: float = number(1, low_open=True)  # <= 1 would mark every run diverged
    patience: int = integer()
    stop: bool = MISSING
    nonfinite_grads: str = one_of(NONFINITE_GRADS)


@dataclass
class Trainer(Checked):
    KEY = "trainer"
    steps: int = integer()
    micro_batch: int = integer()
    log_every: int = integer()
    eval_every: int = integer()
    eval_batches: int = integer()
    ckpt_every: int = integer()
    keep_last: int = integer()
    ckpt_async: bool = MISSING
    resume: bool = MISSING
    preempt_signals: list[str] = MISSING
    dry_run: bool = MISSING
    device: str = one_of(DEVICES)
    parallel: str = one_of(PARALLEL)
    gpu_memory_gb: float = number(0, low_open=True)
    progress: bool = MISSING
    compile: bool = MISSING
    optim: Optim = MISSING
    divergence: Divergence = MISSING

    def check(self) -> None:
        from readback.train.preemption import parse_signals

        try:
            parse_signals(self.preempt_signals)
        except ValueError:
            raise ConfigError(
                "trainer.preempt_signals",
                self.preempt_signals,
                "a list of signal names, e.g. [SIGTERM, SIGUSR1, SIGUSR2], or [] to catch none",
            ) from None


@dataclass
class Config(Checked):
    """The composed config of one run: each group's dataclass, as its component takes it."""

    experiment: str = MISSING
    seed: int = integer(minimum=0)
    model: Model = MISSING
    precision: Precision = MISSING
    policy: Policy = MISSING
    attention: Attention = MISSING
    data: Data = MISSING
    backend: Backend = MISSING
    logger: Logger = MISSING
    trainer: Trainer = MISSING
    probe: Probe = MISSING


def plain_config(cfg: Config) -> dict[str, Any]:
    """``cfg`` as plain containers, for wandb and checkpoints."""
    return dataclasses.asdict(cfg)
