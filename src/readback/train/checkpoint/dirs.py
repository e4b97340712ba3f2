"""A run's checkpoints, ``run_dir/checkpoints/step_XXXXXXX/``: committed all at once, verified
before use, moved aside when damaged, pruned (where a run resumes is :mod:`resumption`'s).

The ranks write a checkpoint into ``.step_XXXXXXX.tmp/``; rank 0 renames it onto its name once
all shards and the index are written (:func:`commit_checkpoint`), so a crash leaves the previous
checkpoint set or the new one, never a part under a checkpoint name.

Damage (:class:`Damaged`): an empty directory; an index (``.metadata``) missing, unreadable or
not DCP's; a shard file shorter than the index needs (a deleted one: 0 bytes); a shard whose size
or CRC-32 differs from what its rank recorded, or that no record names; a garbled record. A
damaged checkpoint is renamed ``step_XXXXXXX.damaged`` (:func:`move_aside`), never deleted, and
the next older one tried; pruning counts intact ones only. A checkpoint set aside for another
reason (:func:`set_aside`: newer than a log behind it, rewound) is kept the same way. An I/O
error (``EIO``, ``ESTALE``) says nothing about the files: :func:`verify` tries again, then raises
it, moving nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from readback.errors import ConfigError
from readback.train.checkpoint import io as checkpoint_io
from readback.train.checkpoint.atomic import fsync_dir
from readback.train.checkpoint.io import CHECKSUM, INDEX

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 3  # a sharded DCP directory
_NAME = re.compile(r"^step_(\d+)$")
# what interrupted writes leave: a save, a pruning, a small file's write, a claim of the run directory
_TEMP = re.compile(
    r"^\.(step_\d+\.(tmp|pruned)|(summary\.json|metrics\.jsonl|launch\.json)\..+\.tmp|writer\.lock\..+\.(tmp|gone))$"
)
RETRY_DELAYS_S = (0.2, 1.0)  # the waits between the tries of a verification an I/O error stopped


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{int(step):07d}"


def temp_checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    """Where the ranks write the checkpoint of ``step`` before :func:`commit_checkpoint`."""
    return Path(ckpt_dir) / f".step_{int(step):07d}.tmp"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint directory (its index written)."""
    return (Path(path) / INDEX).is_file()


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every committed checkpoint in ``ckpt_dir``, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(m, p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted((int(m.group(1)), p) for m, p in found)


class Damaged(Exception):
    """A checkpoint whose files are not what was written; the message says what differs."""


def verify(path: Path, *, checksums: bool = True) -> None:
    """Raise :class:`Damaged` unless the checkpoint at ``path`` is intact; ``checksums=False``
    checks sizes only (no file read but the index and the checksums). A transient ``OSError`` is
    retried (:data:`RETRY_DELAYS_S`), then raised; any other ``OSError`` is raised at once."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return _verify(Path(path), checksums)
        except OSError as e:
            if e.errno not in (errno.EIO, errno.ESTALE) or delay is None:
                raise
            log.warning("reading checkpoint %s: %s; trying again in %.1f s", path, e, delay)
            time.sleep(delay)


def _verify(path: Path, checksums: bool) -> None:
    if not any(path.iterdir()):
        raise Damaged("the directory is empty")
    needed = _needed_sizes(path)
    try:
        recorded = checkpoint_io.read_checksums(path)
    except ValueError as e:
        raise Damaged(f"unreadable checksums ({e})") from e
    for name, need in sorted(needed.items()):
        if (size := _size(path / name)) < need:
            raise Damaged(f"{name} is {size} bytes, its index needs {need}")
    if unrecorded := sorted(needed.keys() - recorded.keys()):
        raise Damaged(f"{unrecorded[0]} has no recorded checksum")
    for name, entry in sorted(recorded.items()):
        if (size := _size(path / name)) != entry["size"]:
            raise Damaged(f"{name} is {size} bytes, {entry['size']} were written")
        if checksums and (crc := checkpoint_io.crc32_of(path / name)) != entry[CHECKSUM]:
            raise Damaged(f"{name} has CRC-32 {crc:08x}, {entry[CHECKSUM]:08x} was written")


def _needed_sizes(path: Path) -> dict[str, int]:
    """``{shard file: the bytes the index reads of it}`` (the largest offset + length)."""
    try:
        index = checkpoint_io.read_index(path)
    except FileNotFoundError as e:
        raise Damaged(f"no index ({INDEX})") from e
    except (OSError, ConfigError):
        raise
    except Exception as e:  # whatever a garbled pickle raises
        raise Damaged(f"unreadable index ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from e
    needed: dict[str, int] = {}
    try:
        for info in index.storage_data.values():
            end = int(info.offset) + int(info.length)
            needed[str(info.relative_path)] = max(end, needed.get(str(info.relative_path), 0))
    except (AttributeError, TypeError, ValueError) as e:
        raise Damaged(f"the index is not DCP's (a {type(index).__name__}: {e})") from e
    return needed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def set_aside(path: Path, suffix: str) -> Path:
    """Rename the checkpoint ``path`` to ``<name>.<suffix>`` (``.<suffix>.2``, ... if taken):
    out of every resume's and pruning's sight, its files never deleted or overwritten."""
    path = Path(path)
    target, n = path.with_name(f"{path.name}.{suffix}"), 2
    while target.exists():
        target, n = path.with_name(f"{path.name}.{suffix}.{n}"), n + 1
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def move_aside(path: Path, reason: str) -> Path:
    """Set the damaged checkpoint ``path`` aside as ``<name>.damaged``, with one warning line
    naming it and ``reason``."""
    target = set_aside(path, "damaged")
    log.warning("checkpoint %s is damaged (%s): moved aside to %s", path, reason, target.name)
    return target


def moved_aside(ckpt_dir: Path) -> list[Path]:
    """The checkpoints in ``ckpt_dir`` that :func:`move_aside` renamed."""
    return sorted(Path(ckpt_dir).glob("step_*.damaged*")) if Path(ckpt_dir).is_dir() else []


def _has_all_bytes(path: Path) -> bool:
    """Whether the checkpoint at ``path`` passes :func:`verify` without checksums (no shard read).
    A damaged one is moved aside; one that cannot be read now is left where it is, with a warning."""
    try:
        verify(path, checksums=False)
        return True
    except Damaged as e:
        move_aside(path, str(e))
    except (OSError, ConfigError) as e:
        log.warning("could not check checkpoint %s: %s", path, e)
    return False


def commit_checkpoint(ckpt_dir: Path, step: int, keep_last: int | None = None) -> Path:
    """Rename the written checkpoint of ``step`` onto its final name, then delete all but the
    newest ``keep_last`` intact ones (``None`` or ``<= 0`` keeps all; a damaged one is moved aside,
    one that cannot be checked now kept, neither counted). Called by one process, after every
    rank's shards and the index are written."""
    tmp, path = temp_checkpoint_path(ckpt_dir, step), checkpoint_path(ckpt_dir, step)
    if not is_checkpoint(tmp):
        raise FileNotFoundError(f"{tmp} holds no complete checkpoint (no {INDEX})")
    if path.exists():  # one of the same step whose shared state did not load, which resume skipped
        move_aside(path, f"its shared state did not load; step {step} was saved again")
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if keep_last is not None and keep_last > 0:
        for old in [p for _, p in reversed(list_checkpoints(ckpt_dir)) if _has_all_bytes(p)][keep_last:]:
            try:  # renamed first: a kill in the removal leaves no part of it under a checkpoint's name
                doomed = old.with_name(f".{old.name}.pruned")
                os.rename(old, doomed)
                shutil.rmtree(doomed)
            except OSError as e:  # pragma: no cover - a concurrent delete
                log.warning("could not remove old checkpoint %s: %s", old, e)
    return path


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete what writes a crash interrupted (``.step_*.tmp/``, ``.step_*.pruned/``,
    ``.summary.json.*.tmp``, ...)."""
    directory = Path(directory)
    removed = []
    for p in directory.iterdir() if directory.is_dir() else ():
        if _TEMP.match(p.name):
            try:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(p)
            except OSError:  # pragma: no cover - a concurrent delete
                pass
    return removed


def load_latest_checkpoint(
    ckpt_dir: Path, quiet: bool = False, *, move_damaged: bool = True, up_to: int | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint (of a step ``up_to`` at most, if given) and its shared state
    (format, step, world size, config, ...), if that loads. A damaged one (:func:`verify`) is
    moved aside (``move_damaged``; else named in a warning) and skipped, an unreadable one
    skipped with a warning. ``quiet``, the entry point's
    look ahead (on every rank of a launch, before the run's log exists): sizes checked, not
    checksums (the run's own resume reads those, once), nothing moved or logged. An I/O error
    that outlasts the retries is raised (``OSError``): nothing is moved for it."""
    for step, path in reversed(list_checkpoints(ckpt_dir)):
        if up_to is not None and step > up_to:
            continue
        try:
            verify(path, checksums=not quiet)
        except Damaged as e:
            if move_damaged and not quiet:
                move_aside(path, str(e))
            elif not quiet:
                log.warning("skipping damaged checkpoint %s (step %d): %s", path, step, e)
            continue
        try:
            shared = checkpoint_io.unpack(checkpoint_io.read(path, keys={"shared"})["shared"], path)
            if not isinstance(shared, dict) or "step" not in shared:
                raise ValueError(f"{path} is not a readback checkpoint")
            return path, shared
        except ConfigError:  # refused as unsafe: never skipped for an older one
            raise
        except Exception as e:
            if not quiet:
                log.warning("skipping unreadable checkpoint %s (step %d): %s", path, step, e)
    return None


def newest_intact(ckpt_dir: Path) -> str:
    """``<path>, which trainer.resume=true continues from``, or ``none``: what a run that a file
    system error stopped leaves to resume from, as its one-line error says (nothing moved, logged
    or read beyond sizes)."""
    try:
        newest = load_latest_checkpoint(ckpt_dir, quiet=True)
    except (OSError, ConfigError):
        newest = None
    return f"{newest[0]}, which trainer.resume=true continues from" if newest else "none"


def refuse_non_file(path: Path) -> None:
    """``ConfigError`` (one line) unless ``path``, one of the run directory's files, is absent or a
    regular file: a directory, a dangling link or a pipe (whose read would hang) in its place."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_file():
        raise ConfigError(
            "hydra.run.dir",
            str(path.parent),
            f"a run directory whose {path.name} is a file: {path} is not (move it away)",
        )
