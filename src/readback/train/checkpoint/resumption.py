"""Where a run in a run directory starts: from step 0, or from its newest intact checkpoint, under
the config that checkpoint was trained with.

A resume continues the run the checkpoints hold, so a config that changes what the run computes
(another model size, policy, recipe, learning rate, seed, data, number of steps, ...:
:func:`~readback.train.settings.config_changes`) is refused, in one line naming each changed key
with its old and new value, before anything is written. ``trainer.resume_changed_config=true``
resumes anyway with the new values (a warning lists them), except where the model's shape changed
(:data:`~readback.train.settings.ARCHITECTURE_KEYS`): those checkpoints cannot load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.train.checkpoint.dirs import (
    CHECKPOINT_FORMAT,
    checkpoint_dir,
    list_checkpoints,
    load_latest_checkpoint,
    moved_aside,
)
from readback.train.checkpoint.log_gap import rewind_plan, set_aside_after_gap
from readback.train.preemption import requeued
from readback.train.settings import ARCHITECTURE_KEYS, Config, config_changes

log = logging.getLogger(__name__)
_SHOWN = 6  # changed keys a refusal lists


def resume_plan(run_dir: Path, cfg: Config, *, quiet: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """Where a run in ``run_dir`` starts: ``(path, shared state)`` of the checkpoint to resume
    from, or ``None`` for step 0. Raises ``ConfigError`` when

    * the run directory holds checkpoints but ``trainer.resume`` is false (they would be
      overwritten) -- unless this is a requeued Slurm job or a torchrun restart, which resumes;
    * ``trainer.resume`` is true and none of its checkpoints loads;
    * the newest readable checkpoint has another format than :data:`CHECKPOINT_FORMAT`, or was
      trained under another config (:func:`check_changes`);
    * ``trainer.log_gap`` is ``rewind``, the log lacks records of that checkpoint, and no
      checkpoint the log covers is left (:mod:`~readback.train.checkpoint.log_gap`), which
      otherwise is the one to resume from, the newer ones set aside once every check passed.
    """
    ckpt_dir = checkpoint_dir(run_dir)
    found = list_checkpoints(ckpt_dir)
    if not found and moved_aside(ckpt_dir):
        raise ConfigError(
            "trainer.resume",
            cfg.trainer.resume,
            f"a run directory with an intact checkpoint, or a new hydra.run.dir: {ckpt_dir} holds only "
            f"damaged ones, moved aside ({', '.join(p.name for p in moved_aside(ckpt_dir))})",
        )
    if not found:
        return None
    resume = cfg.trainer.resume
    restarted = requeued()
    if not resume and restarted:
        log.warning("job started again (%s): resuming from %s", restarted, ckpt_dir)
        resume = True
    if not resume:
        raise ConfigError(
            "trainer.resume",
            False,
            f"true to continue the run in {run_dir} (it holds {len(found)} "
            f"checkpoint(s), up to step {found[-1][0]}), or a new hydra.run.dir",
        )
    try:
        latest = load_latest_checkpoint(ckpt_dir, quiet=quiet)
    except OSError as e:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a checkpoint that can be read; reading those in {ckpt_dir} failed, retried too ({e}); "
            f"nothing was moved (an I/O error is no sign of damage): resume once the file system answers",
        ) from e
    if latest is None:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a run directory with an intact, readable checkpoint: none of the "
            f"{len(found)} in {ckpt_dir} is (remove them, and any step_*.damaged, to start afresh)",
        )
    newer: list[Path] = []
    if cfg.trainer.log_gap == "rewind":
        latest, newer, gap = rewind_plan(run_dir, latest, quiet=quiet)
    path, state = latest
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a checkpoint of format {CHECKPOINT_FORMAT}; {path} has format "
            f"{state.get('format')!r} (resume it with the readback that wrote it)",
        )
    check_changes(config_changes(state.get("config"), cfg), path, cfg.trainer.resume_changed_config)
    if newer and not quiet:
        set_aside_after_gap(newer, path, gap)
    return path, state


def check_changes(changes: list[tuple[str, Any, Any]], path: Path, go_on: bool) -> None:
    """Refuse a resume under ``changes`` (``(key, saved, now)``, from the checkpoint ``path``) in
    one line; with ``go_on`` (``trainer.resume_changed_config``) only a change of the model's
    shape, with a warning listing the others."""
    if not changes:
        return
    listed = "; ".join(f"{k} {was!r} -> {now!r}" for k, was, now in changes[:_SHOWN])
    listed += f"; ... ({len(changes)} keys in all)" if len(changes) > _SHOWN else ""
    key, was, now = changes[0]
    if key in ARCHITECTURE_KEYS:
        fix = "the model's shape cannot change under a checkpoint: set it back or use a new hydra.run.dir"
    elif go_on:
        log.warning("resuming %s under a changed config (trainer.resume_changed_config=true): %s", path, listed)
        return
    else:
        fix = "set it back, or trainer.resume_changed_config=true to go on with the new values, or a new hydra.run.dir"
    raise ConfigError(key, now, f"{was!r}, the value {path} was trained with (changed: {listed}); {fix}")
