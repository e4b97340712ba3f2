"""Checks of a composed config, and the entry point's one-line answer to a bad one.

Every check raises ``ConfigError(key, value, valid)`` before any work is done; ``train.py``
prints it as one line on stderr and exits with code 2, leaving no run directory behind.

Before Hydra creates the run directory, :func:`exit_on_bad_config` also checks that the run
directory can be written and, when it already holds a run, that the run can be resumed
(:func:`readback.train.checkpoint.resume_plan`), so a bad resume leaves that directory as it was.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

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
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_GRADS = ("stop", "skip")
# Run directories that existed, not empty, before Hydra started (never removed on an error), with
# the Hydra config files they held (put back when the attempt to resume them fails).
PREEXISTING_RUN_DIRS: dict[str, dict[str, bytes]] = {}


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> int:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, key, value, f"an integer >= {minimum}")
    return value


def _number(cfg: DictConfig, key: str, low: float, high: float = float("inf"), *, low_open: bool = False,
            high_open: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    require(ok, key, value, f"a number in {interval}")


def _boolean(cfg: DictConfig, key: str) -> None:
    value = OmegaConf.select(cfg, key)
    require(isinstance(value, bool), key, value, "true, false")


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
    _positive_int(cfg, "probe.bias_every", minimum=0)
    _positive_int(cfg, "probe.bias_batches")
    choose("probe.dtype", cfg.probe.dtype, DTYPES)
    batch, micro = cfg.model.global_batch, cfg.trainer.micro_batch
    require(batch % micro == 0, "trainer.micro_batch", micro, f"a divisor of model.global_batch={batch}")
    _validate_trainer(cfg)
    _validate_machine(cfg)
    _validate_data_files(cfg)


def _validate_trainer(cfg: DictConfig) -> None:
    from readback.train.preemption import parse_signals

    for key in ("resume", "dry_run", "progress", "divergence.stop"):
        _boolean(cfg, f"trainer.{key}")
    choose("trainer.device", str(cfg.trainer.device), DEVICES)
    o = "trainer.optim"
    _positive_int(cfg, f"{o}.warmup_steps", minimum=0)
    _number(cfg, f"{o}.cooldown_frac", 0.0, 1.0)
    _number(cfg, f"{o}.min_lr", 0.0)
    _number(cfg, f"{o}.weight_decay", 0.0)
    _number(cfg, f"{o}.grad_clip", 0.0)
    _number(cfg, f"{o}.eps", 0.0, low_open=True)
    betas = OmegaConf.select(cfg, f"{o}.betas")
    ok = isinstance(betas, (list, tuple)) or OmegaConf.is_list(betas)
    ok = ok and len(betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                        for b in betas)
    require(ok, f"{o}.betas", betas if not OmegaConf.is_list(betas) else list(betas), "two numbers in [0, 1)")
    _number(cfg, "trainer.divergence.factor", 0.0, low_open=True)
    _positive_int(cfg, "trainer.divergence.patience")
    choose("trainer.divergence.nonfinite_grads", OmegaConf.select(cfg, "trainer.divergence.nonfinite_grads",
                                                                  default="stop"), NONFINITE_GRADS)
    signals = OmegaConf.select(cfg, "trainer.preempt_signals", default=None)
    if signals is not None:
        try:
            ok = OmegaConf.is_list(signals)
            parse_signals(list(signals) if ok else [])
        except ValueError:
            ok = False
        require(ok, "trainer.preempt_signals", signals if not ok else list(signals),
                "a list of signal names, e.g. [SIGTERM, SIGUSR1, SIGUSR2], or [] to catch none")


def _validate_machine(cfg: DictConfig) -> None:
    """What this machine must have: CUDA for ``trainer.device=cuda``; CUDA and Transformer Engine
    for ``backend=te`` (the backend's own check when it can be imported)."""
    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "cuda", "auto, cpu (no CUDA device is available)")
    if cfg.backend.name != "te":
        return
    check = None
    try:
        from readback.backends import check_available as check
    except Exception:  # noqa: BLE001 - not there yet, or broken: fall back to the plain check
        try:
            from readback.backends.te import check_available as check
        except Exception:  # noqa: BLE001
            check = None
    if check is not None:
        try:
            check(cfg)
            return
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - the backend's check itself failed: use the plain one
            pass
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("backend", "te", "emulated (backend=te needs a CUDA GPU and Transformer Engine)")


def _validate_data_files(cfg: DictConfig) -> None:
    """A local text corpus: every file in ``data.files`` exists and is not empty (cheap checks;
    the data module repeats them when it builds)."""
    if cfg.data.name != "shakespeare" or not OmegaConf.select(cfg, "data.files", default=None):
        return
    from readback.data.corpus import corpus_files

    corpus_files(cfg.data)


def validate_types(cfg: DictConfig, defaults: DictConfig) -> None:
    """Every value has the type of its default in the chosen config files: an integer where the
    file has an integer, a number for a float, a boolean for a boolean, a list for a list (null
    and string defaults accept anything). Catches ``data.n_tokens=abc`` for every group."""
    for key, default in _leaves(defaults):
        if key.startswith("hydra."):
            continue
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if value is None or default is None or isinstance(default, str):
            continue
        if isinstance(default, bool):
            require(isinstance(value, bool), key, value, "true, false")
        elif isinstance(default, int):
            require(isinstance(value, int) and not isinstance(value, bool), key, value, "an integer")
        elif isinstance(default, float):
            require(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "a number")
        elif isinstance(default, list):
            require(OmegaConf.is_list(value) or isinstance(value, list), key, value,
                    f"a list like {OmegaConf.to_yaml(OmegaConf.create({'x': default})).split(':', 1)[1].strip()}")


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of ``node`` (lists are leaves; interpolations skipped)."""
    out = []
    for key in node:
        path = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key):
            continue
        child = node[key]
        if OmegaConf.is_dict(child):
            out += _leaves(child, path + ".")
        else:
            out.append((path, OmegaConf.to_container(child) if OmegaConf.is_list(child) else child))
    return out


def _validate_precision(cfg: DictConfig) -> None:
    p = cfg.precision
    choose("precision.name", p.name, ("fp8", "bf16"))
    if p.name != "fp8":
        return
    te_only = ("mxfp8",) if cfg.backend.name == "te" else ()  # MXFP8 block scaling: Transformer Engine only
    choose("precision.recipe", p.recipe, RECIPES + te_only)
    choose("precision.fp8_format", str(p.fp8_format).upper(), [f.name for f in Format])
    choose("precision.amax_compute_algo", p.amax_compute_algo, AMAX_COMPUTE_ALGOS)
    choose("precision.rounding", p.rounding, ROUNDINGS)
    _positive_int(cfg, "precision.margin", minimum=0)
    _positive_int(cfg, "precision.interval")
    _positive_int(cfg, "precision.amax_history_len")
    override = list(p.override_linear_precision)
    require(len(override) == 3 and all(isinstance(b, bool) for b in override),
            "precision.override_linear_precision", override, "three booleans [fprop, dgrad, wgrad]")
    _validate_site_margin(cfg)


def _validate_site_margin(cfg: DictConfig) -> None:
    """``precision.site_margin``: a mapping of site patterns that match some FOG site to margins >= 0."""
    from readback.model.fog import FOGConfig, rounding_sites
    from readback.ops.context import site_matches

    margins = OmegaConf.select(cfg, "precision.site_margin", default=None)
    if margins is None:
        return
    require(OmegaConf.is_dict(margins), "precision.site_margin", margins, "a mapping {site pattern: margin}")
    require(cfg.backend.name == "emulated", "precision.site_margin", dict(margins),
            "null with backend=te (Transformer Engine has one margin per recipe)")
    m = cfg.model
    sites = rounding_sites(FOGConfig(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
                                     n_kv_groups=m.n_kv_groups, ffn_dim=m.ffn_dim, vocab_size=1, seq_len=1))
    kinds = list(dict.fromkeys(re.sub(r"^layers\.\d+\.", "", s) for s in sites))
    for pattern, margin in margins.items():
        require(any(site_matches(s, str(pattern)) for s in sites), "precision.site_margin", str(pattern),
                "site patterns (globs) matching " + ", ".join(kinds))
        require(isinstance(margin, int) and not isinstance(margin, bool) and margin >= 0,
                f"precision.site_margin.{pattern}", margin, "an integer >= 0")


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


def check_run_dir(path: Path) -> None:
    """``ConfigError`` unless a run directory can be created (or written) at ``path``. Probes with
    a uniquely named temporary directory in the nearest existing ancestor; leaves nothing."""
    path = Path(path).expanduser().absolute()
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise ConfigError("hydra.run.dir", str(path), f"a directory path you can write ({here} is not a directory)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".readback-write-check-", dir=here))
    except OSError as e:
        raise ConfigError("hydra.run.dir", str(path),
                          f"a directory path you can write ({here}: {e.strerror or e})") from None


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
        group = key.split(".")[0]
        owners = _options_with_key(group, key)
        if owners:  # a key of another option of the group
            chosen = next((o.split("=", 1)[1] for o in reversed(overrides)
                           if o.lstrip("+~").split("=")[0] == group), _default_option(group))
            return (f"{key}={value!r} is not a key of {group}={chosen}; it is one of "
                    + ", ".join(f"{group}={o}" for o in owners))
        hint = difflib.get_close_matches(key, _known_keys(), n=1, cutoff=0.6)
        if not hint:
            hint = difflib.get_close_matches(key.split(".")[0], _known_keys(), n=1)
        return f"{key}={value!r} is not a config key" + (f"; did you mean {hint[0]}?" if hint else
                                                            "; see python train.py --cfg job")
    return " ".join(text.split())


def _known_keys() -> list[str]:
    """Config groups, top-level keys and the dotted keys of every group option."""
    keys = [p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"]
    cfg = OmegaConf.load(CONF_DIR / "train.yaml")
    keys += [k for k in cfg if k not in ("defaults", "hydra")]
    for group in [k for k in keys if (CONF_DIR / k).is_dir() and k != "experiment"]:
        for option in sorted((CONF_DIR / group).glob("*.yaml")):
            try:
                keys += [f"{group}.{k}" for k in _dotted(OmegaConf.to_container(OmegaConf.load(option)))]
            except Exception:  # noqa: BLE001 - a file being edited
                continue
    return list(dict.fromkeys(keys))


def _options_with_key(group: str, key: str) -> list[str]:
    if group == "experiment" or not (CONF_DIR / group).is_dir():
        return []
    owners = []
    for option in sorted((CONF_DIR / group).glob("*.yaml")):
        try:
            if key in {f"{group}.{k}" for k in _dotted(OmegaConf.to_container(OmegaConf.load(option)))}:
                owners.append(option.stem)
        except Exception:  # noqa: BLE001 - a file being edited
            continue
    return owners


def _default_option(group: str) -> str:
    for entry in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml")).get("defaults", []):
        if isinstance(entry, dict) and group in entry:
            return str(entry[group])
    return "?"


def _dotted(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return []
    out = []
    for k, v in tree.items():
        if k == "defaults":
            continue
        out.append(prefix + str(k))
        out += _dotted(v, f"{prefix}{k}.")
    return out


def exit_on_bad_config(argv: list[str]) -> None:
    """Compose ``argv``'s overrides and validate them before Hydra creates anything.

    Skipped when Hydra flags (``-m``, ``--cfg``, ...) are present: a sweep's jobs are checked
    one by one when they start.
    """
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra")]
    run_dir_overrides = [a for a in argv if a.lstrip("+~").startswith("hydra.run.dir=")]
    try:
        keys = [a.lstrip("+~").split("=")[0] for a in overrides]
        groups = [a for a, k in zip(overrides, keys) if "." not in k and (CONF_DIR / k).is_dir()]  # model=..., ...
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides + run_dir_overrides, return_hydra_config=True)
            defaults = compose("train", overrides=groups)
        try:
            validate(cfg)  # the specific checks first: their messages say more
        except ConfigError:
            raise
        except Exception:  # a check tripped over a value of the wrong type: name it
            validate_types(cfg, defaults)
            raise
        validate_types(cfg, defaults)
        _check_run_dir_of(cfg)
    except ConfigError as error:
        _exit(str(error))
    except Exception as error:  # Hydra/OmegaConf composition errors
        _exit(_one_line(error, overrides))


def _check_run_dir_of(cfg: DictConfig) -> None:
    """The run directory Hydra will create: writable, and resumable if it already holds a run."""
    try:
        run_dir = Path(str(cfg.hydra.run.dir)).expanduser().absolute()
    except Exception:  # noqa: BLE001 - e.g. an interpolation only Hydra's runtime can resolve
        return
    check_run_dir(run_dir)
    if run_dir.is_dir() and any(run_dir.iterdir()):
        PREEXISTING_RUN_DIRS[str(run_dir.resolve())] = _hydra_files(run_dir)
        if not bool(cfg.trainer.dry_run):
            from readback.train.checkpoint import resume_plan

            resume_plan(run_dir, cfg, mmap=True)


def _hydra_files(run_dir: Path) -> dict[str, bytes]:
    hydra_dir = run_dir / ".hydra"
    if not hydra_dir.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in hydra_dir.iterdir() if p.is_file()}


def restore_hydra_files(run_dir: Path) -> None:
    """Put back the Hydra config files a run directory held before this process started: a failed
    attempt to resume it must not leave its own config there as the run's."""
    saved = PREEXISTING_RUN_DIRS.get(str(Path(run_dir).resolve()))
    if not saved:
        return
    for name, data in saved.items():
        try:
            (Path(run_dir) / ".hydra" / name).write_bytes(data)
        except OSError:
            pass


def print_error(error: BaseException) -> None:
    """``error`` as the one line users see; the traceback too with ``HYDRA_FULL_ERROR=1``."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(type(error), error, error.__traceback__)
    print(f"error: {error}", file=sys.stderr)


def _exit(message: str) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
