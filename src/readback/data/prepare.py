"""Preparing a local corpus once, in memory bounded whatever its size: tokenizer, then token file.

1. The byte-level BPE is trained on a stream of text pieces (``tokenizer.train_bpe``), the corpus's
   first ``data.tokenizer_sample_mb`` MB (all of it when smaller, as for the embedded texts). A
   piece joins consecutive blocks of a document and is cut only between two letters or digits
   around a line end, where the pre-tokenizer's words are the same in the whole text as in its
   pieces: the tokenizer is the one the whole documents would train.
2. The blocks are encoded in ``data.prepare_workers`` processes (``spawn``: none inherits the
   parent's threads; a corpus of a chunk or two, in this one), a few MB of text per task and at
   most two tasks per worker in flight, and appended to the token file and its index
   (``readback.data.token_file``). After each chunk the
   files are flushed and a progress record written: a kill loses the chunks in flight, and the
   next start cuts the files back to the record and continues there.

Chosen over ``datasets`` (``map(num_proc=...)`` into Arrow): the result here is the flat token file
itself, with no Arrow copy of the text or of the ids to write, read back and flatten.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import types
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from readback.data.cache import atomic_write
from readback.data.documents import Block
from readback.data.token_file import INDEX_FIELDS, paths, token_dtype, write_meta
from readback.progress import progress as progress_of

MB = 1 << 20
CHUNK_CHARS = 4 * MB  # text per encoding task
PIECE_CHARS = 1 * MB  # text per piece the BPE trainer reads, where a safe cut comes
FORCED_CUT_CHARS = 64 * MB  # a piece cut here even without a safe place (a document of blank-ended lines)


class Megabytes:
    """A progress bar of text read, in whole megabytes of ``total_bytes`` (at least one), with the
    rate; ``finish`` fills it, as the cleaned text's size differs a little from the files'."""

    def __init__(self, total_bytes: int, done_bytes: int, desc: str, *, enabled: bool) -> None:
        self.total, self.done, self.start_bytes = max(-(-total_bytes // MB), 1), done_bytes, done_bytes
        self.shown, self.start = min(done_bytes // MB, self.total), time.monotonic()
        self.bar = progress_of(self.total, self.shown, desc, unit="megabyte", enabled=enabled)

    def advance(self, n_bytes: int) -> None:
        self.done += n_bytes
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix(MB_s=f"{(self.done - self.start_bytes) / MB / elapsed:.1f}")
        if (now := min(self.done // MB, self.total)) > self.shown:
            self.bar.update(now - self.shown)
            self.shown = now

    def finish(self) -> None:
        if self.shown < self.total:
            self.bar.update(self.total - self.shown)
            self.shown = self.total
        self.bar.close()


def bpe_pieces(blocks: Iterable[Block], sample_chars: int) -> Iterator[str]:
    """The first ``sample_chars`` characters of the corpus (whole blocks) in pieces (module doc, 1)."""
    piece: list[str] = []
    size, total, doc_of_piece = 0, 0, -1
    for doc, text in blocks:
        safe = text[:1].isalnum() and size > 1 and piece[-1][-2:-1].isalnum()
        if piece and (doc != doc_of_piece or (size >= PIECE_CHARS and safe) or size >= FORCED_CUT_CHARS):
            yield "".join(piece)
            piece, size = [], 0
        if total >= sample_chars:
            return
        piece.append(text)
        size, total, doc_of_piece = size + len(text), total + len(text), doc
    if piece:
        yield "".join(piece)


def chunks(blocks: Iterable[Block]) -> Iterator[tuple[list[str], list[int]]]:
    """``(texts, documents)`` of consecutive blocks, about ``CHUNK_CHARS`` of text each."""
    texts: list[str] = []
    docs: list[int] = []
    size = 0
    for doc, text in blocks:
        texts.append(text)
        docs.append(doc)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield texts, docs
            texts, docs, size = [], [], 0
    if texts:
        yield texts, docs


_WORKER_TOKENIZER: list[Any] = []


def _load_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER[:] = [Tokenizer.from_file(path)]


def encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, lengths)`` of the texts encoded by this process's tokenizer, back to back."""
    (tok,) = _WORKER_TOKENIZER
    encodings = tok.encode_batch_fast(texts)  # the ids of encode_batch, without offsets: 30 % faster
    dtype = token_dtype(tok.get_vocab_size())
    pieces = [np.asarray(e.ids, dtype=dtype) for e in encodings]
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)), lengths


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


class _InProcess:
    """The pool's interface, encoding here (``data.prepare_workers: 0``)."""

    def __init__(self, tokenizer_path: Path) -> None:
        _load_tokenizer(str(tokenizer_path))

    def apply_async(self, fn: Any, args: tuple) -> _Done:
        return _Done(fn(*args))

    def __enter__(self) -> _InProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _pool(workers: int, tokenizer_path: Path) -> Any:
    """``workers`` spawned processes that each load the tokenizer, or this process for none.

    A spawned process imports its parent's ``__main__`` (``train.py``, torch with it: hundreds of
    MB) unless it is hidden while they start; they need only this module."""
    if workers == 0:
        return _InProcess(tokenizer_path)
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        return mp.get_context("spawn").Pool(workers, initializer=_load_tokenizer, initargs=(str(tokenizer_path),))
    finally:
        sys.modules["__main__"] = main


_NOTHING_DONE = {"chunks": 0, "tokens": 0, "blocks": 0, "text_bytes": 0}


class _TokenWriter:
    """Appends encoded chunks to the token file and its index (``.partial`` until complete), and
    after each, once both are on disk, the progress record that a restart continues from."""

    def __init__(self, directory: Path, block_lines: int, vocab_size: int) -> None:
        self.tokens, self.index, self.meta = paths(directory, block_lines)
        self.vocab_size = vocab_size
        self.record = directory / f"tokens-b{block_lines}.progress.json"
        self.partial = {p: p.with_name(p.name + ".partial") for p in (self.tokens, self.index)}
        self.done = self._read()
        sizes = {
            self.tokens: self.done["tokens"] * token_dtype(vocab_size).itemsize,
            self.index: self.done["blocks"] * INDEX_FIELDS * 8,
        }
        if any(not part.exists() or part.stat().st_size < sizes[f] for f, part in self.partial.items()):
            self.done, sizes = dict(_NOTHING_DONE), dict.fromkeys(sizes, 0)  # the record outlived its files
        self.files = {}
        for final, part in self.partial.items():
            self.files[final] = open(part, "r+b" if part.exists() else "wb")  # noqa: SIM115 (closed in close)
            self.files[final].truncate(sizes[final])  # what a kill left past the record
            self.files[final].seek(sizes[final])

    def _read(self) -> dict[str, int]:
        try:
            record = json.loads(self.record.read_text())
            return {k: int(record[k]) for k in _NOTHING_DONE}
        except (OSError, ValueError, KeyError, TypeError):
            return dict(_NOTHING_DONE)

    def append(self, ids: np.ndarray, lengths: np.ndarray, docs: list[int], text_bytes: int) -> None:
        ends = self.done["tokens"] + np.cumsum(lengths)
        self.files[self.tokens].write(ids.tobytes())
        self.files[self.index].write(np.stack([ends, np.asarray(docs, dtype=np.int64)], axis=1).tobytes())
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        done = self.done
        done.update(
            chunks=done["chunks"] + 1,
            tokens=int(ends[-1]) if len(ends) else done["tokens"],
            blocks=done["blocks"] + len(docs),
            text_bytes=done["text_bytes"] + text_bytes,
        )
        atomic_write(self.record, lambda f: f.write(json.dumps(done).encode()))

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def finish(self) -> None:
        """The complete files under their names, then their record (``token_file.write_meta``)."""
        for final, part in self.partial.items():
            os.replace(part, final)
        write_meta(self.meta, self.vocab_size, self.done["tokens"], self.done["blocks"])
        self.record.unlink(missing_ok=True)


def encode_corpus(
    blocks: Iterable[Block],
    tokenizer_path: Path,
    directory: Path,
    block_lines: int,
    vocab_size: int,
    *,
    workers: int,
    total_bytes: int,
    progress: bool,
) -> None:
    """The token file and index of ``blocks`` in ``directory``, continuing an interrupted run."""
    writer = _TokenWriter(directory, block_lines, vocab_size)
    done = writer.done
    if total_bytes < 2 * CHUNK_CHARS:  # a chunk or two: starting workers would cost more than they save
        workers = 0
    bar = Megabytes(total_bytes, done["text_bytes"], "preparing", enabled=progress)
    pending: deque[tuple[Any, list[int], int]] = deque()

    def append_oldest() -> None:
        result, docs, text_bytes = pending.popleft()
        ids, lengths = result.get()
        writer.append(ids, lengths, docs, text_bytes)
        bar.advance(text_bytes)

    try:
        with _pool(workers, tokenizer_path) as pool:
            for i, (texts, docs) in enumerate(chunks(blocks)):
                if i < done["chunks"]:
                    continue  # written before a kill
                pending.append((pool.apply_async(encode_chunk, (texts,)), docs, sum(len(t.encode()) for t in texts)))
                if len(pending) >= 2 * max(workers, 1):
                    append_oldest()
            while pending:
                append_oldest()
    finally:
        writer.close()
    writer.finish()
    bar.finish()
