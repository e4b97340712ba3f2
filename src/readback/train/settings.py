"""The ``trainer`` and ``logger`` groups' schemas, and :class:`Config`, the typed configuration
of one run that ``readback.config.validate`` builds and every component reads its group from.

``readback.config`` composes it (Hydra's ``ConfigStore``) and checks the rules between groups
(``readback.config.cross_group``) once each group has checked its own ranges. A checkpoint
resumes only under the model it was trained with (:data:`ARCHITECTURE_KEYS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from readback.backends.precision import Attention, Policy, Precision
from readback.backends.settings import Backend
from readback.data.settings import Data
from readback.errors import ConfigError
from readback.fields import Checked, integer, items, number, one_of
from readback.model.settings import Model
from readback.overrides import config_value
from readback.probe.settings import Probe

DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("ddp", "fsdp")  # readback.train.parallel: DDP, or FSDP2's fully_shard
NONFINITE_GRADS = ("stop", "skip")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "online", "offline", "disabled")
# Keys a checkpoint can only be resumed under with the value it was trained with (:func:`config_mismatch`).
ARCHITECTURE_KEYS = (
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_groups",
    "model.ffn_dim",
    "model.vocab_size",
    "model.tied",
    "precision.name",
    "precision.amax_history_len",
)


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


def config_mismatch(saved_config: Mapping[str, Any] | None, cfg: Config) -> tuple[str, Any, Any] | None:
    """The first of :data:`ARCHITECTURE_KEYS` whose value in ``cfg`` differs from the one the
    checkpoint was trained with: ``(key, now, saved)``, or ``None``. Keys unset on either side
    (``model.vocab_size: null`` takes the data's) are not compared."""
    if not isinstance(saved_config, Mapping):
        return None
    now_config = plain_config(cfg)
    for key in ARCHITECTURE_KEYS:
        now, was = config_value(now_config, key), config_value(saved_config, key)
        if now is not None and was is not None and now != was:
            return key, now, was
    return None
