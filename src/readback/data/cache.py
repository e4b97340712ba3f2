"""On-disk cache for built data (tokenizers, token arrays) that several processes may share.

Every rank of a ``torchrun`` job calls ``build_data`` at the same moment, so the first build
must happen once and nobody may ever read a half-written file:

* builders run under :func:`build_lock` (an OS file lock, released even if the process dies),
  and re-check the cache after taking it, so the other ranks wait and then load;
* files are written by :func:`atomic_write` (temporary file in the same directory, then
  ``os.replace``), so a reader that skips the lock sees either nothing or the whole file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock

DEFAULT_CACHE = "~/.cache/readback"
CACHE_ENV = "READBACK_CACHE"


def cache_root(cache_dir: str | None) -> Path:
    """The cache directory: ``data.cache_dir`` if set, else ``$READBACK_CACHE``, else the default."""
    root = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(os.path.expandvars(os.path.expanduser(str(root))))


def digest(parts: Iterable[bytes | str]) -> str:
    """A short hex key for cache directory names (sha256 of the parts, separated)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` while building what goes into it."""
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / ".build.lock")):
        yield


def atomic_write(
    path: Path, write: Callable[[BinaryIO], None] | Callable[[str], None], *, by_name: bool = False
) -> None:
    """Create ``path`` all at once: ``write`` fills a temporary sibling, then it is renamed.

    ``write`` receives an open binary file, or (``by_name=True``) the temporary file's name for
    writers that only take a path, such as ``tokenizers.Tokenizer.save``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if by_name:
            write(str(tmp))  # type: ignore[arg-type]
        else:
            with open(tmp, "wb") as f:
                write(f)  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
