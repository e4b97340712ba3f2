"""On-disk cache for built data (tokenizers, token arrays) that several processes may share.

Every rank of a ``torchrun`` job calls ``build_data`` at the same moment, so the first build
must happen once and nobody may ever read a half-written file:

* builders run under :func:`build_lock` (an OS file lock, released even if the process dies),
  and re-check the cache after taking it, so the other ranks wait and then load;
* files are written by :func:`atomic_write` (temporary file in the same directory, then
  ``os.replace``), so a reader that skips the lock sees either nothing or the whole file.

A cached file can still be wrong (cut short by a copy or a full disk, written by another
version, edited): :func:`check_token_index` and :func:`check_token_ids` refuse token ids that a
run could not train on, naming the file, before the first step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
from filelock import FileLock

from readback.errors import ConfigError

DEFAULT_CACHE = "~/.cache/readback"
CACHE_ENV = "READBACK_CACHE"


def cache_root(cache_dir: str | None) -> Path:
    """The cache directory: ``data.cache_dir`` if set, else ``$READBACK_CACHE``, else the default."""
    root = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(os.path.expandvars(os.path.expanduser(str(root))))


def digest(parts: Iterable[bytes | str | Path]) -> str:
    """A short hex key for cache directory names (sha256 of the parts, separated); a ``Path``
    stands for its file's contents, read a MB at a time (a corpus of any size)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        else:
            h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def unwritable_cache(directory: Path, error: OSError) -> ConfigError:
    """The one line for a cache that cannot be written: no permission, a full disk, a parent that
    is a file."""
    where, why = error.filename or directory, error.strerror or str(error)
    return ConfigError(
        "data.cache_dir", str(directory), f"a cache directory this run can write ({where}: {why}); set another"
    )


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` while building what goes into it."""
    lock = FileLock(str(directory / ".build.lock"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as e:
        raise unwritable_cache(directory, e) from None
    try:
        yield
    finally:
        lock.release()


def atomic_write(
    path: Path, write: Callable[[BinaryIO], None] | Callable[[str], None], *, by_name: bool = False
) -> None:
    """Create ``path`` all at once: ``write`` fills a temporary sibling, then it is renamed.

    ``write`` receives an open binary file, or (``by_name=True``) the temporary file's name for
    writers that only take a path, such as ``tokenizers.Tokenizer.save``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if by_name:
            write(str(tmp))  # type: ignore[arg-type]
        else:
            with open(tmp, "wb") as f:
                write(f)  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise unwritable_cache(path.parent, e) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def bad_cache_file(path: Path, what: str) -> ConfigError:
    """The one-line refusal of a cached file: which one, what is wrong with it, and the fix."""
    return ConfigError(
        "data.cache_dir", str(path), f"a cache file this run can read, and {what}; delete it to rebuild it"
    )


def check_token_index(path: Path, offsets: np.ndarray, block_doc: np.ndarray, n_ids: int) -> None:
    """Refuse, naming ``path``, a block index a run cannot read ``n_ids`` cached ids by: ``offsets``
    (block ``i`` is ``ids[offsets[i]:offsets[i+1]]``) and ``block_doc`` (each block's document),
    integer arrays of one dimension; offsets that start at 0, never decrease and end at ``n_ids``
    (fewer ids: cut short)."""
    for name, array in (("offsets", offsets), ("block_doc", block_doc)):
        _check_integers(path, name, array)
    if len(offsets) != len(block_doc) + 1 or offsets[0] != 0 or bool(np.any(np.diff(offsets) < 0)):
        what = f"its {len(offsets)} offsets do not index its {len(block_doc)} blocks from 0 in order"
        raise bad_cache_file(path, f"{what}: not a token file of this version")
    if offsets[-1] != n_ids:
        raise bad_cache_file(path, f"it is truncated: it holds {n_ids} token ids, its offsets count {offsets[-1]}")


def check_token_ids(path: Path, ids: np.ndarray, vocab_size: int, first: int = 0) -> None:
    """Refuse, naming ``path``, cached token ids a run cannot train on, ``ids`` being those from
    position ``first`` (a file checked a piece at a time): integers (a float cache, a NaN
    included, is refused by its dtype before any comparison), one dimension, every id in
    ``[0, vocab_size)`` (an embedding lookup fails on a negative id and reads another token for
    one beyond)."""
    _check_integers(path, "ids", ids)
    if not len(ids):
        return
    if (low := int(ids.min())) < 0:
        raise bad_cache_file(path, f"token {first + int(np.argmin(ids))} is id {low}, negative")
    if (top := int(ids.max())) >= vocab_size:
        where = first + int(np.argmax(ids))
        raise bad_cache_file(path, f"token {where} is id {top}, outside the vocabulary of {vocab_size} ids")


def _check_integers(path: Path, name: str, array: np.ndarray) -> None:
    if not np.issubdtype(array.dtype, np.integer):
        raise bad_cache_file(path, f"its {name} are {array.dtype}, not integers: not a token file of this version")
    if array.ndim != 1:
        raise bad_cache_file(path, f"its {name} have shape {array.shape}, not one dimension")
