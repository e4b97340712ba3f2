"""A checkpoint's files, written and read: sharded through ``torch.distributed.checkpoint`` (DCP),
each rank's checksums beside its shards, nothing unpickled that could run code.

A checkpoint is a DCP directory: every rank writes its shards (``__<rank>_0.distcp``) and their
sizes and CRC-32s (``__<rank>_checksums.json``), the coordinator the index (``.metadata``) once all
shards are written. Tensors (model, optimizer) are DCP items, resharded on load to any world size;
other state travels as blobs (:func:`pack`: ``torch.save``-d into a uint8 tensor, one item).

DCP alone would unpickle its index with ``pickle.load`` and its other items with
``torch.load(weights_only=False)``: a crafted checkpoint could run code on resume. Here the index
goes through an unpickler that knows only DCP's metadata classes, items and blobs load with
``weights_only=True``, and anything else is refused with one line (:func:`refuse`).

zlib's CRC-32 catches what damage does to a file (cut short, overwritten, flipped bits) at about
4 GB/s, 2.5 times SHA-256's speed, so a resume waits seconds for it, not minutes. It is no defence
against a forged checkpoint (with checksums to match); loading without running code is.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import platform
import sys
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from readback.errors import ConfigError
from readback.train.checkpoint.atomic import atomic_write_text

# without a process group DCP warns on every call that it assumes one process: so it does
warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent is to")

INDEX = ".metadata"  # DCP's index, written last: a directory without it holds no checkpoint
CHECKSUM = "crc32"
_CHECKSUMS = "checksums.json"  # each rank's: __<rank>_checksums.json
_CHUNK = 8 << 20
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata",)
_INDEX_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_checksums(directory: Path) -> dict[str, dict[str, int]]:
    """Every rank's checksums in ``directory`` merged, ``{file: {"size": n, "crc32": c}}``;
    ``ValueError``: a garbled one."""
    found: dict[str, dict[str, int]] = {}
    for path in sorted(Path(directory).glob(f"__*_{_CHECKSUMS}")):
        record: Any = json.loads(path.read_text())
        files = record.get("files") if isinstance(record, dict) else None
        if not isinstance(files, dict) or record.get("algorithm") != CHECKSUM:
            raise ValueError(f"{path.name} is not a {CHECKSUM} manifest")
        for name, entry in files.items():
            if not (isinstance(entry, dict) and all(isinstance(entry.get(k), int) for k in ("size", CHECKSUM))):
                raise ValueError(f"{path.name} has no size and {CHECKSUM} for {name}")
            found[name] = entry
    return found


def refuse(path: Path, error: pickle.UnpicklingError) -> NoReturn:
    """Raise the one-line refusal of a checkpoint whose pickle names a callable; re-raise
    ``error`` when it names none (an unreadable file, which resume skips)."""
    refused = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line), None)
    if refused is None:
        raise error
    raise ConfigError(
        "trainer.resume",
        str(path),
        f"a checkpoint of tensors and plain containers; this file "
        f"was refused unread ({refused}), as loading it could run code",
    ) from error


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's index: its metadata dataclasses, sizes, dtypes and paths, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib._local":  # where Python 3.13 pickles paths; pathlib exports them too
            if sys.version_info < (3, 13):  # and torch's own reading of the index would fail here
                raise ConfigError(
                    "trainer.resume",
                    "a checkpoint written by Python 3.13 or newer",
                    f"a checkpoint this Python {platform.python_version()} can read: resume it on Python 3.13+",
                )
            module = "pathlib"
        known = module == "torch" or module in _INDEX_MODULES
        found = getattr(__import__(module, fromlist=[name]), name, None) if known else None
        allowed = (
            (module, name) in _INDEX_GLOBALS
            or (module in _INDEX_MODULES and isinstance(found, type) and found.__module__ == module)
            or (module == "torch" and isinstance(found, torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"Trying to load unsupported GLOBAL {module}.{name}")
        return super().find_class(module, name)


def read_index(path: Path) -> Any:
    """The checkpoint's index (DCP's ``Metadata``, unchecked); refused (:func:`refuse`) when it
    names anything but DCP's own classes."""
    with open(Path(path) / INDEX, "rb") as f:
        try:
            return _IndexUnpickler(f).load()
        except pickle.UnpicklingError as e:
            refuse(Path(path), e)


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        read_index(Path(self.path))
        return super().read_metadata(*args, **kwargs)


class _ChecksummedWriter(FileSystemWriter):
    """DCP's writer, which then records the size and CRC-32 of each file this rank wrote (in the
    background thread of an asynchronous save too): before the index, so before the commit."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        directory, prefix = Path(self.path), plan.storage_data.prefix  # prefix: __<rank>_
        names = sorted({result.storage_data.relative_path for result in future.wait()})
        files = {n: {"size": (directory / n).stat().st_size, CHECKSUM: crc32_of(directory / n)} for n in names}
        record = json.dumps({"algorithm": CHECKSUM, "files": files}, indent=1) + "\n"
        atomic_write_text(directory / f"{prefix}{_CHECKSUMS}", record)
        return future


class _SafeBytes:
    """A load planner's ``load_bytes`` with ``weights_only=True``; a refusal is kept for after the load."""

    refused: pickle.UnpicklingError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused, obj = e, None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[fqn] = obj  # type: ignore[attr-defined]

    def raise_refused(self, path: Path) -> None:
        if self.refused is not None:
            refuse(path, self.refused)


class _SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    pass


class _SafeFullPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    pass


def pack(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(blob: torch.Tensor, path: Path) -> Any:
    """A :func:`pack`-ed blob of the checkpoint at ``path``, loaded with ``weights_only=True``."""
    try:
        return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    except pickle.UnpicklingError as e:
        refuse(path, e)


def save(
    state_dict: dict[str, Any], path: Path, *, distributed: bool, process_group: Any = None, asynchronous: bool = False
) -> Future | None:
    """Every rank writes its part of ``state_dict`` (``Stateful`` values are asked for their
    state) into the directory ``path``. Asynchronous: the state is copied now and written by a
    background thread; the returned future completes when the index is written."""
    writer = _ChecksummedWriter(str(path), single_file_per_rank=True, sync_files=True)
    kwargs = {"storage_writer": writer, "process_group": process_group, "no_dist": not distributed}
    if asynchronous:
        return dcp.async_save(state_dict, **kwargs)  # type: ignore[return-value]
    dcp.save(state_dict, **kwargs)
    return None


def os_error_of(error: BaseException) -> OSError | None:
    """The ``OSError`` (a full disk, ...) behind a failed :func:`save`, which DCP wraps, each
    rank's error apart, in a ``CheckpointException``, and ``torch.save`` may hide behind an error
    of its own (a full disk's short write: ``unexpected pos``); ``None``: no file system error."""
    if isinstance(error, OSError):
        return error
    inner = [e for e, _ in error.failures.values()] if isinstance(error, CheckpointException) else []
    for e in [*inner, error.__cause__, error.__context__]:
        found = os_error_of(e) if e is not None else None
        if found is not None:
            return found
    return None


class Unreadable(Exception):
    """A checkpoint whose files DCP could not read (a shard of zeros, ...): its error in one line."""


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """DCP wraps a failed read in a ``CheckpointException``, a ``BaseException`` that no
    ``except Exception`` catches: raise its ``OSError`` (no sign of damage), a refusal
    (:func:`refuse`), or :class:`Unreadable` instead."""
    try:
        yield
    except CheckpointException as e:
        if (os_error := os_error_of(e)) is not None:
            raise os_error from e
        errors = [error for error, _ in e.failures.values()]
        for error in errors:
            if isinstance(error, pickle.UnpicklingError) and "GLOBAL" in str(error):
                refuse(path, error)
        first = " ".join(str(errors[0]).split())[:200] if errors else "no error recorded"
        raise Unreadable(f"{type(errors[0]).__name__ if errors else 'error'}: {first}") from e


def load(state_dict: dict[str, Any], path: Path, *, distributed: bool) -> None:
    """Fill ``state_dict`` in place (every rank reads the shards it needs; ``Stateful`` values
    get theirs through ``load_state_dict``; a ``None`` value becomes its blob) from the
    checkpoint directory ``path``."""
    index = _SafeReader(str(path)).read_metadata()
    for key in [k for k, v in state_dict.items() if v is None]:
        state_dict[key] = torch.empty(index.state_dict_metadata[key].size, dtype=torch.uint8)
    planner = _SafeLoadPlanner()
    with _reading(Path(path)):
        dcp.load(state_dict, storage_reader=_SafeReader(str(path)), planner=planner, no_dist=not distributed)
    planner.raise_refused(Path(path))


def read(path: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` as full (unsharded) tensors and blobs, in this process alone;
    ``keys``: only those top-level entries."""
    read_index(Path(path))
    planner = _SafeFullPlanner(keys=keys)
    state: dict[str, Any] = {}
    with _reading(Path(path)):
        _load_state_dict(state, storage_reader=_SafeReader(str(path)), planner=planner, no_dist=True)
    planner.raise_refused(Path(path))
    return state
