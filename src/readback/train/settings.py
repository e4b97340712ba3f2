"""The ``trainer`` and ``logger`` groups' schemas, and :class:`Config`, the typed configuration
of one run that ``readback.config.validate`` builds and every component reads its group from.

``readback.config`` composes it (Hydra's ``ConfigStore``) and checks the rules between groups
(``readback.config.cross_group``) once each group has checked its own ranges. A checkpoint
resumes only under the config it was trained with (:func:`config_changes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from readback.backends.settings import Backend
from readback.data.settings import Data
from readback.data.stream import Layout
from readback.errors import ConfigError
from readback.fields import Checked, integer, items, matching, number, one_of
from readback.model.settings import Model
from readback.numerics.attention_settings import AttentionSettings
from readback.numerics.precision_settings import PrecisionSettings
from readback.numerics.settings import NumericsSettings
from readback.overrides import with_current_keys
from readback.probe.settings import Probe
from readback.train.compile_choice import is_compile_setting
from readback.train.threads import is_thread_count

DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("ddp", "fsdp")  # readback.train.parallel: DDP, or FSDP2's fully_shard
NONFINITE_GRADS = ("stop", "skip")
LOG_GAPS = ("warn", "rewind")  # a resume whose metrics.jsonl lacks records its checkpoint logged
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "online", "offline", "disabled")
# Keys a checkpoint can only be resumed under with the value it was trained with: its tensors would
# not load under another (:func:`config_changes`; no override).
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
# Keys (and groups: a prefix) a resume may change: how a run is run, shown, logged and checkpointed,
# not what it computes. A change of any other key refuses the resume unless
# ``trainer.resume_changed_config`` is true (:func:`config_changes`).
RESUMABLE_KEYS = (
    "experiment",
    "logger.",
    "trainer.resume",  # and trainer.resume_changed_config
    "trainer.dry_run",
    "trainer.device",
    "trainer.parallel",
    "trainer.micro_batch",  # the same global batch, accumulated another way
    "trainer.gpu_memory_gb",
    "trainer.progress",
    "trainer.preempt_signals",
    "trainer.timeouts.",
    "trainer.ckpt_every",
    "trainer.keep_last",
    "trainer.ckpt_async",
    "trainer.lock_lease_s",
    "trainer.log_gap",  # where a resume starts when its log lost records: the same run either way
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.eval_batches",
    "data.cache_dir",
    "data.prepare_workers",  # the same token file, encoded by more or fewer processes
    "data.prefetch",
    "probe.",  # measurements: the probe and the bias meter never move the run
)
RESOLVED_KEYS = ("model.vocab_size",)  # null: the data's, resolved when the run starts


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
    group: str | None = MISSING  # null: named by readback.train.records.tracking
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
class Timeouts(Checked):
    """How long a collective waits for the other ranks before the run stops (``readback.train.lost_ranks``)."""

    KEY = "trainer.timeouts"
    startup_s: float = number(0, low_open=True)  # joining the group, the rank agreement, the resume, step 1
    step_s: float = number(0, low_open=True)  # every collective after step 1, checkpoint saves included


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
    lock_lease_s: float = number(0, low_open=True)
    resume: bool = MISSING
    resume_changed_config: bool = MISSING
    log_gap: str = one_of(LOG_GAPS)
    preempt_signals: list[str] = MISSING
    dry_run: bool = MISSING
    device: str = one_of(DEVICES)
    parallel: str = one_of(PARALLEL)
    gpu_memory_gb: float = number(0, low_open=True)
    progress: bool = MISSING
    compile: Any = MISSING  # true, false or auto (readback.train.compile_choice; OmegaConf 2.3 nests no Union)
    threads: str = matching("auto or an integer >= 1", is_thread_count)  # readback.train.threads
    optim: Optim = MISSING
    divergence: Divergence = MISSING
    timeouts: Timeouts = MISSING

    def check(self) -> None:
        from readback.train.preemption import parse_signals

        if not is_compile_setting(self.compile):
            raise ConfigError("trainer.compile", self.compile, "auto, true or false")
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
    precision: PrecisionSettings = MISSING
    policy: str = MISSING  # readback.policy: which value each gradient reads (checked with the numerics)
    attention: AttentionSettings = MISSING
    data: Data = MISSING
    backend: Backend = MISSING
    logger: Logger = MISSING
    trainer: Trainer = MISSING
    probe: Probe = MISSING

    @property
    def numerics(self) -> NumericsSettings:
        """The precision and attention groups and the policy, as the one settings object the
        numerics are made from (``ops.numerics_spec``)."""
        return NumericsSettings(self.precision, self.attention, self.policy)

    def layout(self, *, rank: int, world_size: int) -> Layout:
        """How rank ``rank`` of ``world_size`` takes its batches of the run's data."""
        return Layout(self.model.seq_len, self.trainer.micro_batch, self.seed, rank, world_size)


def plain_config(cfg: Config) -> dict[str, Any]:
    """``cfg`` as plain containers, for wandb and checkpoints."""
    return dataclasses.asdict(cfg)


def config_changes(saved_config: Mapping[str, Any] | None, cfg: Config) -> list[tuple[str, Any, Any]]:
    """``(key, saved, now)`` for each key whose value in ``cfg`` differs from the one the checkpoint
    was trained with, but :data:`RESUMABLE_KEYS`; :data:`ARCHITECTURE_KEYS` first. A key the
    checkpoint's config lacks (a key added since) is not compared, nor a ``null`` of
    :data:`RESOLVED_KEYS` (``model.vocab_size: null`` takes the data's when the run starts)."""
    if not isinstance(saved_config, Mapping):
        return []
    saved_config = with_current_keys(saved_config)  # a checkpoint from before a key's rename
    changes = []
    for key, now in config_leaves(cfg):
        was = _saved_value(saved_config, key)
        if key.startswith(RESUMABLE_KEYS) or was is _ABSENT or (now is None and key in RESOLVED_KEYS):
            continue
        if _plain(now) != _plain(was):
            changes.append((key, was, now))
    return sorted(changes, key=lambda change: change[0] not in ARCHITECTURE_KEYS)


_ABSENT = object()


def config_leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every field of a config dataclass, nested groups walked."""
    found = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        found += config_leaves(value, f"{key}.") if dataclasses.is_dataclass(value) else [(key, value)]
    return found


def _saved_value(saved: Mapping[str, Any], dotted: str) -> Any:
    node: Any = saved
    for part in dotted.split("."):
        if node is None:  # a group saved as null (an amax spike not set) has null fields
            return None
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    """``value`` as plain containers (dataclasses as dicts, tuples as lists), for comparing."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
