"""Whether a committed checkpoint still holds what was written, checked before it is used.

Damage (:class:`Damaged`): an empty directory; an index (``.metadata``) missing, unreadable or
not DCP's; a shard file shorter than the index's largest offset + length in it (a missing file:
0 bytes); a shard whose size or CRC-32 differs from what its rank recorded at save time
(:mod:`shard_manifest`), or a garbled record. A checkpoint written before the records existed
has its sizes checked against the index only. :func:`move_aside` renames a damaged checkpoint
to ``step_XXXXXXX.damaged``: it is never deleted, and ``list_checkpoints`` no longer sees it.

No damage: an I/O error (``EIO``, ``ESTALE``: a failing disk, a stale NFS handle) says nothing
about the files, so :func:`verify` tries again and then raises it, the checkpoint left where it
is; an index that names code is refused (``ConfigError``), as everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from readback.errors import ConfigError
from readback.train import dcp_io, shard_manifest
from readback.train.atomic_files import fsync_dir

log = logging.getLogger(__name__)

TRANSIENT = frozenset({errno.EIO, errno.ESTALE})
RETRY_DELAYS_S = (0.2, 1.0)  # the waits between the tries of a verification an I/O error stopped


class Damaged(Exception):
    """A checkpoint whose files are not what was written; the message says what differs."""


def verify(path: Path, *, checksums: bool = True) -> None:
    """Raise :class:`Damaged` unless the checkpoint at ``path`` is intact; ``checksums=False``
    checks sizes only (no file read but the index and the records). A transient ``OSError`` is
    retried (:data:`RETRY_DELAYS_S`), then raised; any other ``OSError`` is raised at once."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            return _verify(Path(path), checksums)
        except OSError as e:
            if e.errno not in TRANSIENT or delay is None:
                raise
            log.warning("reading checkpoint %s: %s; trying again in %.1f s", path, e, delay)
            time.sleep(delay)


def _verify(path: Path, checksums: bool) -> None:
    if not any(path.iterdir()):
        raise Damaged("the directory is empty")
    needed = _needed_sizes(path)
    try:
        recorded = shard_manifest.read(path)
    except ValueError as e:
        raise Damaged(f"unreadable checksums ({e})") from e
    for name, need in sorted(needed.items()):
        size = _size(path / name)
        if size < need:
            raise Damaged(f"{name} is {size} bytes, its index needs {need}")
    if recorded is None:  # written before checksums: the sizes are all there is to check
        return
    unrecorded = sorted(needed.keys() - recorded.keys())
    if unrecorded:
        raise Damaged(f"{unrecorded[0]} has no recorded checksum")
    for name, entry in sorted(recorded.items()):
        size = _size(path / name)
        if size != entry["size"]:
            raise Damaged(f"{name} is {size} bytes, {entry['size']} were written")
        if checksums and (crc := shard_manifest.crc32_of(path / name)) != entry[shard_manifest.ALGORITHM]:
            raise Damaged(f"{name} has CRC-32 {crc:08x}, {entry[shard_manifest.ALGORITHM]:08x} was written")


def _needed_sizes(path: Path) -> dict[str, int]:
    """``{shard file: the bytes the index reads of it}`` (the largest offset + length)."""
    try:
        index = dcp_io.read_index(path)
    except FileNotFoundError as e:
        raise Damaged(f"no index ({dcp_io.INDEX})") from e
    except (OSError, ConfigError):
        raise
    except Exception as e:  # whatever a garbled pickle raises
        raise Damaged(f"unreadable index ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from e
    storage = getattr(index, "storage_data", None)
    if not isinstance(storage, dict):
        raise Damaged(f"the index is not DCP's (a {type(index).__name__})")
    needed: dict[str, int] = {}
    try:
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[str(info.relative_path)] = max(end, needed.get(str(info.relative_path), 0))
    except (AttributeError, TypeError, ValueError) as e:
        raise Damaged(f"the index is not DCP's ({e})") from e
    return needed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def move_aside(path: Path, reason: str) -> Path:
    """Rename the damaged checkpoint ``path`` to ``<name>.damaged`` (``.damaged.2``, ... if
    taken), with one warning line naming it and ``reason``."""
    path = Path(path)
    target, n = path.with_name(f"{path.name}.damaged"), 2
    while target.exists():
        target, n = path.with_name(f"{path.name}.damaged.{n}"), n + 1
    os.rename(path, target)
    fsync_dir(path.parent)
    log.warning("checkpoint %s is damaged (%s): moved aside to %s", path, reason, target.name)
    return target


def moved_aside(ckpt_dir: Path) -> list[Path]:
    """The checkpoints in ``ckpt_dir`` that :func:`move_aside` renamed."""
    return sorted(Path(ckpt_dir).glob("step_*.damaged*")) if Path(ckpt_dir).is_dir() else []


def has_all_bytes(path: Path, *, move_damaged: bool) -> bool:
    """Whether the checkpoint at ``path`` passes :func:`verify` without checksums (no shard
    read). A damaged one is moved aside if ``move_damaged``; one that cannot be read now is
    left where it is, with a warning."""
    try:
        verify(path, checksums=False)
        return True
    except Damaged as e:
        if move_damaged:
            move_aside(path, str(e))
    except (OSError, ConfigError) as e:
        log.warning("could not check checkpoint %s: %s", path, e)
    return False
