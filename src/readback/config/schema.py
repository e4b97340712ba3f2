"""The config schema: one dataclass per config group, registered in Hydra's ``ConfigStore``.

``conf/train.yaml`` starts its defaults list with ``schema`` (the :class:`Config` below), so every
group is composed into a typed node: a value of the wrong type or a key no field declares stops
the composition. ``OmegaConf.to_object`` then builds these dataclasses, and their
``__post_init__`` tests ranges and the rules between fields. Groups whose options hold different
keys (``precision``, ``data``, ``backend``, ``logger``) have one dataclass per option; each such
YAML file names its schema first in its own defaults list (``- schema_fp8``).

To add a key: one field here (``site_margin: int = integer(minimum=0)``) and the key, with its
default and a comment, in the group's YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from readback.backends import BACKENDS
from readback.backends.precision import Fp8Precision, Precision
from readback.backends.te_plan import ATTENTION_CORES, RECIPES
from readback.data import DATASETS
from readback.data.corpus import EDITIONS
from readback.errors import ConfigError, require
from readback.fields import Checked, integer, items, number, one_of
from readback.numerics.spec import ATTENTION_BWD
from readback.policy import POLICIES
from readback.probe.gradient_error import DTYPES
from readback.train.parallel import PARALLEL

FP8_ALIGNMENT = 16  # FP8 GEMMs need every dimension divisible by 16
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_GRADS = ("stop", "skip")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("auto", "online", "offline", "disabled")
TE_ONLY_RECIPES = ("mxfp8",)  # MXFP8 block scaling: Transformer Engine only


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
        m, t = self.model, self.trainer
        require(
            m.global_batch % t.micro_batch == 0,
            "trainer.micro_batch",
            t.micro_batch,
            f"a divisor of model.global_batch={m.global_batch}",
        )
        require(t.optim.min_lr <= m.lr, "trainer.optim.min_lr", t.optim.min_lr, f"a number in [0, model.lr = {m.lr}]")
        require(
            m.vocab_size is None or m.vocab_size >= self.data.vocab_size,
            "model.vocab_size",
            m.vocab_size,
            f"null (the data's) or an integer >= data.vocab_size={self.data.vocab_size}",
        )
        if isinstance(self.precision, Fp8Precision):
            self._check_fp8(self.precision)

    def _check_fp8(self, p: Fp8Precision) -> None:
        from readback.model.fog import rounding_owners

        m = self.model
        for key, value in (
            ("model.d_model", m.d_model),
            ("model.ffn_dim", m.ffn_dim),
            ("model head_dim", m.d_model // m.n_heads),
        ):
            require(value % FP8_ALIGNMENT == 0, key, value, f"a multiple of {FP8_ALIGNMENT} under precision=fp8")
        if p.recipe in TE_ONLY_RECIPES:
            require(
                self.backend.name == "te",
                "precision.recipe",
                p.recipe,
                [r for r in RECIPES if r not in TE_ONLY_RECIPES] + ["mxfp8 with backend=te"],
            )
        self._check_site_margin(p)
        owners = rounding_owners(m.n_layers)
        for entry in p.bf16_layers:
            matches = any(o.startswith(entry) or entry.startswith(o + ".") for o in owners)
            require(
                matches,
                "precision.bf16_layers",
                entry,
                f"names of layers or sites, e.g. lm_head, layers.0.attn, layers.{m.n_layers - 1}.mlp.down",
            )

    def _check_site_margin(self, p: Fp8Precision) -> None:
        """Every pattern matches some site of the model; margins >= 0; emulated backend only."""
        from readback.model.fog import rounding_sites
        from readback.ops.numerics import site_kinds, site_matches

        if p.site_margin is None:
            return
        require(
            isinstance(p.site_margin, dict) and all(isinstance(k, str) for k in p.site_margin),
            "precision.site_margin",
            p.site_margin,
            "a mapping {site pattern: margin}, e.g. {attn.core.output: 14}",
        )
        require(
            self.backend.name == "emulated",
            "precision.site_margin",
            dict(p.site_margin),
            "null with backend=te (Transformer Engine has one margin per recipe)",
        )
        sites = rounding_sites(self.model.n_layers)
        kinds = site_kinds(sites)
        for pattern, margin in p.site_margin.items():
            require(
                any(site_matches(s, pattern) for s in sites),
                "precision.site_margin",
                pattern,
                "site patterns (globs) matching " + ", ".join(kinds),
            )
            require(
                isinstance(margin, int) and not isinstance(margin, bool) and margin >= 0,
                f"precision.site_margin.{pattern}",
                margin,
                "an integer >= 0",
            )


# Option schemas of the groups whose options differ in keys: conf/<group>/<option>.yaml names
# ``schema_<option>`` first in its defaults list.
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"hf": HfModel},
    "precision": {"fp8": Fp8Precision, "bf16": Precision},
    "data": {"shakespeare": ShakespeareData, "synthetic": SyntheticData, "fineweb_edu": FinewebData},
    "backend": {"emulated": Backend, "te": TeBackend},
    "logger": {"none": Logger, "wandb": WandbLogger},
}
SCHEMA_PREFIX = "schema_"


def register() -> None:
    """Put the schema in Hydra's ``ConfigStore`` (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for group, options in OPTION_SCHEMAS.items():
        for option, schema in options.items():
            store.store(group=group, name=f"{SCHEMA_PREFIX}{option}", node=schema)


def schema_keys(schema: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares, option schemas included (for "did you mean")."""
    import dataclasses
    import typing

    keys = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        keys.append(prefix + field.name)
        kind = hints[field.name]
        subtypes = [kind, *OPTION_SCHEMAS.get(prefix + field.name, {}).values()] if not prefix else [kind]
        for sub in subtypes:
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                keys += schema_keys(sub, f"{prefix}{field.name}.")
    return list(dict.fromkeys(keys))
