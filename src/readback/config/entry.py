"""The entry point's checks: a composed config becomes the typed :class:`Config`, or one line.

Every check raises ``ConfigError(key, value, valid)`` before any work is done; ``train.py``
prints it as one line on stderr and exits with code 2, leaving no run directory behind.

Before Hydra creates the run directory, :func:`exit_on_bad_config` also checks that the run
directory can be written and, when it already holds a run, that no other process writes it
(:mod:`readback.train.checkpoint.writer_lock`) and that the run can be resumed
(:func:`readback.train.checkpoint.resumption.resume_plan`), so a bad resume leaves that directory as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from readback.config.cross_group import check_between_groups
from readback.config.refusals import (
    CONF_DIR,
    first_undeclared_key,
    from_composition_error,
    from_schema_error,
    old_spelling,
    unknown_key,
)
from readback.config.resumed import (
    option_overrides,
    previous_overrides,
    record,
    resumed_config,
    saved_config,
    saved_options,
)
from readback.data.settings import ShakespeareData
from readback.errors import ConfigError
from readback.overrides import with_current_keys
from readback.train.settings import Config

# Run directories that existed, not empty, before Hydra started (never removed on an error), with
# the Hydra config files they held (put back when the attempt to resume them fails).
PREEXISTING_RUN_DIRS: dict[str, dict[str, bytes]] = {}


def validate(cfg: DictConfig) -> Config:
    """The typed config of ``cfg`` (composed against the schema), or ``ConfigError`` for the
    first bad value, key or input file, or what this machine lacks."""
    config = typed(cfg)
    check_machine(config)
    return config


def typed(cfg: DictConfig) -> Config:
    """The typed config of ``cfg`` (composed against the schema), or ``ConfigError`` for the
    first bad value or key; what this machine has is not checked (see :func:`validate`)."""
    undeclared = first_undeclared_key(cfg)
    if undeclared:
        raise unknown_key(*undeclared, overrides=[])
    job = cfg
    if "hydra" in cfg:  # composed with return_hydra_config: the job's config is the rest
        job = cfg.copy()
        with open_dict(job):
            del job["hydra"]
    with schema_refusals():
        config = OmegaConf.to_object(job)
    assert isinstance(config, Config), type(config)
    check_between_groups(config)  # once every group has checked its own ranges
    return config


def from_saved(saved: Mapping[str, Any]) -> Config:
    """The typed config a run saved (``plain_config``, in its checkpoints), checked again. It is
    laid over today's defaults of the options it names, so a key added since the run was saved
    takes its default (the behaviour the run had), and a key renamed since is read under its new name."""
    from hydra import compose, initialize_config_dir

    saved = with_current_keys(saved)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        defaults = compose("train", overrides=option_overrides(saved_options(saved, CONF_DIR)))
    with schema_refusals():  # a saved (or replaced) value of the wrong type
        merged = OmegaConf.merge(defaults, saved)
    return typed(cast(DictConfig, merged))


@contextlib.contextmanager
def schema_refusals() -> Iterator[None]:
    """OmegaConf's refusal of a value by the schema (wrong type, unset) as a one-line ``ConfigError``."""
    try:
        yield
    except OmegaConfBaseException as error:
        refusal = from_schema_error(error)
        if refusal is None:
            raise
        raise refusal from None


def check_machine(config: Config) -> None:
    """What this machine must have: CUDA for ``trainer.device=cuda``; what ``backend=te`` needs
    (the backend's own check; a dry run prints the plan for an assumed TE and GPU instead,
    ``readback.train.dry_run``); readable text in ``data.files``."""
    import torch

    if config.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "cuda", "auto, cpu (no CUDA device is available)")
    if config.backend.name == "te" and not config.trainer.dry_run:  # a dry run plans for any machine
        from readback.backends import check_available

        check_available(config)
    if isinstance(config.data, ShakespeareData) and config.data.files:
        from readback.data.corpus import corpus_files

        corpus_files(config.data.files, config.data.editions, config.data.format)


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
        raise ConfigError(
            "hydra.run.dir", str(path), f"a directory path you can write ({here}: {e.strerror or e})"
        ) from None


def exit_on_bad_config(argv: list[str]) -> None:
    """Compose ``argv``'s overrides and validate them before Hydra creates anything.

    Skipped when Hydra flags (``-m``, ``--cfg``, ...) are present: a sweep's jobs are checked
    one by one when they start.
    """
    renamed = old_spelling(argv)
    if renamed is not None:
        _exit(str(renamed))
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra")]
    run_dir_overrides = [a for a in argv if a.lstrip("+~").startswith("hydra.run.dir=")]
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=overrides + run_dir_overrides, return_hydra_config=True)
        run_dir = Path(str(cfg.hydra.run.dir)).expanduser().absolute()
        config = validate(resume_of(cfg, overrides, run_dir))
        _check_run_dir_of(run_dir, config)
    except ConfigError as error:
        _exit(str(error))
    except (HydraException, OmegaConfBaseException) as error:
        refusal = from_composition_error(error, overrides)
        _exit(str(refusal) if refusal is not None else " ".join(str(error).split()))


def resume_of(cfg: DictConfig, overrides: list[str], run_dir: Path, *, launching: bool = False) -> DictConfig:
    """``cfg``, or, when this launch resumes the run in ``run_dir`` (``trainer.resume``, or a
    requeued job), the config that run goes on with (:mod:`.resumed`). ``launching``: the launch
    itself (Hydra's job, rank 0), which logs the defaults that changed and writes the run's
    ``.hydra`` files as the resume leaves them."""
    from readback.train.preemption import requeued

    resuming = OmegaConf.select(cfg, "trainer.resume") is True or requeued()
    saved = saved_config(run_dir) if resuming and OmegaConf.select(cfg, "trainer.dry_run") is not True else None
    if saved is None:
        return cfg
    previous = previous_overrides(PREEXISTING_RUN_DIRS.get(str(run_dir.resolve())) or _hydra_files(run_dir))
    with schema_refusals():
        resumed = resumed_config(saved, overrides, CONF_DIR, previous=previous, report=launching)
    if launching:
        record(run_dir, resumed, overrides, previous)
    return resumed


def _check_run_dir_of(run_dir: Path, config: Config) -> None:
    """The run directory Hydra will create: writable, no other run writing it, and resumable if it
    already holds a run."""
    check_run_dir(run_dir)
    if run_dir.is_dir() and any(run_dir.iterdir()):
        PREEXISTING_RUN_DIRS[str(run_dir.resolve())] = _hydra_files(run_dir)
        if not config.trainer.dry_run:
            from readback.train.checkpoint import check_not_held, resume_plan

            check_not_held(run_dir, config.trainer.lock_lease_s)  # before Hydra writes its files there
            resume_plan(run_dir, config, quiet=True)


def _hydra_files(run_dir: Path) -> dict[str, bytes]:
    hydra_dir = run_dir / ".hydra"
    if not hydra_dir.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in hydra_dir.iterdir() if p.is_file()}


def undo_run_dir(run_dir: Path, hydra_files: set[str]) -> None:
    """After a refusal, the run directory as it was before this job: removed if the job made it
    (it holds nothing but ``hydra_files``, the names of Hydra's own files, and held nothing
    before), else with the Hydra config files it held put back. Every rank of a run refused at
    once does this, on one shared file system: a directory another rank removed first stays so."""
    if run_dir.is_dir() and str(run_dir.resolve()) not in PREEXISTING_RUN_DIRS:
        try:
            names = {p.name for p in run_dir.iterdir()}
        except FileNotFoundError:  # another rank removed it between the two looks
            return
        if names <= hydra_files:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
    _restore_hydra_files(run_dir)


def _restore_hydra_files(run_dir: Path) -> None:
    """Put back the Hydra config files a run directory held before this process started: a failed
    attempt to resume it must not leave its own config there as the run's."""
    saved = PREEXISTING_RUN_DIRS.get(str(Path(run_dir).resolve()))
    if not saved:
        return
    for name, data in saved.items():
        with contextlib.suppress(OSError):
            (Path(run_dir) / ".hydra" / name).write_bytes(data)


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
