"""Checks of a composed config, and the entry point's one-line answer to a bad one.

Every check raises ``ConfigError(key, value, valid)`` before any work is done; ``train.py``
prints it as one line on stderr and exits with code 2, leaving no run directory behind.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from readback.errors import ConfigError, choose, require
from readback.numerics import AMAX_COMPUTE_ALGOS, ROUNDINGS, Format
from readback.ops.context import ATTENTION_BWD
from readback.policy import POLICIES
from readback.probe.gradient_error import DTYPES

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
BACKENDS = ("emulated", "te")
RECIPES = ("delayed", "current")
FP8_ALIGNMENT = 16  # FP8 GEMMs need every dimension divisible by 16


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> int:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, key, value, f"an integer >= {minimum}")
    return value


def validate(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first bad value in ``cfg``."""
    from readback.data import DATASETS

    _positive_int(cfg, "seed", minimum=0)
    choose("backend.name", cfg.backend.name, BACKENDS)
    choose("policy.name", cfg.policy.name, POLICIES)
    choose("attention.bwd_precision", cfg.attention.bwd_precision, ATTENTION_BWD)
    choose("data.name", cfg.data.name, DATASETS)
    _validate_precision(cfg)
    _validate_model(cfg)
    for key in ("steps", "micro_batch", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_last"):
        _positive_int(cfg, f"trainer.{key}")
    _positive_int(cfg, "probe.every", minimum=0)
    _positive_int(cfg, "probe.repeats")
    choose("probe.dtype", cfg.probe.dtype, DTYPES)
    batch, micro = cfg.model.global_batch, cfg.trainer.micro_batch
    require(batch % micro == 0, "trainer.micro_batch", micro, f"a divisor of model.global_batch={batch}")


def _validate_precision(cfg: DictConfig) -> None:
    p = cfg.precision
    choose("precision.name", p.name, ("fp8", "bf16"))
    if p.name != "fp8":
        return
    choose("precision.recipe", p.recipe, RECIPES)
    choose("precision.fp8_format", str(p.fp8_format).upper(), [f.name for f in Format])
    choose("precision.amax_compute_algo", p.amax_compute_algo, AMAX_COMPUTE_ALGOS)
    choose("precision.rounding", p.rounding, ROUNDINGS)
    _positive_int(cfg, "precision.margin", minimum=0)
    _positive_int(cfg, "precision.interval")
    _positive_int(cfg, "precision.amax_history_len")
    override = list(p.override_linear_precision)
    require(len(override) == 3 and all(isinstance(b, bool) for b in override),
            "precision.override_linear_precision", override, "three booleans [fprop, dgrad, wgrad]")


def _validate_model(cfg: DictConfig) -> None:
    for key in ("n_layers", "d_model", "n_heads", "n_kv_groups", "ffn_dim", "seq_len", "global_batch"):
        _positive_int(cfg, f"model.{key}")
    m = cfg.model
    if m.vocab_size is not None:
        _positive_int(cfg, "model.vocab_size")
    require(isinstance(m.lr, (int, float)) and m.lr > 0, "model.lr", m.lr, "a positive number")
    require(m.d_model % m.n_heads == 0, "model.n_heads", m.n_heads, f"a divisor of model.d_model={m.d_model}")
    require(m.n_heads % m.n_kv_groups == 0, "model.n_kv_groups", m.n_kv_groups,
            f"a divisor of model.n_heads={m.n_heads}")
    if cfg.precision.name == "fp8":
        head_dim = m.d_model // m.n_heads
        for key, value in (("model.d_model", m.d_model), ("model.ffn_dim", m.ffn_dim), ("model head_dim", head_dim)):
            require(value % FP8_ALIGNMENT == 0, key, value, f"a multiple of {FP8_ALIGNMENT} under precision=fp8")


def _one_line(error: Exception, overrides: list[str]) -> str:
    """Hydra's multi-line composition errors, said in one line with the valid choices."""
    text = str(error)
    missing = re.search(r"Could not find '([\w/]+)/(\w+)'", text) or re.search(
        r"In '[\w/]+': Could not find '(\w+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return str(ConfigError(group, option, options))
    unknown = re.search(r"Could not override '([\w.]+)'|Key '([\w.]+)' is not in struct|'([\w.]+)' is not in struct", text)
    if unknown:
        key = next(g for g in unknown.groups() if g)
        value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=")[0] == key), None)
        hint = difflib.get_close_matches(key.split(".")[0], _known_keys(), n=1)
        return f"{key}={value!r}: unknown config key" + (f"; did you mean {hint[0]}?" if hint else "")
    return " ".join(text.split())


def _known_keys() -> list[str]:
    groups = [p.name for p in CONF_DIR.iterdir() if p.is_dir()]
    cfg = OmegaConf.load(CONF_DIR / "train.yaml")
    return groups + [k for k in cfg if k not in ("defaults", "hydra")]


def exit_on_bad_config(argv: list[str]) -> None:
    """Compose ``argv``'s overrides and validate them before Hydra creates anything.

    Skipped when Hydra flags (``-m``, ``--cfg``, ...) are present: a sweep's jobs are checked
    one by one when they start.
    """
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra")]
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        validate(cfg)
    except ConfigError as error:
        _exit(str(error))
    except Exception as error:  # Hydra/OmegaConf composition errors
        _exit(_one_line(error, overrides))


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
