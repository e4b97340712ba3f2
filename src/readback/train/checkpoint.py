"""Checkpoint directories: ``run_dir/checkpoints/step_XXXXXXX/``, atomic commit, newest-readable
resume, pruning. What a checkpoint holds is :mod:`checkpoint_manager`'s; how it is written and
read (sharded, through ``torch.distributed.checkpoint``) :mod:`dcp_io`'s.

Every rank writes its shards into ``.step_XXXXXXX.tmp/``; when all are written and the index too,
rank 0 renames that directory onto its final name (:func:`commit_checkpoint`), so a crash at any
moment leaves either the previous checkpoint set or the new one, never a partial directory under
a checkpoint name. The temporary directory of a save that a ``SIGKILL`` interrupted is removed
when the run resumes (:func:`remove_stale_temp_files`). Other files (``summary.json``,
``metrics.jsonl``) are written to a temporary name and ``os.replace``-d (:mod:`atomic_files`).

:func:`resume_plan` decides, from a run directory and a config, where a run starts: the newest
intact and readable checkpoint (``trainer.resume=true``), step 0 (an empty run directory), or a
``ConfigError`` (checkpoints that cannot be resumed, or would be overwritten). ``train.py`` asks it
before Hydra touches the run directory, the trainer again when it starts. Each checkpoint it
considers is verified first (:mod:`checkpoint_verify`: sizes against the index, checksums against
what the ranks recorded); a damaged one is moved aside to ``step_XXXXXXX.damaged`` with a warning,
and the next older one tried. Pruning (``keep_last``) counts intact checkpoints only.

Loading runs no code (:mod:`dcp_io`): a checkpoint that would need to unpickle anything but
tensors and plain containers is refused with one line.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.train import checkpoint_verify, dcp_io
from readback.train.atomic_files import fsync_dir
from readback.train.checkpoint_verify import Damaged, has_all_bytes, move_aside, moved_aside
from readback.train.settings import Config, plain_config

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 3  # 3: a sharded DCP directory (2: one weights_only file of full state dicts)
_NAME = re.compile(r"^step_(\d+)$")
_LEGACY = "step_*.pt"  # format 2's single files
_TEMP = re.compile(r"^\.(step_\d+\.tmp|(summary\.json|metrics\.jsonl)\..+\.tmp)$")  # interrupted writes
# Keys a checkpoint can only be resumed under with the value it was trained with.
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


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{int(step):07d}"


def temp_checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    """Where the ranks write the checkpoint of ``step`` before :func:`commit_checkpoint`."""
    return Path(ckpt_dir) / f".step_{int(step):07d}.tmp"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint directory (its index written)."""
    return (Path(path) / dcp_io.INDEX).is_file()


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint in ``ckpt_dir``, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def newest_intact(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint in ``ckpt_dir`` with all its bytes; nothing is moved."""
    return next((p for _, p in reversed(list_checkpoints(ckpt_dir)) if has_all_bytes(p, move_damaged=False)), None)


def prune_checkpoints(ckpt_dir: Path, keep_last: int | None) -> list[Path]:
    """Delete all but the newest ``keep_last`` intact checkpoints (``None`` or ``<= 0`` keeps all).
    A damaged one is moved aside, one that cannot be checked now kept; neither is counted."""
    if keep_last is None or keep_last <= 0:
        return []
    intact = [p for _, p in reversed(list_checkpoints(ckpt_dir)) if has_all_bytes(p, move_damaged=True)]
    removed = []
    for p in intact[int(keep_last) :]:
        try:
            shutil.rmtree(p)
            removed.append(p)
        except OSError as e:  # pragma: no cover - a concurrent delete
            log.warning("could not remove old checkpoint %s: %s", p, e)
    return removed


def commit_checkpoint(ckpt_dir: Path, step: int, keep_last: int | None = None) -> Path:
    """Rename the written checkpoint of ``step`` onto its final name, then prune to ``keep_last``.
    Called by one process, after every rank's shards and the index are written."""
    tmp, path = temp_checkpoint_path(ckpt_dir, step), checkpoint_path(ckpt_dir, step)
    if not is_checkpoint(tmp):
        raise FileNotFoundError(f"{tmp} holds no complete checkpoint (no {dcp_io.INDEX})")
    if path.exists():  # one of the same step whose shared state did not load, which resume skipped
        move_aside(path, f"its shared state did not load; step {step} was saved again")
    os.rename(tmp, path)
    fsync_dir(path.parent)
    prune_checkpoints(ckpt_dir, keep_last)
    return path


def save_checkpoint(state: dict[str, Any], ckpt_dir: Path, step: int, keep_last: int | None = None) -> Path:
    """Write ``state`` (a DCP state dict) from this process alone as the checkpoint of ``step``."""
    dcp_io.save(state, temp_checkpoint_path(ckpt_dir, step), distributed=False)
    return commit_checkpoint(ckpt_dir, step, keep_last)


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete what writes a crash interrupted (``.step_*.tmp/``, ``.summary.json.*.tmp``, ...)."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if _TEMP.match(p.name):
                try:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
                    removed.append(p)
                except OSError:  # pragma: no cover - a concurrent delete
                    pass
    return removed


def read_shared(path: Path) -> dict[str, Any]:
    """A checkpoint's shared state (format, step, world size, config, ...) without its tensors."""
    state = dcp_io.unpack(dcp_io.read(path, keys={"shared"})["shared"], path)
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} is not a readback checkpoint")
    return state


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A whole checkpoint, unsharded, in this process: its shared state, ``model`` and
    ``optimizer`` (full state dicts keyed by parameter name) and ``ranks`` (each rank's state).
    Read without running code: a crafted checkpoint raises a one-line ``ConfigError``."""
    state = dcp_io.read(path)
    shared = dcp_io.unpack(state.pop("shared"), path)
    ranks = [dcp_io.unpack(state.pop(f"rank{r}"), path) for r in range(shared["world_size"])]
    return {**shared, **state, "ranks": ranks}


def load_latest_checkpoint(
    ckpt_dir: Path, quiet: bool = False, *, move_damaged: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint whose shared state loads (:func:`read_shared`). A damaged one
    (:func:`checkpoint_verify.verify`) is moved aside (``move_damaged``; else named in a warning)
    and skipped, an unreadable one skipped with a warning. ``quiet``, the entry point's look
    ahead (on every rank of a launch, before the run's log exists): sizes checked, not checksums
    (the run's own resume reads those, once), nothing moved or logged. An I/O error that
    outlasts the retries is raised (``OSError``): nothing is moved for it."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        try:
            checkpoint_verify.verify(path, checksums=not quiet)
        except Damaged as e:
            if quiet:
                continue
            if move_damaged:
                move_aside(path, str(e))
            else:
                log.warning("skipping damaged checkpoint %s (step %d): %s", path, step, e)
            continue
        try:
            return path, read_shared(path)
        except ConfigError:  # refused as unsafe: never skipped for an older one
            raise
        except Exception as e:
            if not quiet:
                log.warning("skipping unreadable checkpoint %s (step %d): %s", path, step, e)
    return None


def config_mismatch(saved_config: Mapping[str, Any] | None, cfg: Config) -> tuple[str, Any, Any] | None:
    """The first of :data:`ARCHITECTURE_KEYS` whose value in ``cfg`` differs from the one the
    checkpoint was trained with: ``(key, now, saved)``, or ``None``. Keys unset on either side
    (``model.vocab_size: null`` takes the data's) are not compared."""
    if not isinstance(saved_config, Mapping):
        return None
    now_config = plain_config(cfg)
    for key in ARCHITECTURE_KEYS:
        now, was = _dotted(now_config, key), _dotted(saved_config, key)
        if now is not None and was is not None and now != was:
            return key, now, was
    return None


def _dotted(config: Mapping[str, Any], key: str) -> Any:
    """``config``'s value at the dotted ``key``; ``None`` where a part is missing."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def resume_plan(run_dir: Path, cfg: Config, *, quiet: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """Where a run in ``run_dir`` starts: ``(path, shared state)`` of the checkpoint to resume
    from, or ``None`` for step 0. Raises ``ConfigError`` when

    * the run directory holds checkpoints but ``trainer.resume`` is false (they would be
      overwritten) -- unless this is a requeued Slurm job, which resumes;
    * ``trainer.resume`` is true and none of its checkpoints loads;
    * the newest readable checkpoint has another format than :data:`CHECKPOINT_FORMAT`, or was
      trained with another model (:func:`config_mismatch`).
    """
    from readback.train.preemption import requeued

    ckpt_dir = checkpoint_dir(run_dir)
    found = list_checkpoints(ckpt_dir)
    legacy = sorted(ckpt_dir.glob(_LEGACY)) if ckpt_dir.is_dir() else []
    if legacy and not found:
        raise ConfigError(
            "trainer.resume",
            cfg.trainer.resume,
            f"a checkpoint of format {CHECKPOINT_FORMAT}; {legacy[-1]} is a single file of format 2 "
            f"(resume it with the readback that wrote it, or use a new hydra.run.dir)",
        )
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
    if not resume and requeued():
        log.warning(
            "requeued job (SLURM_RESTART_COUNT=%s): resuming from %s", os.environ["SLURM_RESTART_COUNT"], ckpt_dir
        )
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
    path, state = latest
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(
            "trainer.resume",
            True,
            f"a checkpoint of format {CHECKPOINT_FORMAT}; {path} has format "
            f"{state.get('format')!r} (resume it with the readback that wrote it)",
        )
    mismatch = config_mismatch(state.get("config"), cfg)
    if mismatch is not None:
        key, now, was = mismatch
        raise ConfigError(key, now, f"{was!r}, the value {path} was trained with (or a new hydra.run.dir)")
    return path, state
