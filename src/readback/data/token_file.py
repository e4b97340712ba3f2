"""The prepared corpus on disk: a flat token file and its block index, read by memory map.

In ``<cache>/text/<corpus key>-v<vocab>/``, for blocks of ``<lines>`` lines:

    tokens-b<lines>.bin     every block's token ids back to back (uint16, or uint32 past 65536 ids)
    blocks-b<lines>.bin     int64 pairs per block: (token offset where it ends, its document)
    tokens-b<lines>.json    the counts and dtype, written last: the two files are complete

and, per validation fraction, the two packed splits training reads, ``split-b<lines>-f<fraction>/
{train,val}.bin`` (same dtype; EOS closes every run of consecutive blocks of one document).
Nothing is loaded whole: training maps the split files, so a run's memory does not grow with
its corpus (Megatron's ``.bin``/``.idx``, nanoGPT's ``uint16`` memmap, in one format).
:func:`load_token_file` is the one place a prepared corpus is opened and checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from readback.data.cache import atomic_write, bad_cache_file, check_token_ids, check_token_index

INDEX_FIELDS = 2  # per block: end offset, document
SCAN_TOKENS = 1 << 22  # ids checked per read, so the check holds a few MB whatever the corpus


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def paths(directory: Path, block_lines: int) -> tuple[Path, Path, Path]:
    """``(tokens, index, meta)`` of the prepared corpus in ``directory``."""
    b = f"b{block_lines}"
    return directory / f"tokens-{b}.bin", directory / f"blocks-{b}.bin", directory / f"tokens-{b}.json"


def write_meta(meta: Path, vocab_size: int, n_tokens: int, n_blocks: int) -> None:
    record = {"dtype": token_dtype(vocab_size).name, "tokens": n_tokens, "blocks": n_blocks, "vocab_size": vocab_size}
    atomic_write(meta, lambda f: f.write(json.dumps(record).encode()))


def _check_ids(path: Path, dtype: np.dtype, n_tokens: int, vocab_size: int) -> None:
    """:func:`~readback.data.cache.check_token_ids` over the file, read a few MB at a time (plain
    reads, not the map, so checking leaves no pages of the corpus resident)."""
    with open(path, "rb") as f:
        for start in range(0, max(n_tokens, 1), SCAN_TOKENS):
            ids = np.fromfile(f, dtype=dtype, count=min(SCAN_TOKENS, n_tokens - start))
            check_token_ids(path, ids, vocab_size, first=start)


def load_token_file(directory: Path, block_lines: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, offsets, block_doc)`` of a prepared corpus: ``ids`` a read-only map, block ``i`` is
    ``ids[offsets[i]:offsets[i + 1]]``. A ``ConfigError`` names the file and what is wrong: not
    complete (cut short by a copy or a full disk), an index out of order, or ids no run can train
    on (``readback.data.cache``'s checks)."""
    tokens, index, meta = paths(directory, block_lines)
    try:
        record = json.loads(meta.read_text())
        dtype, n_tokens, n_blocks = np.dtype(record["dtype"]), int(record["tokens"]), int(record["blocks"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise bad_cache_file(meta, f"it is not a token file's record ({type(e).__name__})") from None
    for path, size in ((tokens, n_tokens * dtype.itemsize), (index, n_blocks * INDEX_FIELDS * 8)):
        held = path.stat().st_size if path.exists() else 0
        if held != size:
            raise bad_cache_file(path, f"it is truncated: it holds {held} bytes, its record counts {size}")
    blocks = np.fromfile(index, dtype=np.int64).reshape(n_blocks, INDEX_FIELDS)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), blocks[:, 0]])
    check_token_index(index, offsets, blocks[:, 1], n_tokens)
    _check_ids(tokens, dtype, n_tokens, vocab_size)
    return np.memmap(tokens, dtype=dtype, mode="r", shape=(n_tokens,)), offsets, blocks[:, 1]


def run_starts(block_doc: np.ndarray, is_val: np.ndarray) -> np.ndarray:
    """The first block of each run of consecutive blocks of one document on one side."""
    if len(block_doc) == 0:
        return np.zeros(0, dtype=np.int64)
    changes = (is_val[1:] != is_val[:-1]) | (block_doc[1:] != block_doc[:-1])
    return np.concatenate([[0], np.flatnonzero(changes) + 1])


def runs(offsets: np.ndarray, block_doc: np.ndarray, is_val: np.ndarray) -> Iterator[tuple[bool, int, int]]:
    """``(is_val, first token, end token)`` of each run (:func:`run_starts`)."""
    starts = run_starts(block_doc, is_val)
    for first, end in zip(starts.tolist(), [*starts[1:].tolist(), len(block_doc)]):
        yield bool(is_val[first]), int(offsets[first]), int(offsets[end])


def write_split(
    ids: np.ndarray,
    offsets: np.ndarray,
    block_doc: np.ndarray,
    is_val: np.ndarray,
    eos: int,
    out: dict[bool, BinaryIO],
    chunk: int = SCAN_TOKENS,
) -> None:
    """Train (``out[False]``) and validation (``out[True]``) token streams: each run of blocks, then
    EOS; copied a few MB at a time from the map."""
    eos_bytes = np.asarray([eos], dtype=ids.dtype).tobytes()
    for side, first, end in runs(offsets, block_doc, is_val):
        for start in range(first, end, chunk):
            out[side].write(np.ascontiguousarray(ids[start : min(end, start + chunk)]).tobytes())
        out[side].write(eos_bytes)


def split_files(directory: Path, block_lines: int, val_fraction: float) -> tuple[Path, Path]:
    """Where the packed train and validation splits of this block size and fraction are kept."""
    split = directory / f"split-b{block_lines}-f{val_fraction!r}"
    return split / "train.bin", split / "val.bin"


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    """A read-only map of a split (an empty array for an empty file, which cannot be mapped)."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def load_split(
    train_path: Path, val_path: Path, ids: np.ndarray, block_doc: np.ndarray, is_val: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The maps of the packed splits of ``ids``, which training reads; ``ConfigError`` unless
    together they hold its tokens and one EOS per run (neither cut short), all in the vocabulary."""
    train, val = _map(train_path, ids.dtype), _map(val_path, ids.dtype)
    expected = len(ids) + len(run_starts(block_doc, is_val))
    if len(train) + len(val) != expected:
        raise bad_cache_file(
            train_path.parent, f"it is truncated: its splits hold {len(train) + len(val)} tokens of {expected}"
        )
    for path, tokens in ((train_path, train), (val_path, val)):
        _check_ids(path, ids.dtype, len(tokens), vocab_size)
    return train, val
