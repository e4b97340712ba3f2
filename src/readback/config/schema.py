"""The config schema: one dataclass per config group, registered in Hydra's ``ConfigStore``
(:mod:`.store`).

``conf/train.yaml`` starts its defaults list with ``schema`` (the :class:`Config` below), so every
group is composed into a typed node: a value of the wrong type or a key no field declares stops
the composition. ``OmegaConf.to_object`` then builds these dataclasses, and their
``__post_init__`` tests ranges and the rules between fields; ``Config.check`` the rules between
groups (:mod:`.cross_group`). Groups whose options hold different keys (``precision``, ``data``,
``backend``, ``logger``) have one dataclass per option; each such YAML file names its schema
first in its own defaults list (``- schema_fp8``), under which :mod:`.store` registers it.

To add a key: one field here (``site_margin: int = integer(minimum=0)``) and the key, with its
default and a comment, in the group's YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from readback.backends import BACKENDS
from readback.backends.precision import Precision
from readback.backends.te_plan import ATTENTION_CORES
from readback.config.cross_group import check_between_groups
from readback.data import DATASETS
from readback.data.corpus import EDITIONS
from readback.errors import ConfigError, require
from readback.fields import Checked, integer, items, number, one_of
from readback.numerics.spec import ATTENTION_BWD
from readback.policy import POLICIES
from readback.probe.gradient_error import DTYPES
from readback.train.parallel import PARALLEL

DEVICES = ("auto", "cpu", "cuda")
NONFINITE_GRADS = ("stop", "skip")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class Model(Checked):
    KEY = "model"
    name: str = MISSING
    n_layers: int = integer()
    d_model: int = integer()
    n_heads: int = integer()
    n_kv_groups: int = integer()
    ffn_dim: int = integer()
    vocab_size: int | None = integer()  # null: the data's tokenizer decides
    tied: bool = MISSING
    seq_len: int = integer()
    global_batch: int = integer()
    lr: float = number(0, low_open=True)

    def check(self) -> None:
        require(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            self.n_heads,
            f"a divisor of model.d_model={self.d_model}",
        )
        require(
            self.n_heads % self.n_kv_groups == 0,
            "model.n_kv_groups",
            self.n_kv_groups,
            f"a divisor of model.n_heads={self.n_heads}",
        )


@dataclass
class HfModel(Model):
    """``model=hf``: a transformers causal LM of these sizes, converted by ``readback.convert``."""

    architecture: str = one_of(("llama",))
    filter: list[str] = MISSING  # module-name patterns left in high precision

    def check(self) -> None:
        from readback.backends.hf import check_available

        super().check()
        check_available()


@dataclass
class Policy(Checked):
    KEY = "policy"
    name: str = one_of(POLICIES)


@dataclass
class Attention(Checked):
    KEY = "attention"
    bwd_precision: str = one_of(ATTENTION_BWD)


@dataclass
class Data(Checked):
    KEY = "data"
    name: str = one_of(DATASETS)
    vocab_size: int = integer(minimum=2)


@dataclass
class ShakespeareData(Data):
    val_fraction: float = number(0, 1, high_open=True)
    block_lines: int = integer()
    editions: str = one_of(EDITIONS)
    files: list[str] | None = None  # readable text files, checked by readback.config.entry
    cache_dir: str | None = None


@dataclass
class SyntheticData(Data):
    n_tokens: int = integer(minimum=4)
    val_fraction: float = number(0, 1, high_open=True)
    data_seed: int = integer(minimum=0)
    branching: int = integer()
    noise: float = number(0, 1)


@dataclass
class FinewebData(Data):
    path: str = MISSING
    subset: str = MISSING
    tokenizer: str = MISSING
    eos_token: str = MISSING
    val_docs: int = integer()
    shuffle_buffer: int = integer(minimum=0)
    doc_batch: int = integer()
    loader_workers: int = integer(minimum=0)
    prefetch: int = integer()


@dataclass
class Backend(Checked):
    KEY = "backend"
    name: str = one_of(BACKENDS)


@dataclass
class TeBackend(Backend):
    attention_core: str = one_of(ATTENTION_CORES)
    fp8_mha: bool = MISSING


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
    min_lr: float = number(0)  # <= model.lr, checked in Config.check


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
class Probe(Checked):
    KEY = "probe"
    every: int = integer(minimum=0)  # 0: off
    repeats: int = integer()
    dtype: str = one_of(DTYPES)
    params: list[str] = MISSING
    bias_every: int = integer(minimum=0)  # 0: off
    bias_batches: int = integer()


@dataclass
class Config(Checked):
    """The composed config of one run."""

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

    def check(self) -> None:
        check_between_groups(self)
